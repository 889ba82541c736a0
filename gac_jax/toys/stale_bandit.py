"""Asynchronous policy gradient on a contextual bandit: stale-aligned gradients in seconds.

A small MLP policy picks one of `num_arms` actions for each context; a few arms per context
pay reward 1. Every step samples a GRPO group of actions for each of a batch of contexts
from the *behaviour* policy, the parameters of `staleness` steps ago (the lagged mode of
gac_jax: step t trains on samples of version max(0, t - staleness)), and trains the current
policy with truncated-importance-weighted REINFORCE on GRPO advantages, both from
`gac_jax.objectives`. Any optax chain can be plugged in; GAC's cosine is recorded for every
run through a monitor or the controller itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gac_jax import objectives
from gac_jax.numerics import effective_sample_size
from gac_jax.transforms import alignment_statistics


@dataclasses.dataclass(frozen=True)
class BanditConfig:
    """The problem and the asynchrony."""

    num_contexts: int = 64
    feature_dim: int = 16
    num_arms: int = 64
    good_arms: int = 1  # Arms paying reward 1 in each context.
    hidden: int = 64
    batch_contexts: int = 64  # Contexts per step (GRPO groups), at most num_contexts.
    group_size: int = 16  # Actions sampled per context.
    staleness: int = 0  # Behaviour policy = params of `staleness` steps ago.
    importance_cap: float = 5.0  # Truncated IS weight cap (token = sequence here).
    steps: int = 300
    seed: int = 0


@dataclasses.dataclass
class BanditRunResult:
    """Per-step metrics of one run, as NumPy arrays of length `steps`."""

    reward: np.ndarray  # Mean reward of the behaviour samples.
    greedy_accuracy: np.ndarray  # Share of contexts whose greedy arm pays.
    cosine: np.ndarray  # GAC's c_t before control (NaN where no GAC state is in the chain).
    cosine_after: np.ndarray
    regime: np.ndarray  # 0 pass, 1 project, 2 skip, 3 non-finite; -1 without GAC.
    ess_ratio: np.ndarray


def _problem(config: BanditConfig):
    rng = np.random.default_rng(config.seed)
    features = rng.normal(size=(config.num_contexts, config.feature_dim)).astype(np.float32)
    payoff = np.zeros((config.num_contexts, config.num_arms), np.float32)
    for c in range(config.num_contexts):
        payoff[c, rng.choice(config.num_arms, config.good_arms, replace=False)] = 1.0
    return jnp.asarray(features), jnp.asarray(payoff)


def _init_params(config: BanditConfig, key):
    def dense(key, fan_in, fan_out):
        scale = 1.0 / np.sqrt(fan_in)
        return {"w": scale * jax.random.normal(key, (fan_in, fan_out)), "b": jnp.zeros(fan_out)}

    k1, k2 = jax.random.split(key)
    return {
        "hidden": dense(k1, config.feature_dim, config.hidden),
        "out": dense(k2, config.hidden, config.num_arms),
    }


def _log_policy(params, features_bd):
    hidden_bh = jnp.tanh(features_bd @ params["hidden"]["w"] + params["hidden"]["b"][None, :])
    logits_ba = hidden_bh @ params["out"]["w"] + params["out"]["b"][None, :]
    return jax.nn.log_softmax(logits_ba, axis=-1)


def _stat(state, name, default):
    """GAC's statistic `name` of a chain (bare or `alignment_controlled`), else `default`."""
    return alignment_statistics(state).get(name, jnp.asarray(default))


def run_stale_bandit(
    config: BanditConfig, make_optimizer: Callable[[], optax.GradientTransformationExtraArgs]
) -> BanditRunResult:
    """Trains the bandit policy with the given chain under lagged asynchrony.

    The chain receives `log_importance_weights` (per sample: log pi_theta - log pi_behaviour)
    as an extra arg, so `gac_jax.scale_by_ess` works inside it.
    """
    if not 1 <= config.batch_contexts <= config.num_contexts:
        raise ValueError(
            f"batch_contexts={config.batch_contexts} must lie in [1, num_contexts="
            f"{config.num_contexts}]."
        )
    if config.staleness < 0:
        raise ValueError(f"staleness={config.staleness} must be >= 0.")
    features, payoff = _problem(config)
    key, init_key = jax.random.split(jax.random.key(config.seed))
    params = _init_params(config, init_key)
    tx = make_optimizer()
    opt_state = tx.init(params)
    B, G = config.batch_contexts, config.group_size

    def sample(behaviour_params, key):
        ctx_key, act_key = jax.random.split(key)
        contexts_b = jax.random.choice(ctx_key, config.num_contexts, (B,), replace=False)
        logp_ba = _log_policy(behaviour_params, features[contexts_b])
        actions_bg = jax.random.categorical(act_key, logp_ba[:, None, :], shape=(B, G))
        behaviour_logp_bg = jnp.take_along_axis(logp_ba, actions_bg, axis=1)
        rewards_bg = jnp.take_along_axis(payoff[contexts_b], actions_bg, axis=1)
        return contexts_b, actions_bg, behaviour_logp_bg, rewards_bg

    # Each sample is a one-token "sequence": N = B * G rows of length 1.
    group_ids_n = jnp.repeat(jnp.arange(B), G)
    mask_n1 = jnp.ones((B * G, 1), bool)

    def loss_fn(params, contexts_b, actions_bg, behaviour_logp_bg, advantages_n):
        logp_ba = _log_policy(params, features[contexts_b])
        logp_n1 = jnp.take_along_axis(logp_ba, actions_bg, axis=1).reshape(B * G, 1)
        behaviour_n1 = behaviour_logp_bg.reshape(B * G, 1)
        weights = objectives.truncated_importance_weights(
            logp_n1, behaviour_n1, mask_n1, cap=config.importance_cap
        )
        loss, _ = objectives.reinforce_loss(
            logp_n1, behaviour_n1, advantages_n, mask_n1, is_weights=weights.weights
        )
        return loss, (logp_n1 - behaviour_n1)[:, 0]

    @jax.jit
    def train_step(params, opt_state, behaviour_params, key):
        contexts_b, actions_bg, behaviour_logp_bg, rewards_bg = sample(behaviour_params, key)
        advantages_n, _ = objectives.grpo_advantages(rewards_bg.reshape(-1), group_ids_n)
        grads, log_w = jax.grad(loss_fn, has_aux=True)(
            params, contexts_b, actions_bg, behaviour_logp_bg, advantages_n
        )
        updates, opt_state = tx.update(grads, opt_state, params, log_importance_weights=log_w)
        params = optax.apply_updates(params, updates)
        greedy = jnp.argmax(_log_policy(params, features), axis=-1)
        accuracy = jnp.mean(jnp.take_along_axis(payoff, greedy[:, None], axis=1))
        metrics = {
            "reward": jnp.mean(rewards_bg),
            "greedy_accuracy": accuracy,
            "cosine": _stat(opt_state, "gac_cosine", jnp.nan),
            "cosine_after": _stat(opt_state, "gac_cosine_after", jnp.nan),
            "regime": _stat(opt_state, "gac_regime", -1),
            "ess_ratio": effective_sample_size(log_w).ess_ratio,
        }
        return params, opt_state, metrics

    history = [params]  # history[v] = params of version v; bounded to the lag.
    rows = []
    for _ in range(config.steps):
        behaviour = history[max(0, len(history) - 1 - config.staleness)]
        key, step_key = jax.random.split(key)
        params, opt_state, metrics = train_step(params, opt_state, behaviour, step_key)
        history.append(params)
        del history[: max(0, len(history) - config.staleness - 1)]
        rows.append(metrics)
    rows = jax.device_get(rows)
    names = [field.name for field in dataclasses.fields(BanditRunResult)]
    return BanditRunResult(**{name: np.asarray([row[name] for row in rows]) for name in names})
