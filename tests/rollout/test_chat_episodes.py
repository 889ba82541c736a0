"""Episodes of a chat model: observations rendered in the chat template's tool role, turns
ending on the template's end of turn (which is EOS too), checked against transformers'
`apply_chat_template` of the conversation the episode held."""

import jax
import numpy as np
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.rollout import EpisodeConfig, EpisodeRunner, GenerationConfig, make_sampler
from gac_jax.rollout.episodes import turn_end_ids
from gac_jax.rollout.sampling import SampleSettings
from gac_jax.tasks.chat import ChatTemplate
from gac_jax.tasks.chat_turns import ChatTurns
from gac_jax.tasks.environments import Observation
from tests.tasks.tool_templates import CHATML_SPECIAL, CHATML_TOOLS

END = "<|im_end|>"
TURN_END = ("7", "9")  # The environment's own turn ends, beside the template's.
K = 28


@pytest.fixture(scope="module")
def tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, decoders, pre_tokenizers, trainers
    from tokenizers import models as bpe

    tok = tokenizers.Tokenizer(bpe.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=110, special_tokens=["<|endoftext|>", "<|im_start|>", END, "<unk>"]
    )
    corpus = ["user\n347*29+18? assistant\n=10081 result 10063 tool_response"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False) for t in ("<tool_response>", "</tool_response>")])
    return models.HFTokenizer(tok, eos_token=END, pad_token="<|endoftext|>")


class Counter:
    """Answers the first two turns with a tool result, then ends the episode."""

    turn_end = TURN_END

    def start(self, example):
        return {"turns": []}

    def step(self, state, turn):
        state["turns"].append(turn)
        if len(state["turns"]) > 2:
            return Observation(done=True)
        return Observation(f"result {len(state['turns'])}", role="tool")

    def reward(self, state, transcript, example):
        return 0.0


def _model(tokenizer):
    """A random tiny model that samples the end of turn often."""
    config = models.get_config("tiny")
    assert tokenizer.vocab_size <= config.vocab_size
    model = models.create_model(config, seed=0)
    state = nnx.state(model)
    end = tokenizer.encode(END)[0]
    state["embedding_vd"][...] = state["embedding_vd"][...].at[end].multiply(12.0)
    nnx.update(model, state)
    return model


def test_chat_episodes_hold_the_conversation_transformers_renders(tokenizer):
    transformers = pytest.importorskip("transformers")
    template = ChatTemplate(CHATML_TOOLS, CHATML_SPECIAL)
    chat = ChatTurns(template)
    model = _model(tokenizer)
    generation = GenerationConfig(max_new_tokens=96, prompt_length=24, slots=4)
    sampler = make_sampler(model.config, tokenizer, generation)
    config = EpisodeConfig(max_turns=4, max_observation_tokens=K)
    runner = EpisodeRunner(sampler, tokenizer, Counter(), config, "counter", chat=chat)
    end_id = tokenizer.encode(END)[0]
    assert [end_id] in runner.turn_end_ids and end_id in sampler.eos_ids
    questions = [f"{a}*29+18?" for a in (347, 12, 9, 71, 3, 88)]
    prompts = [template.render([{"role": "user", "content": q}]) for q in questions]
    graphdef, state = nnx.split(model)
    rows = runner.sample(
        graphdef,
        lambda: (state, 0),
        [tokenizer.encode(p) for p in prompts],
        [{} for _ in prompts],
        jax.random.key(0),
        SampleSettings(
            generation.prompt_length,
            dict(temperature=1.0, max_new_tokens=generation.max_new_tokens),
            chunk_steps=8,
        ),
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer._tokenizer, **CHATML_SPECIAL
    )
    hf.chat_template = CHATML_TOOLS
    endings = set()
    for row, (question, env_state) in enumerate(zip(questions, rows.states, strict=True)):
        context = rows.policy_mask[row] | rows.observation_mask[row]
        columns = np.flatnonzero(context)
        runs = np.split(columns, np.flatnonzero(np.diff(rows.observation_mask[row][columns])) + 1)
        conversation = [{"role": "user", "content": question}]
        for run in runs:
            text = tokenizer.decode(rows.tokens[row, run], skip_special_tokens=False)
            if rows.policy_mask[row, run[0]]:
                ended = tokenizer.decode(rows.tokens[row, run[-1:]], skip_special_tokens=False)
                endings.add(ended if ended == END else "own")
                content = text[: -len(END)] if ended == END else text
                conversation.append({"role": "assistant", "content": content})
            else:  # An observation: exactly the template's text after that turn.
                result = f"result {sum(m['role'] == 'tool' for m in conversation) + 1}"
                expected = chat.after_turn([{"role": "tool", "content": result}], ended)
                assert rows.tokens[row, run].tolist() == tokenizer.encode(expected)
                conversation.append({"role": "tool", "content": result})
        assert rows.turns[row] == len(env_state["turns"]) + (rows.turns[row] == config.max_turns)
        # The episode's whole context is the conversation as transformers renders it (up
        # to where the episode stopped: the end of the last assistant message).
        whole = hf.apply_chat_template(conversation, tokenize=False)
        episode = prompts[row] + tokenizer.decode(
            rows.tokens[row, columns], skip_special_tokens=False
        )
        assert whole.startswith(episode) and whole[len(episode) :] in ("", "\n", END + "\n")
    assert endings == {END, "own"}, endings  # Both kinds of turn end were exercised.
    assert (rows.turns >= 3).sum() >= 2, rows.turns


def test_runners_that_no_turn_could_end_or_no_result_fits_are_one_line_errors(tokenizer):
    model = models.create_model(models.get_config("tiny"), seed=0)
    sampler = make_sampler(model.config, tokenizer, GenerationConfig(max_new_tokens=32))
    silent = type("Silent", (Counter,), {"turn_end": ()})()
    chat = ChatTurns(ChatTemplate(CHATML_TOOLS, CHATML_SPECIAL))
    runner = EpisodeRunner(sampler, tokenizer, silent, EpisodeConfig(), "silent", chat=chat)
    assert runner.turn_end_ids == [tokenizer.encode(END)]  # The template's end of turn only.
    for kwargs, message in [
        (dict(chat=None), "silent has no turn_end and the run renders no chat template"),
        (
            dict(chat=chat, config=EpisodeConfig(max_observation_tokens=4)),
            r"max_observation_tokens=4 leaves no room .*writes \d+ tokens around it",
        ),
    ]:
        arguments = dict(config=EpisodeConfig(), name="silent") | kwargs
        with pytest.raises(ValueError, match=message) as error:
            EpisodeRunner(sampler, tokenizer, silent, **arguments)
        assert "\n" not in str(error.value)


def test_a_long_result_is_cut_inside_the_templates_frame(tokenizer):
    model = models.create_model(models.get_config("tiny"), seed=0)
    sampler = make_sampler(model.config, tokenizer, GenerationConfig(max_new_tokens=32))
    chat = ChatTurns(ChatTemplate(CHATML_TOOLS, CHATML_SPECIAL))
    runner = EpisodeRunner(
        sampler, tokenizer, Counter(), EpisodeConfig(max_observation_tokens=K), chat=chat
    )
    end_id = tokenizer.encode(END)[0]
    ids = runner._observation_ids(Observation("10063 " * 50, role="tool"), end_id)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert len(ids) <= K and text.startswith("\n<|im_start|>user\n<tool_response>\n10063")
    assert text.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # Several results: the longest is cut first, the short one kept whole.
    two = runner._observation_ids(Observation(("10063 " * 50, "7"), role="tool"), end_id)
    text = tokenizer.decode(two, skip_special_tokens=False)
    assert len(two) <= K and text.count("<tool_response>") == 2
    assert "\n<tool_response>\n7\n</tool_response>" in text and "10063" in text


def test_turn_end_strings_of_several_tokens_become_token_sequences():
    tokenizer = models.CharTokenizer()
    assert turn_end_ids(tokenizer, [">", "</t>"]) == [
        tokenizer.encode(">"),
        tokenizer.encode("</t>"),
    ]
    assert len(turn_end_ids(tokenizer, ["</t>"])[0]) == 4
    with pytest.raises(ValueError, match="turn_end string '.' cannot be encoded") as error:
        turn_end_ids(tokenizer, ["\u2603"])
    assert "\n" not in str(error.value)
