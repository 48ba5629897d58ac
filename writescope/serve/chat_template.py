"""Chat messages -> one prompt string: the checkpoint's Jinja chat template
(``tokenizer_config.json``'s ``chat_template``, rendered as transformers does, in a sandbox) or a
plain fallback."""

from __future__ import annotations

import json
from pathlib import Path


class ChatTemplate:
    """Renders ``[{"role": ..., "content": ...}, ...]`` with a generation prompt at the end.

    Args:
        template: Jinja source, or None for the fallback (``"<role>: <content>\\n"`` per
            message, then ``"assistant:"``).
        special: ``bos_token`` / ``eos_token`` strings the template may use.
    """

    def __init__(self, template: str | None = None, special: dict | None = None):
        self.source = template
        self.special = special or {}
        self._compiled = None
        if template is not None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            self._compiled = env.from_string(template)

    @staticmethod
    def for_model(model: str) -> "ChatTemplate":
        """The template of checkpoint directory ``model`` (tokenizer_config.json), else the fallback."""
        path = Path(model) / "tokenizer_config.json"
        if not path.is_file():
            return ChatTemplate()
        cfg = json.loads(path.read_text())
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):  # named templates: the default one
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}
        return ChatTemplate(tpl if isinstance(tpl, str) else None, special)

    @property
    def name(self) -> str:
        return "tokenizer_config.json chat_template" if self.source is not None else "plain fallback (role: content lines)"

    def render(self, messages: list[dict]) -> str:
        """The prompt text for ``messages`` (each with ``role`` and string ``content``).

        Raises:
            ValueError: the template refused the messages (its own message, e.g. roles out of order).
        """
        if self._compiled is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None


def _token_text(tok) -> str:
    if isinstance(tok, dict):  # {"content": "<s>", ...} (AddedToken)
        return tok.get("content", "")
    return tok or ""
