"""`TrainBatch(**collate(...))`: the rollout side's dict fills the learner's batch exactly."""

import dataclasses

import jax
import numpy as np

from gac_jax.learner.batch import TrainBatch
from gac_jax.rollout import BATCH_KEYS, Rollout, collate


def _rollout(group_id, version):
    return Rollout(
        prompt_id=group_id,
        group_id=group_id,
        prompt_tokens=np.arange(1, 4, dtype=np.int32),
        completion_tokens=np.full((2, 3), 7, np.int32),
        completion_mask=np.ones((2, 3), bool),
        behaviour_logp=np.full((2, 3), -0.5, np.float32),
        rewards=np.array([0.0, 1.0], np.float32),
        policy_version=version,
    )


def test_collate_keys_are_the_train_batch_fields():
    assert BATCH_KEYS == tuple(f.name for f in dataclasses.fields(TrainBatch))


def test_train_batch_from_collate():
    arrays = collate([_rollout(0, 3), _rollout(1, 4)], prompt_length=5)
    batch = TrainBatch(**arrays)
    assert batch.num_sequences == 4
    np.testing.assert_array_equal(batch.versions, [3, 3, 4, 4])
    np.testing.assert_array_equal(batch.tokens[0], [0, 0, 1, 2, 3, 7, 7, 7])
    # A pytree whose leaves are the arrays, in field order.
    leaves = jax.tree.leaves(batch)
    assert len(leaves) == len(BATCH_KEYS)
    for leaf, key in zip(leaves, BATCH_KEYS, strict=True):
        assert leaf is arrays[key]
