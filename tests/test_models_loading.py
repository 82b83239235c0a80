"""Reading checkpoint folders: configs of every family, broken checkpoints, tokenizers.

Everything is written here with NumPy, ``safetensors`` and ``tokenizers``; no download, no
transformers.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

import portable_llm as pl
from conftest import numpy_only
from portable_llm.checkpoint.tokenizer import read_tokenizer
from portable_llm.cli.cli import main
from portable_llm.cli.model_bench import QWEN2_0_5B, run_model_bench
from portable_llm.cli.report import UsageError
from portable_llm.models import (
    SUPPORTED_MODEL_TYPES,
    CheckpointError,
    DecoderConfig,
    Tokenizer,
    load,
)
from portable_llm.rotary.scaling import ROPE_TYPES
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import (
    SENTENCES,
    random_tensors,
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)

# -- configs -------------------------------------------------------------------------------------


def test_from_dict_ignores_unknown_keys() -> None:
    cfg = DecoderConfig.from_dict({**tiny_config("qwen2"), "some_future_field": [1, 2]})
    assert cfg.hidden_size == 32 and cfg.num_key_value_heads == 2 and cfg.head_dim == 8
    assert cfg.qkv_bias and not cfg.o_bias and cfg.tie_word_embeddings


def test_family_defaults_follow_transformers() -> None:
    qwen3 = {k: v for k, v in tiny_config("qwen3").items() if k != "head_dim"}
    assert DecoderConfig.from_dict(qwen3).head_dim == 128  # Qwen3Config's default
    mixtral = DecoderConfig.from_dict(tiny_config("mixtral"))
    assert mixtral.rope["base"] == 1e6  # MixtralConfig.default_theta
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (True, True)
    assert mixtral.moe_intermediate_size == 48  # Mixtral's experts use intermediate_size
    llama = DecoderConfig.from_dict(tiny_config("llama"))
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias and not llama.qk_norm


def test_rope_parameters_v5_equals_rope_theta_and_rope_scaling_v4() -> None:
    v4 = tiny_config("llama")
    scaling = v4.pop("rope_scaling")
    v5 = {**v4, "rope_parameters": {**scaling, "rope_theta": v4.pop("rope_theta")}}
    assert DecoderConfig.from_dict(v4) != DecoderConfig.from_dict(v5)  # v4 lost its theta
    v4["rope_theta"], v4["rope_scaling"] = v5["rope_parameters"]["rope_theta"], scaling
    a, b = DecoderConfig.from_dict(v4).rope, DecoderConfig.from_dict(v5).rope
    assert a["base"] == b["base"] == 5e5 and dict(a["scaling"]) == dict(b["scaling"])


def test_sliding_window_layers() -> None:
    qwen2 = {**tiny_config("qwen2", num_hidden_layers=4), "sliding_window": 8}
    assert DecoderConfig.from_dict(qwen2).layer_types == ("full_attention",) * 4  # switched off
    on = DecoderConfig.from_dict({**qwen2, "use_sliding_window": True, "max_window_layers": 2})
    assert on.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert [on.window(i) for i in range(4)] == [None, None, 8, 8]
    moe = {**tiny_config("qwen2_moe", num_hidden_layers=4, max_window_layers=3)}
    del moe["layer_types"]
    assert DecoderConfig.from_dict(moe).layer_types == (
        "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    )  # fmt: skip
    mistral = DecoderConfig.from_dict(tiny_config("mistral"))
    assert [mistral.window(i) for i in range(2)] == [4, 4]


def test_qwen2_moe_sparse_layers() -> None:
    cfg = tiny_config("qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    del cfg["layer_types"]
    assert DecoderConfig.from_dict(cfg).moe_layers == (False, True, False, False)


BAD_CONFIGS = [
    ({"model_type": "bert"}, "unsupported model_type 'bert'; supported: "),
    ({"rope_scaling": {"rope_type": "mrope"}}, "unknown rope type 'mrope'; supported: "),
    ({"hidden_act": "tanh"}, "unknown hidden_act 'tanh'"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_h"),
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"layer_types": ["full_attention"]}, "layer_types must list 2 entries"),
]


@pytest.mark.parametrize(("change", "message"), BAD_CONFIGS)
def test_bad_config(change: dict, message: str) -> None:
    cfg = {**tiny_config("qwen2"), **change}
    with pytest.raises(ValueError) as info:
        DecoderConfig.from_dict(cfg)
    assert message in str(info.value)
    if "supported:" in message:  # the supported values are listed
        listed = SUPPORTED_MODEL_TYPES if "model_type" in message else ROPE_TYPES
        assert str(info.value).endswith(", ".join(listed))


# -- broken checkpoints --------------------------------------------------------------------------


def _broken(tmp_path: Path, family: str = "qwen2", **change: np.ndarray | None) -> Path:
    cfg = tiny_config(family)
    tensors = random_tensors(cfg)
    for name, value in change.items():
        name = name.replace("__", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    write_checkpoint(tmp_path, cfg, tensors=tensors)
    return tmp_path


def test_missing_tensor(tmp_path: Path) -> None:
    folder = _broken(tmp_path, model__layers__1__self_attn__k_proj__bias=None)
    with pytest.raises(
        CheckpointError, match=r"missing tensors \(1\): model.layers.1.self_attn.k_proj.bias"
    ):
        load(folder)


def test_missing_expert(tmp_path: Path) -> None:
    folder = _broken(
        tmp_path, "mixtral", model__layers__0__block_sparse_moe__experts__2__w3__weight=None
    )
    with pytest.raises(
        CheckpointError, match=r"missing tensors \(1\): model.layers.0.mlp.experts.2.up_proj"
    ):
        load(folder)


def test_missing_stacked_expert_tensor(tmp_path: Path) -> None:
    """A v5 checkpoint with ``experts.gate_up_proj`` but no ``experts.down_proj``."""
    cfg = tiny_config("qwen2_moe")
    tensors = random_tensors(cfg)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate = np.stack([tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(4)])
        up = np.stack([tensors.pop(f"{p}{e}.up_proj.weight") for e in range(4)])
        tensors[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        down = np.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(4)])
        if i == 0:
            tensors[p + "down_proj"] = down
    write_checkpoint(tmp_path, cfg, tensors=tensors)
    with pytest.raises(
        CheckpointError, match=r"missing tensors \(1\): model.layers.1.mlp.experts.down_proj$"
    ):
        load(tmp_path)


def test_unexpected_and_misshapen_tensors_are_all_listed(tmp_path: Path) -> None:
    folder = _broken(
        tmp_path,
        model__layers__0__mlp__extra__weight=np.zeros((2, 2), np.float32),
        model__layers__1__mlp__up_proj__weight=np.zeros((40, 32), np.float32),
        model__norm__weight=np.zeros((31,), np.float32),
    )
    with pytest.raises(CheckpointError) as info:
        load(folder)
    text = str(info.value)
    assert "unexpected tensors (1): model.layers.0.mlp.extra.weight" in text
    assert "model.layers.1.mlp.up_proj.weight (40, 32) (config implies (48, 32))" in text
    assert "model.norm.weight (31,) (config implies (32,))" in text


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama")))
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load(tmp_path / "nowhere")


def test_missing_shard(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, tiny_config("llama"), shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        load(tmp_path)


def _misplace(folder: Path, names: list[str]) -> dict[str, str]:
    """Point the shard index of ``folder`` at the wrong shard for each of ``names``; return
    the shards it now names."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    for name in names:
        index["weight_map"][name] = next(f for f in shards if f != index["weight_map"][name])
    index_file.write_text(json.dumps(index))
    return {name: index["weight_map"][name] for name in names}


def test_index_maps_a_tensor_to_a_shard_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each tensor is listed once, with the shard the index wrongly names, beside the other
    problems; the command line prints the same message, without a traceback."""
    cfg = tiny_config("mixtral")
    tensors = random_tensors(cfg)
    del tensors["model.norm.weight"]
    write_checkpoint(tmp_path, cfg, tensors=tensors, shards=2)
    wrong = _misplace(
        tmp_path,
        [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.block_sparse_moe.experts.2.w3.weight",
        ],
    )
    with pytest.raises(CheckpointError) as info:
        load(tmp_path)
    text = str(info.value)
    assert "model.safetensors.index.json maps tensors to shards that lack them (2): " in text
    for name, shard in wrong.items():
        assert f"{name} (not in {shard})" in text
    assert text.endswith("; missing tensors (1): model.norm.weight")
    write_tokenizer(tmp_path, vocab_size=cfg["vocab_size"])
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 1
    captured = capsys.readouterr()  # one message, wrapped at 100 columns
    assert re.sub(r"\n {4}", " ", captured.err) == f"portable-llm generate: error: {text}\n"
    assert captured.out == ""


def test_ignored_tensors(tmp_path: Path) -> None:
    """A tied checkpoint that still stores lm_head, and old rotary buffers, load as HF's do."""
    cfg = tiny_config("qwen2")
    tensors = random_tensors(cfg)
    tensors["lm_head.weight"] = np.zeros((300, 32), np.float32)  # ignored: tied to embed_tokens
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    write_checkpoint(tmp_path, cfg, tensors=tensors)
    model = load(tmp_path)
    assert model.lm_head is None


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_stacked_experts_equal_per_expert_layout(tmp_path: Path, family: str) -> None:
    """HF v5's fused ``experts.gate_up_proj``/``down_proj`` load as the per-expert tensors."""
    cfg = tiny_config(family)
    tensors = random_tensors(cfg, seed=4)
    write_checkpoint(tmp_path / "legacy", cfg, tensors=tensors)
    fused = {}
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        old = {k[len(prefix) :]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
        X = cfg.get("num_local_experts") or cfg["num_experts"]
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        block = "block_sparse_moe" if family == "mixtral" else "mlp"
        stack = {
            n: np.stack([old.pop(f"{block}.experts.{e}.{n}.weight") for e in range(X)])
            for n in names
        }
        fused[prefix + "mlp.experts.gate_up_proj"] = np.concatenate(
            [stack[names[0]], stack[names[1]]], axis=1
        )
        fused[prefix + "mlp.experts.down_proj"] = stack[names[2]]
        fused.update({prefix + k.replace("block_sparse_moe.", "mlp."): v for k, v in old.items()})
    write_checkpoint(tmp_path / "fused", cfg, tensors={**tensors, **fused})
    ids = np.array([[5, 9, 200, 17, 3]])
    assert_close(load(tmp_path / "fused")(ids), load(tmp_path / "legacy")(ids), rtol=0.0, atol=0.0)


def test_dtype_cast_and_bad_dtype(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, tiny_config("qwen3"))
    assert load(tmp_path, dtype="float64").dtype == np.float64
    with pytest.raises(ValueError, match="float dtype"):
        load(tmp_path, dtype="int32")


# -- tokenizer -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, vocab_size=300)
    tok = read_tokenizer(folder)
    assert tok is not None
    return tok


def test_tokenizer_round_trip_and_stream(tokenizer: Tokenizer) -> None:
    text = SENTENCES[-1]  # ends in non-ASCII characters split over several byte tokens
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    pieces = list(tokenizer.stream(ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    assert len(pieces) > 1
    assert tokenizer.token_id("<|endoftext|>") == 2


def test_chat_template(tokenizer: Tokenizer) -> None:  # jinja2: in the test extra
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s>user: hi\n<s>assistant:"


def test_load_without_tokenizer(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, tiny_config("mistral"))
    model = load(tmp_path)
    assert model.tokenizer is None
    assert model.generation_config["eos_token_id"] == 2
    assert "mistral" in repr(model) and "numpy" in repr(model)
    assert pl.to_numpy(model([[4, 5]])).shape == (1, 2, 300)


# -- command line --------------------------------------------------------------------------------


def test_generate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config("qwen2")
    write_checkpoint(tmp_path, cfg)
    write_tokenizer(tmp_path, vocab_size=cfg["vocab_size"])
    code = main(["generate", str(tmp_path), "--prompt", "The keys", "--max-new-tokens", "5"])
    out = capsys.readouterr().out
    model = load(tmp_path)
    want = "".join(pl.generate(model, "The keys", max_new_tokens=5))
    assert code == 0
    assert out.startswith(want + "\n")
    prefill = re.search(r"prefill: 4 tokens in ([\d.]+) s, ([\d.]+) tokens/s", out)
    decode = re.search(r"decode: (\d+) tokens in ([\d.]+) s, ([\d.]+) tokens/s", out)
    assert prefill and float(prefill[2]) > 0
    assert decode and int(decode[1]) <= 4


def test_generate_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # a usage error
        main(["generate", str(tmp_path / "none"), "--prompt", "hi"])
    assert exc.value.code == 2
    assert "path: no such file or folder" in capsys.readouterr().err
    write_checkpoint(tmp_path, tiny_config("llama"))
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 1  # no tokenizer.json
    assert "tokenizer.json" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--device", "gpu"]) == 1
    assert "load: backend 'numpy' has no device 'gpu'" in capsys.readouterr().err


_SMALL_BENCH = {**QWEN2_0_5B, "num_hidden_layers": 1, "vocab_size": 512, "hidden_size": 32}
_SMALL_BENCH.update(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@numpy_only
def test_model_bench(tmp_path: Path) -> None:
    """The model benchmark on a small checkpoint, NumPy only: one row with positive speeds."""
    cfg = _SMALL_BENCH
    out = io.StringIO()
    assert run_model_bench(["numpy"], quick=True, cache_dir=tmp_path, config=cfg, file=out) == 0
    rows = [line.split() for line in out.getvalue().splitlines() if line.startswith("portable")]
    assert len(rows) == 1
    engine, backend, dtype, load_s, unit, prefill, decode, *_ = rows[0]
    assert (engine, backend, dtype, unit) == ("portable_llm", "numpy", "float32", "s")
    assert float(load_s) >= 0 and float(prefill) > 0 and float(decode) > 0


def test_model_bench_without_a_backend_for_the_dtype(tmp_path: Path) -> None:
    """array-api-strict has no float16 (or is not installed): nothing to run is a usage error."""
    out = io.StringIO()
    with pytest.raises(UsageError, match="no selected backend is installed with float16"):
        run_model_bench(
            ["array_api_strict"], dtype="float16", quick=True, cache_dir=tmp_path,
            config=_SMALL_BENCH, file=out,
        )  # fmt: skip
    assert "skipped" in out.getvalue()


def test_bfloat16_checkpoint_loads_in_a_fresh_process(backend: str, tmp_path: Path) -> None:
    # safetensors reads BF16 into NumPy only once ml_dtypes is imported; a process whose first
    # backend never imported it (torch alone) failed with "data type 'bfloat16' not understood".
    import subprocess
    import sys

    from portable_llm.testing.checkpoints import tiny_config, write_checkpoint

    bk = pl.get_backend(backend)
    if "bfloat16" not in bk.float_dtypes():
        pytest.skip(f"{backend} has no bfloat16")
    write_checkpoint(tmp_path, tiny_config("qwen2"), dtype="bfloat16")
    code = (
        "import sys, portable_llm as pl\n"
        f"m = pl.load(sys.argv[1], backend={backend!r})\n"
        "print(pl.get_backend(m.backend).dtype_name(m.embed.dtype))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "bfloat16"
