"""The optimizer choice and learning-rate schedule of `OptimizerConfig`: optax's own
optimizers and schedules, the rate each update used logged as `learning_rate`, and the
default chain unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gac_jax import models
from gac_jax.learner import GRPOLearner, OptimizerConfig, TrainBatch, make_optimizer
from gac_jax.learner.optimizer import OPTIMIZERS, injected_learning_rate, replaced_leaves
from gac_jax.rollout import Rollout, collate
from gac_jax.train.config import TrainConfig
from gac_jax.transforms import (
    ESSConfig,
    GACConfig,
    alignment_controlled,
    gradient_alignment_monitor,
)
from tests.conftest import USERS_COMPILE_OPTIONS

CONFIG = models.get_config("tiny")
G, L, PROMPT = 4, 6, 8
PEAK = 1e-3


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    rollouts = [
        Rollout(
            prompt_id=i,
            group_id=i,
            prompt_tokens=rng.integers(3, 60, 3 + i).astype(np.int32),
            completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
            completion_mask=np.ones((G, L), bool),
            behaviour_logp=(-3.0 * rng.random((G, L))).astype(np.float32),
            rewards=np.array([0, 1, 0, 1], np.float32),
            policy_version=0,
        )
        for i in range(2)
    ]
    return TrainBatch(**collate(rollouts, PROMPT))


def _learner(config: OptimizerConfig, steps=None, mesh_shape=(1, 1, 1)):
    tx = make_optimizer(config, steps=steps)
    model = models.create_model(CONFIG, seed=0)
    return GRPOLearner(model, tx, models.make_mesh(*mesh_shape))


def _run(learner, steps):
    return [learner.step(_batch(seed=i), i) for i in range(steps)]


def _linear_reference(step, warmup, total, end_ratio):
    """Warm-up from 0 to PEAK over `warmup` steps, then linear to end_ratio * PEAK at
    `total`, constant after; float64."""
    if step < warmup:
        return PEAK * step / warmup
    frac = min(step - warmup, total - warmup) / (total - warmup)
    return PEAK + frac * (end_ratio * PEAK - PEAK)


@pytest.mark.parametrize("schedule", ["warmup_cosine", "warmup_linear"])
def test_a_warmup_schedule_shows_in_the_logged_learning_rate(schedule):
    warmup, total, end_ratio, k = 2, 5, 0.1, 6
    config = OptimizerConfig(
        learning_rate=PEAK, schedule=schedule, warmup_steps=warmup, end_lr_ratio=end_ratio
    )
    # decay_steps=None: the run's steps.
    logged = [m["learning_rate"] for m in _run(_learner(config, steps=total), k)]
    if schedule == "warmup_cosine":
        fn = optax.schedules.warmup_cosine_decay_schedule(
            0.0, PEAK, warmup, total, end_ratio * PEAK
        )
        expected = [float(fn(i)) for i in range(k)]
    else:
        expected = [_linear_reference(i, warmup, total, end_ratio) for i in range(k)]
    np.testing.assert_allclose(logged, expected, rtol=0, atol=1e-7)
    assert logged[0] == 0.0 and max(logged) == pytest.approx(PEAK)
    assert logged[-1] == pytest.approx(end_ratio * PEAK)  # Held after decay_steps.


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_trains_three_steps(name):
    # On a mesh that shards the weights: every optimizer's state must take a sharding
    # (adafactor's factored statistics are not param-shaped).
    learner = _learner(OptimizerConfig(name=name, learning_rate=PEAK), mesh_shape=(2, 2, 2))
    before = jax.device_get(learner.params)
    metrics = _run(learner, 3)
    after = jax.device_get(learner.params)
    for m in metrics:
        assert np.isfinite(m["loss"]) and m["nonfinite_step"] == 0.0
        assert m["learning_rate"] == pytest.approx(PEAK, rel=1e-7)
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    ]
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after))
    assert sum(changed) > len(changed) // 2, f"{sum(changed)} of {len(changed)} leaves changed"


# Each choice is optax's own optimizer with these arguments (sgd's momentum 0.9 when unset).
OPTAX_CALLS = {
    "adamw": lambda: optax.adamw(PEAK, b1=0.8, b2=0.99, weight_decay=0.01),
    "lion": lambda: optax.lion(PEAK, b1=0.8, b2=0.99, weight_decay=0.01),
    "adafactor": lambda: optax.adafactor(PEAK, momentum=0.5, weight_decay_rate=0.01),
    "sgd": lambda: optax.sgd(PEAK, momentum=0.9),
}
CONFIGS = {
    "adamw": dict(b1=0.8, b2=0.99, weight_decay=0.01),
    "lion": dict(b1=0.8, b2=0.99, weight_decay=0.01),
    "adafactor": dict(momentum=0.5, weight_decay=0.01),
    "sgd": dict(),
}


def _params(dtype=jnp.float32):
    # Dims of 128 and more, so that adafactor factors its second moment.
    shapes = {"embedding_vd": (256, 128), "kernel_dh": (128, 16), "scale_d": (128,)}
    keys = jax.random.split(jax.random.key(1), len(shapes))
    return {
        name: jax.random.normal(key, shape, dtype)
        for key, (name, shape) in zip(keys, shapes.items(), strict=True)
    }


def _updates(tx, params, steps=3, **extra):
    """Params after `steps` jitted updates with fixed pseudo-random gradients, compiled as
    users compile them (the bit-for-bit tests' claim)."""
    state = tx.init(params)
    update = jax.jit(tx.update, compiler_options=USERS_COMPILE_OPTIONS)
    keys = jax.random.split(jax.random.key(0), steps)
    for key in keys:
        leaves, treedef = jax.tree.flatten(params)
        subkeys = jax.random.split(key, len(leaves))
        grads = treedef.unflatten(
            [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(subkeys, leaves, strict=True)]
        )
        updates, state = update(grads, state, params, **extra)
        params = optax.apply_updates(params, updates)
    return params, state


def _assert_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_choice_is_optax_own_optimizer(name):
    params = _params()
    config = OptimizerConfig(name=name, learning_rate=PEAK, clip_norm=None, **CONFIGS[name])
    ours, _ = _updates(make_optimizer(config), params)
    theirs, _ = _updates(optax.chain(gradient_alignment_monitor(), OPTAX_CALLS[name]()), params)
    _assert_identical(ours, theirs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_gac_ess", [False, True])
def test_the_default_is_yesterdays_adamw_chain_bit_for_bit(dtype, with_gac_ess):
    # The chain as it was built before schedules: clip -> optax.adamw with a Python float
    # learning rate under GAC or its monitors -> ESS.
    params = _params(dtype)
    gac, ess = (GACConfig(), ESSConfig()) if with_gac_ess else (None, None)
    extra = {"log_importance_weights": jnp.array([0.1, -0.2, 0.05])} if with_gac_ess else {}
    adamw = optax.adamw(1e-3, b1=0.9, b2=0.999, weight_decay=0.0)
    old = [optax.clip_by_global_norm(1.0)]
    old.append(alignment_controlled(adamw, gac.build() if gac else None))
    old += [ess.build()] if ess else []
    ours, state = _updates(make_optimizer(OptimizerConfig(), gac, ess), params, **extra)
    theirs, _ = _updates(optax.chain(*old), params, **extra)
    _assert_identical(ours, theirs)
    # And what the chain was before GAC wrapped the optimizer (nothing is skipped here):
    # the same updates up to the rounding of a reordered reduction.
    bare = [optax.clip_by_global_norm(1.0), gac.build() if gac else gradient_alignment_monitor()]
    bare += [adamw, *([ess.build()] if ess else [])]
    before, _ = _updates(optax.chain(*bare), params, **extra)
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2  # One unit in the last place.
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(before), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(x, y, rtol=tolerance, atol=tolerance / 10)
    assert injected_learning_rate(state) == jnp.asarray(1e-3, dtype)


BAD = [
    (dict(name="adam"), "name"),
    (dict(schedule="cosine"), "schedule"),
    (dict(name="sgd", momentum=1.0), "momentum"),
    (dict(name="sgd", momentum=-0.1), "momentum"),
    (dict(momentum=0.9), "momentum"),  # adamw has no momentum argument.
    (dict(name="sgd", b2=0.99), "b2"),  # Nor sgd moment decays.
    (dict(name="sgd", weight_decay=0.1), "weight_decay"),
    (dict(schedule="warmup_cosine", warmup_steps=-1), "warmup_steps"),
    (dict(schedule="warmup_cosine", warmup_steps=1.5), "warmup_steps"),
    (dict(schedule="warmup_cosine", decay_steps=0), "decay_steps"),
    (dict(schedule="warmup_cosine", decay_steps=True), "decay_steps"),
    (dict(schedule="warmup_linear", warmup_steps=10, decay_steps=10), "warmup_steps"),
    (dict(schedule="warmup_cosine", end_lr_ratio=1.5), "end_lr_ratio"),
    (dict(warmup_steps=5), "warmup_steps"),  # Unused by the constant schedule.
]


@pytest.mark.parametrize(("kwargs", "field"), BAD)
def test_bad_values_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}=") as error:
        make_optimizer(OptimizerConfig(**kwargs), steps=100)
    assert "\n" not in str(error.value)


def test_a_schedule_without_a_length_needs_decay_steps():
    config = OptimizerConfig(schedule="warmup_linear", warmup_steps=2)
    with pytest.raises(ValueError, match="^decay_steps=None .* set decay_steps"):
        make_optimizer(config)
    make_optimizer(dataclasses.replace(config, decay_steps=10))  # Known length: fine.


def test_the_run_checks_warmup_against_its_steps():
    config = TrainConfig(
        init="random",
        steps=10,
        optimizer=OptimizerConfig(schedule="warmup_cosine", warmup_steps=10),
    )
    message = r"^optimizer\.warmup_steps=10 must be < the run.s 10 optimizer steps"
    with pytest.raises(ValueError, match=message):
        config.validate()


@pytest.mark.parametrize("acts_on", ["gradient", "update"])
def test_replaced_leaves_are_exactly_gacs_references(acts_on):
    """The chain's builder declares which state leaves each update replaces wholesale (the
    learner does not donate them): every leaf of a `gac_reference` field, at both levels
    of the run's chain, and nothing else; a chain without GAC has none."""
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    tx = make_optimizer(gac=GACConfig(acts_on=acts_on), ess=ESSConfig())
    state = tx.init(params)
    paths, _ = jax.tree_util.tree_flatten_with_path(state)
    want = [any(getattr(k, "name", None) == "gac_reference" for k in p) for p, _ in paths]
    assert jax.tree.leaves(replaced_leaves(state)) == want and sum(want) == 2 * len(params)
    plain = optax.adam(1e-3).init(params)
    assert not any(jax.tree.leaves(replaced_leaves(plain)))
