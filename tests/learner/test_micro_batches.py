"""Micro-batching is exact: for every registered loss and aggregation, the step with
`micro_batches=4` equals the step with 1 (loss, every metric, updated params).

Whole-batch statistics (M2PO's mask, BAPO's bounds) and the loss's normaliser must be
those of the whole batch, so the batch here has sequences of different lengths, a padded
row, and behaviour log-probs far enough from the policy's that masks, clips and searches
bind. SGD makes the parameter change proportional to the gradient, so a gradient error
shows in the params (Adam would normalise it away).

The full matrix runs with `jax.disable_jit` on a one-layer model: the step's Python is the
same traced or not, and compiling 2 x 40 variants of it would take most of CI's test
budget; the cases with special handling (whole-batch statistics, non-default
aggregations) also run through `jax.jit`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gac_jax import models, objectives
from gac_jax.learner import LossConfig, TrainBatch, make_train_step
from gac_jax.rollout import Rollout, collate
from gac_jax.transforms import gradient_alignment_monitor

CONFIG = models.get_config("tiny", num_layers=1)
G, L, PROMPT, GROUPS = 2, 6, 5, 4
# Trajectory balance estimates each group's partition function from the rows it is given,
# so the learner refuses to split its batch (tests/learner/test_ppo_updates.py checks that).
SUPPORTED = [
    n
    for n, s in objectives.POLICY_LOSS_SPECS.items()
    if s.unsupported is None and not s.needs_reference
]


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(GROUPS):
        mask = np.ones((G, L), bool)
        mask[0, rng.integers(1, L) :] = False  # Sequences of different lengths.
        if i == 2:
            mask[1, :] = False  # A row without a valid token.
        rollouts.append(
            Rollout(
                prompt_id=i,
                group_id=i,
                prompt_tokens=rng.integers(3, 60, 3).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
                completion_mask=mask,
                behaviour_logp=(-2.5 - 3.0 * rng.random((G, L))).astype(np.float32),
                rewards=rng.random(G).astype(np.float32),
                policy_version=0,
            )
        )
    return jax.tree.map(jnp.asarray, TrainBatch(**collate(rollouts, PROMPT)))


@pytest.fixture(scope="module")
def setup():
    graphdef, params = nnx.split(models.create_model(CONFIG, seed=1))
    return graphdef, params, _batch()


def _run(setup, loss: LossConfig, micro_batches: int, jit: bool):
    graphdef, params, batch = setup
    tx = optax.chain(gradient_alignment_monitor(), optax.sgd(0.5))
    step = make_train_step(graphdef, tx, loss, micro_batches=micro_batches)
    if jit:
        step = jax.jit(step)
    new_params, _, metrics = step(params, tx.init(params), batch, jnp.int32(3))
    return new_params, jax.device_get(metrics)


def _assert_same(setup, loss: LossConfig, jit: bool = False):
    if not jit:
        with jax.disable_jit():
            return _assert_same(setup, loss, jit=True)
    params_1, metrics_1 = _run(setup, loss, 1, jit)
    params_4, metrics_4 = _run(setup, loss, 4, jit)
    assert metrics_1.keys() == metrics_4.keys()
    for key in metrics_1:
        np.testing.assert_allclose(
            metrics_4[key], metrics_1[key], rtol=1e-6, atol=1e-6, err_msg=key
        )
    for a, b in zip(jax.tree.leaves(params_1), jax.tree.leaves(params_4), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    return metrics_1


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", objectives.AGGREGATIONS)
@pytest.mark.parametrize("policy_loss", SUPPORTED)
def test_micro_batches_are_exact(setup, policy_loss, aggregation):
    metrics = _assert_same(setup, LossConfig(policy_loss, {"aggregation": aggregation}))
    assert metrics["grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy_loss",
    [n for n in SUPPORTED if objectives.POLICY_LOSS_SPECS[n].default_aggregation != "token-mean"],
)
def test_each_loss_default_aggregation_is_the_one_micro_batches_weigh_by(setup, policy_loss):
    # gspo and topr default to sequence means: the step must weigh by their entry's
    # aggregation, not assume token-mean (the bug this replaced).
    _assert_same(setup, LossConfig(policy_loss), jit=True)


@pytest.mark.slow
def test_the_whole_batch_statistics_bind(setup):
    # The batch is off-policy enough that M2PO masks tokens and BAPO moves its bounds: the
    # exactness above is about statistics that select something.
    m2po = _assert_same(setup, LossConfig("m2po"), jit=True)
    assert 0 < m2po["loss/masked_fraction"] < 1
    bapo = _assert_same(setup, LossConfig("bapo"), jit=True)
    assert bapo["loss/search_steps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss",
    [
        LossConfig("reinforce", correction="mis", correction_kwargs={"cap": 2.0}),
        LossConfig("ppo", correction="icepop"),
        LossConfig("reinforce", correction="tis", correction_kwargs={"level": "sequence"}),
        LossConfig("ppo", advantage="vcpo", grad_norm="length"),
        LossConfig("gspo", advantage="rloo"),
    ],
    ids=["mis", "icepop", "seq-tis", "vcpo", "gspo-rloo"],
)
def test_micro_batches_are_exact_with_corrections_and_estimators(setup, loss):
    _assert_same(setup, loss)


def test_a_loss_that_reads_whole_groups_refuses_micro_batches():
    with pytest.raises(ValueError, match="partition function"):
        make_train_step(
            nnx.graphdef(models.create_model(CONFIG)),
            optax.sgd(0.1),
            LossConfig("tb"),
            micro_batches=2,
        )
