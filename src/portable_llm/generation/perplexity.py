"""Perplexity and the KL divergence from a base model, as quantized inference is judged.

A quantized model is not judged element by element against its float weights but by what it
does to the token distributions on real text (llama.cpp's ``llama-perplexity
--kl-divergence``): its perplexity, the KL divergence of its next-token distribution from the
base (unquantized) model's, token by token, and how often both put the same token first.

The text's tokens are cut into chunks of ``ctx`` tokens, each evaluated from an empty cache;
the tokens of the second half of each chunk are scored (each has at least ``ctx / 2`` tokens of
context), as ``llama-perplexity`` scores them, so the figures compare with its own on the same
file and context. Log-probabilities are formed in float64 on the host from the logits.

:func:`perplexity` drives any model of the generation protocol (``model(ids, cache=...)``
returning logits ``(B, L, V)``); the base is another such model, or the log-probabilities a
previous run saved (:func:`save_logprobs`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import check_int

__all__ = [
    "PerplexityResult",
    "adds_bos",
    "chunk_windows",
    "load_logprobs",
    "log_softmax64",
    "perplexity",
    "save_logprobs",
]


@dataclass(frozen=True)
class PerplexityResult:
    """Per-token figures of one run over the scored tokens ``T``.

    Attributes
    ----------
    nll : ndarray, shape ``(T,)``, float64
        ``-log p(token)`` in nats.
    kl : ndarray, shape ``(T,)``, float64, or None
        ``KL(base || model)`` of each scored position's next-token distribution (no base: None).
    same_top : ndarray, shape ``(T,)``, bool, or None
        Whether the model's most likely token is the base's.
    ctx : int
        Tokens per chunk.
    chunks : int
        Chunks evaluated.
    seconds : float
        Wall time of the model's forwards (the base's excluded).
    """

    nll: np.ndarray
    kl: np.ndarray | None
    same_top: np.ndarray | None
    ctx: int
    chunks: int
    seconds: float

    @property
    def tokens(self) -> int:
        """Scored tokens ``T``."""
        return int(self.nll.shape[0])

    @property
    def perplexity(self) -> float:
        """``exp(mean nll)``."""
        return math.exp(float(self.nll.mean()))

    @property
    def perplexity_error(self) -> float:
        """The standard error of :attr:`perplexity` (llama.cpp's ``±``): ``ppl * sd(nll) /
        sqrt(T - 1)``, from the spread of the per-token log-likelihoods."""
        if self.tokens < 2:
            return math.nan
        return self.perplexity * float(self.nll.std()) / math.sqrt(self.tokens - 1)

    def kl_quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the per-token KL divergence."""
        if self.kl is None:
            raise ValueError("perplexity: this run had no base model, so no KL divergence")
        return float(np.quantile(self.kl, q))

    @property
    def kl_mean(self) -> float:
        """Mean KL divergence from the base, in nats."""
        if self.kl is None:
            raise ValueError("perplexity: this run had no base model, so no KL divergence")
        return float(self.kl.mean())

    @property
    def top1_agreement(self) -> float:
        """The fraction of scored positions where the model's first token is the base's."""
        if self.same_top is None:
            raise ValueError("perplexity: this run had no base model, so no top-1 agreement")
        return float(self.same_top.mean())

    @property
    def tokens_per_second(self) -> float:
        """Evaluated tokens (``chunks * ctx``) per second of the model's forwards."""
        return self.chunks * self.ctx / self.seconds if self.seconds > 0 else math.inf


def log_softmax64(logits: Any) -> np.ndarray:
    """``log_softmax`` of logits ``(N.., V)`` (any backend) in float64 on the host."""
    x = np.asarray(to_numpy(logits), dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)  # (N.., 1)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))


def chunk_windows(n_tokens: int, ctx: int, *, chunks: int | None = None) -> list[slice]:
    """The chunks of a text of ``n_tokens`` tokens: ``floor(n_tokens / ctx)`` windows of ``ctx``
    tokens (at most ``chunks``), as ``llama-perplexity`` cuts the text; a shorter tail is left
    out."""
    ctx = check_int("perplexity", "ctx", ctx, low=4)
    n = n_tokens // ctx
    if chunks is not None:
        n = min(n, check_int("perplexity", "chunks", chunks, low=1))
    if n == 0:
        raise ValueError(
            f"perplexity: the text has {n_tokens} tokens, fewer than one chunk of ctx={ctx}; "
            "give a longer text or a smaller ctx"
        )
    return [slice(i * ctx, (i + 1) * ctx) for i in range(n)]


def _scored(ctx: int) -> slice:
    """The positions of a chunk whose predictions are scored: from ``ctx // 2`` to the one
    before last (position ``j`` predicts token ``j + 1``)."""
    return slice(ctx // 2, ctx - 1)


#: ``base(chunk_index, ids (ctx,)) -> log-probabilities (ctx // 2 - 1, V)`` of the scored rows.
BaseFn = Callable[[int, np.ndarray], np.ndarray]


def _model_logprobs(model: Any, ids: np.ndarray) -> np.ndarray:
    """The log-probabilities of the scored positions of one chunk ``ids`` ``(ctx,)``."""
    logits = model(ids[None, :], cache=model.make_cache())  # (1, ctx, V)
    return log_softmax64(logits[0, _scored(ids.shape[0]), :])  # (T_c, V)


def _check_ids(ids: np.ndarray, vocab: int) -> None:
    if ids.size and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise ValueError(
            f"perplexity: the text has token ids in [{int(ids.min())}, {int(ids.max())}], "
            f"outside the model's vocabulary [0, {vocab})"
        )


def _base_fn(base: Any) -> BaseFn | None:
    if base is None:
        return None
    if isinstance(base, np.ndarray):  # saved log-probabilities (T, V) of every scored row
        saved = base

        def from_saved(i: int, ids: np.ndarray) -> np.ndarray:
            n = _scored(ids.shape[0])
            per = n.stop - n.start
            if (i + 1) * per > saved.shape[0]:
                raise ValueError(
                    f"perplexity: the saved base has {saved.shape[0]} rows, fewer than chunk "
                    f"{i + 1} needs ({(i + 1) * per}): saved with another text, ctx or chunks"
                )
            return np.asarray(saved[i * per : (i + 1) * per], dtype=np.float64)

        return from_saved
    if callable(base) and hasattr(base, "make_cache"):
        return lambda i, ids: _model_logprobs(base, ids)
    raise TypeError(
        "perplexity: base must be a model (with make_cache and __call__) or saved "
        f"log-probabilities (a NumPy array, load_logprobs), got {type(base).__name__}"
    )


# Over 80 lines for its docstring (every argument and the result's shapes); the loop is ~35.
def perplexity(
    model: Any,
    ids: Sequence[int] | np.ndarray,
    /,
    *,
    ctx: int = 512,
    chunks: int | None = None,
    base: Any = None,
    bos: int | None = None,
    keep: Callable[[np.ndarray], None] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on the tokens ``ids``, and its KL divergence from ``base``.

    Parameters
    ----------
    model : LanguageModel
        Any model of the generation protocol: ``model(ids (1, ctx), cache=model.make_cache())``
        returns logits ``(1, ctx, V)``.
    ids : sequence of int, length ``N``
        The text's tokens (``model.tokenizer.encode(text)``).
    ctx : int
        Tokens per chunk (``llama-perplexity -c``); the second half of each is scored.
    chunks : int, optional
        Evaluate at most this many chunks (default: every whole chunk of the text).
    base : LanguageModel or ndarray ``(T, V)``, optional
        The distribution to compare with: a model run on the same chunks, or the
        log-probabilities that :func:`save_logprobs` kept of an earlier run.
    bos : int, optional
        The BOS id that replaces each chunk's first token, as ``llama-perplexity`` does for a
        model whose tokenizer adds one (:func:`adds_bos`); the first token is never scored.
    keep : callable, optional
        ``keep(logprobs)`` with each chunk's scored log-probabilities ``(ctx // 2 - 1, V)``
        (float64) of ``model``: to save them as a later run's base.
    progress : callable, optional
        ``progress(done, total, seconds)`` after each chunk.

    Returns
    -------
    PerplexityResult
        ``T = chunks * (ctx // 2 - 1)`` scored tokens.
    """
    tokens = np.asarray(ids, dtype=np.int64).reshape(-1)
    windows = chunk_windows(tokens.shape[0], ctx, chunks=chunks)
    base_fn = _base_fn(base)
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int):
        _check_ids(tokens, vocab)
    nll, kl, same = [], [], []
    seconds = 0.0
    for i, window in enumerate(windows):
        chunk = tokens[window].copy()  # (ctx,)
        if bos is not None:
            chunk[0] = bos
        start = time.perf_counter()
        lp = _model_logprobs(model, chunk)  # (T_c, V)
        seconds += time.perf_counter() - start
        _check_ids(chunk, lp.shape[-1])
        targets = chunk[_scored(ctx).start + 1 :]  # (T_c,): what each scored position predicts
        nll.append(-lp[np.arange(targets.shape[0]), targets])
        if keep is not None:
            keep(lp)
        if base_fn is not None:
            blp = base_fn(i, chunk)
            if blp.shape != lp.shape:
                raise ValueError(
                    f"perplexity: the base gives log-probabilities of shape {blp.shape}, the "
                    f"model {lp.shape}: another vocabulary or ctx"
                )
            p = np.exp(blp)
            # KL(base || model) = sum p (log p - log q); 0 log 0 = 0 where the base has p = 0.
            terms = np.where(p > 0, p * (blp - lp), 0.0)
            kl.append(np.maximum(terms.sum(axis=-1), 0.0))
            same.append(blp.argmax(axis=-1) == lp.argmax(axis=-1))
        if progress is not None:
            progress(i + 1, len(windows), seconds)
    return PerplexityResult(
        nll=np.concatenate(nll),
        kl=np.concatenate(kl) if base_fn is not None else None,
        same_top=np.concatenate(same) if base_fn is not None else None,
        ctx=ctx,
        chunks=len(windows),
        seconds=seconds,
    )


def adds_bos(tokenizer: Any) -> int | None:
    """The BOS id ``tokenizer`` puts before a text, or ``None`` when it adds none."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    special = tokenizer.encode("a")
    if len(special) > len(plain) and special[-len(plain) :] == plain:
        return int(special[0])
    return None


def save_logprobs(path: str | Path, rows: Sequence[np.ndarray]) -> Path:
    """Write the scored log-probabilities of a run (``keep``'s chunks) to ``path`` (``.npy``,
    float32 ``(T, V)``): the base of later runs on the same text, ctx and chunks, without the
    base model. Returns the path written."""
    path = Path(path)
    if path.suffix != ".npy":
        path = path.with_suffix(path.suffix + ".npy")
    np.save(path, np.concatenate(rows).astype(np.float32))
    return path


def load_logprobs(path: str | Path) -> np.ndarray:
    """The log-probabilities :func:`save_logprobs` wrote, memory-mapped ``(T, V)``."""
    arr = np.load(Path(path), mmap_mode="r")
    if arr.ndim != 2 or arr.dtype != np.float32:
        raise ValueError(
            f"perplexity: {path} is not saved log-probabilities (float32 (T, V)), got "
            f"{arr.dtype} with shape {arr.shape}"
        )
    return arr
