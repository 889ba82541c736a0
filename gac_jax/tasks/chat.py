"""Chat templates: a task's prompt as the model's own chat format.

An instruct model expects its chat template (the Jinja template in the model directory's
``tokenizer_config.json`` or ``chat_template.jinja``) around the prompt, not raw text.
`ChatTemplate` renders it the way transformers' ``apply_chat_template`` does (a sandboxed
Jinja environment with ``trim_blocks``, ``lstrip_blocks``, loop controls, the
``{% generation %}`` tag, ``tojson``, ``raise_exception`` and ``strftime_now``; the
tokenizer's special tokens and any extra keyword, such as Qwen3's ``enable_thinking``, as
template variables). `with_chat_template` makes a task's prompts chat prompts.

Example::

    template = ChatTemplate.from_directory("/path/to/Qwen3-0.6B")
    template.render([{"role": "user", "content": "2+3?"}], enable_thinking=False)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplate", "system_first", "with_chat_template", "with_system_prompt"]

_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses
        it to find assistant tokens; a prompt has none)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            block = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return block.set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own filter escapes HTML characters; transformers' does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """`source` compiled in the sandbox, once a process (a run's validation, task and
    episodes share the immutable compiled template). jinja2's syntax errors propagate."""
    return _environment().from_string(source)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # Older files store AddedToken dicts.
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A model's chat template (Jinja text) and its special tokens (``bos_token``, ...,
    template variables)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = compile_template(source)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> ChatTemplate | None:
        """The template of a model directory (``chat_template.jinja``, else the
        ``chat_template`` of ``tokenizer_config.json``; of a list of named templates, the
        one named ``default``), or None if it has none."""
        path = Path(path)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            return None
        special = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKENS if key in config}
        return cls(source, special)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The text of `messages` (``{"role": ..., "content": ...}`` dicts), ending with the
        assistant's turn opened when `add_generation_prompt`; `kwargs` are template
        variables (``enable_thinking=False``)."""
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )


def system_first(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """`messages` with a system message `system` first, unless it has one or `system` is None."""
    if system is None or any(m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def with_chat_template(
    task,
    template: ChatTemplate,
    *,
    system: str | None = None,
    strip_bos: bool = False,
    **template_kwargs,
):
    """`task` (a `gac_jax.tasks.Task`) whose prompts are its messages rendered by `template`.

    The messages are ``task.messages(example)`` when the task has them (the JSONL and
    Hugging Face tasks), else one user message holding ``task.prompt(example)``; `system`,
    the default system prompt, is put first where they have no system message.
    `strip_bos` drops the template's leading ``bos_token`` text (when the tokenizer adds
    the BOS id itself, as the rollout generator does); `template_kwargs` are template
    variables, e.g. ``enable_thinking=False``.
    """
    bos = template.special_tokens.get("bos_token") if strip_bos else None
    messages_of: Callable = task.messages or (
        lambda ex: [{"role": "user", "content": task.prompt(ex)}]
    )

    def prompt(example) -> str:
        text = template.render(system_first(list(messages_of(example)), system), **template_kwargs)
        return text[len(bos) :] if bos and text.startswith(bos) else text

    return dataclasses.replace(task, prompt=prompt)


def with_system_prompt(task, system: str):
    """`task` without a chat template, with `system` written before each prompt (a blank
    line between) unless the example brings its own system text."""
    if task.messages is None:
        return dataclasses.replace(task, prompt=lambda ex: f"{system}\n\n{task.prompt(ex)}")

    def prompt(example) -> str:
        messages = system_first(list(task.messages(example)), system)
        return "\n\n".join(str(m["content"]) for m in messages)

    return dataclasses.replace(task, prompt=prompt)
