"""The tokenizer of a GGUF file's metadata (``tokenizer.ggml.*``) as a ``tokenizers.Tokenizer``.

Built as transformers builds it from the same file (``integrations/gguf``): the vocabulary
spelled in the byte-level alphabet, the merges, a byte-level pre-tokenizer whose split regex
follows ``tokenizer.ggml.pre``, control tokens as special tokens, user-defined tokens matched
whole, and the BOS/EOS that ``add_bos_token``/``add_eos_token`` ask for.
"""

from __future__ import annotations

from typing import Any, Protocol

from portable_llm.text.tokenizer import Tokenizer

__all__ = ["gguf_tokenizer"]


class Metadata(Protocol):
    """A GGUF file's metadata: ``get(key, default)``, ``need(key)`` and the ``file``."""

    file: Any

    def get(self, key: str, default: Any = None) -> Any: ...

    def need(self, key: str) -> Any: ...


# transformers' split regexes per ``tokenizer.ggml.pre`` (others: GPT-2's, in ByteLevel).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def gguf_tokenizer(meta: Metadata) -> Tokenizer | None:
    """The byte-level BPE tokenizer of the metadata (``tokenizer.ggml.model == "gpt2"``), as
    transformers builds it; ``None`` for other tokenizer models or when there is none."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return None
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    tokens: list[str] = meta.need("tokenizer.ggml.tokens")
    kinds: list[int] = meta.get("tokenizer.ggml.token_type") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>) are special; user-defined ones (<think>) are matched whole.
    # A control token outside the byte alphabet is a llama.cpp mislabel (skipped, as HF does).
    typed = list(zip(tokens, kinds, strict=False))
    control = [t for t, k in typed if k == _CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in typed if k == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = " ".join(
        [f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos
    )  # transformers' update_post_processor
    specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    config = {
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": special("unknown"),
        "pad_token": special("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    origin = f"{meta.file.name}: tokenizer.chat_template"
    return Tokenizer(tok, {k: v for k, v in config.items() if v is not None}, origin=origin)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out
