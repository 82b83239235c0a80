"""The kernels a composite op's body calls: chosen per call, or bound once with the weights.

A composite op (``mlp``, ``attention``, a model's layers) is a front that checks its arguments
and a body that computes (:func:`~portable_llm.ops.linear.mlp_body`,
:func:`~portable_llm.attn.block.attention_body`), as array-api-extra splits its functions. The
body calls its kernels through a kernel set, any object of the :class:`KernelSet` protocol
(``project``, ``linear``, ``rms_norm``, ``layer_norm``, ``act``, ``glu``, ``choose``, ``traced``):

- :class:`Kernels`: each call asks the dispatcher (:func:`~portable_llm.core.dispatch.pick`,
  the entry every public op uses), so :func:`~portable_llm.trace` records every kernel that
  runs. The public ops use it; so does a model's prepared forward while a trace is open.
- :class:`BoundKernels`: the kernels of the dense ops chosen once for a model's dtype (the same
  dispatcher, the same choices: ``linear``, ``rms_norm`` and the activations choose by dtype),
  then called directly: a model's prepared forward outside a trace ("check once, run many").
- the public ops themselves (:class:`~portable_llm.ops.checked_kernels.CheckedKernels`): each
  call checks its arguments and casts a weight of another float dtype; a model's op-by-op
  forward (``Model(..., prepared=False)``, or weights in mixed dtypes).

A projection's weight is a float array, a :class:`~portable_llm.ops.quant.QuantizedWeight`, or
one bound with its kernel at load (:class:`QLinear`, :class:`Packed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from portable_llm.backends import Backend
from portable_llm.core.dispatch import dispatcher, pick, portable, variant
from portable_llm.ops.quant import MXFP4Weight, QuantizedWeight, quantized_linear

__all__ = [
    "BOUND_PROJECTIONS",
    "MODEL_LINEAR",
    "BoundKernels",
    "KernelSet",
    "Kernels",
    "Packed",
    "QLinear",
    "offset_rms_norm",
    "projector",
    "unpacked",
]

Fn = Callable[..., Any]

#: The op of a model's own float products: ``linear``'s meaning, checks and kernels, except
#: where a backend has a kernel that only a model's forward takes (torch's CPU: NumPy's BLAS
#: for one float32 row at one thread, ``native/torch.py``). A model's kernel sets ask for it
#: (:func:`~portable_llm.decoder.prepared.prepare` chooses it); the public ``linear`` never.
MODEL_LINEAR = "model_linear"
variant(MODEL_LINEAR, of="linear")


@portable("pack_linear")
def unpacked(xp: Any, w: Any) -> Any:
    """``pack_linear``'s portable implementation: no packed layout, the weight as it is (a
    backend's native kernel may pack it, e.g. oneDNN's layout on torch's CPU)."""
    return w


@dataclass(frozen=True)
class Packed:
    """A float projection in a layout that the backend packed once at load (``pack_linear``,
    e.g. oneDNN's for bfloat16 on torch's CPU), with its ``packed_linear`` kernel: the bits of
    ``linear`` on the plain weight (tested)."""

    w: Any  # (O, I), packed
    fn: Fn  # fn(xp, x, w, b)

    def __call__(self, xp: Any, x: Any, b: Any) -> Any:
        return self.fn(xp, x, self.w, b)

    def picked(self, bk: Backend, xp: Any, x: Any, b: Any) -> Any:
        """The same product, its kernel asked of the dispatcher (recorded by a trace)."""
        return pick(bk, "packed_linear", "native", x, self.w, b)(xp, x, self.w, b)


@dataclass(frozen=True)
class QLinear:
    """A quantized projection ``(N, K)`` (MLX's affine format) with its kernels.

    Its op (:attr:`op`) is ``quantized_linear``, or ``quantized_linear_int8`` in a model of
    8-bit activations, fixed when the weight is bound
    (:func:`~portable_llm.decoder.layer_weights.bind_weight`).

    ``quantized_linear``'s kernel is chosen once per weight, dtype and shape of ``x``'s leading
    axes (``auto`` looks at the row count: a few rows of a decode step take another portable
    path than a prefill), then called directly; where the backend's kernel offers a
    specialization for a weight bound once (``specialize``: the dispatcher's
    :meth:`~portable_llm.core.dispatch.Dispatcher.specialized`, e.g. torch's int4 call with the
    repack and checks done), that runs instead, with the same bits.
    """

    packed: Any  # (N, K * bits / 32) uint32
    scales: Any  # (N, K / group_size)
    biases: Any  # (N, K / group_size)
    bits: int
    group_size: int
    pick: Fn  # pick(x, packed, scales, biases, b, **format): the dispatcher's auto choice
    #: (leading axes of x, x's dtype, no bias) -> (the chosen kernel, fn(xp, x, b) that runs it)
    fns: dict[tuple[Any, ...], tuple[Fn, Fn]] = field(
        default_factory=dict, compare=False, repr=False
    )
    #: specialize(fn, x, packed, scales, biases, b, **format) -> fn(xp, x, b) or None
    specialize: Fn | None = field(default=None, compare=False, repr=False)
    #: The op its kernels belong to: ``quantized_linear`` (float activations) or
    #: ``quantized_linear_int8`` (the activations in 8-bit blocks: a model loaded with
    #: ``activations="int8"``), the name a trace records.
    op: str = "quantized_linear"

    def __call__(self, xp: Any, x: Any, b: Any) -> Any:
        """``x @ dequantize(w).T + b`` in x's dtype."""
        key = (*x.shape[:-1], x.dtype, b is None)
        got = self.fns.get(key)
        if got is None:
            got = self.fns[key] = self._bound(x, b)
        return got[1](xp, x, b)

    def _bound(self, x: Any, b: Any) -> tuple[Fn, Fn]:
        """The kernel for activations like ``x`` (and a bias or none), and ``fn(xp, x, b)``
        that runs it: its specialization for this weight, where it has one."""
        opts = {"bits": self.bits, "group_size": self.group_size}
        arrays = (self.packed, self.scales, self.biases)
        chosen = self.pick(x, *arrays, b, **opts)
        if self.specialize is not None:
            fast = self.specialize(chosen, x, *arrays, b, **opts)
            if fast is not None:
                return chosen, fast
        return chosen, lambda xp, x, b: chosen(xp, x, *arrays, b, **opts)

    def picked(self, bk: Backend, xp: Any, x: Any, b: Any) -> Any:
        """The same product, its kernel asked of the dispatcher per call (``auto``, as
        :attr:`pick` chooses; recorded by a trace)."""
        arrays = (self.packed, self.scales, self.biases)
        opts = {"bits": self.bits, "group_size": self.group_size}
        fn = pick(bk, self.op, "auto", x, *arrays, b, **opts)
        return fn(xp, x, *arrays, b, **opts)


class KernelSet(Protocol):
    """What a composite op's body calls (:func:`~portable_llm.attn.block.attention_body`,
    :func:`~portable_llm.ops.linear.mlp_body`, a model's layers): the dense ops' kernels, each
    ``fn(xp, ...)`` on checked arrays, and the choice of any other op's kernel."""

    @property
    def bound(self) -> bool:
        """Whether the kernels were chosen once: a body may then keep the choices it makes
        with :meth:`choose` for the rest of a forward (else it asks per call, as a trace
        records)."""
        ...

    def choose(self, op: str, *args: Any, **options: Any) -> Fn:
        """The implementation of ``op`` for these arguments."""
        ...

    def linear(self, xp: Any, x: Any, w: Any, b: Any) -> Any:
        """``x @ w.T + b`` for a float weight ``w`` ``(O, I)``."""
        ...

    def project(self, xp: Any, x: Any, w: Any, b: Any) -> Any:
        """``x @ w.T + b`` for any projection: a float weight, a ``QuantizedWeight``, a bound
        one (:class:`QLinear`, :class:`Packed`)."""
        ...

    def rms_norm(self, xp: Any, x: Any, w: Any, *, eps: float) -> Any: ...

    def layer_norm(self, xp: Any, x: Any, w: Any, b: Any, *, eps: float) -> Any: ...

    def act(self, xp: Any, x: Any) -> Any:
        """The model's activation."""
        ...

    def glu(self, xp: Any, gate: Any, up: Any, *, limit: float, alpha: float) -> Any:
        """gpt-oss's clamped SwiGLU of a gated projection's halves."""
        ...

    def traced(self) -> KernelSet:
        """The same choices asked of the dispatcher per call, so that a trace records them."""
        ...


def _no_norm(xp: Any, x: Any, w: Any, *, eps: float) -> Any:
    raise TypeError("these kernels hold no rms_norm (BoundKernels.for_mlp)")


def _no_layer_norm(xp: Any, x: Any, w: Any, b: Any, *, eps: float) -> Any:
    raise TypeError("these kernels hold no layer_norm (BoundKernels.for_mlp)")


def _no_glu(xp: Any, gate: Any, up: Any, *, limit: float, alpha: float) -> Any:
    raise TypeError("these kernels hold no clamped SwiGLU")


#: The projections that carry their kernel.
BOUND_PROJECTIONS = (Packed, QLinear)


class Kernels:
    """Kernels chosen per call through :func:`~portable_llm.core.dispatch.pick` (traced).

    Parameters
    ----------
    bk : Backend
    impl : str
        The ``impl=`` of every choice (``"auto"``, ``"portable"``, ``"native"``).
    act : str, optional
        The activation's op name (:func:`~portable_llm.ops.activations.activation_op`).
    linear_op : str
        The op of the float products: ``"linear"``, or a model's :data:`MODEL_LINEAR`.
    """

    __slots__ = ("act_op", "bk", "impl", "linear_op")

    #: Whether the kernels were chosen once (:class:`BoundKernels`): a body may then keep the
    #: choices it makes with :meth:`choose` for the rest of a forward.
    bound = False

    def __init__(
        self, bk: Backend, impl: str = "auto", act: str | None = None, linear_op: str = "linear"
    ) -> None:
        self.bk, self.impl, self.act_op, self.linear_op = bk, impl, act, linear_op

    def choose(self, op: str, *args: Any, **options: Any) -> Fn:
        """The implementation of ``op`` for these arguments (the dispatcher's, recorded)."""
        return pick(self.bk, op, self.impl, *args, **options)

    def linear(self, xp: Any, x: Any, w: Any, b: Any) -> Any:
        """``x @ w.T + b`` for a float weight ``w`` ``(O, I)`` in x's dtype."""
        return pick(self.bk, self.linear_op, self.impl, x, w, b)(xp, x, w, b)

    def project(self, xp: Any, x: Any, w: Any, b: Any) -> Any:
        """``x @ w.T + b`` for a float weight, a ``QuantizedWeight`` or a bound one."""
        t = type(w)
        if t is QuantizedWeight or t is MXFP4Weight:
            return quantized_linear(x, w, b, impl=self.impl, backend=self.bk)
        if t in BOUND_PROJECTIONS:
            return w.picked(self.bk, xp, x, b)
        return pick(self.bk, self.linear_op, self.impl, x, w, b)(xp, x, w, b)

    def rms_norm(self, xp: Any, x: Any, w: Any, *, eps: float) -> Any:
        return pick(self.bk, "rms_norm", self.impl, x, w, eps=eps)(xp, x, w, eps=eps)

    def layer_norm(self, xp: Any, x: Any, w: Any, b: Any, *, eps: float) -> Any:
        return pick(self.bk, "layer_norm", self.impl, x, w, b, eps=eps)(xp, x, w, b, eps=eps)

    def act(self, xp: Any, x: Any) -> Any:
        assert self.act_op is not None
        return pick(self.bk, self.act_op, self.impl, x)(xp, x)

    def glu(self, xp: Any, gate: Any, up: Any, *, limit: float, alpha: float) -> Any:
        """gpt-oss's clamped SwiGLU of a gated projection's halves (``clamped_swiglu``)."""
        opts = {"limit": limit, "alpha": alpha}
        return pick(self.bk, "clamped_swiglu", self.impl, gate, up, **opts)(xp, gate, up, **opts)

    def traced(self) -> Kernels:
        """These kernels: each is already asked of the dispatcher per call."""
        return self


@dataclass(frozen=True)
class BoundKernels:
    """The implementations of the dense ops, chosen once for a model's dtype; see the module
    docstring. Build them with :meth:`choose_for`."""

    bk: Backend | None  # None: kernels a composite op chose per call (a MoE's experts)
    linear: Fn  # fn(xp, x, w, b)
    rms_norm: Fn  # fn(xp, x, w, *, eps)
    act: Fn  # fn(xp, x)
    act_op: str
    #: ``project(xp, x, w, b)``: ``x @ w.T + b`` for the model's projections: the ``linear``
    #: kernel itself where every projection is a float array (one Python frame per product),
    #: else :func:`projector`'s, which also runs :class:`Packed` and :class:`QLinear` ones.
    project: Fn
    layer_norm: Fn = _no_layer_norm  # fn(xp, x, w, b, *, eps)
    glu: Fn = _no_glu  # fn(xp, gate, up, *, limit, alpha): gpt-oss's clamped SwiGLU
    linear_op: str = "linear"  # the op ``linear`` was chosen for (a model's: MODEL_LINEAR)

    bound = True

    @classmethod
    def choose_for(
        cls, bk: Backend, x: Any, norm: Any, *, eps: float, act: str, bound: bool = True,
        linear_op: str = "linear",
    ) -> BoundKernels:  # fmt: skip
        """The kernels ``auto`` takes for activations like ``x`` ``(1, 1, E)`` and a norm
        weight ``(E,)`` of the model's dtype; ``act``: the activation's op name; ``bound``:
        whether some projection carries its kernel (:class:`Packed`, :class:`QLinear`);
        ``linear_op``: the op of the float products (a model's: :data:`MODEL_LINEAR`)."""
        d, xp = dispatcher(bk), bk.xp
        w = xp.zeros((1, x.shape[-1]), dtype=x.dtype, device=bk.device_of(x))
        linear = d.pick(linear_op, "auto", x, w, None)
        return cls(
            bk,
            linear=linear,
            rms_norm=d.pick("rms_norm", "auto", x, norm, eps=eps),
            act=d.pick(act, "auto", x),
            act_op=act,
            project=projector(linear) if bound else linear,
            layer_norm=d.pick("layer_norm", "auto", x, norm, norm, eps=eps),
            glu=d.pick("clamped_swiglu", "auto", x, x, limit=7.0, alpha=1.702),
            linear_op=linear_op,
        )

    @classmethod
    def for_mlp(cls, linear: Fn, act: Fn, glu: Fn | None = None) -> BoundKernels:
        """The kernels of a gated MLP of float weights (``linear``, ``act``, a clamped SwiGLU's
        ``glu``) that a composite op chose itself (a MoE's experts); no ``rms_norm``, no
        backend to ask for more."""
        return cls(
            None, linear=linear, rms_norm=_no_norm, act=act, act_op="", project=linear,
            glu=_no_glu if glu is None else glu,
        )  # fmt: skip

    def traced(self) -> Kernels:
        """The same choices asked of the dispatcher per call, so a trace records them."""
        assert self.bk is not None
        return Kernels(self.bk, "auto", self.act_op, self.linear_op)

    def choose(self, op: str, *args: Any, **options: Any) -> Fn:
        """``auto``'s implementation of ``op`` for these arguments (not recorded)."""
        assert self.bk is not None
        return dispatcher(self.bk).pick(op, "auto", *args, **options)


def offset_rms_norm(xp: Any, kn: KernelSet, x: Any, w: Any, *, eps: float, offset: float) -> Any:
    """``rms_norm(x, w, eps=eps, offset=offset)`` through the kernel set ``kn``: the scale
    ``offset + w`` formed and applied in float32, one rounding (HF's zero-centred norms,
    ``rms_norm_offset``), where a model keeps ``w`` itself (Qwen3-Next)."""
    return kn.choose("rms_norm_offset", x, w, eps=eps, offset=offset)(
        xp, x, w, eps=eps, offset=offset
    )


def projector(linear: Fn) -> Fn:
    """``project(xp, x, w, b)``: ``x @ w.T + b`` for a float weight (by ``linear``), a
    :class:`Packed` or a :class:`QLinear` one (by the kernel it carries)."""

    def project(xp: Any, x: Any, w: Any, b: Any) -> Any:
        if type(w) in BOUND_PROJECTIONS:
            return w(xp, x, b)
        return linear(xp, x, w, b)

    return project
