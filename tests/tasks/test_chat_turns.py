"""Observations in a chat template's tool roles, checked against transformers'
`apply_chat_template`; tool calls parsed back from what the template writes."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gac_jax.tasks.calculator import CalculatorTool
from gac_jax.tasks.chat import ChatTemplate
from gac_jax.tasks.chat_turns import ChatTurns
from gac_jax.tasks.environments import Observation
from gac_jax.tasks.tool_calls import MalformedCall, ToolCall, parse_tool_calls
from tests.tasks.test_chat import _hf_tokenizer
from tests.tasks.tool_templates import CHATML_SPECIAL, CHATML_TOOLS, HEADER_SPECIAL, HEADER_TOOLS

TOOLS = CalculatorTool().tools


def _call(expression):
    return {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}},
    }


def _written(expression, template):
    """The text a policy writes for the call, in the template's own format."""
    arguments = json.dumps({"expression": expression})
    if template is HEADER_TOOLS:
        return '{"name": "calculator", "parameters": ' + arguments + "}"
    return '<tool_call>\n{"name": "calculator", "arguments": ' + arguments + "}\n</tool_call>"


# (the policy's turn, the tool's result or None at the last turn); the first turn thinks.
TURNS = [("347*29", "10063"), ("10063+18", "10081"), (None, None)]


@pytest.mark.parametrize(
    ("template", "special", "end", "kwargs"),
    [
        (CHATML_TOOLS, CHATML_SPECIAL, "<|im_end|>", {}),
        (HEADER_TOOLS, HEADER_SPECIAL, "<|eot_id|>", {}),
        (CHATML_TOOLS, CHATML_SPECIAL, "<|im_end|>", {"enable_thinking": False}),
    ],
)
def test_an_episode_is_the_conversation_transformers_renders(template, special, end, kwargs):
    """prompt + each turn + the text after it == apply_chat_template of the conversation:
    assistant tool_calls, tool messages, the final answer. Where the template rewrites its
    history (with thinking: earlier reasoning and empty think blocks dropped), each
    observation still equals what transformers writes after the last assistant message of
    the conversation so far, and the context keeps what the policy was sampled in."""
    reference = _hf_tokenizer(template, special)
    ours = ChatTemplate(template, special)
    turns = ChatTurns(ours, tools=TOOLS, **kwargs)
    conversation = [{"role": "user", "content": "347*29+18?"}]
    text = ours.render(conversation, tools=TOOLS, **kwargs)
    assert text == reference.apply_chat_template(
        conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
    )
    thinking = "<think>\nMultiply first.\n</think>\n\n" if kwargs else ""
    for index, (expression, result) in enumerate(TURNS):
        if expression is None:
            written = "=10081"
            conversation.append({"role": "assistant", "content": written})
        else:
            written = (thinking if index == 0 else "") + _written(expression, template)
            message = {"role": "assistant", "content": thinking if index == 0 else ""}
            conversation.append({**message, "tool_calls": [_call(expression)]})
        text += written + end  # The policy's turn ends on the template's end of turn.
        if result is None:
            break
        conversation.append({"role": "tool", "content": result})
        observation = turns.after_turn([{"role": "tool", "content": result}], end)
        expected = reference.apply_chat_template(
            conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert expected.endswith(end + observation)
        assert result in observation and not observation.startswith(end)
        text += observation
        # What the policy wrote is what the template writes for the call: it parses back.
        if template is CHATML_TOOLS:
            assert parse_tool_calls(written) == [ToolCall("calculator", {"expression": expression})]
    text += turns.assistant_end[len(end) :]
    whole = reference.apply_chat_template(conversation, tools=TOOLS, tokenize=False, **kwargs)
    if thinking:  # The whole conversation's rendering rewrote the history.
        assert thinking not in whole and text != whole and text.count("<tool_response>") == 2
    else:
        assert text == whole


def test_a_turn_ended_on_another_token_gets_the_whole_end_of_the_message():
    turns = ChatTurns(ChatTemplate(CHATML_TOOLS, CHATML_SPECIAL))
    assert turns.assistant_end == "<|im_end|>\n"
    after = turns.after_turn([{"role": "tool", "content": "7"}], "</tool_call>")
    assert after == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    feedback = turns.after_turn([{"role": "user", "content": "Again."}], "<|im_end|>")
    assert feedback == "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"


def test_templates_that_cannot_render_turns_are_one_line_errors():
    twice = "{% for m in messages %}{{ m.content }}{{ m.content }}|{% endfor %}"
    never = "{% for m in messages %}{{ m.role }}|{% endfor %}"
    nothing_after = "{% for m in messages %}{{ m.content }}{% endfor %}"
    no_tools = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('No tool role.') }}"
        "{% endif %}{{ m.content }}<end>{% endfor %}"
    )
    for source, message in [
        (twice, "verbatim once .it wrote it 2 times"),
        (never, "verbatim once .it wrote it 0 times"),
        (nothing_after, "writes nothing after"),
    ]:
        with pytest.raises(ValueError, match=message) as error:
            ChatTurns(ChatTemplate(source))
        assert "\n" not in str(error.value)
    turns = ChatTurns(ChatTemplate(no_tools))
    with pytest.raises(ValueError, match=r"cannot render \['tool'\] messages.*No tool role"):
        turns.after_turn([{"role": "tool", "content": "1"}])


@settings(max_examples=60, deadline=None)
@given(
    name=st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True),
    arguments=st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.one_of(st.integers(), st.text(max_size=12), st.booleans(), st.none()),
        max_size=4,
    ),
)
def test_calls_the_template_writes_parse_back(name, arguments):
    """Whatever transformers writes for an assistant's tool_calls, parse_tool_calls reads
    back the same name and arguments (two calls, in order)."""
    reference = _hf_tokenizer(CHATML_TOOLS, CHATML_SPECIAL)
    calls = [
        {"type": "function", "function": {"name": name, "arguments": arguments}},
        {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "1+1"}},
        },
    ]
    text = reference.apply_chat_template(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ],
        tokenize=False,
    )
    assert parse_tool_calls(text) == [
        ToolCall(name, arguments),
        ToolCall("calculator", {"expression": "1+1"}),
    ]


def test_malformed_calls_are_answered_with_errors_and_a_turn_without_calls_ends():
    env = CalculatorTool()
    turn = (
        "<tool_call>\nnot json\n</tool_call> <tool_call>[1]</tool_call>"
        '<tool_call>{"name": "calculator", '
        '"arguments": "{\\"expression\\": \\"6*7\\"}"}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": 3}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>'
    )
    calls = parse_tool_calls(turn)
    assert [type(c) for c in calls] == [
        MalformedCall,
        MalformedCall,
        ToolCall,
        MalformedCall,
        ToolCall,
        ToolCall,
    ]
    observation = env.step(None, turn)
    assert observation.role == "tool" and not observation.done
    lines = observation.texts  # One tool message a call.
    assert lines[:4] == (
        "error: malformed call (not JSON)",
        "error: malformed call (no name)",
        "42",
        "error: malformed call (arguments are not an object)",
    )
    assert lines[4] == "error: no tool 'search'" and lines[5].startswith("error: bad arguments")
    assert env.step(None, "=42") == Observation(done=True)
    assert env.reward(None, "... =10081", {"a": 347, "b": 29, "op": "+", "c": 18}) == 1.0


def test_a_turns_several_calls_are_answered_one_tool_message_each_as_transformers_renders():
    reference = _hf_tokenizer(CHATML_TOOLS, CHATML_SPECIAL)
    turns = ChatTurns(ChatTemplate(CHATML_TOOLS, CHATML_SPECIAL))
    written = _written("6*7", CHATML_TOOLS) + "\n" + _written("2+2", CHATML_TOOLS)
    observation = CalculatorTool().step(None, written)
    assert observation.texts == ("42", "4")
    messages = [{"role": observation.role, "content": t} for t in observation.texts]
    conversation = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [_call("6*7"), _call("2+2")]},
        *messages,
    ]
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    after = turns.after_turn(messages, "<|im_end|>")
    assert expected.endswith(written + "<|im_end|>" + after)
    assert after.count("<tool_response>") == 2 and after.count("<|im_start|>user") == 1
    assert Observation(("42", "4")).joined == "42\n4" and Observation(()).texts == ("",)
