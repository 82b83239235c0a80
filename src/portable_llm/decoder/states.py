"""The state of one decoder forward: what its layers share and where their keys go.

The one forward (:class:`~portable_llm.decoder.forward.Forward`) runs its layers over a
*forward state*, any object of the :class:`ForwardState` protocol: the kernel set of this
forward (bound at load, or asked per call inside a trace), RoPE's positions and table, and the
attention over the keys each layer sees. The kinds of state:

- :class:`DenseState` (here): the layers' caches (:class:`~portable_llm.KVCache`,
  :class:`~portable_llm.RotatingKVCache`; a recurrent mixer's :class:`~portable_llm.RecurrentCache`,
  a layer with both: :class:`~portable_llm.caches.hybrid.HybridCache`) or none, with left
  padding or not;
- :class:`~portable_llm.decoder.paged_step.PagedState`: rows over paged caches;
- :class:`~portable_llm.decoder.compiled.TracedState`: one decode token under a compilation,
  the key and value buffers updated functionally.

What a state reads of the model is a :class:`ForwardSetup`, built once per model: the backend,
the kernels, RoPE's options, the attention's scale and soft-capping.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from portable_llm.attn.block import AttentionState
from portable_llm.attn.latent import LatentState
from portable_llm.attn.padding import nonnegative
from portable_llm.attn.sdpa import OP as SDPA
from portable_llm.attn.sdpa_args import SdpaOptions
from portable_llm.attn.visibility import visible
from portable_llm.backends import Backend
from portable_llm.caches.hybrid import attention_cache, recurrent_cache
from portable_llm.core.dispatch import Dispatcher, tracing
from portable_llm.decoder.mixer import RecurrentState
from portable_llm.ops.kernels import KernelSet
from portable_llm.rotary.args import dispatch_args as rope_dispatch_args
from portable_llm.rotary.rope import rope_tables, rotate

Fn = Callable[..., Any]

__all__ = ["DenseState", "ForwardSetup", "ForwardState"]


@dataclass(frozen=True)
class ForwardSetup:
    """What every forward of a model reads, fixed at load: the backend and its dispatcher, the
    kernel set, RoPE's options (Gemma 3: the sliding layers' own), the attention's scale and
    soft-capping, and the device new arrays go to."""

    bk: Backend
    xp: Any  # bk.xp
    dispatch: Dispatcher
    kernels: KernelSet
    rope: Mapping[str, Any] | None  # None: no RoPE (learned positions)
    rope_local: Mapping[str, Any] | None  # Gemma 3: the RoPE of the sliding layers
    scale: float  # the attention's (Gemma: query_pre_attn_scalar ** -0.5)
    softcap: float | None  # Gemma 2: attn_logit_softcapping
    device: Any
    portable_rope: Fn  # RoPE's portable kernel: its tables are then built once per forward


class ForwardState(AttentionState, LatentState, Protocol):
    """What the layers of one forward share (the attention's and the latent attention's
    states): the protocol of :class:`DenseState`,
    :class:`~portable_llm.decoder.paged_step.PagedState` and
    :class:`~portable_llm.decoder.compiled.TracedState`."""

    #: The kernels of this forward (:class:`~portable_llm.ops.kernels.KernelSet`).
    kn: KernelSet
    offset: Any  # the position of the first new token (an int, or a traced 0-d array)
    rows: Any  # (B,) each row's first position where the rows differ, else None
    L: int  # the new tokens per row

    def local(self) -> ForwardState:
        """This state with the RoPE of the sliding layers (Gemma 3's ``rope_local``)."""
        ...

    def recurrent(self, i: int) -> RecurrentState | None:
        """Layer ``i``'s recurrent state (a recurrent mixer's), or ``None`` (no caches: the
        mixer starts from zeros and its state is dropped)."""
        ...

    def pads(self) -> Any:
        """``(B, L, 1)`` bool, ``True`` at the new tokens that are not left padding; ``None``
        when no row is padded."""
        ...


class DenseState:
    """What one forward over KV caches (or none) builds once and its layers share: its kernels
    (those of the setup, or inside a trace the dispatcher's per call), RoPE's table and kernel,
    the masks, the attention kernel.

    Parameters
    ----------
    s : ForwardSetup
    cache : the layers' KV caches, or ``None``
    pad : ``(B,)`` left padding, or ``None``
    rows : ``(B,)`` RoPE offsets of a padded batch, or ``None``
    offset : the position of the first new token (the caches' offset)
    L : the new tokens per row
    """

    def __init__(
        self, s: ForwardSetup, cache: Any, pad: Any, rows: Any, offset: Any, L: int
    ) -> None:
        self.s, self.cache, self.pad, self.rows, self.offset, self.L = (
            s, cache, pad, rows, offset, L
        )  # fmt: skip
        #: The kernels of this forward: the setup's, or asked per call inside a trace.
        self.kn: KernelSet = s.kernels.traced() if tracing() else s.kernels
        self.rope: tuple[Fn, Any, Any, dict[str, Any]] | None = None
        self.tables: tuple[Any, Any] | None = None  # the portable RoPE's cos and sin
        self.masks: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.sdpa: dict[tuple[Any, ...], Fn] = {}
        #: The options of this state's RoPE (Gemma 3's sliding layers: their own, :meth:`local`).
        self.rope_options: Mapping[str, Any] = s.rope or {}
        self._pads: Any = None  # (B, L, 1) bool: not left padding (pads())
        #: Latent layers take either form here (a paged state: the absorbed one only).
        self.absorbed_only = False

    def local(self) -> DenseState:
        """This state with the RoPE of the sliding layers (Gemma 3's ``rope_local``): the same
        caches, masks and kernels, its own frequency table and positions' angles."""
        other = copy.copy(self)
        other.rope, other.tables, other.rope_options = None, None, self.s.rope_local or {}
        return other

    def rope_args(self, q: Any) -> tuple[Fn, Any, Any, dict[str, Any]]:
        """RoPE's kernel (``auto``'s), offsets, frequency table and options, once per forward."""
        if self.rope is None:
            s, xp = self.s, self.s.xp
            start = self.offset if self.rows is None else nonnegative(xp, self.rows)
            _, (_, offsets, inv), ropts = rope_dispatch_args(
                q, start, **self.rope_options, backend=s.bk
            )
            offsets = offsets if self.rows is None else self.rows  # < 0 only on pad columns
            fn = s.dispatch.pick("rope", "auto", q, offsets, inv, **ropts)
            self.rope = (fn, offsets, inv, ropts)
        return self.rope

    def rotate(self, kn: KernelSet, q: Any, k: Any) -> tuple[Any, Any]:
        """RoPE of ``q`` ``(B, H, L, D)`` and ``k`` ``(B, H_kv, L, D)`` at this state's positions.

        With the portable kernel, its cos and sin tables are computed once per forward (the
        kernel's own steps, :func:`~portable_llm.rotary.rope.rope_tables`) and every layer only
        rotates; a native kernel runs per call, and so does every kernel inside a trace.
        """
        if self.s.rope is None:
            return q, k
        fn, offsets, inv, ropts = self.rope or self.rope_args(q)
        xp = self.s.xp
        if not kn.bound:  # inside a trace: the dispatcher's choice per call, recorded
            fq = kn.choose("rope", q, offsets, inv, **ropts)
            fk = kn.choose("rope", k, offsets, inv, **ropts)
            return fq(xp, q, offsets, inv, **ropts), fk(xp, k, offsets, inv, **ropts)
        if fn is not self.s.portable_rope:
            return fn(xp, q, offsets, inv, **ropts), fn(xp, k, offsets, inv, **ropts)
        if self.tables is None:
            off, att = ropts["offset"], ropts["attention"]
            self.tables = rope_tables(xp, q, offsets, inv, offset=off, attention=att)
        cos, sin = self.tables
        dims, traditional = ropts["dims"], ropts["traditional"]
        return (
            rotate(xp, q, cos, sin, cos, sin, dims, traditional),
            rotate(xp, k, cos, sin, cos, sin, dims, traditional),
        )

    def recurrent(self, i: int) -> RecurrentState | None:
        """Layer ``i``'s :class:`~portable_llm.RecurrentCache` (a
        :class:`~portable_llm.caches.hybrid.HybridCache`'s), or ``None`` without caches."""
        return None if self.cache is None else recurrent_cache(self.cache[i])

    def pads(self) -> Any:
        """``(B, L, 1)`` bool: the new tokens' columns ``offset + l`` at or past each row's left
        padding (``None`` without padding); built once per forward."""
        if self.pad is None:
            return None
        if self._pads is None:
            xp, L = self.s.xp, self.L
            cols = xp.arange(L, device=self.s.bk.device_of(self.pad)) + self.offset  # (L,)
            pad = xp.reshape(self.pad, (self.pad.shape[0], 1, 1))  # (B, 1, 1)
            self._pads = xp.reshape(cols, (1, L, 1)) >= xp.astype(pad, cols.dtype)  # (B, L, 1)
        return self._pads

    def positions(self) -> Any:
        """Each row's first position: the offset, or ``(B,)`` (a padded batch's rows, whose
        first real token is at 0, pad columns below; paged rows of other lengths)."""
        return self.offset if self.rows is None else self.rows

    def kv(
        self, i: int, k: Any, v: Any, window: int | None, chunk: int | None = None
    ) -> tuple[Any, Any, Any, Any]:
        """Layer ``i``'s keys and values to attend (its cache updated) and ``(mask, window)``,
        the mask built once per kind of layer (``chunk``: Llama 4's chunked layers)."""
        c = None if self.cache is None else attention_cache(self.cache[i])
        if c is None:
            if self.pad is None and chunk is None:
                return k, v, "causal", window
            key: tuple[Any, ...] = (None, window, chunk)
            got = self.masks.get(key)
            if got is None:
                xp, L = self.s.xp, self.L
                dev = self.s.bk.device_of(k)
                got = self.masks[key] = (
                    visible(xp, L, L, window=window, chunk=chunk, pad=self.pad, device=dev),
                    None,
                )
            return k, v, *got
        k, v = c.update_and_fetch(k, v)
        # Caches of one kind and window saw the same updates: their masks are equal.
        key = (type(c), window, chunk, getattr(c, "max_size", None), getattr(c, "keep", None))
        got = self.masks.get(key)
        if got is None:
            got = self.masks[key] = c.make_mask(window=window, chunk=chunk)
        else:  # the same mask, already built for an earlier layer of this kind
            c.reuse_mask()
        return k, v, *got

    def attend(
        self, kn: KernelSet, i: int, q: Any, k: Any, v: Any, window: int | None,
        chunk: int | None = None, *, sinks: Any = None,
    ) -> Any:  # fmt: skip
        """Layer ``i``'s attention of ``q`` ``(B, H, L, D)`` over its cache and the new keys
        and values ``(B, H_kv, L, D)`` (after RoPE): the output ``(B, H, L, D)``; ``sinks``
        ``(H,)``: the layer's attention sinks (the SDPA's fifth array)."""
        k, v, mask, window = self.kv(i, k, v, window, chunk)
        return self.sdpa_call(kn, q, k, v, mask, window, sinks)  # (B, H, L, D)

    def latents(self, kn: KernelSet, i: int, c_kv: Any, k_pe: Any) -> tuple[Any, Any, Any]:
        """Layer ``i``'s latent attention (:func:`~portable_llm.attn.latent.
        latent_attention_body`): its new ``c_kv`` ``(B, 1, L, R)`` and ``k_pe`` ``(B, 1, L,
        d_r)`` stored in its latent cache (a KV cache holding them as keys and values), every
        latent to attend and the mask."""
        c_kv, k_pe, mask, _ = self.kv(i, c_kv, k_pe, None)
        return c_kv, k_pe, mask

    def attend_latent(self, kn: KernelSet, i: int, q: Any, k: Any, v: Any, mask: Any) -> Any:
        """Latent layer ``i``'s attention of ``q`` ``(B, H, L, D)`` over ``k`` ``(B, 1, S,
        D)`` and ``v`` ``(B, 1, S, D_v)`` with the mask :meth:`latents` gave: ``(B, H, L,
        D_v)``."""
        return self.sdpa_call(kn, q, k, v, mask, None, None)

    def sdpa_call(
        self, kn: KernelSet, q: Any, k: Any, v: Any, mask: Any, window: int | None, sinks: Any
    ) -> Any:
        """The SDPA of the keys to attend (``mask``: ``"causal"`` or an array), its kernel
        chosen once per forward and kind of layer (per call inside a trace)."""
        s = self.s
        causal = isinstance(mask, str) or window is not None
        mask = None if isinstance(mask, str) else mask
        opts = SdpaOptions(scale=s.scale, causal=causal, window=window, softcap=s.softcap)
        arrays = (q, k, v, mask) if sinks is None else (q, k, v, mask, sinks)
        key: tuple[Any, ...] = (
            causal, window, None if mask is None else tuple(mask.shape), tuple(k.shape),
            tuple(v.shape), sinks is not None,
        )  # fmt: skip
        fn = self.sdpa.get(key)
        if not kn.bound:  # inside a trace: asked (and recorded) per layer
            fn = kn.choose(SDPA, *arrays, opts=opts)
        elif fn is None:  # auto's choice, as kn.choose makes it, once per forward
            fn = self.sdpa[key] = s.dispatch.pick(SDPA, "auto", *arrays, opts=opts)
        return fn(s.xp, *arrays, opts=opts)  # (B, H, L, D_v)
