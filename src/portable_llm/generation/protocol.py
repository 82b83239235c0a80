"""What generation needs from a model: :class:`LanguageModel`, and :class:`PagedLanguageModel`
for batching over paged caches.

:func:`~portable_llm.generate`, :func:`~portable_llm.generate_step`,
:class:`~portable_llm.BatchGenerator` and :func:`~portable_llm.speculative_generate` drive any
object with these members; :class:`portable_llm.Model` is one (see
``docs/bring-your-own-model.md``). The ids a model gets are a NumPy ``int64`` array ``(B, L)``
for the prompt, and for each decode step the ids the sampler drew, ``(B, 1)``, an integer array
of the library and device of the model's logits: ``xp.asarray(ids)`` takes both.

:func:`check_model` checks a model once, at the front of a generation call, and
:func:`decode_step` picks its decode forward once (the optional fast path
:class:`DecodeStepModel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, runtime_checkable

from portable_llm.caches.page_pool import PagePool

__all__ = [
    "DecodeStepModel",
    "LanguageModel",
    "PagedLanguageModel",
    "RecomputingModel",
    "check_model",
    "check_paged_model",
    "decode_step",
    "num_layers",
    "recompute_after",
]


@runtime_checkable
class LanguageModel(Protocol):
    """A causal language model that generation can drive.

    Attributes
    ----------
    vocab_size : int
        ``V``: the logits' last dimension; token ids lie in ``[0, V)``.
    tokenizer : Tokenizer or None
        A :class:`~portable_llm.Tokenizer` for text prompts (``encode_prompt``, ``stream``,
        ``decode``, ``stream_decoder``); ``None``: token ids only.
    eos_token_ids : tuple of int
        The default stop ids (a checkpoint's EOS ids); ``()``: none.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def make_cache(self, *, left_padding: Any = None) -> list[Any]:
        """Fresh, empty caches: whatever :meth:`__call__` takes as ``cache`` (one per layer for
        a model built of layers; :func:`~portable_llm.speculative_generate` rewinds each with
        ``trim(n)``). ``left_padding``, a NumPy integer array ``(B,)`` (each row's pad tokens),
        is given only for a left-padded batch (a list of prompts); a model that takes no padded
        batch may refuse it."""
        ...

    def __call__(self, ids: Any, /, *, cache: Sequence[Any], last_only: bool = False) -> Any:
        """Logits ``(B, L, V)`` of the next token after each of the ``L`` new tokens ``ids``
        ``(B, L)``, which follow those ``cache`` holds; the caches then hold them too.
        ``last_only``: only the last position is needed, and ``(B, 1, V)`` may be returned."""
        ...


@runtime_checkable
class DecodeStepModel(Protocol):
    """The optional fast path of a decode step (:meth:`portable_llm.Model.decode_step`)."""

    def decode_step(self, ids: Any, /, *, cache: Sequence[Any]) -> Any:
        """Logits ``(B, 1, V)`` of one token per row, ``ids`` ``(B, 1)`` as the sampler drew
        them (on the device): the model may skip its checks of the ids and any host read."""
        ...


@runtime_checkable
class RecomputingModel(Protocol):
    """A model whose cached keys go stale when the sequence first grows past a length (Phi-3's
    ``longrope``: its long factors replace the short ones there). :func:`~portable_llm.generate`
    then runs every token again into fresh caches, as transformers'
    ``Phi3ForCausalLM.prepare_inputs_for_generation`` does."""

    @property
    def recompute_after(self) -> int | None:
        """The length ``L0``: the step that makes the sequence ``L0 + 1`` tokens long runs all
        of them again, into fresh caches; ``None``: never."""
        ...


@runtime_checkable
class PagedLanguageModel(LanguageModel, Protocol):
    """A :class:`LanguageModel` that runs a batch of sequences over paged KV caches
    (:class:`~portable_llm.BatchGenerator` batches their rows in one forward; a model without
    these members runs each request alone over its own :meth:`~LanguageModel.make_cache`).

    Attributes
    ----------
    max_seq_len : int or None
        The longest sequence the model takes (a config's ``max_position_embeddings``);
        ``None``: it states none.
    """

    @property
    def max_seq_len(self) -> int | None: ...

    def make_page_pools(self, num_pages: int, page_size: int) -> list[PagePool]:
        """One empty :class:`~portable_llm.PagePool` per layer, of ``num_pages`` pages of
        ``page_size`` tokens, with the model's ``H_kv``, ``D``, dtype, backend and device."""
        ...

    def forward_paged(
        self,
        ids: Sequence[Sequence[int]],
        /,
        *,
        caches: Sequence[Sequence[Any]],
        logits: bool = True,
    ) -> Any:
        """Logits ``(B, V)`` of the last position of each row after its tokens ``ids[b]`` (all
        rows of one length ``L``), which follow what row ``b``'s caches ``caches[b]`` hold (one
        :class:`~portable_llm.PagedKVCache` per layer, over the pools of
        :meth:`make_page_pools`); the caches then hold them too. ``logits=False``: only fill
        the caches, return ``None``."""
        ...


def check_model(op: str, model: Any) -> LanguageModel:
    """``model`` if it has every member of :class:`LanguageModel`, else a ``TypeError`` naming
    the missing ones (checked once per generation call)."""
    if not isinstance(model, LanguageModel):
        missing = [m for m in _MEMBERS if not hasattr(model, m)]
        if not callable(model):
            missing.append("__call__")
        raise TypeError(
            f"{op}: model must follow portable_llm.generation.LanguageModel (vocab_size, "
            f"tokenizer, eos_token_ids, make_cache(), __call__(ids, *, cache, last_only)); "
            f"{type(model).__name__} lacks {', '.join(missing)}"
        )
    return model


def check_paged_model(model: LanguageModel) -> PagedLanguageModel | None:
    """``model`` when it is a :class:`PagedLanguageModel`, else ``None`` (the fallback)."""
    return model if isinstance(model, PagedLanguageModel) else None


def decode_step(model: LanguageModel) -> Callable[..., Any]:
    """The forward of one decode step, ``step(ids (B, 1), cache=...) -> (B, 1 | L, V)``:
    ``model.decode_step`` (:class:`DecodeStepModel`), else ``model(..., last_only=True)``."""
    if isinstance(model, DecodeStepModel):
        return model.decode_step
    return partial(model, last_only=True)


def recompute_after(model: LanguageModel) -> int | None:
    """:attr:`RecomputingModel.recompute_after` of ``model``, ``None`` for other models."""
    return model.recompute_after if isinstance(model, RecomputingModel) else None


def num_layers(model: LanguageModel) -> int:
    """How many caches ``model.make_cache()`` makes (fresh caches hold no memory)."""
    return len(model.make_cache())


_MEMBERS = ("vocab_size", "tokenizer", "eos_token_ids", "make_cache")
