"""A normal run prints no library noise: the shipped warm start opens without orbax's
read-only notices, and data prepared into a fresh directory without tfds's "not prepared
yet" warning. (A whole CLI run takes about a minute here, so it is checked by hand:
``gac-jax train --config demo --set steps=1 data_dir=/tmp/fresh`` prints no warning.)"""

import logging
import warnings

from gac_jax.tasks import get_task
from gac_jax.train.checkpoint import CheckpointManager, latest_step
from gac_jax.train.warm_start import SHIPPED_WARM_START_DIR


def _warnings_logged(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


def test_reading_a_checkpoint_logs_no_warning(caplog):
    caplog.set_level(logging.INFO)
    with CheckpointManager(SHIPPED_WARM_START_DIR, read_only=True) as checkpoints:
        assert checkpoints.latest_step() == latest_step(SHIPPED_WARM_START_DIR) is not None
    assert _warnings_logged(caplog) == []


def test_preparing_a_task_in_a_fresh_directory_logs_no_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    task = get_task("arithmetic/add2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Asked directly, outside `prepare_source`, tfds does warn: the check below can fail.
        assert not task.builder(tmp_path).is_prepared()
        assert any("dataset_info.json" in m for m in _warnings_logged(caplog))
        caplog.clear()
        test = task.data_source("test", data_dir=tmp_path)
    assert len(test) == 500
    assert _warnings_logged(caplog) == []
    shown = [w for w in caught if not issubclass(w.category, DeprecationWarning)]
    assert shown == [], [str(w.message) for w in shown]
