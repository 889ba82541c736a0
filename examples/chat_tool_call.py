"""A chat model's tool call answered by `ToolEnvironment`, and the text that then enters the
context (the README's "Multi-turn and tools"): `python examples/chat_tool_call.py`.

`ToolEnvironment` answers Hermes-format calls (`<tool_call>{"name": ..., "arguments": ...}
</tool_call>`, as Qwen2.5 and Qwen3 write them) with Python functions; `ChatTurns` renders
only what follows a turn, with the model's own chat template (here a ChatML one of Qwen3's
shape).
"""

from gac_jax.tasks.calculator import evaluate
from gac_jax.tasks.chat import ChatTemplate
from gac_jax.tasks.chat_turns import ChatTurns
from gac_jax.tasks.tool_calls import ToolEnvironment, function_schema

CHATML = (
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main() -> str:
    tools = ToolEnvironment(
        {"calculator": evaluate},
        tools=[function_schema("calculator", "a+b, a-b or a*b", {"expression": "e.g. 3*4"})],
        reward=lambda transcript, example: float(transcript.endswith("=12")),
    )
    turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    observation = tools.step(None, turn)  # Observation(text=("12",), role="tool"): one a call
    messages = [{"role": observation.role, "content": text} for text in observation.texts]
    return ChatTurns(ChatTemplate(CHATML)).after_turn(messages, ended_with="<|im_end|>")


if __name__ == "__main__":
    # '\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    print(repr(main()))
