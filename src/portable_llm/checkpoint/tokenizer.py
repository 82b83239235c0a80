"""Reading a checkpoint folder's tokenizer files into a :class:`~portable_llm.text.Tokenizer`."""

from __future__ import annotations

from pathlib import Path

from portable_llm.checkpoint.files import (
    CheckpointError,
    checkpoint_file,
    library_errors,
    read_json,
)
from portable_llm.text.tokenizer import TEMPLATE_FILES, Tokenizer, default_template

__all__ = ["read_tokenizer"]


def read_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or ``None`` when it has no ``tokenizer.json``.

    The chat template is read from ``chat_template.jinja`` (transformers 5 saves it there),
    else ``tokenizer_config.json``'s ``chat_template``, else ``chat_template.json`` (older
    processors), as transformers reads it.

    Raises
    ------
    CheckpointError
        A malformed ``tokenizer.json``, ``tokenizer_config.json`` or ``chat_template.json``
        (the message names it), or one of them outside the folder.
    """
    folder = Path(path)
    file = checkpoint_file(folder, "tokenizer.json")
    if not file.is_file():
        return None
    from tokenizers import Tokenizer as HFTokenizer

    with library_errors(f"{str(file)!r} is not a valid tokenizer"):  # a bare Exception, a panic
        tok = HFTokenizer.from_file(str(file))
    config_file = checkpoint_file(folder, "tokenizer_config.json")
    config = read_json(config_file) if config_file.is_file() else {}
    specials_file = checkpoint_file(folder, "special_tokens_map.json")  # legacy: merged under
    if specials_file.is_file():
        config = {**read_json(specials_file), **config}
    template, origin = None, None
    for name in TEMPLATE_FILES:
        source = checkpoint_file(folder, name)
        if not source.is_file():
            continue
        if name.endswith(".jinja"):
            try:
                template = source.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"load: cannot read {str(source)!r}: {exc}") from None
        else:
            d = config if name == "tokenizer_config.json" else read_json(source)
            template = default_template(d.get("chat_template"))
        if template is not None:
            origin = str(source)
            break
    return Tokenizer(tok, config, chat_template=template, origin=origin)
