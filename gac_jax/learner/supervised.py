"""Supervised (teacher-forced) training on the learner's step machinery.

The warm start fits a policy to reference completions before RL. It runs on the same
`ShardedLearner` as the GRPO step (sharded params, jitted and donated step), with a step
that minimises the masked negative log-likelihood of the completion tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from gac_jax.learner.learner import ShardedLearner
from gac_jax.learner.update import select_finite_update
from gac_jax.models import ShardingRules, per_token_logps
from gac_jax.numerics import masked_mean


def masked_nll(logps_bt: jax.Array, loss_mask_bt: jax.Array) -> jax.Array:
    r"""Mean negative log-likelihood over the masked tokens (0 when none is masked).

    .. math::

        L = -\frac{\sum_{b,t} m_{bt} \log p_{bt}}{\sum_{b,t} m_{bt}}

    with `logps_bt` [B, T] the `log p(x_t | x_<t)` and `loss_mask_bt` [B, T] True for the
    tokens trained on.
    """
    return -masked_mean(logps_bt, loss_mask_bt)


def sft_loss(model, tokens_bt, mask_bt, loss_mask_bt) -> jax.Array:
    """Teacher-forced `masked_nll` of `model` on rows laid out as ``<bos> prompt
    completion <eos>`` (`tokens`, real-token `mask`, completion `loss_mask`)."""
    return masked_nll(per_token_logps(model, tokens_bt, mask_bt), loss_mask_bt)


def make_supervised_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)`` minimising
    `sft_loss` on a batch ``{"tokens", "mask", "loss_mask"}``."""

    def step(params, opt_state, batch):
        def loss_fn(p):
            model = nnx.merge(graphdef, p)
            return sft_loss(model, batch["tokens"], batch["mask"], batch["loss_mask"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        # The RL step's guard: a non-finite loss, gradient or update leaves the state as is.
        updates, new_opt_state = tx.update(grads, opt_state, params)
        params, opt_state, metrics = select_finite_update(
            params, opt_state, grads, updates, new_opt_state, loss
        )
        return params, opt_state, {"loss": loss, **metrics}

    return step


class SupervisedLearner(ShardedLearner):
    """A `ShardedLearner` (same arguments, all params trained) running
    `make_supervised_step`."""

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        *,
        rules: ShardingRules | None = None,
    ):
        super().__init__(model, tx, mesh, rules=rules)
        self._step = self.compile_step(make_supervised_step(self.graphdef, tx))

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One update on host rows ``{"tokens", "mask", "loss_mask"}``; returns metrics."""
        placed = {k: jax.device_put(jnp.asarray(v), self.batch_sharding) for k, v in batch.items()}
        return self.run_step(placed)
