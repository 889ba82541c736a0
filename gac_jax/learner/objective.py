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
      grad_norm: for estimators that need per-sequence gradient norms (VCPO's baseline):
        "exact" per-example gradients, or a proxy of `objectives.GRAD_NORM_PROXIES`.
      correction: None, or a name of `objectives.IMPORTANCE_CORRECTIONS` ("tis", "mis",
        "icepop") whose weights the loss takes as ``is_weights`` and whose mask replaces
        the loss mask; e.g. sequence TIS is ``correction="tis"``,
        ``correction_kwargs={"level": "sequence"}`` with ``policy_loss="reinforce"``.
      correction_kwargs: the correction's keyword arguments.
    """

    policy_loss: str = "ppo"
    loss_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    advantage: str = "grpo"
    grad_norm: str = "exact"
    correction: str | None = None
    correction_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

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


class Objective:
    """What the train step computes for a `LossConfig`, by asking the registry entries.

    Args:
      config: the loss config (validated here).
    """

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
        allowed = self.spec.keyword_arguments()
        _check_keywords("loss_kwargs", self.spec.fn, config.loss_kwargs, allowed)
        self.loss_kwargs = dict(config.loss_kwargs)
        self.aggregation = self.loss_kwargs.get("aggregation", self.spec.default_aggregation)
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
        _dry_run(
            "loss_kwargs", self.loss, token, token, jax.ShapeDtypeStruct((2,), jnp.float32), mask
        )
        if self.correct is not None:
            _dry_run("correction_kwargs", self.correct, token, token, mask)

    @property
    def needs_log_weights(self) -> bool:
        """The advantage estimator needs the current policy's log-probs before the update."""
        return self.advantage_spec.needs_log_weights

    def advantages(self, rewards, group_ids, *, log_weights=None, grad_sq_norms=None):
        """(advantages [B], aux) of the configured estimator (no gradient)."""
        kwargs = {}
        if self.needs_log_weights:
            kwargs = dict(log_weights=log_weights, grad_sq_norms=_sg(grad_sq_norms))
        advantages, aux = self.advantage_spec.fn(rewards, group_ids, **kwargs)
        return _sg(advantages), aux

    def batch_statistics(self, logp, behaviour_logp, advantages, mask) -> dict[str, Any]:
        """The loss's whole-batch statistics (M2PO's mask, BAPO's bounds); {} if none."""
        if self.spec.batch_statistics is None:
            return {}
        return self.spec.batch_statistics(
            _sg(logp), behaviour_logp, advantages, mask, **self.loss_kwargs
        )

    def loss(self, logp, behaviour_logp, advantages, mask, statistics=None):
        """``(loss, aux, size)``: the loss of these rows, its diagnostics, and their
        `aggregation_size` (with the correction's mask, when there is one).

        Args:
          logp: [N, T] log-probs of the policy being trained (the gradient flows here).
          behaviour_logp, advantages, mask: as the policy losses take them.
          statistics: the whole batch's `batch_statistics`, or None to compute them on
            these rows (right when the rows are the whole batch).
        """
        extra, aux = {}, {}
        if self.spec.needs_proximal:
            # One update per batch: the proximal policy is the current one, held fixed.
            extra["proximal_logp"] = _sg(logp)
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
        return loss, dict(loss_aux, **aux), size
