"""The GRPO learner: sharded steps equal the single-device step; micro-batching; VCPO norms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.learner import (
    GRPOLearner,
    LearnerConfig,
    LossConfig,
    OptimizerConfig,
    TrainBatch,
    make_optimizer,
    make_train_step,
    per_example_grad_sq_norms,
)
from gac_jax.learner import learner as learner_module
from gac_jax.rollout import Rollout, collate
from gac_jax.train.config import TrainConfig
from gac_jax.transforms import ESSConfig, GACConfig
from tests.conftest import USERS_COMPILE_OPTIONS

CONFIG = models.get_config("tiny")
G, L, PROMPT = 4, 6, 8


def _rollouts(num_groups=4, version=0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_groups):
        mask = np.ones((G, L), bool)
        mask[1, 3:] = False  # A completion that ended early.
        out.append(
            Rollout(
                prompt_id=i,
                group_id=i,
                prompt_tokens=rng.integers(3, 60, 3 + i % 3).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
                completion_mask=mask,
                behaviour_logp=(-3.0 * rng.random((G, L))).astype(np.float32),
                rewards=rng.integers(0, 2, G).astype(np.float32),
                policy_version=version,
            )
        )
    return out


def _batch(rollouts):
    return TrainBatch(**collate(rollouts, PROMPT))


def _learner(mesh_shape, **loss):
    mesh = models.make_mesh(*mesh_shape)
    tx = make_optimizer(
        OptimizerConfig(learning_rate=1e-3),
        gac=GACConfig(tau_low=0.1, tau_high=0.9),
        ess=ESSConfig(),
    )
    model = models.create_model(CONFIG, seed=0)
    return GRPOLearner(model, tx, mesh, loss=LossConfig(**loss))


def _specs(tree):
    return [leaf.sharding.spec for leaf in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def single_device_step():
    """Params and metrics after one step on one device: the reference of the mesh tests."""
    learner = _learner((1, 1, 1))
    metrics = learner.step(_batch(_rollouts(4, version=0)), 1)
    return jax.device_get(learner.params), metrics


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_sharded_step_equals_single_device_step(mesh_shape, single_device_step):
    single_params, m1 = single_device_step
    sharded = _learner(mesh_shape)
    param_specs, opt_specs = _specs(sharded.params), _specs(sharded.opt_state)
    m2 = sharded.step(_batch(_rollouts(4, version=0)), 1)
    for a, b in zip(jax.tree.leaves(single_params), jax.tree.leaves(sharded.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for key in ("loss", "reward", "gac_cosine", "ess_ratio", "grad_norm", "loss/entropy"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, atol=1e-6)
    # Params and optimizer state (GAC's reference included) keep their shardings.
    assert _specs(sharded.params) == param_specs
    assert _specs(sharded.opt_state) == opt_specs
    if mesh_shape != (8, 1, 1):
        assert any(spec != jax.sharding.PartitionSpec() for spec in param_specs)


def test_batch_not_divisible_by_data_axis_is_an_error():
    learner = _learner((8, 1, 1))
    batch = _batch(_rollouts(1))  # 4 sequences over 8 devices.
    with pytest.raises(ValueError, match="4 sequences is not divisible by the 8 devices"):
        learner.step(batch, 0)


def test_micro_batching_equals_one_batch():
    batch = jax.tree.map(jnp.asarray, _batch(_rollouts(4)))
    model = models.create_model(CONFIG, seed=1)
    graphdef, params = nnx.split(model)
    # Plain SGD: the parameter change is proportional to the gradient (Adam's first step,
    # lr * sign(g), would magnify rounding noise in gradients near zero).
    tx = optax.chain(optax.sgd(1.0))
    outs = []
    for m in (1, 2):
        step = jax.jit(make_train_step(graphdef, tx, micro_batches=m))
        outs.append(step(params, tx.init(params), batch, jnp.int32(0)))
    for params_m, _, metrics_m in outs[1:]:
        for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(params_m), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)
        # The loss is a mean of signed terms (advantages sum to zero per group): an absolute
        # tolerance at the scale of the terms, as rtol alone is hostage to cancellation.
        np.testing.assert_allclose(metrics_m["loss"], outs[0][2]["loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics_m["grad_norm"], outs[0][2]["grad_norm"], rtol=1e-4)


def test_exact_grad_norms_match_one_gradient_per_sequence():
    batch = jax.tree.map(jnp.asarray, _batch(_rollouts(2)))
    graphdef, params = nnx.split(models.create_model(CONFIG, seed=2))
    norms = jax.jit(per_example_grad_sq_norms, static_argnums=0)(graphdef, params, batch)

    @jax.jit
    def one_gradient(p, tokens, attention, loss_mask):
        def logp_sum(p):
            logp = models.per_token_logps(nnx.merge(graphdef, p), tokens, attention)
            return jnp.sum(jnp.where(loss_mask, logp, 0.0))

        return jax.grad(logp_sum)(p)

    for i in range(batch.tokens.shape[0]):
        rows = slice(i, i + 1)
        g = one_gradient(
            params, batch.tokens[rows], batch.attention_mask[rows], batch.loss_mask[rows]
        )
        want = sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(g))
        np.testing.assert_allclose(norms[i], want, rtol=1e-4)


@pytest.mark.parametrize("loss", ["m2po", "decoupled_ppo"])
def test_every_supported_loss_trains(loss):
    learner = _learner((1, 1, 1), policy_loss=loss, advantage="grpo")
    metrics = learner.step(_batch(_rollouts(2)), 2)
    assert np.isfinite(metrics["loss"]) and metrics["version_gap_mean"] == 2.0


def test_vcpo_advantage_runs_with_exact_norms_and_with_a_proxy():
    for grad_norm in ("exact", "length"):
        learner = _learner((1, 1, 1), advantage="vcpo", grad_norm=grad_norm)
        metrics = learner.step(_batch(_rollouts(2)), 0)
        assert np.isfinite(metrics["loss"])


def test_step_rejects_unknown_names():
    graphdef, _ = nnx.split(models.create_model(CONFIG))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    with pytest.raises(ValueError, match="ppo"):
        make_train_step(graphdef, tx, LossConfig(policy_loss="ppo2"))
    with pytest.raises(ValueError, match="grad_norm='l2'"):
        make_train_step(graphdef, tx, LossConfig(advantage="vcpo", grad_norm="l2"))


def test_a_learner_config_is_validated_once_where_it_is_built(monkeypatch):
    """`LearnerConfig.validate` runs when the learner is built, not again for each
    micro-batch count's step nor when a step is traced; a run's config runs it once too."""
    calls = []
    validate = LearnerConfig.validate

    def counted(config, *args, **kwargs):
        calls.append(config)
        return validate(config, *args, **kwargs)

    monkeypatch.setattr(LearnerConfig, "validate", counted)
    learner = _learner((1, 1, 1))
    batch = learner.place_batch(_batch(_rollouts(2)))
    for m in (1, 2):
        learner.lower(batch, np.int32(0), learner.reference, step=learner.step_for(m))
    assert calls == [learner.config]
    TrainConfig().validate()
    assert len(calls) == 2


def test_step_donates_the_state_but_not_gacs_reference():
    learner = _learner((1, 1, 1))
    before = learner.opt_state
    learner.step(_batch(_rollouts(2)), 0)
    paths, _ = jax.tree_util.tree_flatten_with_path(before)
    kept = [x for p, x in paths if any(getattr(k, "name", None) == "gac_reference" for k in p)]
    donated = [x for p, x in paths if ".mu" in jax.tree_util.keystr(p)]
    donated += [x for p, x in paths if "gac_reference_sq" in jax.tree_util.keystr(p)]
    assert kept and donated
    # The reference is replaced by the step's gradient: donating it would only add a copy.
    assert not any(x.is_deleted() for x in kept)
    assert all(x.is_deleted() for x in donated)
    assert jax.tree.structure(learner.opt_state) == jax.tree.structure(before)


def test_on_cpu_a_running_step_is_scheduled_for_memory_with_the_same_bits(monkeypatch):
    """XLA:CPU's memory-optimized scheduler (`CPU_STEP_COMPILER_OPTIONS`) orders the same
    arithmetic for a smaller arena of temporaries: params, optimizer state and metrics come
    out bit for bit as without it. A learner built to be lowered (plan's, from
    `nnx.eval_shape`) compiles without it, as before."""
    batch = _batch(_rollouts(4))

    def temp_bytes(learner, placed):
        step = learner.step_for(learner.micro_batching.least)
        lowered = learner.lower(placed, np.int32(3), learner.reference, step=step)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    def trained(options):
        # Compiled as users compile (the suite's -O0 may round two schedules differently).
        options = {**USERS_COMPILE_OPTIONS, **options}
        monkeypatch.setattr(learner_module, "CPU_STEP_COMPILER_OPTIONS", options)
        learner = _learner((1, 1, 1))
        metrics = [learner.step(batch, version) for version in (1, 2)]
        state = jax.device_get((learner.params, learner.opt_state))
        return state, metrics, temp_bytes(learner, learner.place_batch(batch))

    state, metrics, temp = trained(learner_module.CPU_STEP_COMPILER_OPTIONS)
    plain_state, plain_metrics, plain_temp = trained({})
    assert metrics == plain_metrics
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert temp < plain_temp

    monkeypatch.undo()  # The options as shipped.
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    abstract = GRPOLearner(
        nnx.eval_shape(lambda: models.create_model(CONFIG, seed=0)), tx, models.make_mesh(1, 1, 1)
    )
    concrete = GRPOLearner(models.create_model(CONFIG, seed=0), tx, models.make_mesh(1, 1, 1))
    placed = concrete.place_batch(batch)
    assert temp_bytes(abstract, placed) > temp_bytes(concrete, placed)
