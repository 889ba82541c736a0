"""The registries of policy losses, advantage estimators and importance corrections, by name.

`POLICY_LOSS_SPECS` and `ADVANTAGE_SPECS` are the only lists of valid names, and each entry
says what a caller must supply: a learner reads the entry, never the name. Configs refer to
a method by its key; `get_policy_loss` / `get_advantage_estimator` reject any other name
with an error that lists the known ones. Every policy loss follows the common signature
``fn(logp, behaviour_logp, advantages, mask, **kwargs) -> (loss, aux)``, every advantage
estimator ``fn(rewards, group_ids, **kwargs) -> (advantages, aux)`` and every importance
correction ``fn(logp, behaviour_logp, mask, **kwargs) -> ImportanceWeights``.
`POLICY_LOSSES` and `ADVANTAGE_ESTIMATORS` are the name -> function views of the specs.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType

from gac_jax.objectives.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
    vcpo_advantages,
)
from gac_jax.objectives.bapo import bapo_batch_statistics, bapo_clip_bounds, bapo_loss
from gac_jax.objectives.importance import (
    icepop_weights,
    m2po_harmful_clip,
    masked_importance_weights,
    truncated_importance_weights,
)
from gac_jax.objectives.losses import (
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    topr_loss,
)
from gac_jax.objectives.m2po import m2po_batch_statistics, m2po_loss
from gac_jax.objectives.naive import naive_pg_loss, naive_pg_trust_region_loss, ppo_recompute_loss
from gac_jax.objectives.trajectory_balance import trajectory_balance_loss
from gac_jax.objectives.vespo_dppo import (
    dppo_binary_kl_loss,
    dppo_binary_tv_loss,
    vespo_loss,
    vespo_weights,
)


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss and what a learner must feed it.

    Attributes:
      fn: the loss, of the common signature (see the module docstring).
      default_aggregation: the reduction it uses when ``aggregation`` is not given (a name
        of `AGGREGATIONS`); a learner that splits the batch weighs micro-batches by it.
      needs_proximal: takes ``proximal_logp``, the log-probs of a proximal policy.
      needs_reference: takes ``reference_logp`` (a frozen policy's) and ``group_ids``.
      takes_is_weights: accepts ``is_weights``, so an importance correction can feed it.
      takes_rewards: reads raw rewards in the advantages position.
      batch_statistics: None, or ``fn(logp, behaviour_logp, advantages, mask, **kwargs) ->
        {name: value}``, computed once on the whole batch and passed back to the loss
        (M2PO's mask, BAPO's bounds), so micro-batches do not change what they select.
      forwards_to: None, or the function whose keyword-only arguments `fn` takes through
        ``**kwargs`` and passes on (directly, or through `batch_statistics`).
      unsupported: None if the learner can train with it, else why not.
    """

    fn: Callable
    default_aggregation: str = "token-mean"
    needs_proximal: bool = False
    needs_reference: bool = False
    takes_is_weights: bool = False
    takes_rewards: bool = False
    batch_statistics: Callable | None = None
    forwards_to: Callable | None = None
    unsupported: str | None = None

    def keyword_arguments(self) -> tuple[str, ...]:
        """The loss's keyword-only arguments a config may set (those a learner supplies
        itself excluded)."""
        supplied = {"is_weights", "proximal_logp", "reference_logp", "group_ids"}
        if self.batch_statistics is not None:
            supplied |= {"bounds", "statistics"}
        functions = (self.fn,) if self.forwards_to is None else (self.fn, self.forwards_to)
        names = [
            name
            for fn in functions
            for name, p in inspect.signature(fn).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in supplied
        ]
        return tuple(dict.fromkeys(names))


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    """An advantage estimator and what it needs beyond rewards and group ids.

    Attributes:
      fn: the estimator, of the common signature (see the module docstring).
      needs_log_weights: takes per-sequence ``log_weights`` of current to behaviour policy
        and per-sequence squared gradient norms ``grad_sq_norms`` (VCPO's baseline).
    """

    fn: Callable
    needs_log_weights: bool = False


POLICY_LOSS_SPECS: Mapping[str, PolicyLossSpec] = MappingProxyType(
    {
        "reinforce": PolicyLossSpec(reinforce_loss, takes_is_weights=True),
        "ppo": PolicyLossSpec(ppo_clip_loss, takes_is_weights=True),
        "decoupled_ppo": PolicyLossSpec(
            decoupled_ppo_loss, needs_proximal=True, forwards_to=ppo_clip_loss
        ),
        # The naive asynchronous baselines: stale rollouts trained as if on-policy.
        "naive_pg": PolicyLossSpec(naive_pg_loss),
        # Its control: PPO's trust region, no importance weight.
        "naive_pg_trust_region": PolicyLossSpec(naive_pg_trust_region_loss),
        "ppo_recompute": PolicyLossSpec(
            ppo_recompute_loss, needs_proximal=True, forwards_to=ppo_clip_loss
        ),
        "cispo": PolicyLossSpec(cispo_loss),
        "gspo": PolicyLossSpec(gspo_loss, default_aggregation="seq-mean-token-mean"),
        "topr": PolicyLossSpec(topr_loss, default_aggregation="seq-mean-token-sum"),
        "bapo": PolicyLossSpec(
            bapo_loss, batch_statistics=bapo_batch_statistics, forwards_to=bapo_clip_bounds
        ),
        # M2PO's knobs go through m2po_batch_statistics; the harmful budget's statistic
        # takes them all (the mask's takes tau_m2 only).
        "m2po": PolicyLossSpec(
            m2po_loss, batch_statistics=m2po_batch_statistics, forwards_to=m2po_harmful_clip
        ),
        "vespo": PolicyLossSpec(vespo_loss, forwards_to=vespo_weights),
        "dppo_binary_tv": PolicyLossSpec(dppo_binary_tv_loss),
        "dppo_binary_kl": PolicyLossSpec(dppo_binary_kl_loss),
        "tb": PolicyLossSpec(
            trajectory_balance_loss,
            default_aggregation="seq-mean-token-sum",
            needs_reference=True,
            takes_rewards=True,
        ),
    }
)

ADVANTAGE_SPECS: Mapping[str, AdvantageSpec] = MappingProxyType(
    {
        "grpo": AdvantageSpec(grpo_advantages),
        "dr_grpo": AdvantageSpec(dr_grpo_advantages),
        "rloo": AdvantageSpec(rloo_advantages),
        "vcpo": AdvantageSpec(vcpo_advantages, needs_log_weights=True),
    }
)

POLICY_LOSSES: Mapping[str, Callable] = MappingProxyType(
    {name: spec.fn for name, spec in POLICY_LOSS_SPECS.items()}
)
ADVANTAGE_ESTIMATORS: Mapping[str, Callable] = MappingProxyType(
    {name: spec.fn for name, spec in ADVANTAGE_SPECS.items()}
)

# Importance corrections whose weights a loss takes as `is_weights` (and whose mask replaces
# the loss mask): TIS truncates, MIS and IcePop drop.
IMPORTANCE_CORRECTIONS: Mapping[str, Callable] = MappingProxyType(
    {
        "tis": truncated_importance_weights,
        "mis": masked_importance_weights,
        "icepop": icepop_weights,
    }
)


def _lookup(kind: str, registry: Mapping, name: str):
    try:
        return registry[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(registry))
        raise ValueError(f"Unknown {kind} {name!r}; known: {known}.") from None


def get_policy_loss_spec(name: str) -> PolicyLossSpec:
    """The `PolicyLossSpec` registered under `name`; ValueError listing the names otherwise."""
    return _lookup("policy loss", POLICY_LOSS_SPECS, name)


def get_advantage_spec(name: str) -> AdvantageSpec:
    """The `AdvantageSpec` registered under `name`; ValueError listing the names otherwise."""
    return _lookup("advantage estimator", ADVANTAGE_SPECS, name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered under `name`; ValueError listing the names otherwise."""
    return get_policy_loss_spec(name).fn


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator under `name`; ValueError listing the names otherwise."""
    return get_advantage_spec(name).fn


def get_importance_correction(name: str) -> Callable:
    """The importance correction under `name`; ValueError listing the names otherwise."""
    return _lookup("importance correction", IMPORTANCE_CORRECTIONS, name)
