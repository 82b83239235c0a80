"""One compiled decode step: a whole token under one compilation, where the backend compiles.

JAX and MLX: the prepared forward of one token runs under one ``jax.jit`` (``mx.compile``).
Every layer's key and value buffers go in (donated on JAX; MLX reuses a buffer nothing else
holds) and come back updated functionally (``lax.dynamic_update_slice`` / ``mx.slice_update``
at the offset, itself an input), and the keys are the caches' fixed-size views
(``KVCache(static_shapes=True)``, which :meth:`Model.make_cache` gives where a compiled step
exists), so one compilation serves every token until the caches grow (every ``step`` tokens).
The weights are arguments, not constants folded into the program. :attr:`CompiledDecode.traces`
counts the compilations. On JAX the weights may be quantized (``QuantizedWeight``: the
projections, the embedding, the LM head): their packed codes, scales and biases are arguments
too, and ``quantized_linear``'s kernel is traced into the step, chosen on the traced
activations (``auto`` then dequantizes, which XLA fuses into the products) and kept apart from
the kernels the eager forward chose on concrete ones.

The step applies to a decode step (``L = 1``) on plain :class:`~portable_llm.KVCache` caches
that already hold the prompt, on a model of dense layers (MoE layers too on JAX, their
experts by ``jax.lax.ragged_dot``) without ``"dynamic"`` RoPE (whose table depends on the
position; ``"longrope"`` compiles one program per side of its original length, where its table
switches); anything else runs the eager prepared forward. A model with recurrent token
mixers (:attr:`Layer.mixer <portable_llm.decoder.layer_weights.Layer>`: LFM2, Qwen3-Next,
Falcon-H1) compiles its step too: each recurrent layer's state (its
:class:`~portable_llm.RecurrentCache`'s, a tuple of fixed-shape arrays) is an argument of the
program and the mixer's new state a result (not donated: the cache keeps the states a
speculative rewind needs), recorded in the cache after the call as an eager step records it.
The caches keep their meaning: after a compiled step they hold what an eager step would have
left in them.
Token ids go in unchecked: an id outside ``[0, V)`` gives a row of NaN (the embedding's
``"masked"`` implementation), so its logits have no distribution and the decode loop stops with
its error.

NumPy, array-api-strict and torch run the eager prepared forward (see ``docs/models.md``,
"Speed", and ``benchmarks/README.md`` for what was measured).
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from portable_llm.attn.visibility import visible
from portable_llm.backends import Backend, backend_of
from portable_llm.caches.hybrid import attention_cache, recurrent_cache
from portable_llm.caches.kv import KVCache
from portable_llm.core.dispatch import TraceEntry, capture, replay, tracing
from portable_llm.decoder.forward import Forward
from portable_llm.decoder.layer_weights import Layer, QLinear
from portable_llm.decoder.states import DenseState, ForwardSetup
from portable_llm.ops.quant import QuantizedWeight
from portable_llm.rotary.args import dispatch_args as rope_dispatch_args
from portable_llm.rotary.scaling import RopeSpec, uses_length

__all__ = ["CompiledDecode", "compile_decode"]


def _jax_jit(bk: Backend) -> Callable[..., Any]:
    jax = bk.jax  # type: ignore[attr-defined]
    return lambda fn: jax.jit(fn, donate_argnums=(1, 2))


def _jax_update(bk: Backend) -> Callable[..., Any]:
    update = bk.jax.lax.dynamic_update_slice  # type: ignore[attr-defined]

    def at(buf: Any, value: Any, offset: Any) -> Any:
        zero = offset * 0  # indices of one integer type (int64 under jax_enable_x64)
        return update(buf, value, (zero, zero, offset, zero))

    return at


class _MlxProgram:
    """An ``mx.compile``'d step, compiled once per thread that runs it, each thread's program
    dropped when the thread ends and the rest at interpreter exit, before MLX shuts down.

    MLX 0.32 aborts the process at exit ("terminate called without an active exception", rc
    134) when a compiled function that ran on a thread other than the main one is still alive
    then: one worker thread generating on an MLX model (as the server's engine thread does)
    aborted 4 of 6 runs; with the programs dropped at exit, 0 of 20. One program shared by 8
    threads still aborted 3 of 20 runs (5 of 20 a script's 8 threads of 8 tokens) even so, and
    0 of 20 with each thread's own program (measured on a 2-core CPU, issue 33 audit).
    """

    def __init__(self, compile_: Callable[..., Any], fn: Callable[..., Any]) -> None:
        self._compile, self._fn = compile_, fn
        self._local: threading.local | None = threading.local()  # .fn: this thread's program
        _MLX_PROGRAMS.add(self)

    def __call__(self, *args: Any) -> Any:
        local = self._local
        assert local is not None, "the MLX program was released at interpreter exit"
        program = getattr(local, "fn", None)
        if program is None:
            program = local.fn = self._compile(self._fn)
        return program(*args)

    def release(self) -> None:
        """Drop every thread's program (the thread-local store goes, and with it its values)."""
        self._local = None


_MLX_PROGRAMS: weakref.WeakSet[_MlxProgram] = weakref.WeakSet()


@atexit.register
def _release_mlx_programs() -> None:
    for program in list(_MLX_PROGRAMS):
        program.release()


def _mlx_jit(bk: Backend) -> Callable[..., Any]:
    compile_ = bk.mx.compile  # type: ignore[attr-defined]
    return lambda fn: _MlxProgram(compile_, fn)


def _mlx_update(bk: Backend) -> Callable[..., Any]:
    mx = bk.mx  # type: ignore[attr-defined]
    return lambda buf, value, offset: mx.slice_update(buf, value, offset[None], axes=(2,))


def _torch_jit(bk: Backend) -> Callable[..., Any]:
    from portable_llm.native.torch_compile import TorchProgram

    return TorchProgram


def _torch_update(bk: Backend) -> Callable[..., Any]:
    from portable_llm.native.torch_compile import update

    return update


#: backend name -> (compile, with the cache buffers donated where the library asks for it;
#: ``update(buf (B, H_kv, capacity, D), value (B, H_kv, 1, D), offset ()) -> buf`` written at
#: column ``offset``, functionally), per library.
_COMPILERS: dict[str, tuple[Callable[[Backend], Any], Callable[[Backend], Any]]] = {
    "jax": (_jax_jit, _jax_update),
    "mlx": (_mlx_jit, _mlx_update),
    "torch": (_torch_jit, _torch_update),
}

#: The backends whose compiled step runs only when asked (``Model(..., compile=True)``), not by
#: default (``compile="auto"``): torch's (make_fx and inductor, ``native/torch_compile.py``).
OPT_IN = frozenset({"torch"})

#: The backends whose compiled program holds the layers' weights as its constants (the
#: prepared layers themselves, their kernels bound: torch's int8 projections prepacked once)
#: rather than as arguments.
_WEIGHTS_INSIDE = frozenset({"torch"})

#: The backends whose compiled step also takes quantized weights: their arrays (packed codes,
#: scales, biases) are arguments like the float weights, and ``quantized_linear``'s kernel is
#: traced with the rest of the step (XLA fuses the dequantization into the products; MLX runs
#: ``mx.quantized_matmul`` inside ``mx.compile``). The step embeds with ``check=False``, so a
#: quantized embedding reads no id back either (MLX refuses a read-back under ``mx.compile``).
_TAKES_QUANTIZED = frozenset({"jax", "torch", "mlx"})

#: The backends whose compiled step also runs MoE layers: ``moe``'s experts traced with static
#: shapes (``jax.lax.ragged_dot``, which ``impl="auto"`` takes under ``jax.jit``). MLX's
#: experts read the per-expert counts back (MLX does not mark traced arrays): eager there.
_TRACES_MOE = frozenset({"jax"})


#: The backends whose compiled step also runs recurrent token mixers (a hybrid model's): each
#: recurrent layer's state goes in as an argument of the program and its new state comes back
#: (not donated: the cache keeps the states a rewind needs).
_TRACES_MIXERS = frozenset({"jax", "mlx"})


def compile_decode(prepared: Forward, *, opt_in: bool = False) -> CompiledDecode | None:
    """The compiled decode step of ``prepared`` where its backend compiles one, else ``None``;
    ``opt_in``: also on the backends of :data:`OPT_IN`."""
    compilers = _COMPILERS.get(prepared.bk.name)
    if compilers is None or (prepared.bk.name in OPT_IN and not opt_in):
        return None
    if unavailable(prepared) is not None:
        return None
    if any(layer.mixer is not None for layer in prepared.layers) and (
        prepared.bk.name not in _TRACES_MIXERS
    ):
        return None  # recurrent mixers: eager where their states are not traced
    if any(layer.mlp is None for layer in prepared.layers) and prepared.bk.name not in _TRACES_MOE:
        return None  # MoE: eager (the portable experts read their token counts on the host)
    if prepared.quantized and prepared.bk.name not in _TAKES_QUANTIZED:
        return None
    kinds = [
        (rope.get("scaling") or {}).get("rope_type", "default")
        for rope in (prepared.setup.rope or {}, prepared.setup.rope_local or {})
    ]
    if "dynamic" in kinds or kinds[1] == "longrope":  # a table per position
        return None
    jit, update = compilers
    return CompiledDecode(prepared, jit(prepared.bk), update(prepared.bk))


def unavailable(prepared: Forward) -> str | None:
    """Why ``prepared``'s backend cannot compile its step on this machine (torch: no C++
    compiler for inductor, or not the CPU), or ``None``."""
    if prepared.bk.name != "torch":
        return None
    from portable_llm.native.torch_compile import unavailable as torch_unavailable

    return torch_unavailable(prepared.setup.device)


def _switch(prepared: Forward) -> int | None:
    """``L0`` of a ``longrope`` RoPE (its long factors from position ``L0`` on), else None."""
    scaling = (prepared.setup.rope or {}).get("scaling") or {}
    if not uses_length(RopeSpec(kind=scaling.get("rope_type", "default"))):
        return None
    return int(scaling["original_max_position_embeddings"])


Rebuild = Callable[[Sequence[Any]], list[Layer]]


def _flatten(layers: Sequence[Layer], bk: Backend) -> tuple[list[Any], Rebuild]:
    """The layers' arrays as a flat list, and the function that rebuilds the layers from such a
    list (the arrays become arguments of the compiled program, not constants)."""
    leaves: list[Any] = []

    def walk(rec: Any) -> Any:
        out = {}
        for f in dataclasses.fields(rec):
            value = getattr(rec, f.name)
            if dataclasses.is_dataclass(value):
                out[f.name] = walk(value)
            elif value is not None and _array_of(bk, value):
                out[f.name] = len(leaves)
                leaves.append(value)
        return out

    plans = [walk(layer) for layer in layers]

    def fill(rec: Any, plan: dict[str, Any], arrays: Sequence[Any]) -> Any:
        changes = {
            k: fill(getattr(rec, k), v, arrays) if isinstance(v, dict) else arrays[v]
            for k, v in plan.items()
        }
        if type(rec) is QLinear:  # kernels chosen on the traced activations, kept apart
            changes["fns"] = {}
        return dataclasses.replace(rec, **changes)

    def rebuild(arrays: Sequence[Any]) -> list[Layer]:
        return [fill(layer, plan, arrays) for layer, plan in zip(layers, plans, strict=True)]

    return leaves, rebuild


def _array_of(bk: Backend, value: Any) -> bool:
    """Whether ``value`` is an array of ``bk`` (not a number, nor a :class:`QLinear`'s kernel
    chooser or its kernels)."""
    try:
        return backend_of(value) is bk
    except TypeError:  # a type no backend knows: a function, a dict of them
        return False


class TracedState(DenseState):
    """The forward state of one traced decode token: the key and value buffers, updated
    functionally (:mod:`portable_llm.decoder.states`)."""

    def __init__(
        self, s: ForwardSetup, update: Any, ks: list[Any], vs: list[Any], pad: Any, offset: Any,
        rs: list[tuple[Any, ...]] | None = None, at: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        rows = None if pad is None else offset - pad  # (B,)
        super().__init__(s, None, pad, rows, offset, 1)
        self.update, self.ks, self.vs = update, ks, vs
        #: The position RoPE's table is chosen for (``longrope``: ``L0`` past the switch, else 0).
        self.table_position = 0
        self.S = int(ks[0].shape[2]) - 1 if ks else 0  # the fixed-size view: capacity - 1 keys
        #: A hybrid model's: per layer, its index in ``ks``/``vs`` (attention) and in ``rs``
        #: (the recurrent states, replaced functionally by the traced mixers), -1 for none.
        self.at = list(at) if at is not None else list(range(len(ks)))
        self.rs = rs or []  # per layer: its recurrent state, or None

    def rope_args(self, q: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
        """RoPE at the traced offset: the options parsed as for position
        :attr:`table_position` (nothing read back from the offset, which MLX cannot read in a
        trace: ``longrope``'s side of ``L0`` is the program's), the positions the offset's."""
        if self.rope is None:
            s = self.s
            at, opts = self.table_position, self.rope_options
            _, (_, _, inv), ropts = rope_dispatch_args(q, at, **opts, backend=s.bk)
            ropts = {**ropts, "offset": 0}  # the positions: the traced offset's alone
            offsets = self.offset if self.rows is None else self.rows  # () or (B,)
            fn = s.dispatch.pick("rope", "auto", q, offsets, inv, **ropts)
            self.rope = (fn, offsets, inv, ropts)
        return self.rope

    def kv(
        self, i: int, k: Any, v: Any, window: int | None, chunk: int | None = None
    ) -> tuple[Any, Any, Any, Any]:
        i = self.at[i]  # the layer's buffers among the attention layers'
        self.ks[i] = self.update(self.ks[i], k, self.offset)  # (B, H_kv, capacity, D)
        self.vs[i] = self.update(self.vs[i], v, self.offset)
        S = self.S
        key = ("view", window, chunk)
        mask = self.masks.get(key)
        if mask is None:  # the cache's make_mask, with the offset traced
            xp = self.s.xp
            mask = visible(
                xp, 1, S, q_start=self.offset, window=window, chunk=chunk, pad=self.pad
            )  # fmt: skip
            if self.pad is None:
                mask = xp.reshape(mask, (1, 1, 1, S))  # as the cache's: (1, 1, L, S)
            self.masks[key] = mask
        return self.ks[i][:, :, :S, :], self.vs[i][:, :, :S, :], mask, None

    def recurrent(self, i: int) -> _TracedRecurrent:
        """Layer ``i``'s recurrent state as an argument of the program, replaced by the
        mixer's new one (a result of the program)."""
        return _TracedRecurrent(self.rs, i)


class _TracedRecurrent:
    """The recurrent cache a traced mixer reads and writes (``state``, ``update``): entry ``i``
    of the program's recurrent states, replaced functionally; no history (one token)."""

    max_rewind = 0

    def __init__(self, rs: list[Any], i: int) -> None:
        self.rs, self.i = rs, i

    @property
    def state(self) -> tuple[Any, ...]:
        return tuple(self.rs[self.i])

    def update(self, *states: Any, tokens: int = 1, all_states: bool = False) -> None:
        self.rs[self.i] = tuple(states)


def _positions(flags: Sequence[bool]) -> list[int]:
    """For each flag, its index among the true ones (-1 for a false one)."""
    out, n = [], 0
    for f in flags:
        out.append(n if f else -1)
        n += bool(f)
    return out


class CompiledDecode:
    """A prepared model's decode step compiled whole (see the module docstring)."""

    def __init__(self, prepared: Forward, jit: Callable[..., Any], update: Any) -> None:
        self.p = prepared
        self.update = update
        #: How many times the step was traced (compiled): once per cache capacity.
        self.traces = 0
        leaves, self._rebuild = _flatten(prepared.layers, prepared.bk)
        layers = prepared.layers
        #: The layers with attention (their key and value buffers, in order) and with a
        #: recurrent mixer (their states, in order); each layer's index among the first.
        self._kv_layers = [i for i, layer in enumerate(layers) if layer.attn is not None]
        self._rec_layers = [i for i, layer in enumerate(layers) if layer.mixer is not None]
        self._at = _positions([layer.attn is not None for layer in layers])
        #: The weights inside the program (torch): no layer arrays as arguments.
        self._inside = prepared.bk.name in _WEIGHTS_INSIDE
        self._leaves = () if self._inside else tuple(leaves)
        self._jit = jit
        #: The compiled programs, one per layout of the top weights (see :func:`_split_top`)
        #: and, for ``longrope``, per side of its original length ``L0``.
        self._fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._switch = _switch(prepared)
        #: The kernels each program runs, as :func:`~portable_llm.trace` recorded them while
        #: the program was traced; a trace open around a call of the program gets them.
        self.kernels: dict[tuple[Any, ...], list[TraceEntry]] = {}

    @property
    def compile_seconds(self) -> list[float]:
        """The seconds each compilation took, where the backend's program counts them (torch's
        :class:`~portable_llm.native.torch_compile.TorchProgram`; elsewhere ``[]``)."""
        return [t for fn in self._fns.values() for t in getattr(fn, "compile_seconds", ())]

    def applies(self, ids: Any, cache: Sequence[Any] | None) -> bool:
        """Whether this call is a decode step the compiled program runs."""
        if cache is None or ids.shape[1] != 1:
            return False
        first = cache[0]
        kv = [attention_cache(cache[i]) for i in self._kv_layers]
        rec = [recurrent_cache(cache[i]) for i in self._rec_layers]
        return (
            all(type(c) is KVCache and c.static_shapes and c.offset == first.offset for c in kv)
            and all(r is not None and r.state is not None and r.offset == first.offset
                    for r in rec)
            and first.offset > 0
        )  # fmt: skip

    def __call__(self, ids: Any, cache: Sequence[Any], top: tuple[Any, Any, Any]) -> Any:
        """Logits ``(B, 1, V)`` of one token per row after what ``cache`` holds; the caches are
        updated as an eager step updates them."""
        xp = self.p.xp
        off = cache[0].offset
        kv = [attention_cache(cache[i]) for i in self._kv_layers]
        rec = [recurrent_cache(cache[i]) for i in self._rec_layers]
        state = [c.reserve(1, op="model") for c in kv]  # as update_and_fetch: a slot stays free
        ks = tuple(k for k, _ in state)
        vs = tuple(v for _, v in state)
        rs = tuple(r.state for r in rec if r is not None)  # the recurrent layers' states
        offset = xp.asarray(off, dtype=xp.int32)
        pad = cache[0].left_padding
        arrays, layout = _split_top(top, self.p.head_weight)
        layout = (*layout, self._switch is not None and off + 1 > self._switch)  # longrope: long
        fn = self._fns.get(layout)
        if fn is None:
            fn = self._fns[layout] = self._jit(partial(self._step, layout=layout))
        logits, ks, vs, rs = fn(ids, ks, vs, offset, pad, self._leaves, arrays, rs)
        for c, k, v in zip(kv, ks, vs, strict=True):
            c.adopt(k, v, off + 1)  # the step attended with the cache's mask
        for r, new in zip(rec, rs, strict=True):
            assert r is not None
            r.update(*new, tokens=1)
        if tracing():  # the kernels the program runs, recorded when it was traced
            replay(self.kernels[layout])
        return logits

    def _step(
        self, ids: Any, ks: tuple[Any, ...], vs: tuple[Any, ...], offset: Any, pad: Any,
        leaves: tuple[Any, ...], top: tuple[Any, Any, Any], rs: tuple[Any, ...], *,
        layout: tuple[Any, ...],
    ) -> tuple[Any, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
        self.traces += 1
        with capture() as kernels:  # every kernel of the program, asked of the dispatcher
            out = self._forward(ids, ks, vs, offset, pad, leaves, top, layout, rs)
        self.kernels[layout] = list(kernels)
        return out

    def _forward(
        self, ids: Any, ks: tuple[Any, ...], vs: tuple[Any, ...], offset: Any, pad: Any,
        leaves: tuple[Any, ...], top: tuple[Any, Any, Any], layout: tuple[Any, ...],
        rs: tuple[Any, ...] = (),
    ) -> tuple[Any, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
        p = self.p
        embed, norm, head = (
            a if f is None else QuantizedWeight(*a, bits=f[0], group_size=f[1])
            for a, f in zip(top, layout[:3], strict=True)
        )
        per_layer: list[Any] = [None] * len(p.layers)  # each recurrent layer's state
        for i, r in zip(self._rec_layers, rs, strict=True):
            per_layer[i] = r
        state = TracedState(
            p.setup, self.update, list(ks), list(vs), pad, offset, per_layer, self._at
        )  # fmt: skip
        if layout[4]:  # longrope past L0: the table of a position beyond it
            assert self._switch is not None
            state.table_position = self._switch
        # the layers' arrays: the program's arguments, or (torch) its constants
        traced = p if self._inside else p.with_layers(self._rebuild(leaves))
        # traced ids: an id out of range gives NaN (a quantized table: its rows dequantized)
        h = traced.embed(ids, state, embed, check=False)  # (B, 1, E)
        h = traced.run_layers(h, state)
        if layout[3] and self._inside:  # the head bound at load, as the layers
            head = p.bound_head
        elif layout[3] and type(p.bound_head) is QLinear:  # the head bound at load: its kernels
            packed, scales, biases = top[2]
            bound = p.bound_head
            head = dataclasses.replace(bound, packed=packed, scales=scales, biases=biases, fns={})
        new = tuple(state.rs[i] for i in self._rec_layers)
        return traced.head(h, state, norm, head), tuple(state.ks), tuple(state.vs), new


def _split_top(top: tuple[Any, Any, Any], bound: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The arguments of the step for the model's ``(embed, norm, head)``: a quantized weight
    as its three arrays; and their layout, the program's static part: per weight its
    ``(bits, group_size)`` (``None``: an array), then whether the head is ``bound`` (the one
    the prepared forward bound at load, whose kernels the step reuses)."""
    arrays = tuple(w.arrays if isinstance(w, QuantizedWeight) else w for w in top)
    formats = tuple((w.bits, w.group_size) if isinstance(w, QuantizedWeight) else None for w in top)
    return arrays, (*formats, top[2] is bound)
