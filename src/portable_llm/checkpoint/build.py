"""One place builds a :class:`~portable_llm.models.Model`: the options of :func:`portable_llm.load`
and the record every reader returns.

Each reader (a checkpoint folder, a ``.gguf`` file) takes the path and one :class:`LoadOptions`
and returns a :class:`CheckpointContents`: the config, the weights by HF name, the backend, the
tokenizer and the generation config. :func:`build_model` makes the model of any of them, so a
new reader (or a new family) adds a reader, never a second way to build a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from portable_llm.backends import FLOAT_DTYPES, Backend, get_backend
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.model import Model
from portable_llm.ops.quant import ACTIVATIONS, QuantizedWeight, device_kind, int8_by_default
from portable_llm.text.tokenizer import Tokenizer

__all__ = ["CheckpointContents", "LoadOptions", "build_model"]


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a checkpoint is read: the keyword arguments of :func:`portable_llm.load`.

    ``backend``, ``dtype``, ``device``, ``dequantize``, ``activations`` and ``compile`` are
    described there;
    every reader takes this one record. ``revision`` and ``gguf_file`` choose what a Hub name
    resolves to (:mod:`portable_llm.checkpoint.hub`).
    """

    backend: str = "numpy"
    dtype: Any = None
    device: Any = None
    dequantize: bool | str = "auto"
    revision: str | None = None
    gguf_file: str | None = None
    activations: str = "auto"
    compile: bool | str = "auto"

    def __post_init__(self) -> None:
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ValueError(f"load: compile must be True, False or 'auto', got {self.compile!r}")
        if self.activations not in ("auto", *ACTIVATIONS):
            raise ValueError(
                f"load: activations must be 'auto', 'float' or 'int8', got {self.activations!r}"
            )
        if not isinstance(self.backend, str):
            raise TypeError(f"load: backend must be a str, got {type(self.backend).__name__}")
        if not isinstance(self.dequantize, bool) and self.dequantize != "auto":
            kind = type(self.dequantize).__name__
            raise TypeError(f"load: dequantize must be a bool or 'auto', got {kind}")
        for name in ("revision", "gguf_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"load: {name} must be a str or None, got {type(value).__name__}")

    def int8(self, *, partitioned: bool = False) -> bool:
        """Whether the quantized projections take 8-bit activations: ``activations="int8"``,
        or ``"auto"`` where :func:`~portable_llm.ops.quant.policy.int8_by_default` says so
        for this backend and device (and the codes are not dropped: ``dequantize=True``).

        Raises
        ------
        ValueError
            ``activations="int8"`` with ``dequantize=True`` (no codes left to multiply) or
            with a partitioned model (not supported: its ranks bind float activations).
        """
        if self.activations == "int8":
            if self.dequantize is True:
                raise ValueError(
                    "load: activations='int8' multiplies the quantized codes, and "
                    "dequantize=True drops them; pass dequantize='auto' or False"
                )
            if partitioned:
                raise ValueError(
                    "load: activations='int8' is not supported with tensor_parallel or "
                    "pipeline_parallel (their ranks multiply float activations)"
                )
            return True
        if self.activations == "float" or self.dequantize is True or partitioned:
            return False
        bk = get_backend(self.backend)
        if not int8_by_default(bk.name):  # on none of its devices: no array to make
            return False
        dev = None if self.device is None else bk.device(self.device)
        return int8_by_default(bk.name, device_kind(bk, bk.xp.zeros((1,), device=dev)))

    def reading(self, *, partitioned: bool = False) -> LoadOptions:
        """These options as a reader takes them: in the int8 mode (:meth:`int8`),
        ``dequantize="auto"`` keeps every code (the rule of
        :func:`~portable_llm.ops.quant.keeps_codes` is the float mode's)."""
        if self.int8(partitioned=partitioned) and self.dequantize == "auto":
            return replace(self, dequantize=False)
        return self

    def placement(self, default_dtype: str | None) -> tuple[Backend, Any, Any]:
        """``(backend, dtype, device)`` resolved: ``dtype`` or else ``default_dtype`` (the
        checkpoint's own; ``float32`` when ``None``), on ``device``.

        Raises ``ValueError`` for a device the backend lacks, a dtype it lacks there, or a dtype
        that is not a float dtype.
        """
        bk = get_backend(self.backend)
        try:
            dev = None if self.device is None else bk.device(self.device)
        except ValueError as exc:
            raise ValueError(f"load: {exc}") from None
        name = self.dtype if self.dtype is not None else default_dtype
        try:
            target = bk.dtype(name or "float32", dev)
        except ValueError as exc:
            hint = "" if self.dtype is not None else "; pass dtype= to load the checkpoint in a "
            hint += 'dtype the backend has (e.g. dtype="float32")' if hint else ""
            raise ValueError(f"load: {exc}{hint}") from None
        if bk.dtype_name(target) not in FLOAT_DTYPES:
            raise ValueError(f"load: dtype must be a float dtype ({', '.join(FLOAT_DTYPES)})")
        return bk, target, dev


class CheckpointContents(NamedTuple):
    """What a reader gives: the arguments of :class:`~portable_llm.models.Model`."""

    config: DecoderConfig
    weights: dict[str, Any]  # HF names -> arrays, or QuantizedWeight where kept quantized
    backend: Backend
    tokenizer: Tokenizer | None
    generation_config: dict[str, Any]


def build_model(contents: CheckpointContents, /, options: LoadOptions | None = None) -> Model:
    """The :class:`~portable_llm.models.Model` of what a reader read, its quantized projections
    in the activations ``options`` ask for (:meth:`LoadOptions.int8`; ``"auto"`` keeps float
    activations where no projection is quantized)."""
    int8 = options is not None and options.int8()
    if int8 and options is not None and options.activations == "auto":
        int8 = _quantized_projection(contents.weights)
    return Model(
        contents.config,
        contents.weights,
        contents.backend,
        tokenizer=contents.tokenizer,
        generation_config=contents.generation_config,
        activations="int8" if int8 else "float",
        compile="auto" if options is None else options.compile,
    )


def _quantized_projection(weights: dict[str, Any]) -> bool:
    """Whether a weight other than an untied embedding table is quantized."""
    tied = "lm_head.weight" not in weights
    return any(
        isinstance(w, QuantizedWeight) and (tied or name != "model.embed_tokens.weight")
        for name, w in weights.items()
    )
