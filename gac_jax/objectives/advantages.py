"""Group-relative advantage estimators for outcome rewards: GRPO, Dr. GRPO, RLOO and
VCPO's off-policy optimal baseline.

Every estimator takes per-sequence rewards [B] and integer group ids [B] (sequences
sampled for the same prompt share an id; the ids may be any integers, in any order) and
returns ``(advantages_b, aux)``. Sequences excluded with ``where`` get advantage 0 and do
not enter their group's statistics. Advantages carry no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import as_float, as_mask, check_choice, check_nonnegative
from gac_jax.objectives._groups import dense_group_ids, group_max, group_moments, group_sum

GRAD_NORM_PROXIES = ("length", "inverse_length", "uniform")


def _prepare(rewards, group_ids, where):
    rewards_b = jax.lax.stop_gradient(as_float(rewards))
    if rewards_b.ndim != 1:
        raise ValueError(f"`rewards` must be [B], got shape {rewards_b.shape}.")
    if jnp.shape(group_ids) != rewards_b.shape:
        raise ValueError(
            f"`group_ids` has shape {jnp.shape(group_ids)}, expected {rewards_b.shape}."
        )
    segments_b = dense_group_ids(group_ids)
    where_b = jnp.ones(rewards_b.shape, bool) if where is None else as_mask(where, rewards_b.shape)
    return rewards_b, segments_b, where_b


def _std_normalise(centred_b, std_b, epsilon):
    """centred / (std + epsilon), and 0 where the group std is 0 (all rewards equal or a
    single member), so epsilon = 0 never divides 0 by 0."""
    denom_b = std_b + epsilon
    safe_b = jnp.where(denom_b > 0, denom_b, 1.0)
    return jnp.where(std_b > 0, centred_b / safe_b, 0.0)


def _check_ddof(std_ddof) -> None:
    if std_ddof not in (0, 1):
        raise ValueError(f"`std_ddof` must be 0 or 1, got {std_ddof!r}.")


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    where: jax.Array | None = None,
    epsilon: float = 1e-6,
    std_ddof: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""GRPO's group-normalised advantage (Shao et al., DeepSeekMath, arXiv 2402.03300,
    Sec. 4.1.2):

    .. math::

        A_i = \frac{R_i - \operatorname{mean}_{j \in g(i)} R_j}
                   {\operatorname{std}_{j \in g(i)} R_j + \epsilon}

    The std is the sample std by default (``std_ddof=1``, as ``torch.std`` in verl and TRL;
    0: population std) and :math:`\epsilon = 10^{-6}` (verl's default). A group of one
    member, or whose rewards are all equal, gets advantage 0 (verl instead gives a
    singleton group its raw reward).

    Returns:
      ``(advantages, aux)``: [B] float32, and per-sequence ``aux["baseline"]`` (the group
      mean), ``aux["group_std"]``, ``aux["group_size"]``.
    """
    check_nonnegative("epsilon", epsilon)
    _check_ddof(std_ddof)
    rewards_b, segments_b, where_b = _prepare(rewards, group_ids, where)
    count_b, mean_b, std_b = group_moments(rewards_b, segments_b, where_b, std_ddof)
    adv_b = _std_normalise(rewards_b - mean_b, std_b, epsilon)
    adv_b = jnp.where(where_b & (count_b > 1), adv_b, 0.0)
    return adv_b, {"baseline": mean_b, "group_std": std_b, "group_size": count_b}


def dr_grpo_advantages(
    rewards: jax.Array, group_ids: jax.Array, *, where: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Dr. GRPO's unnormalised advantage (Liu et al., "Understanding R1-Zero-Like
    Training", arXiv 2503.20783, Sec. 3.1): GRPO without the std division, which biases
    updates towards groups with low reward variance.

    .. math::

        A_i = R_i - \operatorname{mean}_{j \in g(i)} R_j

    Args / Returns: as `grpo_advantages` (``aux["group_std"]`` is the population std).
    """
    rewards_b, segments_b, where_b = _prepare(rewards, group_ids, where)
    count_b, mean_b, std_b = group_moments(rewards_b, segments_b, where_b, 0)
    adv_b = jnp.where(where_b, rewards_b - mean_b, 0.0)
    return adv_b, {"baseline": mean_b, "group_std": std_b, "group_size": count_b}


def rloo_advantages(
    rewards: jax.Array, group_ids: jax.Array, *, where: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""REINFORCE leave-one-out (Ahmadian et al., "Back to Basics", arXiv 2402.14740,
    Eq. 7; Kool et al., 2019):

    .. math::

        A_i = R_i - \frac{1}{n-1}\sum_{j \in g(i),\, j \ne i} R_j
            = \frac{n}{n-1}\left(R_i - \operatorname{mean}_{j \in g(i)} R_j\right)

    A group of one member gets advantage 0 (no other sample to form a baseline).

    Args / Returns: as `grpo_advantages`; ``aux["baseline"]`` is the leave-one-out mean.
    """
    rewards_b, segments_b, where_b = _prepare(rewards, group_ids, where)
    count_b, mean_b, std_b = group_moments(rewards_b, segments_b, where_b, 0)
    others_b = jnp.maximum(count_b - 1.0, 1.0)
    loo_mean_b = (group_sum(jnp.where(where_b, rewards_b, 0.0), segments_b) - rewards_b) / others_b
    adv_b = jnp.where(where_b & (count_b > 1), rewards_b - loo_mean_b, 0.0)
    return adv_b, {"baseline": loo_mean_b, "group_std": std_b, "group_size": count_b}


VCPO_BASELINE_WEIGHTS = ("paper", "released")
VCPO_SCOPES = ("group", "batch")


def vcpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    log_weights: jax.Array,
    grad_sq_norms: jax.Array,
    where: jax.Array | None = None,
    normalize_std: bool = True,
    epsilon: float = 1e-6,
    std_ddof: int = 0,
    baseline_weights: str = "paper",
    cap: float = 8.0,
    scope: str = "group",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""VCPO's off-policy optimal baseline replacing the group mean (Huang et al.,
    "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv 2602.17616):

    .. math::

        b^*_g = \frac{\sum_{i \in g} v_i R_i}{\sum_{i \in g} v_i},
        \qquad v_i = w_i^2 \,\|\nabla \log\pi(\tau_i)\|^2,
        \qquad
        A_i = \frac{R_i - b^*_{g(i)}}{\operatorname{std}_{j\in g(i)} R_j + \epsilon}

    with :math:`w_i = \pi_\theta(\tau_i)/\mu(\tau_i)` the sequence importance weight: the
    constant baseline of least variance for :math:`w_i (R_i - b)\nabla\log\pi(\tau_i)`.
    The :math:`v_i` are normalised per group in log space (a softmax); a group whose
    weights are all zero falls back to its plain mean. GRPO's std normalisation is kept
    (population std by default, as mit-han-lab/vcpo ``compute_grad_info``, which skips the
    division below 1e-8 where :math:`\epsilon` guards it here).

    The released code (mit-han-lab/vcpo at c7f030f) records the norm of the
    truncated-IS-weighted loss, :math:`\min(w_i, c) \|\nabla\log\pi(\tau_i)\|`
    (``megatron_actor.py`` L777-786), which ``staleness_utils.py`` L447-459 square and
    multiply by :math:`w_i^2` again: :math:`v_i = \min(w_i, c)^2\, w_i^2
    \|\nabla\log\pi(\tau_i)\|^2`, about :math:`w_i^4` (``baseline_weights="released"``).

    Args:
      log_weights: [B] sequence log importance weights :math:`\log w_i`, e.g.
        `sequence_log_ratio(logp, behaviour_logp, mask)`. No gradient flows through them.
      grad_sq_norms: [B] :math:`\|\nabla\log\pi(\tau_i)\|^2 \ge 0`: exact per-example
        squared norms (of the token-sum log-likelihood, the released code's) for small
        models, a proxy (`grad_sq_norm_proxy`) for large ones; the caller says which.
      normalize_std, epsilon, std_ddof: as `grpo_advantages` (std_ddof 0: VCPO's code).
      baseline_weights: "paper" (:math:`w^2 \|\nabla\|^2`, the paper's formula) or
        "released" (:math:`\min(w, c)^2 w^2 \|\nabla\|^2`, the authors' code).
      cap: :math:`c`, the truncation cap of "released" (their ``rollout_is_threshold``).
      scope: "group" (a baseline per prompt group, their default) or "batch" (one
        baseline over every included sequence, their ``scope="minibatch"``: it is then
        the weighted mean of the group-normalised advantages, subtracted from them).

    Returns:
      ``(advantages, aux)`` as `grpo_advantages`, ``aux["baseline"]`` holding :math:`b^*`.
    """
    check_nonnegative("epsilon", epsilon)
    _check_ddof(std_ddof)
    check_choice("baseline_weights", baseline_weights, VCPO_BASELINE_WEIGHTS)
    check_choice("scope", scope, VCPO_SCOPES)
    if not cap > 0:
        raise ValueError(f"`cap` must be > 0, got {cap!r}.")
    rewards_b, segments_b, where_b = _prepare(rewards, group_ids, where)
    log_w_b = jax.lax.stop_gradient(as_float(log_weights))
    g_b = jax.lax.stop_gradient(as_float(grad_sq_norms))
    for name, value in (("log_weights", log_w_b), ("grad_sq_norms", g_b)):
        if value.shape != rewards_b.shape:
            raise ValueError(f"`{name}` has shape {value.shape}, expected {rewards_b.shape}.")
    count_b, mean_b, std_b = group_moments(rewards_b, segments_b, where_b, std_ddof)
    active_b = where_b & (g_b > 0)
    log_v_b = 2.0 * log_w_b + jnp.log(jnp.where(active_b, g_b, 1.0))
    if baseline_weights == "released":
        log_v_b = log_v_b + 2.0 * jnp.minimum(log_w_b, jnp.log(cap))
    log_v_b = jnp.where(active_b, log_v_b, -jnp.inf)
    if scope == "group":
        baseline_b = _weighted_mean(rewards_b, log_v_b, active_b, segments_b, mean_b)
        centred_b = rewards_b - baseline_b
        adv_b = _std_normalise(centred_b, std_b, epsilon) if normalize_std else centred_b
    else:  # One baseline over the batch, of the group-normalised advantages.
        centred_b = rewards_b - mean_b
        grpo_b = _std_normalise(centred_b, std_b, epsilon) if normalize_std else centred_b
        everyone_b = jnp.zeros_like(segments_b)
        _, plain_b, _ = group_moments(grpo_b, everyone_b, where_b, 0)
        baseline_b = _weighted_mean(grpo_b, log_v_b, active_b, everyone_b, plain_b)
        adv_b = grpo_b - baseline_b
    adv_b = jnp.where(where_b, adv_b, 0.0)
    return adv_b, {"baseline": baseline_b, "group_std": std_b, "group_size": count_b}


def _weighted_mean(values_b, log_v_b, active_b, segments_b, fallback_b):
    """Per-sequence mean of `values_b` over its segment weighted by exp(`log_v_b`) (a
    softmax: log weights of any size are safe), or `fallback_b` where all weigh 0."""
    shift_b = group_max(log_v_b, segments_b)
    shift_b = jnp.where(jnp.isfinite(shift_b), shift_b, 0.0)
    v_b = jnp.where(active_b, jnp.exp(jnp.where(active_b, log_v_b - shift_b, 0.0)), 0.0)
    num_b = group_sum(v_b * values_b, segments_b)
    den_b = group_sum(v_b, segments_b)
    return jnp.where(den_b > 0, num_b / jnp.where(den_b > 0, den_b, 1.0), fallback_b)


def grad_sq_norm_proxy(mask: jax.Array, *, proxy: str = "length") -> jax.Array:
    r"""A named proxy for :math:`\|\nabla\log\pi(\tau_b)\|^2` when per-example gradients are
    too costly (VCPO, arXiv 2602.17616, needs these norms for its baseline).

    - ``"length"``: :math:`n_b`, the number of valid tokens. Assumes the per-token score
      gradients are orthogonal with similar norms (the assumption behind OPO's
      length-weighted optimal baseline, Hao et al., arXiv 2505.23585, Sec. 3).
    - ``"inverse_length"``: :math:`1/n_b`, the same assumption when the loss averages
      over each sequence's tokens (seq-mean-token-mean), which scales sequence b's
      gradient by :math:`1/n_b` (VCPO's ``normalize_by_length`` divides by :math:`n_b^2`).
    - ``"uniform"``: 1, which reduces :math:`b^*` to a :math:`w^2`-weighted mean.

    From the [B, T] `mask`; [B] float32, 0 for sequences without valid tokens.
    """
    check_choice("proxy", proxy, GRAD_NORM_PROXIES)
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"`mask` must be [B, T], got shape {mask.shape}.")
    length_b = jnp.sum(as_mask(mask, mask.shape), axis=-1, dtype=jnp.float32)
    if proxy == "length":
        return length_b
    if proxy == "inverse_length":
        return jnp.where(length_b > 0, 1.0 / jnp.maximum(length_b, 1.0), 0.0)
    return jnp.where(length_b > 0, 1.0, 0.0)
