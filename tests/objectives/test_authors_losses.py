"""VESPO and DPPO against their authors' own torch functions, copied below.

Random batches (several seeds) with padding holding garbage, a fully padded row,
per-sequence and per-token advantages and heavy-tailed log-ratios (Student-t, outliers
past the +-20 clamp); the authors' functions run in float64 on the same float32 inputs
(padding zeroed, since their masks multiply), ours in float32. Loss and gradient with
respect to ``logp`` must agree for every aggregation.
"""

import types

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gac_jax.objectives import (  # noqa: E402
    AGGREGATIONS,
    dppo_binary_kl_loss,
    dppo_binary_tv_loss,
    get_policy_loss_spec,
    vespo_loss,
)

# ------------------------------------------------------------------------------------------
# Copied code. Apache License 2.0, http://www.apache.org/licenses/LICENSE-2.0.
#
# `masked_sum` and `agg_loss` (its optional batch arguments unused here):
#   Copyright 2024 Bytedance Ltd. and/or its affiliates; from sail-sg/Stable-RL at
#   c6af1d119c0fe30d16dd9a837d35fdf695acd226, verl/utils/torch_functional.py and
#   verl/trainer/ppo/core_algos.py.
# `compute_policy_loss_vespo`: Copyright 2024 VESPO Authors; from FloyedShen/VESPO at
#   aa1f3045c3462bba07518dc112693a8bb3183ed2, recipe/vespo/code/core_algos.py (L39-154;
#   the metrics block L156-249 is left out, the rest is unchanged).
# `compute_policy_loss_with_mask` and `_compute_token_mask_for_policy_loss`: Copyright 2024
#   Bytedance Ltd. and/or its affiliates; from sail-sg/Stable-RL at
#   c6af1d119c0fe30d16dd9a837d35fdf695acd226, verl/trainer/ppo/core_algos.py (L1160-1238,
#   L1241-1308; left out: the invalid-token metric lists and the loss modes other than
#   dppo_binary_kl and dppo_binary_tv).
# ------------------------------------------------------------------------------------------


def masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None,
             global_batch_size=None, loss_scale_factor=None):  # fmt: skip
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = torch.sum(seq_losses) / loss_scale_factor
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")

    return loss


def compute_policy_loss_vespo(old_log_prob, log_prob, advantages, response_mask,
                              loss_agg_mode="token-mean", config=None,
                              rollout_is_weights=None):  # fmt: skip
    assert config is not None

    # 1. Config Extraction
    gamma_config = config.policy_loss.get("vespo", {}) if hasattr(config, "policy_loss") else {}

    k_pos = float(gamma_config.get("k_pos", 2.0))
    lambda_pos = float(gamma_config.get("lambda_pos", 3.0))
    k_neg = float(gamma_config.get("k_neg", 3.0))
    lambda_neg = float(gamma_config.get("lambda_neg", 2.0))

    # 2. Compute TRUE Sequence-Level IS Ratio (product, not geometric mean)
    log_ratio = log_prob - old_log_prob
    log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio * response_mask, dim=-1)  # (batch_size,)

    # 3. Apply TIS Correction in LOG space (if provided)
    seq_log_tis = None
    if rollout_is_weights is not None:
        log_tis = torch.log(rollout_is_weights.clamp(min=1e-8))
        log_tis = torch.clamp(log_tis, -20.0, 20.0)  # Clamp per-token log TIS
        seq_log_tis = torch.sum(log_tis * response_mask, dim=-1)
        seq_log_ratio_combined = seq_log_ratio + seq_log_tis
    else:
        seq_log_ratio_combined = seq_log_ratio

    # 4. Compute w_seq for gamma weighting (detached, not in gradient graph)
    seq_log_ratio_clamped = torch.clamp(seq_log_ratio_combined, -20.0, 20.0)
    w_seq = torch.exp(seq_log_ratio_clamped.detach())  # (batch_size,)

    # 5. Get sequence-level advantage
    seq_adv = advantages[:, 0] if advantages.dim() > 1 else advantages  # (batch_size,)

    # 6. Select k and lambda based on advantage sign (sequence level)
    pos_mask_seq = (seq_adv >= 0).float()
    neg_mask_seq = 1.0 - pos_mask_seq

    k_seq = pos_mask_seq * k_pos + neg_mask_seq * k_neg
    lam_seq = pos_mask_seq * lambda_pos + neg_mask_seq * lambda_neg

    # 7. Compute Gamma Weight phi(w_seq): log phi(w) = lambda + k log(w) - lambda w
    lam_safe = torch.clamp(lam_seq, min=1e-4)
    log_w_seq = torch.log(w_seq.clamp(min=1e-8))

    log_phi = lam_safe + k_seq * log_w_seq - lam_safe * w_seq

    phi_seq = torch.exp(log_phi).detach()  # (batch_size,)
    phi_seq = torch.nan_to_num(phi_seq, nan=0.0, posinf=0.0, neginf=0.0)

    # 8. Broadcast phi to token level
    phi_token = phi_seq.unsqueeze(-1)  # (batch_size, 1)

    # 9. Compute Loss: L = -phi(w).detach() x A x log_prob
    loss_mat = -phi_token * advantages * log_prob

    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode)
    return pg_loss, {}


def compute_policy_loss_with_mask(old_log_prob, log_prob, advantages, response_mask,
                                  loss_agg_mode="token-mean", config=None,
                                  rollout_is_weights=None, rollout_log_prob=None, topk_kl=None,
                                  topk_tv=None, entropy=None, mask=None,
                                  loss_mode=None):  # fmt: skip
    if mask is None:
        mask = _compute_token_mask_for_policy_loss(
            rollout_log_prob=rollout_log_prob,
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            config=config,
            loss_mode=loss_mode,
            topk_kl=topk_kl,
            topk_tv=topk_tv,
        )
    mask = mask.detach().float()

    clip_ratio_c = config.get("clip_ratio_c", 10.0)
    negative_approx_kl = log_prob - rollout_log_prob
    # Clamp negative_approx_kl for stability
    negative_approx_kl = torch.clamp(negative_approx_kl, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ratio = torch.clamp(ratio, max=clip_ratio_c)
    ratio = ratio.detach()

    pg_losses = -advantages * ratio * mask * log_prob
    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info  # noqa: E501
    )  # fmt: skip
    return pg_loss, {}


def _compute_token_mask_for_policy_loss(rollout_log_prob, old_log_prob, log_prob, advantages,
                                        response_mask, config=None, loss_mode=None,
                                        topk_kl=None, topk_tv=None):  # fmt: skip
    clip_ratio = config.clip_ratio  # Clipping parameter for standard PPO.
    cliprange_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    cliprange_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio

    prob = torch.exp(log_prob)
    rollout_prob = torch.exp(rollout_log_prob)

    if loss_mode is None:
        loss_mode = config.policy_loss.get("loss_mode", "dppo_binary_tv")
    if loss_mode == "dppo_binary_kl":
        kl = rollout_prob * (rollout_log_prob - log_prob) + (1 - rollout_prob) * torch.log((1.0 - rollout_prob + 1e-8) / (1.0 - prob + 1e-8))  # fmt: skip  # noqa: E501
        invalid_positive_mask = (kl > cliprange_high) & (prob > rollout_prob)
        invalid_negative_mask = (kl > cliprange_low) & (prob < rollout_prob)
    elif loss_mode == "dppo_binary_tv":
        invalid_positive_mask = (prob - rollout_prob) > cliprange_high
        invalid_negative_mask = (prob - rollout_prob) < -cliprange_low
    else:
        raise ValueError(f"Invalid loss_mode: {loss_mode}")

    invalid_mask = torch.where(advantages > 0, invalid_positive_mask, invalid_negative_mask)
    valid_mask = 1.0 - invalid_mask.detach().float()
    valid_mask = valid_mask * response_mask.float()
    return valid_mask


# ------------------------------------------------------------------------- end of copied code


class _Config(types.SimpleNamespace):
    """The fields of verl's ActorConfig the copied functions read."""

    def get(self, key, default=None):
        return getattr(self, key, default)


B, T = 8, 12


def _batch(seed, per_token_adv=False):
    """float32 inputs with padding garbage; heavy-tailed log-ratios, some past +-20."""
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(0.7, (B, T))  # token probabilities spread over (0, 1]
    scale_b1 = 10.0 ** rng.permutation(np.linspace(-2.0, 1.0, B))[:, None]  # w near 1 and far
    ell = scale_b1 * rng.standard_t(2.0, (B, T))
    ell[rng.random((B, T)) < 0.04] *= 40.0
    behaviour = np.minimum(logp - ell, 0.0)
    mask = np.arange(T)[None, :] < rng.integers(1, T + 1, (B, 1))
    mask[3] = False  # a fully padded row
    adv_b = rng.normal(0.0, 1.0, B)
    adv_b[5] = 0.0
    adv = adv_b[:, None] * rng.uniform(0.2, 2.0, (B, T)) if per_token_adv else adv_b
    logp, behaviour, adv = (x.astype(np.float32) for x in (logp, behaviour, adv))
    garbage_logp = np.where(mask, logp, np.float32(1e4))
    garbage_behaviour = np.where(mask, behaviour, np.float32(-1e4))
    return garbage_logp, garbage_behaviour, adv, mask


def _torch_inputs(logp, behaviour, adv, mask):
    clean = [np.where(mask, x, 0.0) for x in (logp, behaviour)]
    logp_t, behaviour_t = (torch.tensor(x, dtype=torch.float64) for x in clean)
    adv_bt = np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv
    adv_t = torch.tensor(np.array(adv_bt), dtype=torch.float64)
    return logp_t.requires_grad_(), behaviour_t, adv_t, torch.tensor(mask, dtype=torch.float64)


def _compare(ours, authors, logp, behaviour, adv, mask, mode):
    (loss, aux), grad = jax.jit(jax.value_and_grad(ours, has_aux=True))(logp, behaviour, adv, mask)
    logp_t, behaviour_t, adv_t, mask_t = _torch_inputs(logp, behaviour, adv, mask)
    ref, _ = authors(logp_t, behaviour_t, adv_t, mask_t)
    ref.backward()
    # verl's seq-mean-token-sum-norm divides by T only; ours is a mean over the B rows too.
    norm = B if mode == "seq-mean-token-sum-norm" else 1
    ref_grad = logp_t.grad.numpy() / norm
    scale = np.abs(ref_grad).max()
    np.testing.assert_allclose(float(loss), ref.item() / norm, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=2e-5, atol=1e-6 * scale)
    assert np.all(np.asarray(grad)[~mask] == 0.0)
    return aux, np.asarray(grad)


_VESPO_SHAPES = [{}, {"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 5.0, "lambda_neg": 4.0}]


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("shape", _VESPO_SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vespo_matches_the_authors_code(seed, shape, mode):
    logp, behaviour, adv, mask = _batch(seed)
    config = _Config(policy_loss={"vespo": shape})
    aux, grad = _compare(
        lambda *a: vespo_loss(*a, **shape, aggregation=mode),
        lambda *a: compute_policy_loss_vespo(a[1], a[0], a[2], a[3], mode, config),
        logp, behaviour, adv, mask, mode,
    )  # fmt: skip
    # The batch reaches the kernel's whole range: sequences near w = 1 and far from it.
    log_w = np.sum(np.where(mask, logp - behaviour, 0.0), axis=-1)[mask.any(-1)]
    assert np.any(np.abs(log_w) < 1.0) and np.any(np.abs(log_w) > 5.0)
    assert 0.0 < float(aux["weight_mean"])


def test_vespo_weight_is_one_on_policy_and_fades_far_from_it():
    logp, _, adv, mask = _batch(0)
    _, on = vespo_loss(logp, logp, adv, mask)
    np.testing.assert_allclose(float(on["weight_mean"]), 1.0, rtol=1e-6)
    for log_w in (-8.0, 8.0):  # every sequence weight e^-8 or e^8
        far = np.where(mask, logp + log_w / mask.sum(-1, keepdims=True).clip(1), logp)
        _, aux = vespo_loss(far, logp, adv, mask)
        assert float(aux["weight_mean"]) < 1e-4


_DPPO = {
    "tv": (dppo_binary_tv_loss, "dppo_binary_tv", (0.15, 0.15)),
    "kl": (dppo_binary_kl_loss, "dppo_binary_kl", (0.05, 0.05)),
}


def _dppo_margin(kind, logp, behaviour, mask, eps_low, eps_high):
    """The distance of each valid token's divergence from a threshold (float64)."""
    p, q = np.exp(logp[mask].astype(np.float64)), np.exp(behaviour[mask].astype(np.float64))
    if kind == "tv":
        d = np.minimum(np.abs(p - q - eps_high), np.abs(p - q + eps_low))
    else:
        kl = q * (np.log(q) - np.log(p)) + (1 - q) * np.log((1 - q + 1e-8) / (1 - p + 1e-8))
        d = np.minimum(np.abs(kl - eps_high), np.abs(kl - eps_low))
    return d.min()


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("knobs", [None, (0.1, 0.3, 2.0)])
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_matches_the_authors_code(kind, seed, per_token_adv, knobs, mode):
    fn, loss_mode, (eps_low, eps_high) = _DPPO[kind]
    kwargs, ratio_cap = {}, 10.0  # None: our defaults, which must be the authors'.
    if knobs is not None:
        eps_low, eps_high, ratio_cap = knobs
        kwargs = {"eps_low": eps_low, "eps_high": eps_high, "ratio_cap": ratio_cap}
    config = _Config(clip_ratio=0.2, clip_ratio_low=eps_low, clip_ratio_high=eps_high,
                     clip_ratio_c=ratio_cap, policy_loss={}, global_batch_info={})  # fmt: skip
    logp, behaviour, adv, mask = _batch(seed, per_token_adv)
    # No valid token sits within float32's reach of a threshold.
    assert _dppo_margin(kind, logp, behaviour, mask, eps_low, eps_high) > 1e-5
    aux, grad = _compare(
        lambda *a: fn(*a, **kwargs, aggregation=mode),
        lambda *a: compute_policy_loss_with_mask(
            a[1], a[0], a[2], a[3], mode, config, rollout_log_prob=a[1], loss_mode=loss_mode
        ),
        logp, behaviour, adv, mask, mode,
    )  # fmt: skip
    # The trust region binds: the dropped share is the authors' (tokens with A != 0).
    logp_t, behaviour_t, adv_t, mask_t = _torch_inputs(logp, behaviour, adv, mask)
    kept = _compute_token_mask_for_policy_loss(
        behaviour_t, behaviour_t, logp_t, adv_t, mask_t, config, loss_mode
    ).numpy()
    dropped = mask & (kept == 0) & (adv_t.numpy() != 0)
    assert dropped.any() and (mask & ~dropped).any()
    np.testing.assert_allclose(float(aux["clip_fraction"]), dropped.sum() / mask.sum(), rtol=1e-6)
    assert np.all(grad[dropped] == 0.0)


def test_rejects_bad_arguments():
    logp, behaviour, adv, mask = _batch(0)
    with pytest.raises(ValueError, match="`lambda_neg` must be >= 0, got -1"):
        vespo_loss(logp, behaviour, adv, mask, lambda_neg=-1.0)
    with pytest.raises(ValueError, match="`eps_high` must be >= 0"):
        dppo_binary_tv_loss(logp, behaviour, adv, mask, eps_high=-0.1)
    with pytest.raises(ValueError, match="`ratio_cap` must be > 0, got 0"):
        dppo_binary_kl_loss(logp, behaviour, adv, mask, ratio_cap=0)
    with pytest.raises(ValueError, match="'mean'"):
        dppo_binary_kl_loss(logp, behaviour, adv, mask, aggregation="mean")


def test_the_registry_names_each_loss_and_its_knobs():
    knobs = {
        "vespo": {"k_pos", "lambda_pos", "k_neg", "lambda_neg", "aggregation"},
        "dppo_binary_tv": {"eps_low", "eps_high", "ratio_cap", "aggregation"},
        "dppo_binary_kl": {"eps_low", "eps_high", "ratio_cap", "aggregation"},
        "naive_pg_trust_region": {"eps_low", "eps_high", "aggregation"},
    }
    for name, expected in knobs.items():
        assert set(get_policy_loss_spec(name).keyword_arguments()) == expected, name
    logp, behaviour, adv, mask = _batch(0)
    with pytest.raises(TypeError, match="k_poz"):
        vespo_loss(logp, behaviour, adv, mask, k_poz=1.0)
