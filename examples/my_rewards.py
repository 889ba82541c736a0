"""The reward of the README's "Bring your own task": `reward=my_rewards:score` with
`PYTHONPATH=examples`.

A reward is any function `(completion, example) -> float`; `example` is the JSONL line,
every field of it (here `answer`). Exact answers score 1 and any other number 0.1, so a
policy from random weights, which rarely writes the answer, still sees a signal.
"""

import re


def score(completion, example):
    numbers = re.findall(r"-?\d+", completion)
    if not numbers:
        return 0.0
    return 1.0 if numbers[0] == example["answer"] else 0.1
