"""The tokenizer of a GGUF file's metadata (``tokenizer.ggml.*``) as a ``tokenizers.Tokenizer``.

Built as transformers builds it from the same file (``integrations/gguf``), for the two
tokenizer models llama.cpp writes:

- ``gpt2`` (byte-level BPE: Qwen, Llama 3, SmolLM): the vocabulary spelled in the byte-level
  alphabet, the merges, a byte-level pre-tokenizer whose split regex follows
  ``tokenizer.ggml.pre``;
- ``llama`` (SentencePiece BPE: Llama 2, Mistral, Gemma, Phi-3): the vocabulary as the file
  spells it (``\u2581`` for a space), merges recovered from the vocabulary and ordered by
  ``tokenizer.ggml.scores`` (Gemma: by position in the file), byte fallback to the ``<0xNN>``
  tokens, the prefix space of ``tokenizer.ggml.add_space_prefix``;

then, for both, control tokens as special tokens, user-defined tokens matched whole, and the
BOS/EOS that ``add_bos_token``/``add_eos_token`` ask for.
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
    """The tokenizer of the metadata, as transformers builds it from the same file; ``None``
    when the file has none or names a tokenizer model other than ``gpt2`` and ``llama``."""
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        tok, vocab = _byte_level(meta)
    elif model == "llama":
        tok, vocab = _sentencepiece(meta)
    else:
        return None
    return _finish(meta, tok, vocab, sentencepiece=model == "llama")


def _byte_level(meta: Metadata) -> tuple[Any, dict[str, int]]:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens: list[str] = meta.need("tokenizer.ggml.tokens")
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
    return tok, vocab


_SPACE = "\u2581"  # SentencePiece's spelling of a space
_GEMMA = ("gemma", "gemma2", "gemma3")


def _sentencepiece(meta: Metadata) -> tuple[Any, dict[str, int]]:
    """A SentencePiece BPE vocabulary as transformers' ``LlamaTokenizer``/``GemmaTokenizer``
    (``phi3``: its prepending normalizer) build it from the file."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    tokens: list[str] = list(meta.need("tokenizer.ggml.tokens"))
    arch = meta.get("general.architecture")
    gemma = arch in _GEMMA
    if gemma:
        # Gemma files store a token of two or more spaces as the spaces themselves; the
        # vocabulary (and transformers) spell it with one \u2581 per space.
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        # Gemma's scores do not follow its merge order; the order of the file does.
        scores: dict[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, meta.need("tokenizer.ggml.scores"), strict=False))
    vocab = {t: i for i, t in enumerate(tokens)}
    file_merges = meta.get("tokenizer.ggml.merges")
    if file_merges:
        merges = [tuple(m.split(" ")) for m in file_merges]
    else:
        merges = _merges_by_score(vocab, scores)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=tokens[unk] if gemma and unk is not None else None,
        )
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # no prefix space; spaces become \u2581 before the (inert) split on " "
        tok.normalizer = normalizers.Replace(" ", _SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":  # the prefix space of every text section, from a normalizer
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        # llama.cpp follows tokenizer.ggml.add_space_prefix (default true); transformers'
        # LlamaTokenizer always prepends. Both prepend at the start of the text only.
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, vocab


def _merges_by_score(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: each token cut into two tokens of the
    vocabulary, best score first (transformers' ``generate_merges``, the same ties)."""
    found: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _finish(meta: Metadata, tok: Any, vocab: dict[str, int], *, sentencepiece: bool) -> Tokenizer:
    """Special and added tokens, the BOS/EOS post-processor and the tokenizer config."""
    from tokenizers import AddedToken, processors

    tokens: list[str] = meta.need("tokenizer.ggml.tokens")
    kinds: list[int] = meta.get("tokenizer.ggml.token_type") or []

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    # Control tokens (<|im_end|>) are special; user-defined ones (<think>) are matched whole.
    # A byte-level control token outside the byte alphabet is a llama.cpp mislabel (skipped, as
    # HF does).
    alphabet = None if sentencepiece else set(_bytes_to_unicode().values())
    typed = list(zip(tokens, kinds, strict=False))
    control = [t for t, k in typed if k == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in typed if k == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    bos, eos, unk, pad = (special(k) for k in ("bos", "eos", "unknown", "padding"))
    if sentencepiece:  # transformers makes the named special tokens special, whatever their type
        named = [t for t in (bos, eos, unk, pad) if t is not None and t not in control]
        tok.add_special_tokens([AddedToken(t, special=True) for t in named])
    # A SentencePiece file without the flag gets a BOS (llama.cpp's and transformers' default).
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)) and bos is not None
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
        "unk_token": unk,
        "pad_token": pad,
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
