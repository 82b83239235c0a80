"""Checkpoints written by HF transformers, loaded on every backend: logits and greedy tokens
agree with transformers (float32 and bfloat16), and with mlx-lm on MLX.

Each family is built once per session, random-initialised from a seed, and saved with
``save_pretrained`` (no download: ``HF_HUB_OFFLINE=1``), with a ``tokenizers`` BPE.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.models import load
from portable_llm.testing import MODEL_TOLERANCES, assert_close
from portable_llm.testing.checkpoints import write_tokenizer

pytestmark = pytest.mark.oracle
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 300
COMMON = dict(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2", {"rope_theta": 1e6, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3", {"head_dim": 32}),
    "llama": ("Llama", {
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    }),
    "mistral": ("Mistral", {"sliding_window": 6}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2Moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "use_sliding_window": True, "sliding_window": 6,
        "max_window_layers": 2,
    }),
}  # fmt: skip
MOE = ("mixtral", "qwen2_moe")
IDS = np.random.default_rng(0).integers(3, V, size=(2, 12))  # longer than every window


def _build(family: str, folder: Path, seed: int, **change: Any) -> Any:
    name, extra = FAMILIES[family]
    config = getattr(transformers, f"{name}Config")(**COMMON, **{**extra, **change})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():  # wider than the default init (std 0.02): varied greedy tokens
        for p in model.parameters():
            p.copy_(torch.rand_like(p) * 0.4 + 0.8 if p.ndim == 1 else torch.randn_like(p) * 0.15)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """family -> (folder, transformers model in float32)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(family)
        out[family] = (folder, _build(family, folder, seed=i))
        write_tokenizer(folder, vocab_size=V)
    return out


@pytest.fixture(scope="session")
def hf_all_experts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """MoE families with every expert routed, for bfloat16 (no top-k choice to flip)."""
    out = {}
    for family in MOE:
        folder = tmp_path_factory.mktemp(f"{family}_all")
        X = FAMILIES[family][1].get("num_local_experts") or FAMILIES[family][1]["num_experts"]
        out[family] = (folder, _build(family, folder, seed=7, num_experts_per_tok=X))
    return out


def _hf_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(hf_models: dict, family: str, backend: str) -> None:
    folder, hf = hf_models[family]
    model = load(folder, backend=backend, dtype="float32")
    assert_close(model(pl.asarray(IDS, backend=backend)), _hf_logits(hf, IDS), backend=backend)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(hf_models: dict, family: str, backend: str) -> None:
    folder, hf = hf_models[family]
    prompt = IDS[0, :7]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(prompt[None]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    want = out[0, len(prompt) :].tolist()
    model = load(folder, backend=backend, dtype="float32")
    assert list(pl.generate(model, prompt, max_new_tokens=20, stop=())) == want
    assert len(set(want)) > 3  # the test models do not just repeat one token


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_matches_transformers(
    hf_models: dict, hf_all_experts: dict, family: str, backend: str
) -> None:
    if "bfloat16" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no bfloat16")
    folder, hf = (hf_all_experts if family in MOE else hf_models)[family]
    hf16 = type(hf).from_pretrained(folder, dtype=torch.bfloat16).eval()
    model = load(folder, backend=backend, dtype="bfloat16")
    tol = MODEL_TOLERANCES["bfloat16"]
    got = model(pl.asarray(IDS, backend=backend))
    want = _hf_logits(hf16, IDS)  # float32 copy of transformers' bfloat16 logits
    assert_close(got, want, backend=backend, dtype="bfloat16", rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("family", MOE)
def test_fused_expert_layout_of_transformers_v5(
    hf_models: dict, family: str, tmp_path: Path
) -> None:
    """``save_pretrained(save_original_format=False)`` writes ``experts.gate_up_proj``."""
    folder, hf = hf_models[family]
    hf.save_pretrained(tmp_path, save_original_format=False)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()  # noqa: SIM118
    fused = load(tmp_path, dtype="float32")(IDS)
    assert_close(fused, load(folder, dtype="float32")(IDS), rtol=0.0, atol=0.0)


def test_sharded_checkpoint_of_transformers(hf_models: dict, tmp_path: Path) -> None:
    _, hf = hf_models["qwen2_moe"]
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_close(load(tmp_path, dtype="float32")(IDS), _hf_logits(hf, IDS), dtype="float32")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_mlx_lm(hf_models: dict, family: str) -> None:
    """mlx-lm's own model classes on the same folder, both on MLX in float32.

    mlx-lm 0.32 reads a sliding window only from ``layer_types`` (which Mistral configs do not
    have) and not at all for Qwen2-MoE, so the prompt stays within the windows (6 tokens). It
    reads RoPE from the v4 fields ``rope_theta``/``rope_scaling``, not from the
    ``rope_parameters`` that transformers v5 writes: they are handed to it as v4 fields.
    """
    mx = pytest.importorskip("mlx.core")
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    folder, _ = hf_models[family]
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    v4 = {"rope_theta": rope["rope_theta"]}
    if rope["rope_type"] != "default":
        v4["rope_scaling"] = rope
    ref, _ = mlx_lm_utils.load_model(Path(folder), model_config=v4)
    ids = IDS[:, :6]
    want = ref(mx.array(ids))
    got = load(folder, backend="mlx", dtype="float32")(pl.asarray(ids, backend="mlx"))
    assert_close(got, want)
