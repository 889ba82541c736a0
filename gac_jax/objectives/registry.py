"""The registries of policy losses, advantage estimators and importance corrections, by name.

These mappings are the only list of valid names: configs refer to a method by its key,
and `get_policy_loss` / `get_advantage_estimator` reject any other name with an error that
lists the known ones. Every policy loss follows the common signature
``fn(logp, behaviour_logp, advantages, mask, **kwargs) -> (loss, aux)`` and every
advantage estimator ``fn(rewards, group_ids, **kwargs) -> (advantages, aux)``; every
importance correction ``fn(logp, behaviour_logp, mask, **kwargs) -> ImportanceWeights``. The
method-specific keyword arguments are documented on each function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gac_jax.objectives.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
    vcpo_advantages,
)
from gac_jax.objectives.importance import (
    icepop_weights,
    masked_importance_weights,
    truncated_importance_weights,
)
from gac_jax.objectives.losses import (
    bapo_loss,
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    m2po_loss,
    ppo_clip_loss,
    reinforce_loss,
    topr_loss,
    trajectory_balance_loss,
)

POLICY_LOSSES: Mapping[str, Callable] = MappingProxyType(
    {
        "reinforce": reinforce_loss,
        "ppo": ppo_clip_loss,
        "decoupled_ppo": decoupled_ppo_loss,
        "cispo": cispo_loss,
        "gspo": gspo_loss,
        "topr": topr_loss,
        "bapo": bapo_loss,
        "m2po": m2po_loss,
        "tb": trajectory_balance_loss,
    }
)

ADVANTAGE_ESTIMATORS: Mapping[str, Callable] = MappingProxyType(
    {
        "grpo": grpo_advantages,
        "dr_grpo": dr_grpo_advantages,
        "rloo": rloo_advantages,
        "vcpo": vcpo_advantages,
    }
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


def _lookup(kind: str, registry: Mapping[str, Callable], name: str) -> Callable:
    try:
        return registry[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(registry))
        raise ValueError(f"Unknown {kind} {name!r}; known {kind}s: {known}.") from None


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered under `name` (a key of `POLICY_LOSSES`).

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    return _lookup("policy loss", POLICY_LOSSES, name)


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator registered under `name` (a key of `ADVANTAGE_ESTIMATORS`).

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    return _lookup("advantage estimator", ADVANTAGE_ESTIMATORS, name)


def get_importance_correction(name: str) -> Callable:
    """The importance correction registered under `name` (a key of
    `IMPORTANCE_CORRECTIONS`).

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    return _lookup("importance correction", IMPORTANCE_CORRECTIONS, name)
