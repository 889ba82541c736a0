"""Tasks with verifiable rewards: tfds builders, prompts, answer extraction and rewards.

* Embedded synthetic tasks, generated locally and deterministically for tiny
  character-level models: `countdown` (make a target from given numbers) and
  `arithmetic` (multi-digit operations, optionally with a scratchpad).
* GSM8K, through tfds's own builder or, offline, the original release files.

`get_task` is the entry point; `TASK_NAMES` lists every task::

    task = gac_jax.tasks.get_task("arithmetic/add3")
    test = task.data_source("test", data_dir="/tmp/tfds")
    task.reward(task.reference_completion(test[0]), test[0])  # 1.0
"""

from gac_jax.tasks.arithmetic import arithmetic_reward, scratchpad
from gac_jax.tasks.builders import (
    Arithmetic,
    ArithmeticConfig,
    Countdown,
    CountdownConfig,
    Gsm8k,
    prepare_source,
)
from gac_jax.tasks.countdown import (
    CountdownVerdict,
    ExpressionError,
    check_countdown,
    countdown_reward,
    parse_expression,
    reachable,
    solve,
)
from gac_jax.tasks.gsm8k import gsm8k_reward
from gac_jax.tasks.registry import TASK_NAMES, Task, get_task
from gac_jax.tasks.rewards import (
    extract_numeric_answer,
    find_numbers,
    numbers_match,
    numeric_reward,
    parse_number,
)

__all__ = ["TASK_NAMES", "Arithmetic", "ArithmeticConfig", "Countdown", "CountdownConfig",
           "CountdownVerdict", "ExpressionError", "Gsm8k", "Task", "arithmetic_reward",
           "check_countdown", "countdown_reward", "extract_numeric_answer", "find_numbers",
           "get_task", "gsm8k_reward", "numbers_match", "numeric_reward", "parse_expression",
           "parse_number", "prepare_source", "reachable", "scratchpad", "solve"]  # fmt: skip
