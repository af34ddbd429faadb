"""Chat prompts: the messages of a ``/v1/chat/completions`` request rendered to one prompt string
with a Jinja2 chat template (:class:`ChatTemplate`).

The template is the tokenizer's own where the checkpoint has one (``chat_template`` in a Hugging
Face ``tokenizer_config.json`` next to ``tokenizer.json``: a string, or a list of
``{"name", "template"}`` of which "default" is used), else :data:`DEFAULT_TEMPLATE`: each message
as ``Role: content`` followed by a blank line, then ``Assistant:`` for the answer, e.g.::

    System: Answer in verse.

    User: Who is Juliet?

    Assistant:

The template sees ``messages`` (dicts with ``role`` and ``content``), ``add_generation_prompt``
(True), ``bos_token`` and ``eos_token`` (the tokenizer's ``<|endoftext|>``, or "") as in
``transformers``' ``apply_chat_template``; it renders in Jinja2's sandbox."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DEFAULT_TEMPLATE", "ChatTemplate", "load_chat_template"]

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


def load_chat_template(checkpoint_dir: str | Path | None) -> str | None:
    """The ``chat_template`` of ``checkpoint_dir/tokenizer_config.json``, or None when there is
    none (no file, no field). Raises ValueError for a file that is not JSON."""
    if checkpoint_dir is None:
        return None
    f = Path(checkpoint_dir) / "tokenizer_config.json"
    if not f.is_file():
        return None
    try:
        t = json.loads(f.read_text()).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON ({e}); fix or remove it") from None
    if isinstance(t, list):  # named templates: the default one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) and t else None


class ChatTemplate:
    """A compiled chat template (``source`` None: :data:`DEFAULT_TEMPLATE`); ``eos``: the end
    token's text. :meth:`render` returns the prompt; template errors raise ValueError."""

    def __init__(self, source: str | None = None, eos: str = ""):
        from ..data.sft import compile_template  # the one sandboxed Jinja environment (training data too)

        self.source = source or DEFAULT_TEMPLATE
        self.builtin = source is None
        self.template, self.eos = compile_template(self.source), eos

    def render(self, messages: list[dict]) -> str:
        """``messages``: ``[{"role", "content"}]`` -> the prompt text ending where the assistant speaks."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token="",
                                        eos_token=self.eos)
        except TemplateError as e:
            raise ValueError(f"the chat template failed: {e}") from None
