"""What generation needs from a model: :class:`LanguageModel`; and what it uses where a model
has it, each member optional with a default: ``vocab_size`` (:class:`SizedVocabularyModel`;
else ``V`` from the first logits), :class:`ReleasingModel` (caches given back when a request
ends), :class:`MaterializingModel` (a lazy model computes its prefill chunks itself),
:class:`RewindingModel` (a course's ``rewind``), :class:`BatchDecodingModel` (batched decode
over the model's own caches), :class:`DecodeStepModel`, :class:`RecomputingModel`, and
:class:`PagedLanguageModel` for batching over paged caches.

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

import numbers
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, runtime_checkable

from portable_llm.backends import Backend, backend_of
from portable_llm.caches.page_pool import PagePool

__all__ = [
    "BatchDecodingModel",
    "DecodeStepModel",
    "LanguageModel",
    "MaterializingModel",
    "PagedLanguageModel",
    "RecomputingModel",
    "ReleasingModel",
    "RewindingModel",
    "SizedVocabularyModel",
    "UNKNOWN_VOCAB",
    "array_library",
    "check_cache_list",
    "check_logits",
    "check_model",
    "check_page_pools",
    "check_paged_model",
    "decode_step",
    "materialize",
    "num_layers",
    "recompute_after",
    "release_cache",
    "rewind_cache",
    "vocab_size",
]


@runtime_checkable
class LanguageModel(Protocol):
    """A causal language model that generation can drive.

    Attributes
    ----------
    tokenizer : Tokenizer, any object with ``encode`` and ``decode``, or None
        A :class:`~portable_llm.Tokenizer`, or another library's (transformers', tokenizers',
        a course's: ``encode(text)`` gives ids or an object with ``.ids``, ``decode(ids)``
        text; :func:`~portable_llm.generation.tokenizer.text_tokenizer` wraps it), for text
        prompts; ``None``: token ids only.
    eos_token_ids : tuple of int
        The default stop ids (a checkpoint's EOS ids); ``()``: none.

    ``vocab_size`` is optional (:class:`SizedVocabularyModel`): without it, ``V`` is read from
    the first logits. The other optional members, each with its default: :class:`DecodeStepModel`,
    :class:`RecomputingModel`, :class:`ReleasingModel`, :class:`MaterializingModel`,
    :class:`RewindingModel`, :class:`BatchDecodingModel` and :class:`PagedLanguageModel`.
    """

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
class SizedVocabularyModel(Protocol):
    """A model that states ``V`` before it runs: prompts, ``top_k`` and ``logit_bias`` are then
    checked against it at the front (without it, against the first logits' last dimension)."""

    @property
    def vocab_size(self) -> int | None:
        """``V``: the logits' last dimension; token ids lie in ``[0, V)``. ``None``: unknown
        until the first logits."""
        ...


@runtime_checkable
class ReleasingModel(Protocol):
    """A model whose caches hold something to give back when a request ends (a pool's slots,
    a device buffer); without it generation just drops the caches."""

    def release_cache(self, cache: Sequence[Any], /) -> None:
        """Called once per list of :meth:`~LanguageModel.make_cache` caches that generation made,
        when the request that used it ends (finished, cancelled, failed, or its iterator
        closed): :class:`~portable_llm.BatchGenerator` per request,
        :func:`~portable_llm.speculative_generate` for the target's and the draft's,
        :func:`~portable_llm.generate` for its own (never a caller's ``prompt_cache``)."""
        ...


@runtime_checkable
class MaterializingModel(Protocol):
    """A lazy model (MLX) that computes its pending work itself: generation never forces a
    forward but at a prefill chunk (to bound memory) and at the host read of the sampled ids."""

    def materialize(self, cache: Sequence[Any], /) -> None:
        """Compute what ``cache`` holds so far (MLX: ``mx.eval([c.keys for c in cache])``):
        called after each prefill chunk whose logits are dropped, in place of the default,
        the backend's ``synchronize`` of that chunk's logits (:func:`materialize`)."""
        ...


@runtime_checkable
class RewindingModel(Protocol):
    """A model that rewinds its own caches (a course's ``rewind(n)``, mlx-lm's
    ``trim_prompt_cache``); without it, :func:`rewind_cache` calls each cache's ``trim(n)``."""

    def rewind_cache(self, cache: Sequence[Any], n: int, /) -> None:
        """Forget the last ``n >= 1`` tokens of every cache in ``cache`` (speculative decoding's
        rejected proposals)."""
        ...


@runtime_checkable
class BatchDecodingModel(Protocol):
    """A model that decodes several requests, each over its own :meth:`~LanguageModel.
    make_cache`, in one forward: :class:`~portable_llm.BatchGenerator` then runs each step's
    rows together without page pools (a :class:`PagedLanguageModel` uses its pools instead)."""

    def decode_batch(self, ids: Any, /, *, caches: Sequence[Sequence[Any]]) -> Any:
        """Logits ``(B, 1, V)`` of one new token per row, ``ids`` ``(B, 1)`` (NumPy int64),
        row ``b`` following what its caches ``caches[b]`` hold (which may differ in length);
        each ``caches[b]`` then holds its row's token too. The model stacks the rows itself
        (e.g. the keys right-padded to the longest row, the pad masked, each row's position
        its cache's offset)."""
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
    these members decodes its rows in one :meth:`BatchDecodingModel.decode_batch` where it has
    one, else runs each request alone over its own :meth:`~LanguageModel.make_cache`).

    Attributes
    ----------
    max_seq_len : int or None
        The longest sequence the model takes (a config's ``max_position_embeddings``);
        ``None``: it states none.
    paged : bool, optional
        ``False``: this model does not run over pages now (a hybrid model's recurrent states
        live in no page, and it keeps none in slots), and is batched as a model without these
        members.

    Notes
    -----
    A hybrid model (recurrent layers beside attention) may also have
    ``make_state_slots(num_slots) -> list[RecurrentSlots | None]`` (one per layer): the
    generator then gives each request a slot of them and calls ``forward_paged(...,
    state_slots=..., slot_ids=[each row's slot])``.
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


def check_model(op: str, model: Any, /, *, rewinds: bool = False) -> LanguageModel:
    """``model`` checked at the front of a generation call: every member of
    :class:`LanguageModel` present and of its type, else a ``TypeError`` naming it.

    The one check :func:`~portable_llm.generate`, :func:`~portable_llm.generate_step`,
    :class:`~portable_llm.BatchGenerator` and :func:`~portable_llm.speculative_generate` run
    (``docs/bring-your-own-model.md``): ``vocab_size`` (when present and not ``None``) an int
    ``>= 1``; ``eos_token_ids`` a sequence of ints; ``tokenizer`` ``None``, a
    :class:`~portable_llm.Tokenizer` or an object with ``encode`` and ``decode``;
    ``make_cache()`` a list or tuple; the optional members' types where present
    (``decode_step``, ``release_cache``, ``materialize``, ``rewind_cache``, ``decode_batch``
    callable, ``recompute_after`` an int or ``None``, a paged model's ``max_seq_len`` an int or
    ``None``, ``make_page_pools`` and ``forward_paged`` callable). ``rewinds``: each cache must
    also have ``trim(n)``, unless the model has ``rewind_cache`` (speculative decoding rewinds
    them).
    What the model returns is checked where it returns it (:func:`check_logits`).
    """
    if not isinstance(model, LanguageModel):
        missing = [m for m in _MEMBERS if not hasattr(model, m)]
        if not callable(model):
            missing.append("__call__")
        raise TypeError(
            f"{op}: model must follow portable_llm.generation.LanguageModel (tokenizer, "
            f"eos_token_ids, make_cache(), __call__(ids, *, cache, last_only)); "
            f"{type(model).__name__} lacks {', '.join(missing)}"
        )
    name = type(model).__name__
    if vocab_size(model) is not None:
        _check_count(op, f"{name}.vocab_size", vocab_size(model), low=1)
    eos = model.eos_token_ids
    if isinstance(eos, str | bytes) or not isinstance(eos, Sequence | frozenset | set):
        raise TypeError(
            f"{op}: {name}.eos_token_ids must be a tuple of token ids (ints), got "
            f"{type(eos).__name__} {eos!r}"
        )
    for i, t in enumerate(eos):
        _check_count(op, f"{name}.eos_token_ids[{i}]", t, low=0)
    tok = model.tokenizer
    lacks = [m for m in _TOKENIZER if tok is not None and not callable(getattr(tok, m, None))]
    if lacks and any(not callable(getattr(tok, m, None)) for m in ("encode", "decode")):
        raise TypeError(
            f"{op}: {name}.tokenizer must be None or a portable_llm.Tokenizer (or any object "
            f"with encode(text) and decode(ids)); {type(tok).__name__} lacks {', '.join(lacks)}"
        )
    _check_optional_members(op, model)
    caches = model.make_cache()
    if not isinstance(caches, list | tuple):
        raise TypeError(
            f"{op}: {name}.make_cache() must return a list of caches (one per layer), got "
            f"{type(caches).__name__}"
        )
    if rewinds and not isinstance(model, RewindingModel):
        for i, c in enumerate(caches):
            if not callable(getattr(c, "trim", None)):
                raise TypeError(
                    f"{op}: {name}.make_cache()[{i}] ({type(c).__name__}) has no trim(n) (and "
                    f"{name} no rewind_cache(cache, n)): speculative decoding rewinds each cache "
                    "by the rejected tokens"
                )
    release_cache(model, caches)  # made only to be checked
    return model


def _check_count(op: str, name: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{op}: {name} must be >= {low}, got {value}")
    return int(value)


def _check_optional_members(op: str, model: Any) -> None:
    """The types of the optional members a model has (see :func:`check_model`)."""
    name = type(model).__name__
    step = getattr(model, "decode_step", None)
    if step is not None and not callable(step):
        raise TypeError(f"{op}: {name}.decode_step must be callable, got {type(step).__name__}")
    for member in ("recompute_after", "max_seq_len"):
        value = getattr(model, member, None)
        if value is not None:
            _check_count(op, f"{name}.{member}", value, low=1)
    for member in (*_OPTIONAL_METHODS, "make_page_pools", "forward_paged", "make_state_slots"):
        value = getattr(model, member, None)
        if value is not None and not callable(value):
            raise TypeError(f"{op}: {name}.{member} must be callable, got {type(value).__name__}")


def array_library(x: Any) -> Backend | None:
    """The backend of the array ``x``, ``None`` for anything else (a list, a string, a Python
    scalar): what a model or a sampler returned, before it is trusted to be an array."""
    try:
        return backend_of(x)
    except TypeError:  # a type no backend knows
        return None


def check_logits(op: str, model: Any, logits: Any, shape: tuple[int | None, ...], call: str) -> Any:
    """``logits`` as ``model``'s ``call`` returned them, checked: an array of a supported
    library of ``shape`` (``None``: any size on that axis), else a ``TypeError`` (not an
    array) or ``ValueError`` (another rank or shape) naming the call."""
    name = type(model).__name__
    if array_library(logits) is None:
        raise TypeError(
            f"{op}: {name}.{call} must return logits as an array of a supported library, got "
            f"{type(logits).__name__}"
        )
    got = tuple(logits.shape)
    if len(got) != len(shape) or any(
        w is not None and g != w for g, w in zip(got, shape, strict=False)
    ):
        want = "(" + ", ".join("any" if w is None else str(w) for w in shape) + ")"
        raise ValueError(
            f"{op}: {name}.{call} returned logits of shape {got}, expected {want} "
            f"({_LAYOUTS[len(shape)]}, V = vocab_size)"
        )
    return logits


def check_page_pools(op: str, model: Any, pools: Any, layers: int, page_size: int) -> list[Any]:
    """A paged model's ``make_page_pools(num_pages, page_size)`` result, checked: one
    :class:`~portable_llm.PagePool` of ``page_size`` tokens per layer."""
    name = type(model).__name__
    kinds = [type(p).__name__ for p in pools] if isinstance(pools, list | tuple) else None
    if kinds is None or not all(isinstance(p, PagePool) for p in pools):
        raise TypeError(
            f"{op}: {name}.make_page_pools() must return a list of portable_llm.PagePool, got "
            f"{type(pools).__name__} {kinds[:4] if kinds else ''}"
        )
    if len(pools) != layers or any(p.page_size != page_size for p in pools):
        raise ValueError(
            f"{op}: {name}.make_page_pools(..., page_size={page_size}) must return one pool "
            f"per layer ({layers}, as make_cache()) of page_size {page_size}, got {len(pools)} "
            f"of page sizes {sorted({p.page_size for p in pools})}"
        )
    return list(pools)


def check_cache_list(op: str, name: str, caches: Any, model: LanguageModel) -> list[Any]:
    """Caches a caller gives (``prompt_cache``), checked: a list of ``model.make_cache()``'s
    length whose entries have ``offset`` (an int) and ``trim(n)``."""
    layers = num_layers(model)
    if not isinstance(caches, list | tuple) or len(caches) != layers:
        got = f"{len(caches)} caches" if isinstance(caches, list | tuple) else repr(caches)
        raise ValueError(
            f"{op}: {name} must hold one cache per layer ({layers}, from model.make_cache()), "
            f"got {got}"
        )
    empty = [i for i, c in enumerate(caches) if c is None]
    if empty:
        raise TypeError(
            f"{op}: {name} holds None at {empty}; give the caches of model.make_cache()"
        )
    for i, c in enumerate(caches):
        offset = getattr(c, "offset", None)
        if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
            raise TypeError(
                f"{op}: {name}[{i}] must be a cache of model.make_cache() (with an int offset "
                f"and trim(n)), got {type(c).__name__} {repr(c)[:40]}"
            )
        if not callable(getattr(c, "trim", None)):
            raise TypeError(f"{op}: {name}[{i}] ({type(c).__name__}) has no trim(n)")
    return caches if isinstance(caches, list) else list(caches)


def check_paged_model(model: LanguageModel) -> PagedLanguageModel | None:
    """``model`` when it is a :class:`PagedLanguageModel` that pages (its optional ``paged``
    is not ``False``: a hybrid :class:`~portable_llm.Model`, whose recurrent states no page
    holds, says ``False``), else ``None`` (the fallback)."""
    if isinstance(model, PagedLanguageModel) and getattr(model, "paged", True) is not False:
        return model
    return None


def decode_step(model: LanguageModel) -> Callable[..., Any]:
    """The forward of one decode step, ``step(ids (B, 1), cache=...) -> (B, 1 | L, V)``:
    ``model.decode_step`` (:class:`DecodeStepModel`), else ``model(..., last_only=True)``."""
    if isinstance(model, DecodeStepModel):
        return model.decode_step
    return partial(model, last_only=True)


def recompute_after(model: LanguageModel) -> int | None:
    """:attr:`RecomputingModel.recompute_after` of ``model``, ``None`` for other models."""
    return model.recompute_after if isinstance(model, RecomputingModel) else None


def vocab_size(model: Any) -> int | None:
    """:attr:`SizedVocabularyModel.vocab_size` of ``model``; ``None`` when it has none (then
    ``V`` is the first logits' last dimension)."""
    return model.vocab_size if isinstance(model, SizedVocabularyModel) else None


def release_cache(model: LanguageModel, cache: Sequence[Any] | None) -> None:
    """Hand ``cache`` (made by generation with ``model.make_cache()``) back to ``model``'s
    :meth:`ReleasingModel.release_cache`; nothing for other models or ``cache=None``."""
    if cache is not None and isinstance(model, ReleasingModel):
        model.release_cache(cache)


def materialize(model: LanguageModel, out: Any, cache: Sequence[Any]) -> None:
    """Compute a prefill chunk now: ``model.materialize(cache)`` (:class:`MaterializingModel`),
    else the backend's ``synchronize`` of the chunk's logits ``out`` (dropped)."""
    if isinstance(model, MaterializingModel):
        model.materialize(cache)
        return
    bk = backend_of(out) if array_library(out) is not None else None
    if bk is not None:
        bk.synchronize(out)


def rewind_cache(model: LanguageModel, cache: Sequence[Any], n: int) -> None:
    """Forget the last ``n`` tokens of ``cache``: ``model.rewind_cache(cache, n)``
    (:class:`RewindingModel`), else each cache's ``trim(n)``; nothing for ``n == 0``."""
    if n == 0:
        return
    if isinstance(model, RewindingModel):
        model.rewind_cache(cache, n)
        return
    for c in cache:
        c.trim(n)


def num_layers(model: LanguageModel) -> int:
    """How many caches ``model.make_cache()`` makes (given back at once: :func:`release_cache`)."""
    caches = model.make_cache()
    release_cache(model, caches)
    return len(caches)


#: The bound the front checks token ids against when a model states no ``vocab_size`` (ids are
#: int32 at most); the first logits then give ``V``.
UNKNOWN_VOCAB = 2**31 - 1
_MEMBERS = ("tokenizer", "eos_token_ids", "make_cache")
_OPTIONAL_METHODS = ("release_cache", "materialize", "rewind_cache", "decode_batch")
#: What text generation calls on a tokenizer (:class:`~portable_llm.Tokenizer`).
_TOKENIZER = ("encode_prompt", "decode", "stream", "stream_decoder")
_LAYOUTS = {2: "(B, V)", 3: "(B, L, V)"}
