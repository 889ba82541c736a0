"""Importance corrections in the train step: wiring checked against a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gac_jax import models, objectives
from gac_jax.learner import (
    LossConfig,
    OptimizerConfig,
    TrainBatch,
    make_optimizer,
    make_train_step,
)
from gac_jax.rollout import Rollout, collate

CONFIG = models.get_config("tiny")
G, L, PROMPT = 4, 6, 8


def _batch(seed=0, num_groups=3):
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(num_groups):
        mask = np.ones((G, L), bool)
        mask[2, 4:] = False
        rollouts.append(
            Rollout(
                prompt_id=i,
                group_id=i,
                prompt_tokens=rng.integers(3, 60, 4).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
                completion_mask=mask,
                # Behaviour log-probs far from the random model's (~-4.2): ratios well
                # away from 1 in both directions, so the caps bind on some sequences.
                behaviour_logp=(-1.0 - 6.0 * rng.random((G, L))).astype(np.float32),
                rewards=np.array([1.0, 0.0, 1.0, 0.0], np.float32)[rng.permutation(G)],
                policy_version=0,
            )
        )
    return jax.tree.map(jnp.asarray, TrainBatch(**collate(rollouts, PROMPT)))


def _sgd_step(graphdef, params, batch, **loss):
    tx = optax.sgd(1.0)
    step = jax.jit(make_train_step(graphdef, tx, LossConfig(policy_loss="reinforce", **loss)))
    new_params, _, metrics = step(params, tx.init(params), batch, jnp.int32(0))
    grads = jax.tree.map(lambda old, new: old - new, params, new_params)
    return grads, metrics


@pytest.fixture(scope="module")
def model_and_batch():
    graphdef, params = nnx.split(models.create_model(CONFIG, seed=3))
    return graphdef, params, _batch()


def test_sequence_tis_equals_reinforce_with_float64_truncated_sequence_weights(model_and_batch):
    graphdef, params, batch = model_and_batch
    cap = 2.0
    grads, metrics = _sgd_step(
        graphdef,
        params,
        batch,
        correction="tis",
        correction_kwargs={"level": "sequence", "cap": cap},
    )
    # Reference: weights from the current log-probs in float64 NumPy, then the plain loss.
    logp = models.per_token_logps(nnx.merge(graphdef, params), batch.tokens, batch.attention_mask)
    mask = np.asarray(batch.loss_mask)
    ell = np.where(mask, np.asarray(logp, np.float64) - np.asarray(batch.behaviour_logp), 0.0)
    seq_log_w = ell.sum(axis=1)
    weights = np.minimum(np.exp(np.minimum(seq_log_w, 50.0)), cap)
    assert 0 < np.sum(weights == cap) < len(weights), "the cap should bind on some sequences"
    adv, _ = objectives.grpo_advantages(batch.rewards, batch.group_ids)

    def loss(p):
        lp = models.per_token_logps(nnx.merge(graphdef, p), batch.tokens, batch.attention_mask)
        value, _ = objectives.reinforce_loss(
            lp,
            batch.behaviour_logp,
            adv,
            batch.loss_mask,
            is_weights=jnp.asarray(weights, jnp.float32),
        )
        return value

    want = jax.grad(loss)(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)
    truncated = np.sum(mask[weights == cap]) / np.sum(mask)
    np.testing.assert_allclose(metrics["loss/correction_fraction"], truncated, rtol=1e-5)


def test_token_tis_with_an_unreachable_cap_is_the_token_ratio(model_and_batch):
    graphdef, params, batch = model_and_batch
    plain, _ = _sgd_step(graphdef, params, batch)  # REINFORCE's default weight: pi / mu.
    capped, metrics = _sgd_step(
        graphdef, params, batch, correction="tis", correction_kwargs={"cap": 1e30}
    )
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(capped), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7)
    assert metrics["loss/correction_fraction"] == 0.0


def test_mis_drops_the_rejected_tokens_from_the_loss(model_and_batch):
    graphdef, params, batch = model_and_batch
    _, metrics = _sgd_step(
        graphdef, params, batch, correction="mis", correction_kwargs={"cap": 1.0}
    )
    assert 0.0 < float(metrics["loss/correction_fraction"]) < 1.0


def test_correction_errors_name_the_bad_value():
    graphdef, _ = nnx.split(models.create_model(CONFIG))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    with pytest.raises(ValueError, match="policy_loss='gspo' does not"):
        make_train_step(graphdef, tx, LossConfig(policy_loss="gspo", correction="tis"))
    with pytest.raises(ValueError, match="'tiss'.*icepop, mis, tis"):
        make_train_step(graphdef, tx, LossConfig(correction="tiss"))


def test_advantage_kwargs_reach_the_estimator():
    # VCPO as its authors run it: the objective passes advantage_kwargs to the estimator.
    from gac_jax.learner.objective import Objective

    rng = np.random.default_rng(0)
    rewards = jnp.asarray(rng.random(8), jnp.float32)
    ids = jnp.asarray([0, 0, 0, 0, 1, 1, 1, 1], jnp.int32)
    log_w, norms = jnp.asarray(rng.normal(size=8)), jnp.asarray(rng.uniform(1, 2, size=8))
    kwargs = {"baseline_weights": "released", "cap": 2.0, "scope": "batch"}
    objective = Objective(LossConfig(advantage="vcpo", advantage_kwargs=kwargs))
    got, _ = objective.advantages(rewards, ids, log_weights=log_w, grad_sq_norms=norms)
    direct, _ = objectives.vcpo_advantages(
        rewards, ids, log_weights=log_w, grad_sq_norms=norms, **kwargs
    )
    paper, _ = objectives.vcpo_advantages(rewards, ids, log_weights=log_w, grad_sq_norms=norms)
    np.testing.assert_allclose(got, direct, rtol=1e-6)
    assert not np.allclose(got, paper, atol=1e-3)
    with pytest.raises(ValueError, match="advantage_kwargs.scope is not an argument"):
        Objective(LossConfig(advantage="grpo", advantage_kwargs={"scope": "batch"}))
