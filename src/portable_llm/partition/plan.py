"""Which weights a rank holds: the plan of a tensor- and pipeline-parallel split.

A :class:`PartitionPlan` is made from a :class:`~portable_llm.decoder.config.DecoderConfig` and
the sizes (and this process's ranks) of the two groups, before any weight is read. It says:

- **tensor parallel** (Megatron): ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
  are split by rows (their output columns: whole heads, whole intermediate slices),
  ``o_proj``/``down_proj`` by columns (their input), so each rank's attention and MLP give a
  partial sum that one all-reduce completes; an ``o_proj`` bias stays whole and is added once
  after the sum, a ``down_proj`` bias is held by TP rank 0 (zeros on the others). With fewer KV
  heads than ranks, the KV heads are *replicated*: rank ``r`` holds KV head ``r // (T / H_kv)``,
  the one its query heads read (vLLM's and mlx-lm's rule), so ``T`` must be a multiple of
  ``H_kv``. MoE layers split every expert's intermediate size (the router stays whole, so every
  rank routes alike and one all-reduce completes the sum); the embedding, the final norm and the
  LM head are replicated (no collective in the embedding nor a gather of the logits: every rank
  has the logits its sampler needs).
- **pipeline parallel** (Mistral): contiguous layer ranges, the first ``n % P`` stages one
  layer longer; stage 0 embeds, the last stage norms and projects (a tied embedding is read
  at both ends).

:meth:`PartitionPlan.index` gives the slice of one tensor (HF name) a rank reads, in the
tensor's own coordinates, so a reader can read that slice alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from portable_llm.decoder.config import DecoderConfig
from portable_llm.ops.quant import k_unit

__all__ = ["PartitionPlan", "plan_partition", "quantized_index", "stage_layers"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: Tensors split by rows (dimension -2 of a (…, out, in) weight, or the only one of a bias).
_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
#: Tensors split by columns (their input, dimension -1).
_COLS = ("o_proj.weight", "down_proj.weight")


#: The weights whose input dimension (of the size named) a tensor-parallel split cuts.
_ROW_SPLIT_INPUTS = {
    "num_attention_heads * head_dim": "o_proj",
    "intermediate_size": "down_proj",
    "moe_intermediate_size": "each expert's down_proj",
    "shared_expert_intermediate_size": "shared_expert.down_proj",
}


def quantized_index(
    name: str, shape: tuple[int, ...], index: tuple[slice, ...], bits: int, group_size: int
) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """The slices of a quantized weight's packed codes ``(.., N, K * bits / 32)`` and of its
    scales and biases ``(.., N, K / group_size)`` that hold the slice ``index`` of the weight
    ``name`` of (dequantized) shape ``shape`` ``(.., N, K)``: rows and leading axes as they
    are, the input dimension along whole groups.

    Raises
    ------
    ValueError
        A slice of the input dimension that would cut a group (naming the weight, its shape,
        the columns and the group size).
    """
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    *lead, cols = index
    c0, c1, step = cols.indices(shape[-1])
    unit = k_unit(bits, group_size)  # whole groups, and whole words of codes
    if step != 1 or c0 % unit or c1 % unit:
        raise ValueError(
            f"partition: {name} of shape {shape}, quantized in groups of {group_size} "
            f"({bits} bits), split at columns {c0}:{c1}: the split would cut a group (each "
            f"rank's columns must be a whole number of {unit} columns)"
        )
    codes = slice(c0 * bits // 32, c1 * bits // 32)  # whole words
    return (*lead, codes), (*lead, slice(c0 // group_size, c1 // group_size))


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The contiguous layers of pipeline stage ``stage`` of ``stages`` (the first
    ``num_layers % stages`` stages hold one layer more)."""
    per, extra = divmod(num_layers, stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


@dataclass(frozen=True)
class PartitionPlan:
    """The split of one model over a ``tp_size`` x ``pp_size`` group, seen from one rank.

    ``tp_rank``/``pp_rank``: this rank's place; ``layers``: the global layers it runs;
    ``config``: its :class:`DecoderConfig` (local heads, intermediate sizes and layers).
    Make one with :func:`plan_partition`.
    """

    full: DecoderConfig
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    layers: range
    config: DecoderConfig

    @property
    def first(self) -> bool:
        """Whether this rank embeds the ids (pipeline stage 0)."""
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        """Whether this rank norms and projects (the last pipeline stage)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def kv_replicated(self) -> bool:
        """Whether each rank holds one KV head shared with other ranks (``T > H_kv``)."""
        return self.tp_size > self.full.num_key_value_heads

    def held(self, name: str) -> bool:
        """Whether this rank holds tensor ``name`` (HF name) at all."""
        m = _LAYER.match(name)
        if m:
            return int(m[1]) in self.layers
        if name == "model.embed_tokens.weight":
            return self.first or (self.last and self.full.tie_word_embeddings)
        if name.startswith("model.embed_"):  # GPT-2's learned positions: where ids are embedded
            return self.first
        return self.last  # model.norm.weight, lm_head.weight

    def local_name(self, name: str) -> str:
        """``name`` with its layer index counted from this rank's first layer."""
        m = _LAYER.match(name)
        return f"model.layers.{int(m[1]) - self.layers.start}.{m[2]}" if m else name

    def split_axis(self, name: str, ndim: int) -> int | None:
        """The axis tensor ``name`` (of ``ndim`` dimensions) is split along across the TP
        ranks, or ``None`` when each rank holds it whole (norms, router, embedding, head, the
        biases added after a reduction; K/V when they are replicated)."""
        if self.tp_size == 1:
            return None
        stem = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        if name.endswith(_COLS) or (stem.endswith(".experts.down_proj")):
            return ndim - 1
        if stem.endswith(_ROWS):
            if self.kv_replicated and stem.endswith(("k_proj", "v_proj")):
                return None
            return ndim - 2 if name.endswith(".weight") or ndim == 3 else 0
        return None

    def zeroed(self, name: str) -> bool:
        """Whether this rank holds tensor ``name`` as zeros: a ``down_proj`` bias, added
        before the all-reduce, is held by TP rank 0 only, so the sum counts it once."""
        return self.tp_rank > 0 and name.endswith("down_proj.bias")

    def index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        """The slice of tensor ``name`` (of full ``shape``) this rank holds (one ``slice`` per
        dimension); replicated K/V give the rows of the rank's KV head."""
        out = [slice(None)] * len(shape)
        t, r = self.tp_size, self.tp_rank
        stem = name.rsplit(".", 1)[0]
        if self.kv_replicated and stem.endswith(("k_proj", "v_proj")):
            D = self.full.head_dim
            head = r // (t // self.full.num_key_value_heads)
            out[-2 if name.endswith(".weight") else 0] = slice(head * D, (head + 1) * D)
            return tuple(out)
        axis = self.split_axis(name, len(shape))
        if axis is not None:
            n = shape[axis] // t
            out[axis] = slice(r * n, (r + 1) * n)
        return tuple(out)


def _refuse_unsplit(c: DecoderConfig, T: int) -> None:
    """Refuse, by name, what a split does not cover yet: latent attention (any split), and
    over ``T > 1`` tensor ranks the grouped router's shared experts, recurrent layers,
    gpt-oss's biased experts and sinks, and q/k norms over all heads."""
    if c.kv_lora_rank:
        raise ValueError(
            f"partition: {c.model_type}'s latent attention (kv_lora_rank={c.kv_lora_rank}) is "
            "not partitioned yet (its heads, latent cache and grouped experts are not split "
            "across ranks, nor its layers over stages); load it unpartitioned"
        )
    if c.router == "grouped" and T > 1:
        raise ValueError(
            f"partition: {c.model_type}'s grouped router and shared experts are not split across "
            f"tensor_parallel={T} ranks yet; use tensor_parallel=1 (pipeline stages are planned)"
        )
    if c.mixer and T > 1:
        raise ValueError(
            f"partition: {c.model_type}'s recurrent layers (short convolutions, linear "
            f"attention, state-space scans) are not split across ranks: use "
            f"tensor_parallel=1, not {T} (pipeline stages are fine)"
        )
    if c.model_type == "gpt_oss" and T > 1:
        raise ValueError(
            f"partition: gpt_oss's experts' down_proj bias and attention sinks are not split "
            f"across ranks yet (the bias would be summed once per rank): use tensor_parallel=1, "
            f"not {T}"
        )
    if c.qk_norm_whole and T > 1:
        raise ValueError(
            f"partition: {c.model_type}'s q_norm and k_norm each span all heads' features "
            f"(one RMSNorm over the whole projection), which tensor_parallel={T} would split "
            "across ranks; use tensor_parallel=1 (pipeline stages are fine)"
        )


def plan_partition(
    config: DecoderConfig,
    /,
    *,
    tp: tuple[int, int] = (1, 0),
    pp: tuple[int, int] = (1, 0),
    group_size: int | None = None,
) -> PartitionPlan:
    """The plan of rank ``(tp[1], pp[1])`` in a ``tp[0]`` x ``pp[0]`` split of ``config``.

    ``group_size``: that of quantized weights, whose input dimension is split along whole
    groups only.

    Raises
    ------
    ValueError
        Heads, KV heads or intermediate sizes not divisible by the TP size (naming them), more
        pipeline stages than layers, a rank outside its group.
    """
    (T, tr), (P, pr) = tp, pp
    for what, size, rank in (("tensor_parallel", T, tr), ("pipeline_parallel", P, pr)):
        if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
            raise ValueError(f"partition: {what} rank {rank!r} of a group of {size!r}")
    c = config
    H, H_kv = c.num_attention_heads, c.num_key_value_heads
    _refuse_unsplit(c, T)
    if H % T:
        raise ValueError(
            f"partition: num_attention_heads={H} is not divisible by tensor_parallel={T}"
        )
    if H_kv % T and T % H_kv:
        raise ValueError(
            f"partition: num_key_value_heads={H_kv} and tensor_parallel={T}: one must divide "
            "the other (KV heads are split, or replicated when there are fewer than ranks)"
        )
    sizes = {}
    if not all(c.moe_layers):  # dense layers
        sizes["intermediate_size"] = c.intermediate_size
    if any(c.moe_layers):
        sizes["moe_intermediate_size"] = c.moe_intermediate_size
        if c.model_type == "qwen2_moe":
            sizes["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
    split = {"num_attention_heads * head_dim": H * c.head_dim, **sizes}
    for key, n in split.items():
        if n % T:
            raise ValueError(f"partition: {key}={n} is not divisible by tensor_parallel={T}")
        if group_size and T > 1 and (n // T) % group_size:
            E, weight = c.hidden_size, _ROW_SPLIT_INPUTS[key]
            raise ValueError(
                f"partition: {weight} of shape (E, {key}) = ({E}, {n}) split along its input "
                f"over tensor_parallel={T} gives {n // T} columns per rank, not a whole number "
                f"of quantization groups of {group_size}: the split would cut a group"
            )
    if c.num_hidden_layers < P:
        raise ValueError(
            f"partition: pipeline_parallel={P} exceeds num_hidden_layers={c.num_hidden_layers}"
        )
    layers = stage_layers(c.num_hidden_layers, P, pr)
    local = replace(
        c,
        num_attention_heads=H // T,
        num_key_value_heads=max(H_kv // T, 1),
        intermediate_size=c.intermediate_size // T,
        moe_intermediate_size=c.moe_intermediate_size // T,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size // T,
        num_hidden_layers=len(layers),
        layer_types=c.layer_types[layers.start : layers.stop],
        moe_layers=c.moe_layers[layers.start : layers.stop],
        no_rope_layers=c.no_rope_layers[layers.start : layers.stop],  # Llama 4
    )
    return PartitionPlan(c, T, tr, P, pr, layers, local)
