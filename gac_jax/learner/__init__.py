"""The GRPO learner: batches, the optimizer chain, the train step, mesh and shardings."""

from gac_jax.learner.batch import TrainBatch, collate
from gac_jax.learner.learner import BATCH_AXES, GRPOLearner, optimizer_shardings
from gac_jax.learner.optimizer import make_optimizer
from gac_jax.learner.step import make_train_step, per_example_grad_sq_norms

__all__ = [
    "BATCH_AXES",
    "GRPOLearner",
    "TrainBatch",
    "collate",
    "make_optimizer",
    "make_train_step",
    "optimizer_shardings",
    "per_example_grad_sq_norms",
]
