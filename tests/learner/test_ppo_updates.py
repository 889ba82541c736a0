"""Mini-batch PPO updates, the reference model's KL penalty, the entropy bonus, and the
learner's diagnostics of gradient noise and policy change.

The mini-batch test unrolls decoupled PPO's four updates by hand: the proximal log-probs
are taken once under the starting params, each mini-batch's loss gradient with respect to
the log-probs is written in float64 NumPy from the formula (AReaL, arXiv 2505.24298, Eq. 5),
and pulled back to the params through the model's own scorer (`jax.vjp`); SGD makes the
params carry any gradient error.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.learner import GRPOLearner, LearnerConfig, LossConfig, TrainBatch, make_train_step
from gac_jax.learner.update import noise_scale_metrics
from gac_jax.models.scoring import token_logps_and_entropy
from gac_jax.rollout import Rollout, collate

CONFIG = models.get_config("tiny", num_layers=1)
G, L, PROMPT, GROUPS = 4, 6, 5, 4  # 16 sequences: 4 mini-batches of 4.
EPS = 0.2
LR = 2.0


def _batch(seed=0, behaviour=None):
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(GROUPS):
        mask = np.ones((G, L), bool)
        mask[0, rng.integers(2, L) :] = False
        rollouts.append(
            Rollout(
                prompt_id=i,
                group_id=i,
                prompt_tokens=rng.integers(3, 60, 3).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
                completion_mask=mask,
                behaviour_logp=(-3.0 - rng.random((G, L))).astype(np.float32),
                rewards=rng.random(G).astype(np.float32),
                policy_version=0,
            )
        )
    batch = jax.tree.map(jnp.asarray, TrainBatch(**collate(rollouts, PROMPT)))
    if behaviour is not None:
        batch = dataclasses.replace(batch, behaviour_logp=behaviour)
    return batch


@pytest.fixture(scope="module")
def model_and_batch():
    graphdef, params = nnx.split(models.create_model(CONFIG, seed=3))
    batch = _batch()
    logp, _ = _logp_fn(graphdef, batch)(params)
    # A behaviour policy near the starting one, so the behaviour weights are O(1).
    noise = np.random.default_rng(1).normal(0.0, 0.1, logp.shape).astype(np.float32)
    behaviour = jnp.where(batch.loss_mask, logp + noise, 0.0)
    return graphdef, params, dataclasses.replace(batch, behaviour_logp=behaviour)


def _logp_fn(graphdef, batch):
    def logp(params):
        return token_logps_and_entropy(
            nnx.merge(graphdef, params), batch.tokens, batch.attention_mask, chunk_size=512
        )

    return logp


def _grpo_advantages_np(rewards, group_ids):
    rewards, group_ids = np.asarray(rewards, np.float64), np.asarray(group_ids)
    adv = np.zeros_like(rewards)
    for g in np.unique(group_ids):
        members = group_ids == g
        r = rewards[members]
        adv[members] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    return adv


def _decoupled_ppo_grad_np(logp, proximal, behaviour, adv, mask):
    """d loss / d logp of decoupled PPO, token-mean, in float64."""
    logp, proximal, behaviour = (np.asarray(x, np.float64) for x in (logp, proximal, behaviour))
    u = np.exp(logp - proximal)
    weight = np.exp(proximal - behaviour)
    a = adv[:, None]
    unclipped, clipped = -a * u, -a * np.clip(u, 1 - EPS, 1 + EPS)
    active = unclipped >= clipped  # The max picks the unclipped term: its gradient flows.
    grad = np.where(mask & active, weight * -a * u, 0.0)
    return grad / np.sum(mask)


def _rows(batch, rows):
    return jax.tree.map(lambda x: x[rows], batch)


def test_four_mini_batches_equal_a_hand_unrolled_decoupled_ppo(model_and_batch):
    graphdef, params, batch = model_and_batch
    loss = LossConfig(policy_loss="decoupled_ppo", loss_kwargs={"eps_low": EPS, "eps_high": EPS})
    tx = optax.chain(optax.sgd(LR))
    step = jax.jit(make_train_step(graphdef, tx, loss, mini_batches=4, shuffle=False))
    new_params, _, metrics = step(params, tx.init(params), batch, jnp.int32(1))

    proximal, _ = _logp_fn(graphdef, batch)(params)
    adv = _grpo_advantages_np(batch.rewards, batch.group_ids)
    expected = params
    for j in range(4):  # Mini-batch j holds rows j, j + 4, ... (unshuffled).
        rows = np.arange(j, batch.tokens.shape[0], 4)
        mini = _rows(batch, rows)
        (logp, _), pullback = jax.vjp(_logp_fn(graphdef, mini), expected)
        mask = np.asarray(mini.loss_mask)
        g = _decoupled_ppo_grad_np(logp, proximal[rows], mini.behaviour_logp, adv[rows], mask)
        (grads,) = pullback((jnp.asarray(g, jnp.float32), jnp.zeros_like(logp)))
        expected = jax.tree.map(lambda p, d: p - LR * d, expected, grads)

    leaves = zip(*(jax.tree.leaves(t) for t in (new_params, expected, params)), strict=True)
    for got, want, start in leaves:
        # The float32 model's rounding moves an update by ~1e-6 of its size; a wrong
        # proximal policy, mini-batch or clip would move it by far more.
        moved = np.linalg.norm(np.asarray(want) - np.asarray(start))
        assert moved > 0
        assert np.linalg.norm(np.asarray(got) - np.asarray(want)) <= 1e-4 * moved
    clip = np.asarray(metrics["loss/clip_fraction"])
    assert clip.shape == (4,)
    assert clip[0] == 0.0  # The first update starts at the proximal policy.
    assert np.all(clip[1:] > 0.0), clip  # Then the policy has moved: the clip fires.
    assert np.asarray(metrics["grad_norm"]).shape == (4,)
    assert np.ndim(metrics["reward"]) == 0  # Batch metrics stay scalars.


def test_one_update_keeps_scalar_metrics_and_no_clip(model_and_batch):
    graphdef, params, batch = model_and_batch
    loss = LossConfig(policy_loss="decoupled_ppo")
    tx = optax.chain(optax.sgd(LR))
    _, _, metrics = jax.jit(make_train_step(graphdef, tx, loss))(
        params, tx.init(params), batch, jnp.int32(1)
    )
    assert np.ndim(metrics["loss/clip_fraction"]) == 0
    assert float(metrics["loss/clip_fraction"]) == 0.0  # Proximal = current: degenerate.


def _kl_np(logp, ref, estimator):
    delta = np.asarray(ref, np.float64) - np.asarray(logp, np.float64)
    return {"k1": -delta, "k2": 0.5 * delta**2, "k3": np.exp(delta) - 1 - delta}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_in_the_loss_matches_numpy(model_and_batch, estimator):
    graphdef, params, batch = model_and_batch
    reference = nnx.state(models.create_model(CONFIG, seed=4))
    coef = 0.3
    tx = optax.chain(optax.sgd(0.0))
    plain = make_train_step(graphdef, tx, LossConfig())
    penalised = make_train_step(graphdef, tx, LossConfig(kl_coef=coef, kl_estimator=estimator))
    args = (params, tx.init(params), batch, jnp.int32(1))
    _, _, m0 = jax.jit(plain)(*args)
    _, _, m1 = jax.jit(penalised)(*args, reference)

    logp, _ = _logp_fn(graphdef, batch)(params)
    ref, _ = _logp_fn(graphdef, batch)(reference)
    mask = np.asarray(batch.loss_mask)
    terms = np.where(mask, _kl_np(logp, ref, estimator), 0.0)
    kl = np.sum(terms) / mask.sum()
    # k1 is a mean of signed terms: float32 loses relative precision to their cancellation
    # (and its last bits depend on the CPU's reduction order), so the tolerance is set against
    # the terms' own scale, not against their mean.
    scale = np.sum(np.abs(terms)) / mask.sum()
    np.testing.assert_allclose(float(m1["loss/kl"]), kl, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(
        float(m1["loss"]) - float(m0["loss"]),
        coef * kl,
        rtol=1e-4,
        atol=1e-5 * (abs(float(m0["loss"])) + coef * scale),
    )


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_in_the_reward_matches_numpy(model_and_batch, estimator):
    graphdef, params, batch = model_and_batch
    reference = nnx.state(models.create_model(CONFIG, seed=4))
    coef = 0.05
    tx = optax.chain(optax.sgd(0.0))
    loss = LossConfig(kl_coef=coef, kl_estimator=estimator, kl_penalty="reward")
    _, _, metrics = jax.jit(make_train_step(graphdef, tx, loss))(
        params, tx.init(params), batch, jnp.int32(1), reference
    )
    ref, _ = _logp_fn(graphdef, batch)(reference)
    mask = np.asarray(batch.loss_mask)
    terms = np.where(mask, _kl_np(batch.behaviour_logp, ref, estimator), 0.0)
    kl_b = np.sum(terms, axis=1)
    # Signed k1 terms cancel: tolerance against their magnitudes (see the test above).
    scale = coef * np.abs(terms).sum(axis=1).mean()
    np.testing.assert_allclose(
        float(metrics["kl_reward_penalty"]), coef * kl_b.mean(), rtol=1e-5, atol=1e-5 * scale
    )
    rewards = np.asarray(batch.rewards, np.float64) - coef * kl_b
    np.testing.assert_allclose(float(metrics["reward"]), rewards.mean(), rtol=1e-5)
    adv = _grpo_advantages_np(rewards, batch.group_ids)
    np.testing.assert_allclose(float(metrics["advantage_abs_mean"]), np.abs(adv).mean(), rtol=1e-4)


def test_entropy_bonus_lowers_the_loss_by_its_value(model_and_batch):
    graphdef, params, batch = model_and_batch
    tx = optax.chain(optax.sgd(0.0))
    args = (params, tx.init(params), batch, jnp.int32(1))
    _, _, m0 = jax.jit(make_train_step(graphdef, tx, LossConfig()))(*args)
    _, _, m1 = jax.jit(make_train_step(graphdef, tx, LossConfig(entropy_coef=0.01)))(*args)
    _, entropy = _logp_fn(graphdef, batch)(params)
    mask = np.asarray(batch.loss_mask)
    mean_entropy = np.sum(np.where(mask, np.asarray(entropy, np.float64), 0.0)) / mask.sum()
    np.testing.assert_allclose(float(m1["loss/entropy_bonus"]), 0.01 * mean_entropy, rtol=1e-5)
    np.testing.assert_allclose(
        float(m0["loss"]) - float(m1["loss"]), 0.01 * mean_entropy, rtol=1e-4
    )


def test_penalties_keep_micro_batching_exact(model_and_batch):
    graphdef, params, batch = model_and_batch
    reference = nnx.state(models.create_model(CONFIG, seed=4))
    loss = LossConfig(
        kl_coef=0.2, entropy_coef=0.05, loss_kwargs={"aggregation": "seq-mean-token-mean"}
    )
    tx = optax.chain(optax.sgd(0.5))
    out = {}
    for m in (1, 4):
        step = jax.jit(make_train_step(graphdef, tx, loss, micro_batches=m))
        out[m] = step(params, tx.init(params), batch, jnp.int32(1), reference)
    for a, b in zip(jax.tree.leaves(out[1][0]), jax.tree.leaves(out[4][0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key in ("loss", "loss/kl", "loss/entropy_bonus"):
        np.testing.assert_allclose(out[1][2][key], out[4][2][key], rtol=1e-5, err_msg=key)


def test_trajectory_balance_refuses_split_rows(model_and_batch):
    graphdef, _, _ = model_and_batch
    with pytest.raises(ValueError, match="partition function"):
        make_train_step(graphdef, optax.sgd(0.1), LossConfig(policy_loss="tb"), mini_batches=2)


def test_learner_logs_every_optimizer_step(model_and_batch):
    _, _, batch = model_and_batch
    model = models.create_model(CONFIG, seed=3)
    config = LearnerConfig(mini_batches=2, epochs=2)
    mesh = models.make_mesh(2, 2, 2)
    learner = GRPOLearner(model, optax.chain(optax.sgd(0.1)), mesh, config=config)
    metrics = learner.step(batch, 3)
    updates = metrics.pop("updates")
    assert [(u["epoch"], u["mini_batch"], u["optimizer_step"]) for u in updates] == [
        (0, 0, 12),
        (0, 1, 13),
        (1, 0, 14),
        (1, 1, 15),
    ]
    assert metrics["grad_norm"] == updates[-1]["grad_norm"]
    assert len({u["grad_norm"] for u in updates}) == 4  # Four different updates.
    assert isinstance(metrics["reward"], float)


def test_noise_scale_estimator_is_unbiased_on_synthetic_gradients():
    """Per-example gradients G + noise with a known covariance: averaged over many draws,
    the two-batch-size estimates recover |G|^2 and tr(Sigma)."""
    rng = np.random.default_rng(0)
    dim, small, parts = 6, 4, 8
    g_true = rng.normal(size=dim)
    scales = rng.uniform(0.5, 2.0, dim)  # Sigma = diag(scales^2).
    estimates = []
    for _ in range(4000):
        examples = g_true + scales * rng.normal(size=(small * parts, dim))
        micro = examples.reshape(parts, small, dim).mean(axis=1)
        small_sq = np.mean(np.sum(micro**2, axis=1))
        big_sq = np.sum(examples.mean(axis=0) ** 2)
        estimates.append(
            jax.device_get(noise_scale_metrics(small_sq, small, big_sq, small * parts))
        )
    grad_sq = np.mean([e["noise/grad_sq"] for e in estimates])
    trace = np.mean([e["noise/trace"] for e in estimates])
    np.testing.assert_allclose(grad_sq, np.sum(g_true**2), rtol=0.05)
    np.testing.assert_allclose(trace, np.sum(scales**2), rtol=0.05)


def test_the_steps_noise_scale_comes_from_its_micro_batch_gradients(model_and_batch):
    graphdef, params, batch = model_and_batch
    loss = LossConfig(policy_loss="reinforce")
    tx = optax.chain(optax.sgd(0.0))
    step = jax.jit(make_train_step(graphdef, tx, loss, micro_batches=4, noise_scale=True))
    _, _, metrics = step(params, tx.init(params), batch, jnp.int32(1))

    # REINFORCE's token-mean gradient, -sum(w A grad log pi) / tokens, in float64 weights.
    adv = _grpo_advantages_np(batch.rewards, batch.group_ids)
    logp, _ = _logp_fn(graphdef, batch)(params)
    mask = np.asarray(batch.loss_mask)
    w = np.exp(np.asarray(logp, np.float64) - np.asarray(batch.behaviour_logp, np.float64))
    sq_norms, sizes = [], []
    for rows in [np.arange(j, 16, 4) for j in range(4)] + [np.arange(16)]:
        mini = _rows(batch, rows)
        _, pullback = jax.vjp(_logp_fn(graphdef, mini), params)
        tokens = mask[rows].sum()
        cotangent = np.where(mask[rows], -w[rows] * adv[rows, None] / tokens, 0.0)
        (grads,) = pullback((jnp.asarray(cotangent, jnp.float32), jnp.zeros(mask[rows].shape)))
        sq_norms.append(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
        sizes.append(tokens)
    want = noise_scale_metrics(np.mean(sq_norms[:4]), np.mean(sizes[:4]), sq_norms[4], sizes[4])
    for key in ("noise/grad_sq", "noise/trace", "noise/b_simple", "noise/batch_size"):
        np.testing.assert_allclose(float(metrics[key]), float(want[key]), rtol=1e-3, err_msg=key)


def test_noise_scale_needs_micro_batches(model_and_batch):
    graphdef, _, _ = model_and_batch
    with pytest.raises(ValueError, match="micro_batches >= 2"):
        make_train_step(graphdef, optax.sgd(0.1), LossConfig(), noise_scale=True)


def test_policy_change_measures_the_updates_move(model_and_batch):
    graphdef, params, batch = model_and_batch
    tx = optax.chain(optax.sgd(LR))
    step = jax.jit(make_train_step(graphdef, tx, LossConfig(), policy_change=True))
    new_params, _, metrics = step(params, tx.init(params), batch, jnp.int32(1))
    before, _ = _logp_fn(graphdef, batch)(params)
    after, _ = _logp_fn(graphdef, batch)(new_params)
    mask = np.asarray(batch.loss_mask)
    delta = np.asarray(after, np.float64) - np.asarray(before, np.float64)
    kl = np.exp(delta) - 1 - delta  # k3 of KL(before || after), samples as from `before`.
    np.testing.assert_allclose(float(metrics["policy_change/kl"]), kl[mask].mean(), rtol=1e-3)
    np.testing.assert_allclose(
        float(metrics["policy_change/log_ratio_sq"]), (0.5 * delta**2)[mask].mean(), rtol=1e-3
    )
    assert float(metrics["policy_change/kl"]) > 0
