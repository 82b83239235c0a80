"""Model partition (issue 19): the plan, per-rank reading, and each engine against one device.

The engines run in processes of their own, started by the tests with bounded time: JAX in one
process with 8 host devices (``XLA_FLAGS``), torch as 2 ranks over gloo, MLX as 2 ranks over
the ring backend on 127.0.0.1 (a hostfile the test writes). Each compares the logits with the
same backend on one device (the tolerance table's float32 entry) and the greedy tokens exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import numpy_only, skip_reason
from portable_llm.checkpoint.build import LoadOptions
from portable_llm.checkpoint.partitioned import read_partitioned
from portable_llm.checkpoint.shards import SafetensorsFiles
from portable_llm.decoder.config import DecoderConfig
from portable_llm.partition import Engine, plan_partition, stage_layers
from portable_llm.testing import MODEL_TOLERANCES, assert_close
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from portable_llm.testing.partition import launch, launch_jax


def _cfg(model_type: str, **kw: object) -> DecoderConfig:
    return DecoderConfig.from_dict(tiny_config(model_type, **kw))


class _Ranks(Engine):
    """A process engine whose collectives are never called: the reading alone."""

    def __init__(self, tp: tuple[int, int] = (1, 0), pp: tuple[int, int] = (1, 0)) -> None:
        (self.tp_size, self.tp_rank), (self.pp_size, self.pp_rank) = tp, pp


@numpy_only
def test_plan_splits_heads_rows_and_columns() -> None:
    cfg = _cfg("llama")  # E=32, H=4, H_kv=2, D=8, I=48, biases
    p = plan_partition(cfg, tp=(2, 1))
    a = "model.layers.0.self_attn."
    assert p.index(a + "q_proj.weight", (32, 32)) == (slice(16, 32), slice(None))
    assert p.index(a + "q_proj.bias", (32,)) == (slice(16, 32),)
    assert p.index(a + "k_proj.weight", (16, 32)) == (slice(8, 16), slice(None))
    assert p.index(a + "o_proj.weight", (32, 32)) == (slice(None), slice(16, 32))
    assert p.index(a + "o_proj.bias", (32,)) == (slice(None),)  # added once, after the sum
    m = "model.layers.0.mlp."
    assert p.index(m + "down_proj.weight", (32, 48)) == (slice(None), slice(24, 48))
    assert p.index(m + "down_proj.bias", (32,)) == (slice(None),)
    assert p.zeroed(m + "down_proj.bias") and not plan_partition(cfg, tp=(2, 0)).zeroed(
        m + "down_proj.bias"
    )  # held by TP rank 0 only: the all-reduce counts it once
    assert p.index(m + "up_proj.bias", (48,)) == (slice(24, 48),)
    assert p.index("model.embed_tokens.weight", (300, 32)) == (slice(None), slice(None))
    c = p.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (2, 1, 24)


@numpy_only
def test_plan_replicates_kv_heads_and_splits_experts() -> None:
    p = plan_partition(_cfg("llama"), tp=(4, 3))  # 2 KV heads over 4 ranks
    assert p.kv_replicated and p.config.num_key_value_heads == 1
    k = "model.layers.1.self_attn.k_proj.weight"
    assert p.index(k, (16, 32)) == (slice(8, 16), slice(None))  # rank 3 reads KV head 1
    assert p.split_axis(k, 2) is None
    p = plan_partition(_cfg("mixtral"), tp=(2, 1))
    x = "model.layers.0.mlp.experts."
    assert p.index(x + "gate_proj", (4, 48, 32)) == (slice(None), slice(24, 48), slice(None))
    assert p.index(x + "down_proj", (4, 32, 48)) == (slice(None), slice(None), slice(24, 48))
    assert p.index("model.layers.0.mlp.gate.weight", (4, 32)) == (slice(None), slice(None))


@numpy_only
def test_plan_stages() -> None:
    assert [stage_layers(5, 2, s) for s in (0, 1)] == [range(0, 3), range(3, 5)]
    cfg = _cfg("qwen2", num_hidden_layers=3)  # tied embedding
    first, last = (plan_partition(cfg, pp=(2, s)) for s in (0, 1))
    assert first.held("model.embed_tokens.weight") and last.held("model.embed_tokens.weight")
    assert not first.held("model.norm.weight") and last.held("model.norm.weight")
    assert (
        last.local_name("model.layers.2.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    )
    assert last.config.layer_types == cfg.layer_types[2:]


@numpy_only
@pytest.mark.parametrize(
    ("overrides", "tp", "pp", "match"),
    [
        ({}, 3, 1, "num_attention_heads=4 is not divisible by tensor_parallel=3"),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 48},
            4,
            1,
            "num_key_value_heads=3",
        ),
        ({"intermediate_size": 50}, 4, 1, "intermediate_size=50"),
        ({}, 1, 3, "pipeline_parallel=3 exceeds num_hidden_layers=2"),
    ],
)
def test_bad_group_is_refused_before_the_weights_are_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    overrides: dict[str, Any],
    tp: int,
    pp: int,
    match: str,
) -> None:
    write_checkpoint(tmp_path, tiny_config("llama", **overrides))

    def refuse(*args: object, **kw: object) -> None:
        raise AssertionError("a weight was read")

    monkeypatch.setattr(SafetensorsFiles, "read", refuse)
    with pytest.raises(ValueError, match=match):
        read_partitioned(tmp_path, LoadOptions(), _Ranks(tp=(tp, 0), pp=(pp, 0)))


@numpy_only
def test_whole_projection_qk_norms_refuse_tensor_ranks() -> None:
    """OLMo 2's q/k norms span every head's features: a tensor rank holds only some of them,
    so tensor parallelism is refused by name; pipeline stages are planned."""
    d = {"model_type": "olmo2", "hidden_size": 32, "num_attention_heads": 4,
         "intermediate_size": 64, "vocab_size": 100, "num_hidden_layers": 2}  # fmt: skip
    cfg = DecoderConfig.from_dict(d)
    with pytest.raises(ValueError, match="olmo2's q_norm and k_norm each span all heads"):
        plan_partition(cfg, tp=(2, 0))
    assert plan_partition(cfg, pp=(2, 1)).layers == range(1, 2)


@numpy_only
def test_the_grouped_router_refuses_tensor_ranks() -> None:
    """GLM-4.5's grouped router and shared experts are refused over tensor ranks by name;
    pipeline stages are planned."""
    d = {"model_type": "glm4_moe", "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100,
         "num_hidden_layers": 2, "n_routed_experts": 8, "moe_intermediate_size": 16}  # fmt: skip
    cfg = DecoderConfig.from_dict(d)
    with pytest.raises(ValueError, match="glm4_moe's grouped router and shared experts"):
        plan_partition(cfg, tp=(2, 0))
    assert plan_partition(cfg, pp=(2, 1)).layers == range(1, 2)


@numpy_only
@pytest.mark.parametrize("ranks", [{"tp": (2, 0)}, {"pp": (2, 1)}, {}])
def test_latent_attention_is_not_partitioned(ranks: dict[str, tuple[int, int]]) -> None:
    """DeepSeek V3's latent attention is refused by name, tensor ranks and stages alike (its
    heads, latent caches and grouped experts are not split yet)."""
    d = {"model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 100,
         "num_hidden_layers": 2, "kv_lora_rank": 16, "n_routed_experts": 8}  # fmt: skip
    with pytest.raises(ValueError, match=r"deepseek_v3's latent attention \(kv_lora_rank=16\)"):
        plan_partition(DecoderConfig.from_dict(d), **ranks)


@numpy_only
def test_group_on_a_backend_without_collectives() -> None:
    import portable_llm as pl

    with pytest.raises(ValueError, match="backend with collectives"):
        pl.load("unused", backend="numpy", tensor_parallel=object())


@numpy_only
@pytest.mark.parametrize("model_type", ["qwen2", "llama"])  # tied embedding, untied head
def test_pipeline_ranks_read_their_layers_only(tmp_path: Path, model_type: str) -> None:
    cfg = tiny_config(model_type, num_hidden_layers=4)
    full = write_checkpoint(tmp_path, cfg)
    for rank in (0, 1):
        model, report = read_partitioned(tmp_path, LoadOptions(), _Ranks(pp=(2, rank)))
        assert report.held <= 0.75 * report.total, report
        assert report.touched <= 0.8 * report.file, report
        assert len(model.layers) == 2
        name = f"model.layers.{2 * rank + 1}.self_attn.q_proj.weight"
        np.testing.assert_array_equal(model.layers[1].attn.wq, full[name])


@numpy_only
def test_tensor_ranks_read_their_slices(tmp_path: Path) -> None:
    full = write_checkpoint(tmp_path, tiny_config("mixtral"))
    model, _ = read_partitioned(tmp_path, LoadOptions(), _Ranks(tp=(2, 1)))
    a, moe = model.layers[0].attn, model.layers[0].moe
    np.testing.assert_array_equal(a.wo, full["model.layers.0.self_attn.o_proj.weight"][:, 16:])
    w1 = full["model.layers.0.block_sparse_moe.experts.3.w1.weight"]  # expert 3's gate (I, E)
    assert moe is not None
    np.testing.assert_array_equal(moe.experts_gate[3], w1[24:])


def _smollm_like_gguf(folder: Path, **types: str) -> tuple[Path, dict[str, np.ndarray]]:
    """A llama GGUF with SmolLM2's head ratio (6 query heads, 3 KV heads), Q8_0 matrices."""
    from test_gguf import family_config, gguf_tokenizer_meta, random_weights, write_gguf

    cfg = family_config(
        "llama", hidden_size=96, head_dim=16, num_attention_heads=6, num_key_value_heads=3,
        intermediate_size=192, num_hidden_layers=2,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    tok = gguf_tokenizer_meta(folder / "tok")
    file = folder / "smol.gguf"
    held = write_gguf(file, "llama", cfg, random_weights(cfg), tok=tok, types=types)
    return file, held


@numpy_only
def test_gguf_ranks_read_their_blocks(tmp_path: Path) -> None:
    file, held = _smollm_like_gguf(tmp_path)
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    for r in range(3):  # TP 3: 2 query heads and 1 KV head per rank
        model, report = read_partitioned(file, LoadOptions(), _Ranks(tp=(3, r)))
        b = model.layers[1]
        np.testing.assert_array_equal(b.attn.wq, held[a + "q_proj.weight"][32 * r : 32 * (r + 1)])
        np.testing.assert_array_equal(b.attn.wk, held[a + "k_proj.weight"][16 * r : 16 * (r + 1)])
        np.testing.assert_array_equal(
            b.attn.wo, held[a + "o_proj.weight"][:, 32 * r : 32 * (r + 1)]
        )
        assert b.mlp is not None
        np.testing.assert_array_equal(
            b.mlp.w_down, held[m + "down_proj.weight"][:, 64 * r : 64 * (r + 1)]
        )
        assert report.touched < 0.75 * report.file
    with pytest.raises(ValueError, match="not a whole number of quantization groups of 32"):
        read_partitioned(file, LoadOptions(), _Ranks(tp=(6, 0)))  # 16 columns of o_proj


def _equal_to_one_device(
    got: dict[str, Any], want_logits: np.ndarray, want: dict[str, Any]
) -> None:
    assert_close(got["logits"], want_logits)
    for key, tokens in want.items():  # generate, batch_generate, speculative_generate
        np.testing.assert_array_equal(got[key], tokens, err_msg=key)


def _one_device(
    folder: Path, backend: str, dtype: str = "float32"
) -> tuple[np.ndarray, dict[str, Any]]:
    import portable_llm as pl
    from portable_llm.testing.partition import NEW_TOKENS, PROMPT, more_tokens

    model = pl.load(folder, backend=backend, dtype=dtype, dequantize=True)
    logits = pl.to_numpy(model([PROMPT])).astype(np.float32)
    tokens = [int(t) for t in pl.generate(model, PROMPT, max_new_tokens=NEW_TOKENS, stop=())]
    return logits, {"tokens": np.asarray(tokens), **more_tokens(model)}


JAX_CASES = [
    pytest.param("llama", ["pp2tp2"], id="llama-pp2xtp2"),  # both kinds, one process
    pytest.param("llama", ["tp2", "tp4"], id="llama-tp2-tp4", marks=pytest.mark.slow),
    pytest.param("qwen2", ["tp4", "pp2"], id="qwen2-tp4-pp2", marks=pytest.mark.slow),
    pytest.param("mixtral", ["tp2", "pp2"], id="mixtral-tp2-pp2", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", ["tp2"], id="qwen2_moe-tp2", marks=pytest.mark.slow),
]


@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
@pytest.mark.parametrize(("model_type", "cases"), JAX_CASES)
def test_jax_mesh_equals_one_device(tmp_path: Path, model_type: str, cases: list[str]) -> None:
    write_checkpoint(tmp_path / "ckpt", tiny_config(model_type))
    results = launch_jax(tmp_path / "ckpt", tmp_path / "out", cases)
    one = results.pop("one")
    H_kv = DecoderConfig.from_dict(tiny_config(model_type)).num_key_value_heads
    for case, got in results.items():
        assert_close(got["logits"], one["logits"], err_msg=case)
        np.testing.assert_array_equal(got["tokens"], one["tokens"], err_msg=case)
        T = int(case.partition("tp")[2] or 1)
        # the caches and the page pools hold each device's KV heads (all of them where
        # T > H_kv: replicated)
        assert int(got["kv_heads"]) == (H_kv // T if H_kv >= T else H_kv), case
        assert int(got["pool_heads"]) == (H_kv // T if H_kv >= T else H_kv), case
        assert_close(got["paged"], one["logits"][:, -1, :], err_msg=case)  # (B, V)


@pytest.mark.slow  # about 25 s of batch_generate on the shared 2-core machine
@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
def test_jax_mesh_batch_generate(tmp_path: Path) -> None:
    """``batch_generate`` of three prompts of three lengths over a mesh (TP 2 and PP 2 x TP 2)
    gives the one-device tokens: each layer's page pools on its stage's devices."""
    write_checkpoint(tmp_path / "ckpt", tiny_config("llama"))
    results = launch_jax(tmp_path / "ckpt", tmp_path / "out", ["tp2", "pp2tp2"], batch=True)
    one = results.pop("one")
    for case, got in results.items():
        np.testing.assert_array_equal(got["batch"], one["batch"], err_msg=case)
        assert int(got["pool_heads"]) == 1, case  # H_kv = 2 over TP 2: one head per device


@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
def test_jax_mesh_without_the_axis(tmp_path: Path) -> None:
    import jax
    from jax.sharding import Mesh

    import portable_llm as pl

    write_checkpoint(tmp_path, tiny_config("llama"))
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match="no axis 'tp'"):
        pl.load(tmp_path, backend="jax", tensor_parallel=(mesh, "tp"))
    both = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    with pytest.raises(ValueError, match="no axis 'pp'"):
        pl.load(tmp_path, backend="jax", pipeline_parallel=both)


PROCESS_CASES = [
    pytest.param("llama", "tp", id="llama-tp2"),
    pytest.param("qwen2", "pp", id="qwen2-pp2"),
    pytest.param("mixtral", "tp", id="mixtral-tp2", marks=pytest.mark.slow),
    pytest.param("llama", "pp", id="llama-pp2", marks=pytest.mark.slow),
    pytest.param("mistral", "tp", id="mistral-tp2", marks=pytest.mark.slow),  # rotating caches
    pytest.param("qwen3", "tp", id="qwen3-tp2", marks=pytest.mark.slow),  # q/k norms
    pytest.param("qwen2_moe", "tp", id="qwen2_moe-tp2", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "pp", id="qwen2_moe-pp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("engine", ["torch", "mlx"])
@pytest.mark.parametrize(("model_type", "mode"), PROCESS_CASES)
def test_two_local_ranks_equal_one_device(
    tmp_path: Path, engine: str, model_type: str, mode: str
) -> None:
    if skip_reason(engine):
        pytest.skip(str(skip_reason(engine)))
    write_checkpoint(tmp_path / "ckpt", tiny_config(model_type))
    cfg = _cfg(model_type)
    logits, tokens = _one_device(tmp_path / "ckpt", engine)
    for rank, got in enumerate(launch(engine, mode, tmp_path / "ckpt", tmp_path / "out")):
        _equal_to_one_device(got, logits, tokens)  # batch_generate: 3 rows, paged, batched
        assert got["prepared"]  # the rank's layers ran as the prepared forward
        # the rank's page pools: its layers (PP) and its KV heads (TP) only
        n, H_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
        want = [len(stage_layers(n, 2, rank)), H_kv] if mode == "pp" else [n, H_kv // 2]
        np.testing.assert_array_equal(got["pools"], want)


@pytest.mark.slow  # 4 processes: 13 s (MLX), 30 s (torch) on the shared 2-core machine
@pytest.mark.parametrize("engine", ["mlx", "torch"])
def test_tensor_and_pipeline_on_four_local_ranks(tmp_path: Path, engine: str) -> None:
    """TP 2 x PP 2 on 4 ranks: torch's two groups (``new_group``); MLX's ring, which has no
    ``Group.split`` and sends only to a rank's neighbours, over ``NeighborGroup`` s laid out so
    that every link is between neighbours (stage 0: ranks 0, 1; stage 1: ranks 3, 2)."""
    if skip_reason(engine):
        pytest.skip(str(skip_reason(engine)))
    write_checkpoint(tmp_path / "ckpt", tiny_config("llama"))
    logits, tokens = _one_device(tmp_path / "ckpt", engine)
    ranks = launch(engine, "pp2tp2", tmp_path / "ckpt", tmp_path / "out", world=4, timeout=300)
    for got in ranks:
        _equal_to_one_device(got, logits, tokens)
        assert got["prepared"]
        assert got["held"] <= 0.5 * got["total"]  # half the layers, half of each


@pytest.mark.skipif(bool(skip_reason("mlx")), reason=str(skip_reason("mlx")))
def test_gguf_tp3_on_three_mlx_ranks(tmp_path: Path) -> None:
    """SmolLM2's head ratio at TP 3 (one KV head per rank), each rank reading its blocks."""
    file, _ = _smollm_like_gguf(tmp_path / "ckpt")
    logits, tokens = _one_device(file, "mlx")
    for got in launch("mlx", "tp", file, tmp_path / "out", world=3):
        _equal_to_one_device(got, logits, tokens)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "mlx"])
@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_bfloat16_ranks_equal_one_device(tmp_path: Path, engine: str, mode: str) -> None:
    """bfloat16 logits within the whole-model table (``MODEL_TOLERANCES``): a TP rank rounds
    its partial sum to bfloat16 before the all-reduce, one rounding more than one device's
    product, so only the logits are compared."""
    if skip_reason(engine):
        pytest.skip(str(skip_reason(engine)))
    write_checkpoint(tmp_path / "ckpt", tiny_config("llama"))
    logits, _ = _one_device(tmp_path / "ckpt", engine, "bfloat16")
    tol = MODEL_TOLERANCES["bfloat16"]
    for got in launch(engine, mode, tmp_path / "ckpt", tmp_path / "out", dtype="bfloat16"):
        assert_close(got["logits"], logits, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.slow
@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
def test_jax_bfloat16_mesh(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", tiny_config("llama"))
    results = launch_jax(tmp_path / "ckpt", tmp_path / "out", ["tp2", "pp2tp2"], dtype="bfloat16")
    one, tol = results.pop("one"), MODEL_TOLERANCES["bfloat16"]
    for case, got in results.items():
        assert_close(got["logits"], one["logits"], rtol=tol.rtol, atol=tol.atol, err_msg=case)


@pytest.mark.slow
@pytest.mark.skipif(bool(skip_reason("torch")), reason=str(skip_reason("torch")))
def test_cli_generate_under_torchrun(tmp_path: Path) -> None:
    """``portable-llm generate --tensor-parallel 2 --pipeline-parallel 2`` under ``torchrun``
    (4 ranks: two TP groups, two pipelines) prints the one-process tokens, once."""
    import os
    import subprocess
    import sys

    from portable_llm.testing.partition import free_port

    write_checkpoint(tmp_path, tiny_config("llama"))
    cmd = ["generate", str(tmp_path), "--backend", "torch", "--ids", "3,17,42"]
    cmd += ["--max-new-tokens", "6"]
    one = subprocess.run(
        [sys.executable, "-m", "portable_llm", *cmd], capture_output=True, text=True
    )
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    run += ["--master-port", str(free_port()), "-m", "portable_llm", *cmd]
    run += ["--tensor-parallel", "2", "--pipeline-parallel", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    split = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env)
    assert split.returncode == 0, split.stderr[-2000:]
    tokens = one.stdout.splitlines()[0]
    assert split.stdout.splitlines().count(tokens) == 1, split.stdout


@pytest.mark.oracle
@pytest.mark.skipif(bool(skip_reason("mlx")), reason=str(skip_reason("mlx")))
@pytest.mark.parametrize(
    ("family", "mode"),
    [("gemma2", "tp"), ("gpt2", "pp"), pytest.param("phi3", "tp", marks=pytest.mark.slow),
     ("llama4_text", "pp"), pytest.param("llama4_text", "tp", marks=pytest.mark.slow),
     ("olmo2", "pp"), pytest.param("granite", "tp", marks=pytest.mark.slow), ("lfm2", "pp"),
     ("qwen3_next", "pp")],
)  # fmt: skip
def test_families_over_mlx_ranks(tmp_path: Path, family: str, mode: str) -> None:
    """Families beyond Llama (Gemma 2's sandwich norms, scaled embedding and soft-capping;
    GPT-2's learned positions and fused Conv1D weights; Phi-3's fused projections; Llama 4's
    per-layer RoPE, chunks and temperature over pipeline stages, its sigmoid-routed experts
    split over tensor ranks; OLMo 2's norms of the outputs only over stages; Granite's
    multipliers over tensor ranks; LFM2's short convolutions beside attention over stages, each
    stage's recurrent caches its own; Qwen3-Next's Gated DeltaNet and gated attention layers on
    one stage each), saved by transformers, over 2 MLX ranks."""
    transformers = pytest.importorskip("transformers")
    import torch

    from test_oracle_families import FAMILIES

    name, extra = FAMILIES[family]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=300, bos_token_id=1, eos_token_id=2, **extra
    )
    torch.manual_seed(0)
    cls = {"GPT2": "GPT2LMHeadModel", "Llama4Text": "Llama4ForCausalLM"}.get(
        name, f"{name}ForCausalLM"
    )
    getattr(transformers, cls)(config).save_pretrained(tmp_path / "ckpt")
    logits, tokens = _one_device(tmp_path / "ckpt", "mlx")
    for got in launch("mlx", mode, tmp_path / "ckpt", tmp_path / "out"):
        _equal_to_one_device(got, logits, tokens)
