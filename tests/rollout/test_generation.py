"""GenerationConfig: validation and `make_sampler`; the generator's rollouts whatever the
slots; training and evaluation generating through one function; stop strings."""

import threading
import time
import types

import jax
import numpy as np
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.rollout import (
    EvalSettings,
    GenerationConfig,
    TaskGroupGenerator,
    answers,
    make_sampler,
)
from gac_jax.rollout.answers import AnswerRunner
from gac_jax.rollout.sampling import cut_at_stop
from gac_jax.rollout.worker import GroupRequest
from gac_jax.tasks.custom import GuardedReward, RewardGuardConfig
from gac_jax.train import evaluate_policy


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(slots=0), "slots=0 must be an int >= 1 or None"),
        (dict(slots=True), "slots=True must be an int >= 1 or None"),
        (dict(stop=("</a>", "")), r"stop=\('</a>', ''\) must be a list of non-empty strings"),
        (dict(stop="</a>"), "stop='</a>' must be a list of non-empty strings"),
    ],
)
def test_bad_sampler_settings_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**fields).validate()


def test_make_sampler_builds_the_configured_sampler():
    cfg, tokenizer = models.get_config("tiny"), models.CharTokenizer()
    sampler = make_sampler(cfg, tokenizer, GenerationConfig(max_new_tokens=5, slots=3))
    assert type(sampler) is models.Sampler
    assert (sampler.slots, sampler.max_new_tokens, sampler.pad_id) == (3, 5, tokenizer.pad_id)
    assert sampler.eos_ids == (cfg.eos_token_ids or (tokenizer.eos_id,))
    assert make_sampler(cfg, tokenizer, GenerationConfig()).slots is None


EXAMPLES = ["1+2=", "13+4=", "7+70=", "2+2="]


def _generator(model, task, **fields):
    config = GenerationConfig(
        group_size=2, prompt_length=8, max_new_tokens=6, temperature=0.0, greedy=True, **fields
    )
    sampler = make_sampler(model.config, models.CharTokenizer(), config)
    graphdef = nnx.graphdef(model)
    return TaskGroupGenerator(graphdef, sampler, task, EXAMPLES, models.CharTokenizer(), config)


def test_the_generator_gives_the_same_greedy_rollouts_whatever_the_slots():
    model = models.create_model(models.get_config("tiny"), seed=0)
    params = nnx.state(model)
    task = types.SimpleNamespace(prompt=lambda e: e, reward=lambda c, e: float(len(c)))
    requests = [GroupRequest(prompt_id=i, group_id=10 + i) for i in range(4)]
    rollouts = [
        _generator(model, task, slots=slots)(params, 0, requests, jax.random.key(0))
        for slots in (None, 3)
    ]
    for a, b in zip(*rollouts, strict=True):
        assert (a.prompt_id, a.group_id) == (b.prompt_id, b.group_id)
        np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
        np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_allclose(a.behaviour_logp, b.behaviour_logp, atol=1e-5)
    assert all(r.completion_mask.any() for r in rollouts[0])


def test_training_and_evaluation_generate_through_one_function(monkeypatch):
    """Rollouts and `evaluate_policy` both sample through one runner (`AnswerRunner`, by
    `sampling.generate`): a spy in its place sees both, with the sampler, params and
    prompts each was given."""
    model = models.create_model(models.get_config("tiny"), seed=0)
    graphdef, params = nnx.split(model)
    tokenizer = models.CharTokenizer()
    task = types.SimpleNamespace(prompt=lambda e: e, reward=lambda c, e: 1.0)
    calls, real = [], answers.generate

    def spy(sampler, graphdef, params_fn, prompts, key, **kwargs):
        calls.append((sampler, len(prompts), kwargs["settings"].sampling["temperature"]))
        return real(sampler, graphdef, params_fn, prompts, key, **kwargs)

    monkeypatch.setattr(answers, "generate", spy)
    generator = _generator(model, task)
    requests = [GroupRequest(prompt_id=i, group_id=i) for i in range(2)]
    rollouts = generator(params, 0, requests, jax.random.key(0))
    assert calls == [(generator.sampler, 4, 0.0)] and len(rollouts) == 2
    scores = evaluate_policy(
        graphdef, params, AnswerRunner(generator.sampler, tokenizer, task.reward), task,
        EXAMPLES, tokenizer, EvalSettings(prompt_length=8, num_problems=3, num_samples=2),
        key=jax.random.key(1),
    )  # fmt: skip
    # Greedy (one row per problem), then sampled (two per problem).
    assert calls[1:] == [(generator.sampler, 3, 0.0), (generator.sampler, 6, 1.0)]
    assert scores["greedy_accuracy"] == scores["pass@2"] == 1.0


def test_an_evaluation_prompt_too_long_names_the_setting_as_training_does():
    model = models.create_model(models.get_config("tiny"), seed=0)
    graphdef, params = nnx.split(model)
    task = types.SimpleNamespace(prompt=lambda e: e, reward=lambda c, e: 1.0)
    generator = _generator(model, task)
    problems = [*EXAMPLES[:2], "123456+7890="]  # 13 tokens with BOS, over 8.
    message = (
        r"test problem 2 has 13 tokens, more than generation.prompt_length=8 "
        r"\(raise it with --set generation.prompt_length=N\): '123456\+7890='"
    )
    with pytest.raises(ValueError, match=message):
        evaluate_policy(
            graphdef, params, AnswerRunner(generator.sampler, models.CharTokenizer(), task.reward),
            task, problems, models.CharTokenizer(),
            EvalSettings(prompt_length=8, num_problems=3, num_samples=2), key=jax.random.key(1),
        )  # fmt: skip


class PieceTokenizer:
    """Ids are multi-character pieces, so a stop string can span tokens and end inside one."""

    pieces = ("", "a", "b", "\n", "\n\n", "b\nQ", "Q:", "ab")
    pad_id = 0
    vocab_size = len(pieces)

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def _cut_by_scan(pieces, ids, stop):
    """Reference: grow the completion a token at a time until its text holds a stop string."""
    for n in range(1, len(ids) + 1):
        text = "".join(pieces[i] for i in ids[:n])
        found = [text.index(s) for s in stop if s in text]
        if found:
            return text[: min(found)], n
    return "".join(pieces[i] for i in ids), len(ids)


@pytest.mark.parametrize("stop", [("\n\n",), ("Q:", "b\n"), ("ab", "\n\nQ"), ("zz",)])
def test_cut_at_stop_ends_at_the_token_that_completes_the_first_stop_string(stop):
    tokenizer, rng = PieceTokenizer(), np.random.default_rng(0)
    for _ in range(200):
        length, generated = 12, int(rng.integers(0, 13))
        tokens = rng.integers(1, tokenizer.vocab_size, length)
        tokens[generated:] = 0
        mask = np.arange(length) < generated
        text, kept = cut_at_stop(tokenizer, tokens, mask, stop)
        want_text, want_kept = _cut_by_scan(tokenizer.pieces, tokens[:generated], stop)
        assert text == want_text
        np.testing.assert_array_equal(kept, np.arange(length) < want_kept)


def test_the_generator_cuts_completions_at_stop_strings():
    model = models.create_model(models.get_config("tiny"), seed=0)
    graphdef, params = nnx.split(model)
    tokenizer = models.CharTokenizer()
    examples = ["1+2=", "13+4=", "7+70=", "2+2="]
    seen = []
    task = types.SimpleNamespace(prompt=lambda e: e, reward=lambda c, e: seen.append(c) or 1.0)
    requests = [GroupRequest(prompt_id=i, group_id=i) for i in range(4)]

    def generate(stop):
        config = GenerationConfig(
            group_size=2, prompt_length=8, max_new_tokens=12, temperature=0.0, greedy=True,
            stop=stop,
        )  # fmt: skip
        sampler = make_sampler(model.config, tokenizer, config)
        generator = TaskGroupGenerator(graphdef, sampler, task, examples, tokenizer, config)
        seen.clear()
        return generator(params, 0, requests, jax.random.key(0)), list(seen)

    whole, whole_texts = generate(())
    # Two characters from the middle of the first completion: a stop string it holds.
    stop = whole_texts[0][4:6]
    cut, cut_texts = generate((stop,))
    rows = [(r, row) for r in range(4) for row in range(2)]
    for (r, row), text, cut_text in zip(rows, whole_texts, cut_texts, strict=True):
        a, b = whole[r], cut[r]
        # The character tokenizer: one token per character, so the stop string found at
        # character j ends the completion after token j + len(stop).
        end = text.find(stop) + len(stop) if stop in text else int(a.completion_mask[row].sum())
        assert cut_text == (text[: text.find(stop)] if stop in text else text)
        np.testing.assert_array_equal(b.completion_mask[row], np.arange(12) < end)
        np.testing.assert_array_equal(
            b.completion_tokens[row, :end], a.completion_tokens[row, :end]
        )
        assert (b.completion_tokens[row, end:] == tokenizer.pad_id).all()
        np.testing.assert_array_equal(b.behaviour_logp[row, :end], a.behaviour_logp[row, :end])
        assert (b.behaviour_logp[row, end:] == 0).all()
    # The stop string did cut: the first completion holds it, and loses tokens.
    assert stop in whole_texts[0]
    assert cut[0].completion_mask[0].sum() < whole[0].completion_mask[0].sum()


def test_evaluation_scores_each_problems_completions_together_with_its_example():
    """A run's own (guarded) reward is called on a problem's samples side by side, as
    training scores a group, so a hanging reward costs one timeout per problem; and each
    completion is scored with its own problem."""
    model = models.create_model(models.get_config("tiny"), seed=0)
    graphdef, params = nnx.split(model)
    active, most = [0], [0]
    lock = threading.Lock()

    def slow_index(completion, example):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return float(EXAMPLES.index(example))

    reward = GuardedReward(slow_index, "slow_index", RewardGuardConfig(timeout=30.0))
    task = types.SimpleNamespace(prompt=lambda e: e, reward=reward)
    sampler = make_sampler(model.config, models.CharTokenizer(), GenerationConfig(max_new_tokens=4))
    scores = evaluate_policy(
        graphdef, params, AnswerRunner(sampler, models.CharTokenizer(), task.reward), task,
        EXAMPLES, models.CharTokenizer(),
        EvalSettings(prompt_length=8, num_problems=3, num_samples=4), key=jax.random.key(2),
    )  # fmt: skip
    assert most[0] == 4  # One problem's 4 samples at once.
    assert scores["sampled_reward"] == pytest.approx(1.0)  # Mean of the problems' 0, 1, 2.
    assert scores["greedy_accuracy"] == pytest.approx(2 / 3)  # Problems 1 and 2 score >= 1.
    assert reward.failures == reward.timeouts == 0


def test_in_flight_rollouts_start_with_the_params_they_were_given():
    # The first chunk samples with the call's params and version; a newer version only
    # from the next chunk on (here there is none: one chunk covers every token).
    model = models.create_model(models.get_config("tiny"), seed=0)
    params = nnx.state(model)
    newer = jax.tree.map(lambda x: x * 0.5, params)
    task = types.SimpleNamespace(prompt=lambda e: e, reward=lambda c, e: float(len(c)))
    requests = [GroupRequest(prompt_id=i, group_id=i) for i in range(2)]
    plain = _generator(model, task)(params, 3, requests, jax.random.key(0))
    inflight = _generator(model, task)
    inflight.latest_params, inflight.chunk_steps = (lambda: (newer, 9)), 64
    got = inflight(params, 3, requests, jax.random.key(0))
    for a, b in zip(plain, got, strict=True):
        np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
        assert b.policy_version == 3
        assert set(np.unique(b.token_versions[b.completion_mask])) == {3}
