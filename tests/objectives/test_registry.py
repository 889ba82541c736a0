"""The registries are the only list of names, and unknown names fail helpfully."""

import inspect

import jax.numpy as jnp
import pytest

import gac_jax.objectives as objectives
from gac_jax.objectives import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_policy_loss,
)


def test_lookup_returns_the_registered_function():
    assert get_policy_loss("ppo") is objectives.ppo_clip_loss
    assert get_policy_loss("tb") is objectives.trajectory_balance_loss
    assert get_advantage_estimator("vcpo") is objectives.vcpo_advantages
    assert objectives.get_importance_correction("tis") is objectives.truncated_importance_weights


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError) as err:
        get_policy_loss("ppo2")
    for name in POLICY_LOSSES:
        assert name in str(err.value)
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("gae")
    for name in ADVANTAGE_ESTIMATORS:
        assert name in str(err.value)
    with pytest.raises(
        ValueError, match="Unknown importance correction 'is'; known: icepop, mis, tis"
    ):
        objectives.get_importance_correction("is")


def test_registries_are_read_only():
    with pytest.raises(TypeError):
        POLICY_LOSSES["mine"] = objectives.ppo_clip_loss
    with pytest.raises(TypeError):
        objectives.IMPORTANCE_CORRECTIONS["mine"] = objectives.icepop_weights


def test_every_policy_loss_shares_the_signature():
    for name, fn in POLICY_LOSSES.items():
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[:2]] == ["logp", "behaviour_logp"], name
        assert params[3].name == "mask", name
        spec, rest = objectives.get_policy_loss_spec(name), params[4:]
        if rest and rest[-1].kind is rest[-1].VAR_KEYWORD:  # Knobs forwarded to `spec.forwards_to`.
            assert spec.forwards_to is not None, name
            rest = rest[:-1]
        assert all(p.kind is p.KEYWORD_ONLY for p in rest), name


def test_a_forwarding_loss_takes_its_callees_config_keys():
    spec = objectives.get_policy_loss_spec("bapo")
    assert spec.forwards_to is objectives.bapo_clip_bounds
    assert {"low_start", "contribution", "dual_clip", "aggregation"} <= set(
        spec.keyword_arguments()
    )
    assert "bounds" not in spec.keyword_arguments()  # The learner supplies it.
    recompute = objectives.get_policy_loss_spec("ppo_recompute").keyword_arguments()
    assert set(recompute) == {"eps_low", "eps_high", "dual_clip", "aggregation"}
    with pytest.raises(TypeError, match="low_strat"):
        objectives.bapo_loss(*[jnp.zeros((1, 2))] * 2, jnp.zeros(1), jnp.ones((1, 2)), low_strat=1)


def test_every_public_function_cites_its_source():
    # Lookups: no method, no paper.
    lookups = {
        "get_policy_loss",
        "get_advantage_estimator",
        "get_importance_correction",
        "get_policy_loss_spec",
        "get_advantage_spec",
    }
    for name in objectives.__all__:
        obj = getattr(objectives, name)
        if not inspect.isfunction(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        assert doc, name
        if name not in lookups:
            assert "arXiv" in doc or "http" in doc, name
