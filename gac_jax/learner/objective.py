"""The learner's objective: which loss, advantage estimator and correction, as one config.

`LossConfig` names the methods of `gac_jax.objectives` and their arguments; `Objective`
reads what each needs from its registry entry (`PolicyLossSpec`, `AdvantageSpec`), so no
method name appears in the train step. Validation happens here, once, when the config is
checked: an unknown name, an unsupported loss, a keyword the loss does not take, or a value
the loss rejects is an error before any model is built.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from gac_jax import objectives

_sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The policy loss and advantage estimator, by registry name, with their arguments.

    Attributes:
      policy_loss: a name of `objectives.POLICY_LOSS_SPECS`.
      loss_kwargs: its keyword arguments (``eps_low``, ``tau_m2``, ``aggregation``, ...).
      advantage: a name of `objectives.ADVANTAGE_SPECS`.
      advantage_kwargs: its keyword arguments beyond what the learner supplies (e.g.
        VCPO's ``baseline_weights``, ``cap``, ``scope``; GRPO's ``std_ddof``).
      grad_norm: for estimators that need per-sequence gradient norms (VCPO's baseline):
        "exact" per-example gradients, or a proxy of `objectives.GRAD_NORM_PROXIES`.
      correction: None, or a name of `objectives.IMPORTANCE_CORRECTIONS` ("tis", "mis",
        "icepop") whose weights the loss takes as ``is_weights`` and whose mask replaces
        the loss mask; e.g. sequence TIS is ``correction="tis"``,
        ``correction_kwargs={"level": "sequence"}`` with ``policy_loss="reinforce"``.
      correction_kwargs: the correction's keyword arguments.
      kl_coef: beta >= 0 of a KL penalty to the frozen reference policy (the learner's
        `reference`); 0 computes no reference log-probs unless the loss needs them (`tb`).
      kl_estimator: Schulman's estimator of KL(pi || pi_ref) per token
        (`objectives.kl_estimate`): "k1", "k2" or "k3" (GRPO's).
      kl_penalty: where the penalty goes. "loss": ``beta * agg_t k(pi_theta, pi_ref)`` is
        added to the loss with the policy loss's aggregation (GRPO, arXiv 2402.03300 Eq. 3;
        verl's ``use_kl_loss``); the gradient flows through it. "reward": each sequence's
        reward loses ``beta * sum_t k(pi_behaviour, pi_ref)`` before the advantages are
        computed (InstructGPT's per-sample penalty; verl's ``use_kl_in_reward``); no
        gradient flows through it.
      entropy_coef: c >= 0 of an entropy bonus: the loss loses ``c * agg_t H_t``, the
        entropy of each predicted token's distribution, with the policy loss's
        aggregation.
    """

    policy_loss: str = "ppo"
    loss_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    advantage: str = "grpo"
    advantage_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    grad_norm: str = "exact"
    correction: str | None = None
    correction_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_penalty: str = "loss"
    entropy_coef: float = 0.0

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        Objective(self)


def _check_keywords(what: str, fn, given, allowed) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(
            f"{what}.{unknown[0]} is not an argument of {fn.__name__}; its arguments: "
            f"{', '.join(allowed) or 'none'}."
        )


def _named(field: str, lookup, name):
    try:
        return lookup(name)
    except ValueError as error:
        raise ValueError(f"{field}={name!r}: {error}") from None


def _keyword_only(fn) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _dry_run(what: str, fn, *args, **kwargs) -> None:
    """Traces `fn` on tiny abstract inputs, so its own checks see the configured values."""
    try:
        jax.eval_shape(functools.partial(fn, **kwargs), *args)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{what}: {error}") from None


KL_PENALTY_PLACES = ("loss", "reward")


def _check_penalties(config: LossConfig) -> None:
    for name in ("kl_coef", "entropy_coef"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"{name}={value!r} must be a number >= 0.")
    if config.kl_estimator not in objectives.KL_ESTIMATORS:
        raise ValueError(
            f"kl_estimator={config.kl_estimator!r} must be one of {list(objectives.KL_ESTIMATORS)}."
        )
    if config.kl_penalty not in KL_PENALTY_PLACES:
        places = list(KL_PENALTY_PLACES)
        raise ValueError(f"kl_penalty={config.kl_penalty!r} must be one of {places}.")


class Objective:
    """What the train step computes for a `LossConfig` (validated here), by asking the
    registry entries."""

    def __init__(self, config: LossConfig):
        self.config = config
        self.spec = _named("policy_loss", objectives.get_policy_loss_spec, config.policy_loss)
        if self.spec.unsupported is not None:
            raise ValueError(
                f"policy_loss={config.policy_loss!r} is not supported by the learner: "
                f"{self.spec.unsupported}."
            )
        self.advantage_spec = _named("advantage", objectives.get_advantage_spec, config.advantage)
        if config.grad_norm != "exact" and config.grad_norm not in objectives.GRAD_NORM_PROXIES:
            raise ValueError(
                f"grad_norm={config.grad_norm!r} is unknown; expected 'exact' or one of "
                f"{sorted(objectives.GRAD_NORM_PROXIES)}."
            )
        self.grad_norm = config.grad_norm
        supplied = ("where", "log_weights", "grad_sq_norms")  # By the learner.
        fn = self.advantage_spec.fn
        allowed_advantage = [k for k in _keyword_only(fn) if k not in supplied]
        _check_keywords("advantage_kwargs", fn, config.advantage_kwargs, allowed_advantage)
        self.advantage_kwargs = dict(config.advantage_kwargs)
        allowed = self.spec.keyword_arguments()
        _check_keywords("loss_kwargs", self.spec.fn, config.loss_kwargs, allowed)
        self.loss_kwargs = dict(config.loss_kwargs)
        self.aggregation = self.loss_kwargs.get("aggregation", self.spec.default_aggregation)
        _check_penalties(config)
        self.correct = None
        if config.correction is not None:
            self.correct = self._correction(config)
        elif config.correction_kwargs:
            raise ValueError("correction_kwargs are set but correction is None.")
        self._dry_run()

    def _correction(self, config: LossConfig):
        fn = _named("correction", objectives.get_importance_correction, config.correction)
        if not self.spec.takes_is_weights:
            takers = [n for n, s in objectives.POLICY_LOSS_SPECS.items() if s.takes_is_weights]
            raise ValueError(
                f"correction={config.correction!r} needs a policy loss that takes is_weights; "
                f"policy_loss={config.policy_loss!r} does not (use one of {takers})."
            )
        _check_keywords("correction_kwargs", fn, config.correction_kwargs, _keyword_only(fn))
        return functools.partial(fn, **config.correction_kwargs)

    def _dry_run(self) -> None:
        token = jax.ShapeDtypeStruct((2, 3), jnp.float32)
        mask = jax.ShapeDtypeStruct((2, 3), jnp.bool_)
        inputs = {}
        if self.needs_reference:
            inputs = dict(reference_logp=token, group_ids=jax.ShapeDtypeStruct((2,), jnp.int32))
        if self.config.entropy_coef > 0:
            inputs["entropy"] = token
        rows = jax.ShapeDtypeStruct((2,), jnp.float32)

        def loss(logp, behaviour, advantages, mask, inputs):
            return self.loss(logp, behaviour, advantages, mask, **inputs)

        _dry_run("loss_kwargs", loss, token, token, rows, mask, inputs)
        groups = jax.ShapeDtypeStruct((2,), jnp.int32)

        def advantages(rewards, group_ids, sequence_values):
            extra = {}
            if self.needs_log_weights:
                extra = dict(log_weights=sequence_values, grad_sq_norms=sequence_values)
            return self.advantage_spec.fn(rewards, group_ids, **extra, **self.advantage_kwargs)

        _dry_run("advantage_kwargs", advantages, rows, groups, rows)

    @property
    def needs_reference(self) -> bool:
        """The step needs a frozen reference policy's log-probs (a KL penalty, or `tb`)."""
        return self.spec.needs_reference or self.config.kl_coef > 0

    @property
    def kl_in_loss(self) -> bool:
        return self.config.kl_coef > 0 and self.config.kl_penalty == "loss"

    def penalised_rewards(self, rewards, behaviour_logp, reference_logp, mask):
        """`(rewards, penalty)`: the rewards less the KL penalty when it goes in the reward
        (`kl_penalty="reward"`), and the penalty [B] (zeros otherwise)."""
        if self.config.kl_coef == 0 or self.config.kl_penalty != "reward":
            return rewards, jnp.zeros_like(rewards)
        kl_bt = objectives.kl_estimate(
            behaviour_logp, reference_logp, estimator=self.config.kl_estimator
        )
        penalty = self.config.kl_coef * jnp.sum(jnp.where(mask, kl_bt, 0.0), axis=-1)
        return rewards - penalty, penalty

    @property
    def needs_log_weights(self) -> bool:
        """The advantage estimator needs the current policy's log-probs before the update."""
        return self.advantage_spec.needs_log_weights

    def advantages(self, rewards, group_ids, *, log_weights=None, grad_sq_norms=None):
        """(advantages [B], aux) of the configured estimator (no gradient)."""
        kwargs = dict(self.advantage_kwargs)
        if self.needs_log_weights:
            kwargs.update(log_weights=log_weights, grad_sq_norms=_sg(grad_sq_norms))
        advantages, aux = self.advantage_spec.fn(rewards, group_ids, **kwargs)
        return _sg(advantages), aux

    def batch_statistics(self, logp, behaviour_logp, advantages, mask) -> dict[str, Any]:
        """The loss's whole-batch statistics (M2PO's mask, BAPO's bounds); {} if none."""
        if self.spec.batch_statistics is None:
            return {}
        return self.spec.batch_statistics(
            _sg(logp), behaviour_logp, advantages, mask, **self.loss_kwargs
        )

    def loss(self, logp, behaviour_logp, advantages, mask, statistics=None, **inputs):
        """``(loss, aux, size)``: the loss of these rows, its diagnostics, and their
        `aggregation_size` (with the correction's mask, when there is one).

        Args:
          logp: [N, T] log-probs of the policy being trained (the gradient flows here).
          behaviour_logp, advantages, mask: as the policy losses take them (raw rewards
            in the advantages position for a loss that `takes_rewards`).
          statistics: the whole batch's `batch_statistics`, or None to compute them on
            these rows (right when the rows are the whole batch).
          **inputs: what the configured terms read, [N, T] unless said: `proximal_logp`
            (None: the current policy held fixed, right for one update per batch),
            `reference_logp` and `group_ids` [N] (a KL penalty, `tb`), `entropy` (the
            entropy bonus; the gradient flows through it).
        """
        extra, aux = {}, {}
        if self.spec.needs_proximal:
            proximal = inputs.get("proximal_logp")
            extra["proximal_logp"] = _sg(logp) if proximal is None else proximal
        if self.spec.needs_reference:
            extra["reference_logp"] = inputs["reference_logp"]
            extra["group_ids"] = inputs["group_ids"]
        if self.correct is not None:
            weights = self.correct(_sg(logp), behaviour_logp, mask)
            extra["is_weights"], mask = weights.weights, weights.mask
            aux["correction_fraction"] = weights.fraction
        if statistics is not None:
            extra.update(statistics)
        loss, loss_aux = self.spec.fn(
            logp, behaviour_logp, advantages, mask, **self.loss_kwargs, **extra
        )
        size = objectives.aggregation_size(mask, self.aggregation)
        loss = loss + self._penalties(logp, mask, aux, inputs)
        return loss, dict(loss_aux, **aux), size

    def _penalties(self, logp, mask, aux, inputs):
        """The KL (in the loss) and entropy terms, aggregated as the policy loss is, so
        micro-batching stays exact; their values go to `aux`."""
        total = jnp.zeros((), jnp.float32)
        if self.kl_in_loss:
            kl, kl_aux = objectives.kl_penalty(
                logp,
                inputs["reference_logp"],
                mask,
                estimator=self.config.kl_estimator,
                coef=self.config.kl_coef,
                aggregation=self.aggregation,
            )
            total, aux["kl"] = total + kl, kl_aux["kl"]
        if self.config.entropy_coef > 0:
            entropy = objectives.aggregate(inputs["entropy"], mask, self.aggregation)
            total = total - self.config.entropy_coef * entropy
            aux["entropy_bonus"] = _sg(self.config.entropy_coef * entropy)
        return total
