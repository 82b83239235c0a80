"""Issue 33, the model side: inputs and files that ran silently wrong or failed with a raw error
now give a clear error at the front, one regression test per case.

- GPT-2's learned positions end at ``n_positions``: a longer sequence (no cache, a cache, a
  decode step, a paged forward) is a ValueError naming both, on every path (was: NaN logits on
  the prepared path).
- Config values the forward cannot run with are refused at load (one place:
  ``DecoderConfig.from_dict``), with what transformers refuses as the floor (the oracle test
  checks that transformers 5 cannot run any of them): heads that do not split, an odd rotated
  width, a ``longrope`` factor list of the wrong length, more experts per token than experts,
  a sliding layer with ``sliding_window: 0`` or none, a chunked one without a chunk size.
- A GGUF of odd head dimension (llama.cpp's q/k permutation needs pairs) is refused at load.
- A GGUF tensor float16 cannot hold is refused as float16, kept quantized or dequantized alike.
- ``quantize``'s error bound as documented (one step; half a step strictly inside).
- Mesh arguments: Llama 4 over a JAX mesh; falsy and doubled handles name the argument.
- ``--threads`` past 4 per CPU is a one-line usage error (torch segfaulted at 100000).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from conftest import skip_reason
from portable_llm.backends import get_backend
from portable_llm.caches.paged import PagedKVCache
from portable_llm.checkpoint import CheckpointError
from portable_llm.checkpoint.weights import expected_shapes
from portable_llm.decoder.config import DecoderConfig
from portable_llm.ops.quant import BITS, GROUP_SIZES, dequantize, k_unit, quantize
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from portable_llm.testing.strategies import seeds

# -- the configs: one dict per family, in the names transformers 5 writes and reads ------------

_IDS = {"vocab_size": 100, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
_DENSE = {**_IDS, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
BASE: dict[str, dict[str, Any]] = {
    "gpt2": {**_IDS, "model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 2,
             "n_positions": 64},
    "llama": {**_DENSE, "model_type": "llama"},
    "mistral": {**_DENSE, "model_type": "mistral", "sliding_window": 8},
    "qwen2": {**_DENSE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
              "max_window_layers": 0},
    "phi": {**_DENSE, "model_type": "phi", "num_key_value_heads": 4,
            "partial_rotary_factor": 0.5},
    "phi3": {**_DENSE, "model_type": "phi3", "sliding_window": 8},
    "gemma2": {**_DENSE, "model_type": "gemma2", "head_dim": 8, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_text": {**_DENSE, "model_type": "gemma3_text", "head_dim": 8, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "mixtral": {**_DENSE, "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "llama4_text": {**_DENSE, "model_type": "llama4_text", "head_dim": 8,
                    "intermediate_size_mlp": 64, "num_local_experts": 4,
                    "num_experts_per_tok": 1, "moe_layers": [0, 1], "no_rope_layers": [1, 0],
                    "layer_types": ["chunked_attention", "full_attention"],
                    "attention_chunk_size": 4},
}  # fmt: skip

_LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 3,
             "long_factor": [1.0] * 3, "original_max_position_embeddings": 16}  # fmt: skip
_SLIDING = "but layer_types has sliding_attention layers, which need a window >= 1"
#: (family, change, message): each refused by from_dict, and run by transformers by no means.
REFUSED = [
    pytest.param("gpt2", {"n_head": 3}, "hidden_size=32 is not a multiple of "
                 "num_attention_heads=3", id="gpt2-n_head-3"),
    pytest.param("llama", {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 8},
                 "hidden_size=32 is not a multiple of num_attention_heads=3", id="llama-heads"),
    pytest.param("llama", {"head_dim": 7}, "the rotated width is head_dim=7",
                 id="llama-head_dim-7"),
    pytest.param("phi", {"partial_rotary_factor": 0.375}, "int(head_dim=8 * 0.375)=3",
                 id="phi-odd-rotated-width"),
    pytest.param("phi3", {"rope_parameters": _LONGROPE, "max_position_embeddings": 64},
                 "short_factor has 3 entries but the rotated width dims=8 has 4 pairs",
                 id="phi3-longrope-length"),
    pytest.param("mixtral", {"num_experts_per_tok": 5},
                 "num_experts_per_tok=5 must be in [1, num_experts=4]", id="mixtral-top-5"),
    pytest.param("llama4_text", {"num_experts_per_tok": 5},
                 "num_experts_per_tok=5 must be in [1, num_experts=4]", id="llama4-top-5"),
    *[pytest.param(f, {"sliding_window": 0}, f"sliding_window=0 {_SLIDING}", id=f"{f}-window-0")
      for f in ("mistral", "qwen2", "phi3", "gemma2", "gemma3_text")],
    pytest.param("gemma2", {"sliding_window": None}, f"sliding_window=None {_SLIDING}",
                 id="gemma2-window-null"),
    pytest.param("llama4_text", {"attention_chunk_size": None},
                 "attention_chunk_size is null but layer_types has chunked_attention",
                 id="llama4-chunk-null"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "change", "message"), REFUSED)
def test_config_the_forward_cannot_run_is_refused(family: str, change: dict, message: str) -> None:
    DecoderConfig.from_dict(BASE[family])  # the base runs
    with pytest.raises(ValueError, match=r"^config\.json: ") as info:
        DecoderConfig.from_dict({**BASE[family], **change})
    assert message in str(info.value)


@pytest.mark.oracle
@pytest.mark.parametrize(("family", "change", "message"), REFUSED)
def test_transformers_cannot_run_what_is_refused(family: str, change: dict, message: str) -> None:
    """The floor: transformers 5 refuses each config, or cannot build or run its model (a
    shape error, 'selected index k out of range', a None window); the base config runs."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    classes = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"),
               "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM")}  # fmt: skip
    name = {"qwen2": "Qwen2", "gemma2": "Gemma2", "mixtral": "Mixtral"}.get(
        family, family.capitalize()
    )
    config_cls, model_cls = classes.get(family, (f"{name}Config", f"{name}ForCausalLM"))

    def run(d: dict[str, Any]) -> None:
        config = getattr(transformers, config_cls)(
            **{k: v for k, v in d.items() if k != "model_type"}
        )
        config._attn_implementation = "eager"
        model = getattr(transformers, model_cls)(config).eval()
        with torch.no_grad():
            logits = model(torch.tensor([[1, 2, 3, 4, 5, 6]])).logits
        assert bool(torch.isfinite(logits).all())

    run(BASE[family])
    # any refusal or failure of transformers: a config error, a shape error, a None window
    with pytest.raises(Exception):  # noqa: B017
        run({**BASE[family], **change})


def test_config_values_read_as_transformers_does() -> None:
    """What stays valid reads as transformers reads it: a null window is none, 0 is not read
    as none (it is refused above), GPT-2 ignores a stray head_dim and defaults n_positions to
    1024, Llama 4's chunk defaults to 8192, Gemma 2's v4 window to 4096."""
    for family in ("mistral", "phi3"):
        cfg = DecoderConfig.from_dict({**BASE[family], "sliding_window": None})
        assert cfg.layer_types == ("full_attention",) * 2 and cfg.window(0) is None, family
    gpt2 = {k: v for k, v in BASE["gpt2"].items() if k != "n_positions"}
    cfg = DecoderConfig.from_dict({**gpt2, "head_dim": 16})
    assert (cfg.head_dim, cfg.max_position_embeddings) == (8, 1024)
    llama4 = {k: v for k, v in BASE["llama4_text"].items() if k != "attention_chunk_size"}
    assert DecoderConfig.from_dict(llama4).attention_chunk_size == 8192
    v4 = {k: v for k, v in BASE["gemma2"].items() if k not in ("layer_types", "sliding_window")}
    assert DecoderConfig.from_dict(v4).sliding_window == 4096
    with pytest.raises(ValueError, match=f"sliding_window=0 {_SLIDING}"):
        DecoderConfig.from_dict({**v4, "sliding_window": 0})  # was read as 4096


def test_refused_config_names_the_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, tiny_config("mistral", sliding_window=0))
    with pytest.raises(CheckpointError) as info:
        pl.load(tmp_path)
    assert str(info.value).startswith(f"load: '{tmp_path / 'config.json'}': sliding_window=0 ")


# -- GPT-2's learned positions ------------------------------------------------------------------

P = 8  # n_positions of the test model


def _gpt2(backend: str, prepared: bool) -> pl.Model:
    cfg = DecoderConfig.from_dict({**BASE["gpt2"], "n_positions": P})
    rng = np.random.default_rng(0)
    bk = get_backend(backend)
    weights = {
        name: bk.from_numpy(
            (rng.uniform(0.8, 1.2, shape) if name.endswith("norm.weight")
             else rng.uniform(-1, 1, shape) / math.sqrt(shape[-1])).astype(np.float32)
        )
        for name, shape in expected_shapes(cfg).items()
    }  # fmt: skip
    model = pl.Model(cfg, weights, bk, prepared=prepared)
    assert (model.prepared is not None) == prepared
    return model


def _too_long(total: int, cached: int, new: int) -> str:
    return (
        f"a sequence of {total} tokens ({cached} cached + {new} new) is longer than n_positions={P}"
    )


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "op-by-op"])
def test_gpt2_past_n_positions_is_refused(backend: str, prepared: bool) -> None:
    model = _gpt2(backend, prepared)
    ids = [[5, 17, 42, 99, 3, 50, 7, 11, 8]]  # P + 1 tokens
    full = model([ids[0][:P]])  # (1, P, V): fits exactly
    assert bool(np.isfinite(pl.to_numpy(full)).all())
    with pytest.raises(ValueError, match=re.escape(_too_long(P + 1, 0, P + 1))):
        model(ids)
    cache = model.make_cache()
    model([ids[0][:6]], cache=cache)
    with pytest.raises(ValueError, match=re.escape(_too_long(9, 6, 3))):
        model([ids[0][6:9]], cache=cache)
    assert [c.offset for c in cache] == [6, 6]  # refused before any cache took a token
    rest = model([ids[0][6:P]], cache=cache)  # the last two positions, as the full forward
    assert_close(rest, full[:, 6:, :], backend=backend)
    step = pl.asarray([[ids[0][P]]], backend=backend, device=model.device)
    with pytest.raises(ValueError, match=re.escape(_too_long(P + 1, P, 1))):
        model.decode_step(step, cache=cache)


def test_gpt2_paged_past_n_positions_is_refused(backend: str) -> None:
    model = _gpt2(backend, prepared=True)
    pools = model.make_page_pools(4, 4)
    caches = [[PagedKVCache(p) for p in pools] for _ in range(2)]
    model.forward_paged([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]], caches=caches)
    with pytest.raises(ValueError, match=re.escape(_too_long(9, 6, 3))):
        model.forward_paged([[7, 8, 9], [7, 8, 9]], caches=caches)
    assert [c.offset for row in caches for c in row] == [6] * 4


# -- GGUF: an odd head dimension, a tensor float16 cannot hold --------------------------------


def _gguf_helpers() -> Any:
    pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
    import test_gguf

    return test_gguf


def test_gguf_of_odd_head_dim_is_refused_at_load(tmp_path: Path, monkeypatch: Any) -> None:
    """A llama GGUF of head dimension 7: refused at load by the config's RoPE rule (was: the
    q/k rows un-permuted in pairs made a (24, 32) q_proj of a (28, 32) tensor, failing later in
    a reshape). llama.cpp's permutation, as RoPE, needs an even head dimension."""
    tg = _gguf_helpers()
    cfg = tg.family_config("llama", head_dim=7)
    shapes = expected_shapes(
        dataclasses.replace(DecoderConfig.from_dict(tg.family_config("llama")), head_dim=7)
    )
    rng = np.random.default_rng(0)
    tensors = {n: rng.uniform(-1, 1, s).astype(np.float32) for n, s in shapes.items()}
    for name in ("_permute", "_reverse_permute"):  # llama.cpp's needs pairs too
        monkeypatch.setattr(tg, name, lambda w, heads: w)
    floats = {tg._to_gguf(name)[0]: "F32" for name in tensors}  # rows of 28: no Q8_0 blocks
    tg.write_gguf(tmp_path / "odd.gguf", "llama", cfg, tensors, types=floats)
    with pytest.raises(CheckpointError) as info:
        pl.load(tmp_path / "odd.gguf", backend="numpy")
    message = str(info.value)
    assert "GGUF metadata: " in message and "the rotated width is head_dim=7" in message


def _k_quant_file(folder: Path, monkeypatch: Any, d: float) -> tuple[Path, str]:
    """A llama GGUF whose ``ffn_down`` matrices are Q4_K blocks with ``d = dmin = d``."""
    tg = _gguf_helpers()
    random_blocks = tg.random_blocks

    def blocks(kind: str, n: int, rng: Any, scale: float = 1.0) -> np.ndarray:
        b = random_blocks(kind, n, rng, scale)
        if kind == "Q4_K":
            b[:, 0:4] = np.array([d, d], np.float16).view(np.uint8)
        return b

    monkeypatch.setattr(tg, "random_blocks", blocks)
    cfg = tg.family_config("llama")
    types = {f"blk.{i}.ffn_down.weight": "Q4_K" for i in range(cfg["num_hidden_layers"])}
    file = folder / "k.gguf"
    tg.write_gguf(file, "llama", cfg, tg.random_weights(cfg), types=types)
    return file, "blk.0.ffn_down.weight (Q4_K) has scales up to "


@pytest.mark.parametrize("dequantize", [False, True, "auto"])
def test_k_quant_past_float16_is_refused_kept_or_not(
    backend: str, dequantize: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """``d = dmin = 65504`` (float16's largest): ``d * sc`` is a finite float32 scale that
    float16 cannot hold. Kept, its groups were inf/NaN; dequantized, other weights were inf:
    non-finite values in different places. Now one rule refuses both, naming the tensor; in
    bfloat16 (float32's range) the file loads, kept and dequantized alike finite."""
    bk = get_backend(backend)
    file, words = _k_quant_file(tmp_path, monkeypatch, 65504.0)
    if "float16" in bk.float_dtypes():
        with pytest.raises(CheckpointError) as info:
            pl.load(file, backend=backend, dtype="float16", dequantize=dequantize)
        assert words in str(info.value) and "dtype='bfloat16' or dtype='float32'" in str(info.value)
    if "bfloat16" not in bk.float_dtypes():
        return
    model = pl.load(file, backend=backend, dtype="bfloat16", dequantize=dequantize)
    w = model.layers[0].mlp.w_down  # (E, I) down_proj
    w = dequantize_weight(w)
    assert bool(np.isfinite(pl.to_numpy(w).astype(np.float32)).all())


def test_k_quant_past_float16_is_refused_per_rank(tmp_path: Path, monkeypatch: Any) -> None:
    """A partitioned load reads each rank's blocks (``GGUFSlices``): cast to float16, the
    blocks read are refused by the same rule, kept or as floats."""
    from portable_llm.checkpoint.gguf import GGUFSlices

    file, words = _k_quant_file(tmp_path, monkeypatch, 65504.0)
    name = "model.layers.0.mlp.down_proj.weight"
    for keep in (True, False):
        with pytest.raises(CheckpointError, match=re.escape(words)):
            GGUFSlices(file, keep=keep, float16=True).read(name, (slice(0, 16),))
        assert GGUFSlices(file, keep=keep).read(name, (slice(0, 16),)) is not None  # float32


def dequantize_weight(w: Any) -> Any:
    return dequantize(w) if isinstance(w, pl.QuantizedWeight) else w


def test_float16_overflow_rule() -> None:
    """Which numbers of a block float16 cannot hold: the scales of a Q4_K ``d`` at float16's
    largest, the bias ``-128 d`` of a Q8_0 one, the values of a Q4_1 whose scale and bias fit;
    nothing in ordinary blocks nor in a file's own infinities (inf in every dtype)."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
    from portable_llm.checkpoint.gguf_blocks import FLOAT16_INF, float16_overflow
    from test_gguf import random_blocks

    assert float(np.finfo(np.float16).max) + 2.0**4 == FLOAT16_INF  # half an ulp above
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(FLOAT16_INF).astype(np.float16))
    assert np.float32(FLOAT16_INF - 1).astype(np.float16) == np.finfo(np.float16).max
    rng = np.random.default_rng(0)
    for kind in ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F32", "F16"):
        assert float16_overflow(kind, random_blocks(kind, 4, rng)) is None, kind
    big = np.array([65504.0], np.float16).view(np.uint8)
    k = random_blocks("Q4_K", 4, rng)
    k[:, 0:2] = big
    assert float16_overflow("Q4_K", k)[0] == "scales"  # type: ignore[index]
    q8 = random_blocks("Q8_0", 4, rng)
    q8[:, 0:2] = big  # its bias -128 d overflows
    assert float16_overflow("Q8_0", q8) == ("biases", 65504.0 * 128)
    q41 = random_blocks("Q4_1", 4, rng)
    q41[:, 0:4] = np.array([5000.0, 0.0], np.float16).view(np.uint8)  # d, m: both fit
    q41[:, 4] = 0xFF  # codes 15: 15 d = 75000 does not
    assert float16_overflow("Q4_1", q41) == ("values", 75000.0)
    q4 = random_blocks("Q4_0", 4, rng)
    q4[:, 0:2] = np.array([np.inf], np.float16).view(np.uint8)
    assert float16_overflow("Q4_0", q4) is None


# -- quantize's error bound -----------------------------------------------------------------------

#: Unit roundoff of float32 (half an ulp at 1).
_U32 = 2.0**-24


@given(
    bits=st.sampled_from(BITS),
    group=st.sampled_from(GROUP_SIZES),
    far=st.floats(0.0, 1.0),
    flip=st.booleans(),
    seed=seeds(),
)
def test_quantize_error_is_at_most_one_step(
    backend: str, bits: int, group: int, far: float, flip: bool, seed: int
) -> None:
    """The documented bound, where it is tight: groups whose anchor (the endpoint of larger
    magnitude) rounds the step down, so that the far end's code is clipped. Every element is
    within one step of w; those with a code strictly inside, within half a step (plus the
    float32 roundings of the scales and biases)."""
    k = math.lcm(group, k_unit(bits, group))
    rng = np.random.default_rng(seed)
    w = rng.uniform(-1.0, far, (2, k))
    w[:, 0::group], w[:, 1::group] = -1.0, far  # each group's ends: -1 anchors, far may clip
    w = (-w if flip else w).astype(np.float32)
    qw = quantize(get_backend(backend).from_numpy(w), bits=bits, group_size=group)
    bk = qw.backend
    s = np.repeat(bk.to_numpy(qw.scales).astype(np.float64), group, axis=-1)
    got = bk.to_numpy(dequantize(qw)).astype(np.float64)
    codes = np.rint((got - np.repeat(bk.to_numpy(qw.biases), group, axis=-1)) / s)
    err = np.abs(got - w)
    slack = 4 * _U32 * (np.abs(s) * (2**bits - 1) + np.abs(got) + np.abs(w)) + 1e-12
    assert np.all(err <= np.abs(s) + slack)
    inside = (codes > 0) & (codes < 2**bits - 1)
    assert np.all(err[inside] <= 0.5 * np.abs(s[inside]) + slack[inside])


def test_quantize_error_reaches_one_step(backend: str) -> None:
    """At 2 bits ``[-1.5, 1.5]`` anchors at 1.5 with ``s = -0.75`` (``q0 = round(-1.5) = -2``):
    -1.5 needs code 4, clipped to 3, one whole step off; so the docstring promises one step
    (it promised half a step, broken by 2x here)."""
    w = np.zeros((1, 16), np.float32)
    w[0, :2] = -1.5, 1.5
    qw = quantize(get_backend(backend).from_numpy(w), bits=2, group_size=16)
    s = float(qw.backend.to_numpy(qw.scales)[0, 0])
    err = np.abs(qw.backend.to_numpy(dequantize(qw)) - w).max()
    assert s == -0.75 and err == 0.75 == abs(s)
    assert "within one step (``|scale|``)" in (quantize.__doc__ or "")


# -- mesh arguments -----------------------------------------------------------------------------


_SHARDED_TEMPERATURE = """
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from portable_llm.attn.temperature import temperature_body
from portable_llm.backends import get_backend

q = np.asarray(json.loads(sys.argv[1]), np.float32)  # (1, H, L, D)
mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
split = jax.device_put(q, NamedSharding(mesh, PartitionSpec(None, "tp")))  # heads over 2
out = temperature_body(get_backend("jax").xp, split, 6, 4.0, 0.5)
print(json.dumps(np.asarray(out).tolist()))
"""


@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
def test_temperature_of_a_q_split_over_a_mesh() -> None:
    """Llama 4's temperature tuning of a q whose heads are split over 2 devices (a tensor-
    parallel layer): the positions are made where they fit, not with q's own sharding (an
    ``arange`` of rank 1 under q's rank-4 ``PartitionSpec`` failed in ``device_put``)."""
    import subprocess
    import sys

    from portable_llm.testing import reference
    from portable_llm.testing.partition import host_devices_env

    q = np.random.default_rng(0).standard_normal((1, 4, 3, 8)).astype(np.float32)
    env = host_devices_env(2)
    done = subprocess.run(
        [sys.executable, "-c", _SHARDED_TEMPERATURE, json.dumps(q.tolist())],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.asarray(json.loads(done.stdout), np.float32)
    want = reference.attention_temperature(q, np.arange(6, 9), floor_scale=4.0, scale=0.5)
    assert_close(got, want.astype(np.float32))


@pytest.mark.oracle
@pytest.mark.slow  # 80 s of JAX compiles on the shared 2-core machine
@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
def test_llama4_over_a_jax_mesh(tmp_path: Path) -> None:
    """A valid Llama 4 split (PP 2 x TP 2: its no-RoPE layers' temperature tuning on a q split
    over the TP devices) equals one device: logits, greedy tokens, a paged forward (was: the
    positions' ``arange`` took q's own sharding as its device, failing in ``device_put``)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from portable_llm.testing.partition import launch_jax

    d = {k: v for k, v in BASE["llama4_text"].items() if k != "model_type"}
    d.update(
        vocab_size=300,
        num_hidden_layers=4,
        moe_layers=[1, 2],
        no_rope_layers=[1, 0, 1, 0],
        layer_types=["chunked_attention", "full_attention"] * 2,
    )
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**d)
    transformers.Llama4ForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    results = launch_jax(tmp_path / "ckpt", tmp_path / "out", ["pp2tp2"])
    one, got = results["one"], results["pp2tp2"]
    assert_close(got["logits"], one["logits"])
    np.testing.assert_array_equal(got["tokens"], one["tokens"])
    assert_close(got["paged"], one["logits"][:, -1, :])
    assert int(got["kv_heads"]) == 1  # H_kv = 2 over TP 2


@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
@pytest.mark.parametrize("bad", [0, False, (), 2, "tp"])
@pytest.mark.parametrize("keyword", ["tensor_parallel", "pipeline_parallel"])
def test_falsy_or_wrong_mesh_names_the_argument(tmp_path: Path, keyword: str, bad: Any) -> None:
    """A falsy handle is a handle, checked (was: read as none, then a TypeError)."""
    write_checkpoint(tmp_path, tiny_config("llama"))
    with pytest.raises(ValueError, match=f"^load: {keyword} on JAX must be a jax.sharding.Mesh"):
        pl.load(tmp_path, backend="jax", **{keyword: bad})


@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
def test_one_mesh_axis_for_both_keywords_is_refused(tmp_path: Path) -> None:
    """The same axis given to both keywords (a 1-axis mesh twice, or ``(mesh, 'tp')`` twice)
    cannot split both ways (was: 'axes don't match array' from a transpose)."""
    import jax
    from jax.sharding import Mesh

    write_checkpoint(tmp_path, tiny_config("llama"))
    line = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    square = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("pp", "tp"))
    for tp, pp, axis in ((line, line, "x"), ((square, "tp"), (square, "tp"), "tp")):
        with pytest.raises(ValueError, match=f"both name the mesh axis '{axis}'"):
            pl.load(tmp_path, backend="jax", tensor_parallel=tp, pipeline_parallel=pp)


@pytest.mark.skipif(bool(skip_reason("mlx")), reason=str(skip_reason("mlx")))
def test_one_group_for_both_keywords_is_refused(tmp_path: Path) -> None:
    """One process group given to both keywords (MLX's world here; torch's alike: the engines
    share ``bind_groups``) would make each process TP rank r of stage r."""
    import mlx.core as mx

    write_checkpoint(tmp_path, tiny_config("llama"))
    world = mx.distributed.init()
    with pytest.raises(ValueError, match="tensor_parallel and pipeline_parallel are the same"):
        pl.load(tmp_path, backend="mlx", tensor_parallel=world, pipeline_parallel=world)


# -- --threads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "batch", "report"])
def test_too_many_threads_is_one_usage_line(
    command: str, tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    """``--threads`` past 4 per CPU: one line, exit 2, before torch is told (100000 threads
    segfaulted torch, rc -11)."""
    from portable_llm.cli import options
    from portable_llm.cli.cli import main

    monkeypatch.setattr(options.os, "cpu_count", lambda: 2)
    write_checkpoint(tmp_path, tiny_config("llama"))
    model = [] if command == "report" else [str(tmp_path), "--ids", "1"]
    for threads, ok in (("100000", False), ("9", False), ("8", True)):
        if ok:  # the bound itself parses
            args = options.Parser()
            options.add_threads_argument(args)
            assert args.parse_args(["--threads", threads]).threads == 8
            continue
        with pytest.raises(SystemExit) as info:
            main([command, *model, "--backend", "torch", "--threads", threads])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Traceback" not in err
        assert " ".join(err.split()) == (
            f"portable-llm {command}: error: argument --threads: expected an integer in [1, 8] "
            f"(4 per CPU; this machine has 2), got {threads}"
        )


def test_apply_threads_checks_the_count(monkeypatch: Any) -> None:
    torch = pytest.importorskip("torch")
    from portable_llm.cli import options

    monkeypatch.setattr(options.os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=r"threads: expected an integer in \[1, 8\]"):
        options.apply_threads(100000, ["torch"])
    with pytest.raises(TypeError, match="threads: expected an integer, got float"):
        options.apply_threads(2.0, ["torch"])  # type: ignore[arg-type]
    assert torch.get_num_threads() == before  # nothing was set
    assert options.check_threads(8) == 8 and os.cpu_count() is not None
