"""A LoRA learner trains its adapters only: the frozen base stays bitwise, and the
optimizer's state (GAC's reference included) has the adapters' shapes."""

import jax
import numpy as np
import optax
from flax import nnx

from gac_jax import models
from gac_jax.learner import GRPOLearner, OptimizerConfig, TrainBatch, make_optimizer
from gac_jax.models.lora import LoraConfig, Policy
from gac_jax.rollout import Rollout, collate
from gac_jax.transforms import ESSConfig, GACConfig

CONFIG = models.get_config("tiny")
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
G, L, PROMPT = 4, 6, 8


def _batch(num_groups=4, seed=0):
    rng = np.random.default_rng(seed)
    rollouts = [
        Rollout(
            prompt_id=i,
            group_id=i,
            prompt_tokens=rng.integers(3, 60, 3 + i % 3).astype(np.int32),
            completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
            completion_mask=np.ones((G, L), bool),
            behaviour_logp=(-3.0 * rng.random((G, L))).astype(np.float32),
            rewards=rng.integers(0, 2, G).astype(np.float32),
            policy_version=0,
        )
        for i in range(num_groups)
    ]
    return TrainBatch(**collate(rollouts, PROMPT))


def _learner():
    tx = make_optimizer(
        OptimizerConfig(learning_rate=1e-2),
        gac=GACConfig(tau_low=0.1, tau_high=0.9),
        ess=ESSConfig(),
    )
    model = models.apply_lora(models.create_model(CONFIG, seed=0), LORA, rngs=nnx.Rngs(1))
    mesh = models.make_mesh(2, 4)
    return GRPOLearner(model, tx, mesh, trainable=models.lora_filter)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def test_lora_steps_change_only_the_adapters_and_gac_state_has_their_shapes():
    learner = _learner()
    adapter_shapes = jax.tree.map(np.shape, learner.params)
    assert {type(v) for v in jax.tree.leaves(learner.params, is_leaf=_is_var)} == {nnx.LoRAParam}
    frozen_before, params_before = _host(learner.frozen), _host(learner.params)
    for step in range(3):
        metrics = learner.step(_batch(seed=step), step)
        assert metrics["nonfinite_step"] == 0.0

    jax.tree.map(np.testing.assert_array_equal, _host(learner.frozen), frozen_before)
    changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), _host(learner.params), params_before)
    assert all(jax.tree.leaves(changed))  # B moved off zero, and A with it.
    # GAC's two references (raw gradients, applied updates) mirror the adapters alone.
    references = optax.tree.get_all_with_path(learner.opt_state, "gac_reference")
    assert len(references) == 2
    for _, reference in references:
        assert jax.tree.map(np.shape, reference) == adapter_shapes
        assert jax.tree.structure(reference) == jax.tree.structure(learner.params)
    # The learner's model is the adapted one; the policy the sampler runs is it merged.
    tokens = np.random.default_rng(5).integers(3, CONFIG.vocab_size, (2, 7))
    adapted = np.asarray(jax.jit(lambda m, t: m(t)[0])(learner.model(), tokens), np.float64)
    policy = Policy(learner)
    merged = nnx.merge(policy.graphdef, policy.params())
    assert not jax.tree.leaves(nnx.state(merged, models.lora_filter))
    ours = np.asarray(jax.jit(lambda m, t: m(t)[0])(merged, tokens), np.float64)
    assert np.abs(ours - adapted).max() <= 1e-5 * np.abs(adapted).max()


def _is_var(x):
    return isinstance(x, nnx.Variable)
