"""The checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library.

:class:`Tokenizer` encodes text to ids, decodes ids to text, and streams text while ids arrive
(:meth:`Tokenizer.stream`): a piece is released only once its bytes form whole characters, so a
character split over several byte-level tokens is never shown half-done. The chat template of
``tokenizer_config.json`` is applied with ``jinja2`` when it is installed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "read_tokenizer"]


class Tokenizer:
    """Encode and decode with a ``tokenizers.Tokenizer``; the special tokens of the folder.

    Parameters
    ----------
    tok : tokenizers.Tokenizer
    config : dict
        ``tokenizer_config.json`` (``chat_template``, ``bos_token``, ``eos_token``,
        ``add_bos_token``), possibly empty.
    """

    def __init__(self, tok: Any, config: dict[str, Any] | None = None) -> None:
        self._tok = tok
        self.config = dict(config or {})

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        """The id of a token string (``"<|endoftext|>"``), or ``None``."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's special tokens, e.g. a BOS)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Text pieces of a stream of ids: their concatenation is ``decode(all ids)``.

        Decodes everything seen so far after each id and releases the new text once it does
        not end in U+FFFD (an incomplete UTF-8 sequence); the rest comes with the last piece.
        """
        seen: list[int] = []
        shown = ""
        for token in ids:
            seen.append(int(token))
            text = self.decode(seen)
            if text.endswith("\ufffd") or not text.startswith(shown):
                continue
            if len(text) > len(shown):
                yield text[len(shown) :]
                shown = text
        text = self.decode(seen)
        if text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown) :]

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of ``messages`` (``[{"role": "user", "content": ...}]``).

        Needs ``chat_template`` in ``tokenizer_config.json`` and the ``jinja2`` package.
        """
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if not template:
            raise ValueError("apply_chat_template: tokenizer_config.json has no chat_template")
        try:
            import jinja2
        except ImportError as exc:
            raise ImportError("apply_chat_template needs jinja2: pip install jinja2") from exc
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        specials = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token")}
        return str(
            env.from_string(template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **specials
            )
        )


def _token_text(token: Any) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older configs
        return str(token.get("content", ""))
    return "" if token is None else str(token)


def read_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or ``None`` when it has no ``tokenizer.json``."""
    folder = Path(path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer as HFTokenizer

    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    return Tokenizer(HFTokenizer.from_file(str(file)), config)
