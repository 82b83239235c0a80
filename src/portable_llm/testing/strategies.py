"""Hypothesis strategies shared by every test: shapes ``N.. x D``, float dtypes, seeds, token
ids, JSON schemas, the dimensions of the recurrent ops and the Mamba-2 mixer, latent
attention's sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from portable_llm.backends import get_backend

__all__ = [
    "LAST_SIDES",
    "LATENT_SIZES",
    "SIDES",
    "chunk_sizes",
    "conv_dims",
    "delta_rule_dims",
    "float_dtypes",
    "json_schemas",
    "latent_sizes",
    "mamba2_dims",
    "mxfp4_shapes",
    "seeds",
    "shapes",
    "sizes",
    "ssd_dims",
    "token_ids",
]


#: Sizes the strategies draw from. A small fixed set, so that compiling backends (JAX compiles
#: per shape) see repeated shapes, while still covering 1, odd and non-power-of-two sizes.
SIDES: tuple[int, ...] = (1, 2, 3, 5, 6)
LAST_SIDES: tuple[int, ...] = (1, 2, 3, 4, 7, 8, 16, 31, 33, 64, 96, 128)


def shapes(
    *, min_dims: int = 1, max_dims: int = 4, max_side: int = 6, last: Any = None, max_last: int = 64
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes ``N.. x D``: leading sides from :data:`SIDES` up to ``max_side``, the last side
    ``last`` (an int or a strategy) or from :data:`LAST_SIDES` up to ``max_last``."""
    if last is None:
        last = st.sampled_from([d for d in LAST_SIDES if d <= max_last] or [max_last])
    elif isinstance(last, int):
        last = st.just(last)
    side = st.sampled_from([s for s in SIDES if s <= max_side] or [max_side])
    lead = st.lists(side, min_size=min_dims - 1, max_size=max_dims - 1)
    return st.tuples(lead, last).map(lambda t: (*t[0], t[1]))


def sizes(max_size: int = 64) -> st.SearchStrategy[int]:
    """One dimension size from :data:`LAST_SIDES` up to ``max_size``."""
    return st.sampled_from([d for d in LAST_SIDES if d <= max_size] or [max_size])


def float_dtypes(backend: str, device: Any = None) -> st.SearchStrategy[str]:
    """The float dtype names ``backend`` supports on ``device``."""
    return st.sampled_from(get_backend(backend).float_dtypes(device))


def seeds() -> st.SearchStrategy[int]:
    """Seeds for :func:`portable_llm.testing.random_array`."""
    return st.integers(0, 2**32 - 1)


def token_ids(
    vocab_size: int, /, *, favoured: Sequence[int] = (), max_size: int = 24
) -> st.SearchStrategy[list[int]]:
    """Id sequences as a sampler may draw them: any id below ``vocab_size + 2`` (the last two
    unknown to the tokenizer), and as often one of ``favoured`` (byte-fallback ids, special
    tokens: rare in a large vocabulary, where decoders have their edge cases)."""
    ids: st.SearchStrategy[int] = st.integers(0, vocab_size + 1)
    if favoured:
        ids = st.one_of(ids, st.sampled_from(list(favoured)))
    return st.lists(ids, max_size=max_size)


#: Multi-head latent attention's sizes (HF ``DeepseekV3Config`` names; ``q_lora_rank=None``: a
#: plain ``q_proj``), a few fixed sets so that compiling backends see repeated shapes: a query
#: LoRA with ``v_head_dim != qk_nope_head_dim`` and an ``o_proj`` of another width, then a plain
#: query projection with one head.
LATENT_SIZES: tuple[dict[str, Any], ...] = (
    {"hidden_size": 32, "num_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 16,
     "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "out_size": 24},
    {"hidden_size": 16, "num_heads": 1, "q_lora_rank": None, "kv_lora_rank": 8,
     "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "out_size": 16},
)  # fmt: skip


def latent_sizes() -> st.SearchStrategy[dict[str, Any]]:
    """One of :data:`LATENT_SIZES` with a batch ``B`` and a length ``L`` (from 1 and 2, 1, 5
    and 7)."""
    return st.tuples(
        st.sampled_from(LATENT_SIZES), st.sampled_from([1, 2]), st.sampled_from([1, 5, 7])
    ).map(lambda t: {**t[0], "B": t[1], "L": t[2]})


def mxfp4_shapes(*, max_dims: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """MXFP4 weight shapes ``(.., N, K)``: ``K`` whole blocks of 32 (32, 64, 96 or 128), ``N``
    and the leading sides from :data:`SIDES`, 2 to ``max_dims`` dimensions."""
    return shapes(min_dims=2, max_dims=max_dims, last=st.sampled_from([32, 64, 96, 128]))


def json_schemas(*, max_depth: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    """JSON object schemas whose every instance is short (structured outputs' tests): bounded
    strings (``maxLength``, a ``pattern`` or an ``enum``), integer ranges, booleans, ``null``,
    arrays of at most 3 items and objects nested up to ``max_depth``, each property required
    or not, no other properties."""
    leaves = st.one_of(
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "string", "pattern": "^[a-z]{1,4}$"}),
        st.lists(st.sampled_from(["a", "bb", "c d", "é"]), min_size=1, max_size=3, unique=True)
        .map(lambda v: {"enum": v}),
        st.tuples(st.integers(-50, 50), st.integers(0, 100))
        .map(lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
    )  # fmt: skip

    def grow(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        arrays = children.map(lambda c: {"type": "array", "items": c, "maxItems": 3})
        return st.one_of(arrays, _objects(children))

    schemas = st.recursive(leaves, grow, max_leaves=6).filter(lambda s: _depth(s) <= max_depth)
    return schemas.map(lambda s: s if s.get("type") == "object" else _object({"v": s}, ["v"]))


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(st.sampled_from(["a", "b", "name", "x_1"]), children, max_size=3)
    return props.flatmap(
        lambda p: st.lists(st.sampled_from(sorted(p) or [""]), unique=True).map(
            lambda required: _object(p, [r for r in required if r in p])
        )
    )


def _object(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": sorted(required),
            "additionalProperties": False}  # fmt: skip


def _depth(schema: dict[str, Any]) -> int:
    inner = [
        *schema.get("properties", {}).values(),
        *[schema[k] for k in ("items",) if k in schema],
    ]
    return 1 + max((_depth(s) for s in inner), default=0)


# -- the recurrent ops (short_conv, gated_delta_rule, ssd_scan) ---------------------------------
# Few, small sides: the references loop in Python, and JAX compiles per shape (and unrolls each
# token of the recurrent form and each row of the chunked form's UT transform).
_TOKENS = st.sampled_from([1, 2, 5, 6])
_BATCH = st.sampled_from([1, 2])


def conv_dims() -> st.SearchStrategy[tuple[int, int, int, int]]:
    """``(B, L, C, K)`` of :func:`~portable_llm.short_conv`: ``K`` taps from 1 (no state) to 4
    (Mamba's ``d_conv``; LFM2's ``conv_L_cache`` is 3)."""
    return st.tuples(_BATCH, _TOKENS, st.sampled_from([1, 3, 8]), st.sampled_from([1, 2, 3, 4]))


def delta_rule_dims() -> st.SearchStrategy[tuple[int, int, int, int, int, int]]:
    """``(B, L, H_k, H, D_k, D_v)`` of :func:`~portable_llm.gated_delta_rule`: ``H`` a multiple
    of ``H_k`` (Qwen3-Next has twice as many value heads as key heads)."""
    heads = st.sampled_from([(1, 1), (1, 2), (2, 4)])
    dims = st.sampled_from([(4, 4), (8, 3)])
    return st.tuples(_BATCH, _TOKENS, heads, dims).map(lambda t: (t[0], t[1], *t[2], *t[3]))


def ssd_dims() -> st.SearchStrategy[tuple[int, int, int, int, int, int]]:
    """``(B, L, n_groups, H, P, N)`` of :func:`~portable_llm.ssd_scan`: ``H`` a multiple of
    ``n_groups``."""
    heads = st.sampled_from([(1, 1), (1, 2), (2, 4)])
    dims = st.sampled_from([(2, 4), (4, 8)])
    return st.tuples(_BATCH, _TOKENS, heads, dims).map(lambda t: (t[0], t[1], *t[2], *t[3]))


def mamba2_dims() -> st.SearchStrategy[tuple[int, ...]]:
    """``(B, L, n_groups, H, P, N, K, E)`` of :func:`~portable_llm.mamba2_mixer`: the scan's
    sizes (:func:`ssd_dims`), ``K`` convolution taps (Mamba-2's ``d_conv`` is 4) and the
    hidden size ``E``."""
    more = st.tuples(st.sampled_from([2, 4]), st.sampled_from([6, 16]))
    return st.tuples(ssd_dims(), more).map(lambda t: (*t[0], *t[1]))


def chunk_sizes() -> st.SearchStrategy[int]:
    """Chunk sizes of the chunked forms: one token, sizes that split 5 and 6 unevenly, and one
    larger than every sequence drawn."""
    return st.sampled_from([1, 2, 4, 64])
