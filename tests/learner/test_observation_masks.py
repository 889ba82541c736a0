"""Environment tokens are context only: no gradient, no statistic.

A batch of multi-turn rows (policy turns with observation tokens between them) is trained
twice, the second time with the behaviour log-probs on the observation tokens replaced by
other values; every metric (loss, ESS, clip and mask fractions, KL, gradient norm, ...) and
every updated parameter must be the same. A positive control perturbs one policy token's
behaviour log-prob instead and must change the loss, so the comparison can fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.learner import LossConfig, TrainBatch, make_train_step
from gac_jax.rollout import Rollout, collate
from gac_jax.transforms import gradient_alignment_monitor

CONFIG = models.get_config("tiny", num_layers=1)
G, L, PROMPT, GROUPS = 4, 12, 4, 3


def _rollouts(seed=0):
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(GROUPS):
        policy = np.zeros((G, L), bool)
        observed = np.zeros((G, L), bool)
        for row in range(G):  # turn, observation, turn, padding
            a, b, c = 2 + row % 3, 2 + (row + i) % 3, 2 + row % 2
            policy[row, :a] = True
            observed[row, a : a + b] = True
            policy[row, a + b : a + b + c] = True
        rollouts.append(
            Rollout(
                prompt_id=i,
                group_id=i,
                prompt_tokens=rng.integers(3, 60, 3).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
                completion_mask=policy,
                behaviour_logp=np.where(policy, -2.5 - 3.0 * rng.random((G, L)), 0.0).astype(
                    np.float32
                ),
                rewards=rng.random(G).astype(np.float32),
                policy_version=0,
                observation_mask=observed,
            )
        )
    return rollouts


@pytest.fixture(scope="module")
def setup():
    graphdef, params = nnx.split(models.create_model(CONFIG, seed=1))
    batch = TrainBatch(**collate(_rollouts(), PROMPT))
    observed = batch.attention_mask & ~batch.loss_mask
    observed[:, :PROMPT] = False
    assert observed.any() and batch.loss_mask.any()
    return graphdef, params, batch, observed


def _step(graphdef, params, loss, batch):
    tx = optax.chain(gradient_alignment_monitor(), optax.sgd(0.5))
    step = jax.jit(make_train_step(graphdef, tx, loss))
    new_params, _, metrics = step(
        params, tx.init(params), jax.tree.map(jnp.asarray, batch), jnp.int32(2)
    )
    return new_params, jax.device_get(metrics)


def _with_behaviour(batch, where, values):
    arrays = {f: np.array(getattr(batch, f)) for f in batch.__dataclass_fields__}
    arrays["behaviour_logp"] = np.where(where, values, arrays["behaviour_logp"]).astype(np.float32)
    return TrainBatch(**arrays)


LOSSES = {
    "ppo": LossConfig(),
    "m2po": LossConfig(policy_loss="m2po"),
    "sequence tis": LossConfig(
        policy_loss="reinforce", correction="tis", correction_kwargs={"level": "sequence"}
    ),
    "vcpo baseline": LossConfig(advantage="vcpo"),
}


@pytest.mark.parametrize("name", LOSSES)
def test_observation_tokens_change_no_metric_and_no_gradient(setup, name):
    graphdef, params, batch, observed = setup
    loss = LOSSES[name]
    rng = np.random.default_rng(1)
    params_a, metrics_a = _step(graphdef, params, loss, batch)
    noise = (-0.1 - 8.0 * rng.random(observed.shape)).astype(np.float32)
    params_b, metrics_b = _step(graphdef, params, loss, _with_behaviour(batch, observed, noise))
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        np.testing.assert_array_equal(metrics_b[key], metrics_a[key], err_msg=key)
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_array_equal(b, a)
    # Positive control: the same perturbation on one policy token changes the loss.
    one = np.zeros_like(observed)
    one[0, np.flatnonzero(batch.loss_mask[0])[0]] = True
    _, metrics_c = _step(graphdef, params, loss, _with_behaviour(batch, one, noise))
    changed = [k for k in metrics_a if not np.array_equal(metrics_a[k], metrics_c[k])]
    assert changed, "perturbing a policy token changed nothing: the test cannot fail"
