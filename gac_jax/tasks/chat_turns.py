"""Observations in a chat model's own format: what a chat template writes between two turns.

With a Hugging Face chat template, the text between a policy's turn and its next one is the
template's: the end of the assistant message, the environment's answer as a message of its
role (a ``tool`` message: Qwen3 writes ``<|im_start|>user\\n<tool_response>\\n...
\\n</tool_response><|im_end|>``), and the next assistant turn opened. `ChatTurns` renders a
conversation whose last assistant message is a sentinel followed by the new messages (as
transformers' ``apply_chat_template`` does) and keeps what the template writes after it.

Only what follows the policy's last turn is rendered: a template that rewrites its history
(Qwen3 drops the reasoning of earlier assistant turns) would otherwise change the context
the policy's tokens were sampled in. A turn that ends on the token `assistant_end` starts
with (``<|im_end|>``, written by the policy) is followed by the rest of `assistant_end`
(`after_turn`'s `ended_with`); one that ends on an environment's own turn end
(``</tool_call>``), by the whole of it.

Example::

    turns = ChatTurns(ChatTemplate.from_directory(path), enable_thinking=False)
    turns.after_turn([{"role": "tool", "content": "10063"}], ended_with="<|im_end|>")
    # '\\n<|im_start|>user\\n<tool_response>\\n10063\\n</tool_response><|im_end|>\\n'
    # '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gac_jax.tasks.chat import ChatTemplate

__all__ = ["ChatTurns"]

# An assistant message's content: unlikely in any template, no whitespace to trim.
_SENTINEL = "GacJaxTurnSentinel7f3a"
_QUESTION = {"role": "user", "content": "GacJaxQuestion"}


class ChatTurns:
    """Renders the text a chat template writes after an assistant turn, with `tools` (JSON
    schemas, ``tools=`` of ``apply_chat_template``) and `template_kwargs` (template
    variables, e.g. ``enable_thinking=False``). ValueError, in one line, if the template
    does not write an assistant message's content verbatim once, or writes nothing after it.
    """

    def __init__(
        self,
        template: ChatTemplate,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs,
    ):
        self.template = template
        self.tools = None if tools is None else list(tools)
        self.template_kwargs = template_kwargs
        self.assistant_end = self._after_sentinel([], add_generation_prompt=False)
        if not self.assistant_end:
            raise ValueError(
                "the chat template writes nothing after an assistant message's content, so "
                "no token can end a policy's turn."
            )

    def after_turn(self, messages: Sequence[Mapping[str, Any]], ended_with: str = "") -> str:
        """The text that follows a policy's turn: the rest of the assistant message after
        `ended_with` (the text of the template's end token when the turn ended on it, else
        ""), `messages` in their roles, and the next assistant turn opened.

        Raises:
          ValueError: in one line, if the template cannot render `messages` there.
        """
        text = self._after_sentinel(messages, add_generation_prompt=True)
        if ended_with and self.assistant_end.startswith(ended_with):
            return text[len(ended_with) :]
        return text

    def _after_sentinel(self, messages, *, add_generation_prompt: bool) -> str:
        conversation = [_QUESTION, {"role": "assistant", "content": _SENTINEL}, *messages]
        roles = [m.get("role") for m in messages]
        try:
            text = self.template.render(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tools=self.tools,
                **self.template_kwargs,
            )
        except Exception as error:  # noqa: BLE001 - Jinja: TemplateError, TypeError, ...
            raise ValueError(
                f"the chat template cannot render {roles} messages after an assistant "
                f"turn ({type(error).__name__}: {error})."
            ) from None
        if text.count(_SENTINEL) != 1:
            raise ValueError(
                "the chat template does not write an assistant message's content verbatim "
                f"once (it wrote it {text.count(_SENTINEL)} times), so the text between turns "
                "cannot be taken from it."
            )
        return text.split(_SENTINEL, 1)[1]
