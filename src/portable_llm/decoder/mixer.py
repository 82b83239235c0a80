"""A layer's token mixer that is not attention: the :class:`RecurrentMixer` a family implements.

The hybrid families mix tokens with a layer that carries a fixed-size state from token to token
instead of attending over cached keys: LFM2's short convolution, Qwen3-Next's Gated DeltaNet,
Falcon-H1's Mamba-2. A layer (:class:`~portable_llm.decoder.layer_weights.Layer`) holds such a
mixer in ``mixer``, beside its attention (Falcon-H1: both read the same normed input and their
outputs are added) or instead of it (``attn=None``: LFM2's conv layers, Qwen3-Next's linear
attention layers). The one forward runs it (:meth:`~portable_llm.decoder.forward.Forward.layer`)
with :func:`run_mixer`, which hands it the layer's recurrent state and records the new one in
the layer's :class:`~portable_llm.RecurrentCache`.

A family's mixer is a frozen dataclass subclassing :class:`RecurrentMixer`: its fields are its
weights (arrays of the model's backend, or projections) and options (ints, floats, strings),
and :meth:`RecurrentMixer.mix` computes the layer over ``(B, L, E)`` from a state to a state,
through the bodies of the public ops (``short_conv``, ``gated_delta_rule``, ``ssd_scan``) and the
kernel set's projections, so that the prepared and the op-by-op forwards run the same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self

from portable_llm.ops.kernels import KernelSet

__all__ = ["RecurrentMixer", "RecurrentState", "run_mixer", "zero_pads"]


class RecurrentState(Protocol):
    """What :func:`run_mixer` reads and writes of a layer's recurrent cache: a
    :class:`~portable_llm.RecurrentCache`, a paged batch's rows
    (:class:`~portable_llm.caches.recurrent.SlotRows`), a compiled step's traced state."""

    @property
    def max_rewind(self) -> int:
        """Tokens a rewind may take back (their states are kept)."""
        ...

    @property
    def state(self) -> tuple[Any, ...] | None:
        """The state after the tokens so far (``None``: none yet, zeros)."""
        ...

    def update(self, *states: Any, tokens: int = 1, all_states: bool = False) -> None:
        """Record the state after a chunk of ``tokens`` (``all_states``: after each token)."""
        ...


@dataclass(frozen=True)
class RecurrentMixer:
    """The base of a family's recurrent token mixer (see the module docstring).

    A subclass is a frozen dataclass of the mixer's weights and options, lists in
    :attr:`projections` the fields that are projections (``(O, I)`` weights: bound at load for
    the prepared forward, and may be quantized), and implements :meth:`mix`.
    """

    #: The fields that hold projections ``(O, I)`` (``x @ w.T``): bound for the prepared
    #: forward (:func:`~portable_llm.decoder.layer_weights.bind_layer`), may be quantized.
    projections: ClassVar[tuple[str, ...]] = ()
    #: The fields kept in their own float dtype whatever the model's (HF keeps Mamba-2's
    #: ``A_log``, ``D`` and ``dt_bias`` in float32): not asked to be of the model's dtype for
    #: the prepared forward.
    own_dtype: ClassVar[tuple[str, ...]] = ()

    def mix(
        self, xp: Any, kn: KernelSet, x: Any, state: tuple[Any, ...] | None, *,
        pads: Any, all_states: bool,
    ) -> tuple[Any, tuple[Any, ...]]:  # fmt: skip
        """The mixer over ``x`` ``(B, L, E)`` (the layer's normed input) from ``state``.

        Parameters
        ----------
        xp : the array namespace
        kn : KernelSet
            The forward's kernels (``kn.project`` for a projection of any kind, ``kn.choose``
            for an op's kernel, as the public op would pick it).
        x : array ``(B, L, E)``, the model's dtype
        state : tuple of arrays, or ``None``
            The state after the tokens before ``x`` (what :meth:`mix` returned then), or
            ``None`` at the start of a sequence (the ops start from zeros).
        pads : bool array ``(B, L, 1)``, or ``None``
            ``False`` at the pad columns of a left-padded batch, ``True`` elsewhere
            (:func:`zero_pads`):
            the mixer zeroes its inputs there where its reference does (HF's
            ``apply_mask_to_padding_states``), so that the state starts at the first real token.
        all_states : bool
            Return every state array with a token axis after ``B``: the state after each token
            of ``x`` (the ops' ``all_states=True``), which a rewindable cache keeps.

        Returns
        -------
        (out, state) : the output ``(B, L, E)`` in the model's dtype, and the new state (a
            tuple of arrays, each ``(B, ...)``, or ``(B, L, ...)`` with ``all_states``).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement mix()")

    def state_shapes(self) -> tuple[tuple[int, ...], ...] | None:
        """One row's shape of each state array (what :meth:`mix` returns without ``B``): the
        slots of a paged batch (:class:`~portable_llm.RecurrentSlots`) are made of them.
        ``None`` (the default): the mixer does not say, and its model does not run over pages
        (``Model.paged`` is false)."""
        return None

    def arrays(self) -> list[Any]:
        """The mixer's arrays and projections of the model's dtype (its fields that are
        neither ``None``, nor a Python number, string, bool or tuple, nor in
        :attr:`own_dtype`)."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.own_dtype:
                continue
            if value is not None and not isinstance(value, int | float | str | bool | tuple):
                out.append(value)
        return out

    def projection_weights(self) -> tuple[Any, ...]:
        """The projections of :attr:`projections` that are set, in that order."""
        return tuple(w for w in (getattr(self, n) for n in self.projections) if w is not None)

    def bound(self, bind: Callable[[Any], Any]) -> Self:
        """This mixer with each projection bound by ``bind`` (for the prepared forward)."""
        return dataclasses.replace(
            self,
            **{n: bind(getattr(self, n)) for n in self.projections if getattr(self, n) is not None},
        )


def run_mixer(
    mixer: RecurrentMixer, xp: Any, kn: KernelSet, x: Any,
    cache: RecurrentState | None, pads: Any,
) -> Any:  # fmt: skip
    """``mixer`` over ``x`` ``(B, L, E)`` from the state ``cache`` holds; the new state recorded
    in ``cache`` (a :class:`RecurrentState`; none: a forward without caches, from zeros).
    Returns ``(B, L, E)``.

    Rewinds keep states (:class:`~portable_llm.RecurrentCache`): a cache that may be rewound
    (``max_rewind > 0``: speculative decoding) takes the state after each of the last
    ``min(L, max_rewind)`` tokens. A chunk longer than that (a prompt) runs in two calls, its
    tokens before the last ``max_rewind`` without per-token states (the ops' state of a
    prefix is their state; only the tail's per-token states are kept), so a long prompt never
    holds ``L`` states at once.
    """
    if cache is None:
        return mixer.mix(xp, kn, x, None, pads=pads, all_states=False)[0]
    L = int(x.shape[1])
    keep = min(cache.max_rewind, L)
    if keep == 0 or L == 1:  # one token: its state is the one to keep anyway
        out, state = mixer.mix(xp, kn, x, cache.state, pads=pads, all_states=False)
        cache.update(*state, tokens=L)
        return out
    outs = []
    if keep < L:  # the prefix: its last state only
        head = None if pads is None else pads[:, : L - keep, :]
        y, state = mixer.mix(xp, kn, x[:, : L - keep, :], cache.state, pads=head, all_states=False)
        cache.update(*state, tokens=L - keep)
        outs.append(y)
    tail = None if pads is None else pads[:, L - keep :, :]
    y, states = mixer.mix(xp, kn, x[:, L - keep :, :], cache.state, pads=tail, all_states=True)
    cache.update(*states, all_states=True)
    outs.append(y)
    return outs[0] if len(outs) == 1 else xp.concat(outs, axis=1)  # (B, L, E)


def zero_pads(xp: Any, x: Any, pads: Any) -> Any:
    """``x`` ``(B, L, ...)`` with its pad columns zeroed (``pads`` ``(B, L, 1)`` bool, ``False``
    at a pad; ``None``: no padding), HF's ``apply_mask_to_padding_states``."""
    if pads is None:
        return x
    if x.ndim > 3:  # (B, L, H, D): the mask over the heads too
        pads = xp.reshape(pads, (*pads.shape, *(1,) * (x.ndim - 3)))
    return x * xp.astype(pads, x.dtype)
