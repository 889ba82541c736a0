"""The GRPO learner: batches, the optimizer chain, the train step, mesh and shardings."""

from gac_jax.learner.batch import TrainBatch
from gac_jax.learner.grpo import GRPOLearner, LearnerConfig, NonFiniteStepError
from gac_jax.learner.learner import BATCH_AXES, ShardedLearner, optimizer_shardings
from gac_jax.learner.objective import LossConfig, Objective
from gac_jax.learner.optimizer import OptimizerConfig, make_optimizer
from gac_jax.learner.step import make_train_step, per_example_grad_sq_norms
from gac_jax.learner.supervised import (
    SupervisedLearner,
    make_supervised_step,
    masked_nll,
    sft_loss,
)

__all__ = [
    "BATCH_AXES",
    "GRPOLearner",
    "LearnerConfig",
    "LossConfig",
    "NonFiniteStepError",
    "Objective",
    "OptimizerConfig",
    "ShardedLearner",
    "SupervisedLearner",
    "TrainBatch",
    "make_optimizer",
    "make_supervised_step",
    "masked_nll",
    "sft_loss",
    "make_train_step",
    "optimizer_shardings",
    "per_example_grad_sq_norms",
]
