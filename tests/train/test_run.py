"""`build_run`: the one builder. Its abstract build (what `plan` compiles) has the real
build's shapes, dtypes and shardings, for the demo, a LoRA and a split-device run."""

import jax
import pytest

from gac_jax.train.config import get_preset
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.run import build_run

BASE = [
    "init=random",
    "mesh.data=1",
    "mesh.fsdp=-1",
    "rollout.groups_per_batch=4",
    "rollout.groups_per_call=4",
]


def _layout(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)


@pytest.mark.parametrize("extra", [[], ["lora.rank=8"], ["placement.devices=4"]])
def test_the_abstract_build_has_the_real_builds_layout(extra, tmp_path):
    config = apply_overrides(get_preset("demo"), [*BASE, f"data_dir={tmp_path}", *extra])
    abstract = build_run(config, abstract=True)
    real = build_run(config)
    leaves = jax.tree.leaves(abstract.learner.params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert _layout(abstract.learner.params) == _layout(real.learner.params)
    assert _layout(abstract.learner.opt_state) == _layout(real.learner.opt_state)
    assert _layout(abstract.policy.like()) == _layout(real.policy.like())
    assert abstract.policy.graphdef == real.policy.graphdef
    assert abstract.placement.devices == real.placement.devices
    assert abstract.train_examples is None and len(real.train_examples) > 0
    rollout_layout = _layout(abstract.placement.abstract_rollout(abstract.policy.like()))
    published = real.placement.to_rollout(real.policy.params())
    assert rollout_layout == _layout(published)
    if "lora.rank=8" in extra:
        assert real.learner.frozen is not None and abstract.learner.frozen is not None
        assert abstract.learner.graphdef == real.learner.graphdef


def test_a_batch_the_learners_devices_cannot_split_is_refused_before_any_rollout():
    # 128 sequences on the 6 devices left once 2 sample: one line, at build time.
    config = apply_overrides(get_preset("demo"), [*BASE, "placement.devices=2"])
    with pytest.raises(
        ValueError, match="group_size: the global batch of 32 sequences is not divisible by the 6"
    ):
        build_run(config, abstract=True)
