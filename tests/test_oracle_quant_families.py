"""mlx-lm quantized folders of the families beyond Llama (``phi``, ``phi3``, ``gemma2``,
``gemma3_text``, ``gpt2``, ``qwen3_moe``, ``smollm3``, ``olmo2``, ``granite``, ``starcoder2``,
``cohere2``, ``lfm2``, ``glm4_moe``, ``deepseek_v3``, ``qwen3_next``): a random-initialised
transformers model saved offline with ``save_pretrained``, converted by
``mlx_lm.convert(quantize=True)`` (4 bits, groups of 64), loaded by ``pl.load`` kept quantized
on every backend, against mlx-lm's own model on the same folder (float32 logits within the
float32 tolerance: the same dequantized weights, summed in another order).

What each family's folder holds beyond a Llama's (``checkpoint/mlx_layout.py``): Phi-2's own
names (``dense``, ``fc1``, ``fc2``, ``final_layernorm``); Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` quantized whole (q, k, v and gate, up are row ranges of them); GPT-2 in
mlx-lm's names (``model.h.{i}``, ``model.wte``, ``model.wpe`` quantized too) with its Conv1D
weights transposed at conversion.

Where mlx-lm 0.32.2 reads a transformers-5 config differently from transformers, the test model
avoids the difference rather than hiding it: Phi-2's ``partial_rotary_factor`` is 0.4 (mlx-lm
reads only a top-level one, transformers 5 writes it into ``rope_parameters``; 0.4 is Phi-2's
own and mlx-lm's default); Gemma 2's window is longer than the prompt (mlx-lm's Gemma 2 has no
sliding window); Gemma 3 gets ``sliding_window_pattern: 2`` (mlx-lm ignores ``layer_types``) and
``E = 64`` (mlx-lm rounds ``sqrt(E)`` to bfloat16; 8 is exact); both Gemmas tie their head
(mlx-lm's have no ``lm_head``); GPT-2 is saved in the original
``gpt2`` layout (no ``transformer.`` prefix, mlx-lm's convert expects none) with ``n_ctx``;
Qwen3-MoE's config gets v4's ``num_experts`` and ``rope_theta`` (mlx-lm reads neither v5 name)
and neither a window nor attention biases (mlx-lm's Qwen3-MoE has none); every config gets v4's
top-level ``rope_theta`` from v5's ``rope_parameters``; SmolLM3 no window (mlx-lm's has none);
StarCoder2 ``hidden_act="gelu"`` and no window (mlx-lm's runs the erf GELU whatever the config
says, transformers' default is the tanh form, and has no window); Cohere 2 v4's
``sliding_window_pattern`` (mlx-lm ignores ``layer_types``), with a window of 4, shorter than
the prompt; LFM2 ``block_dim`` (mlx-lm requires it; transformers 5 does not write it), its
convolution in MLX's ``Conv1d`` layout ``(E, K, 1)``, two layers (a convolution, then attention:
with four, conv, attention, conv, conv, array-api-strict's float32 logits were up to 1.7e-5 from
mlx-lm's, 5 of 4200 past the table's 1e-5; the other backends within it).
Qwen3-Next is saved per expert (its checkpoints' layout: mlx-lm 0.32 stacks, and converts the
norms (``1 + w``) and the convolution of, only those) with v4's ``full_attention_interval``;
its ``in_proj_qkvz``, ``in_proj_ba`` and gated ``q_proj`` are read as floats (the family cuts
them with array operations); checked on MLX only (see the test's skip reason).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from conftest import numpy_only
from portable_llm.ops.quant import QuantizedWeight
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import save_hf_tokenizer

pytestmark = pytest.mark.oracle

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 300
IDS = np.random.default_rng(0).integers(3, V, size=(2, 7))
_GEMMA = {"intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 24}  # fmt: skip
_DENSE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
# family -> (config class, model class, config keywords, config.json additions for mlx-lm)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "phi": ("PhiConfig", "PhiForCausalLM", {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "partial_rotary_factor": 0.4,
    }, {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0,
    }, {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        **_GEMMA, "hidden_size": 128, "sliding_window": 8, "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 10.0,
    }, {}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_GEMMA, "hidden_size": 64, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    }, {"sliding_window_pattern": 2}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 128, "n_layer": 2, "n_head": 4,
                                               "n_positions": 64}, {"n_ctx": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "mlp_only_layers": [1],
    }, {"num_experts": 4, "rope_theta": 10000.0}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {
        **_DENSE, "num_hidden_layers": 4, "attention_bias": True, "mlp_bias": True,
        "tie_word_embeddings": False, "pad_token_id": 0,
    }, {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**_DENSE, "tie_word_embeddings": False}, {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        **_DENSE, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
        "attention_multiplier": 0.1, "logits_scaling": 2.0, "attention_bias": True,
        "mlp_bias": True,
    }, {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {**_DENSE, "hidden_act": "gelu"},
                   {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {
        **_DENSE, "num_hidden_layers": 4, "sliding_window": 4, "logit_scale": 0.5,
    }, {"sliding_window_pattern": 4}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {
        **_DENSE, "block_multiple_of": 64, "layer_types": ["conv", "full_attention"],
    }, {"block_dim": 128}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        **_DENSE, "moe_intermediate_size": 64, "head_dim": 32, "partial_rotary_factor": 0.5,
        "use_qk_norm": True, "attention_bias": True, "n_routed_experts": 8,
        "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 1.5, "tie_word_embeddings": False,
    }, {"partial_rotary_factor": 0.5, "rope_scaling": None}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_DENSE, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 64,
        "kv_lora_rank": 64, "qk_nope_head_dim": 64, "qk_rope_head_dim": 16, "v_head_dim": 64,
        "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 2.0, "norm_topk_prob": True, "tie_word_embeddings": False,
    }, {"rope_scaling": None}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **_DENSE, "head_dim": 32, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "linear_num_key_heads": 2, "linear_key_head_dim": 32, "linear_num_value_heads": 4,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "full_attention"], "tie_word_embeddings": False,
    }, {"full_attention_interval": 2, "partial_rotary_factor": 0.25}),
}  # fmt: skip


def _hf_folder(family: str, folder: Path) -> Path:
    config_cls, model_cls, extra, additions = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=V, bos_token_id=1, eos_token_id=2, **extra
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # wider than the default init; Gemma's norms: offsets from 1
        for p in model.parameters():
            low = -0.2 if family.startswith("gemma") else 0.8
            p.copy_(torch.rand_like(p) * 0.4 + low if p.ndim == 1 else torch.randn_like(p) * 0.15)
        for name, b in model.named_buffers():  # GLM-4.5's router bias (HF inits zeros)
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(folder)
    save_hf_tokenizer(folder, vocab_size=V)
    config_json = json.loads((folder / "config.json").read_text())
    theta = config_json.get("rope_parameters", {}).get("rope_theta")
    if theta is not None:  # mlx-lm reads only v4's top-level rope_theta
        additions = {"rope_theta": theta, **additions}
    (folder / "config.json").write_text(json.dumps({**config_json, **additions}))
    if family == "qwen3_next":  # mlx-lm 0.32 converts only per-expert checkpoints
        _per_expert(folder / "model.safetensors")
    if family == "gpt2":  # the original gpt2 layout: no transformer. prefix
        from safetensors.numpy import load_file, save_file

        file = str(folder / "model.safetensors")
        tensors = {k.removeprefix("transformer."): v for k, v in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    return folder


def _per_expert(file: Path) -> None:
    """Rewrite a v5 file's stacked experts ``mlp.experts.gate_up_proj`` ``(X, 2I, E)`` and
    ``down_proj`` ``(X, E, I)`` per expert (``mlp.experts.{e}.gate_proj.weight``, ...), the
    layout of Qwen3-Next's own checkpoints, the only one mlx-lm 0.32's ``qwen3_next`` stacks
    (and whose norms and convolution it converts only then)."""
    from safetensors.numpy import load_file, save_file

    out = {}
    for name, value in load_file(str(file)).items():
        stem, _, leaf = name.rpartition(".")
        if stem.endswith(".experts") and leaf == "gate_up_proj":
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{stem}.{e}.gate_proj.weight"] = np.ascontiguousarray(value[e, :half])
                out[f"{stem}.{e}.up_proj.weight"] = np.ascontiguousarray(value[e, half:])
        elif stem.endswith(".experts") and leaf == "down_proj":
            for e in range(value.shape[0]):
                out[f"{stem}.{e}.down_proj.weight"] = np.ascontiguousarray(value[e])
        else:
            out[name] = value
    save_file(out, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def mlx_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx_families")
    out = {}
    for family in FAMILIES:
        hf = _hf_folder(family, root / f"{family}_hf")
        out[family] = root / family
        mlx_lm.convert(hf_path=str(hf), mlx_path=str(out[family]), quantize=True, q_bits=4,
                       q_group_size=64)  # fmt: skip
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_family_folder_logits_match_mlx_lm(mlx_folders: dict, family: str, backend: str) -> None:
    if family == "qwen3_next" and backend != "mlx":
        pytest.skip(
            "qwen3_next: mlx-lm 0.32's own float32 logits differ from NumPy's, torch's and "
            "array-api-strict's (which agree with each other and, in test_oracle_families, "
            "with transformers) by up to 4.5e-5 on this model, past the table's 1e-5; MLX's "
            "match them (the folder's reading is backend-independent)"
        )
    folder = mlx_folders[family]
    ref, _ = mlx_lm_utils.load_model(folder)
    want = np.array(ref(mx.array(IDS)).astype(mx.float32))
    model = pl.load(folder, backend=backend, dequantize=False)
    assert model.config.model_type == family
    attn = next(layer.attn for layer in model.layers if layer.attn is not None)  # LFM2: layer 1
    q = attn.wq if attn.wq is not None else attn.wq_a  # DeepSeek V3: q_a_proj
    if family == "qwen3_next":  # its gated q_proj is cut at load, read as floats
        q = attn.wo
    # kept quantized, a fused module's rows for phi3 and gpt2
    assert isinstance(q, QuantizedWeight) and (q.bits, q.group_size) == (4, 64)
    assert isinstance(model.embed, QuantizedWeight)
    if family == "lfm2":  # the short convolution's projections kept quantized too
        assert isinstance(model.layers[0].mixer.in_proj, QuantizedWeight)
    got = model(pl.asarray(IDS, backend=backend))
    assert_close(got, want, backend=backend, dtype="float32")


@numpy_only
def test_deepseek_folder_kv_b_joined(mlx_folders: dict) -> None:
    """mlx-lm's ``embed_q``/``unembed_out`` (each quantized alone) are joined into HF's
    ``kv_b_proj``, alike on load and by a partitioned load's reader."""
    from portable_llm.checkpoint.config import read_config
    from portable_llm.checkpoint.quantized import read_quantization
    from portable_llm.checkpoint.quantized_slices import QuantizedSlices
    from portable_llm.checkpoint.shards import SafetensorsFiles

    folder = mlx_folders["deepseek_v3"]
    model = pl.load(folder, backend="numpy", dequantize=False)
    want = np.asarray(model.layers[1].attn.wkv_b)  # (H (d_n + d_v), R)
    quant = read_quantization(folder)
    assert quant is not None
    with SafetensorsFiles(folder) as st:
        slices = QuantizedSlices(st, read_config(folder), quant)
        name = "model.layers.1.self_attn.kv_b_proj.weight"
        assert slices.shapes[name] == want.shape == (2 * (64 + 64), 64)
        np.testing.assert_array_equal(slices.read(name), want)


#: gpt-oss as mlx-lm 0.32 reads it: a top-level ``rope_theta`` and no YaRN (mlx-lm rounds
#: YaRN's correction range, gpt-oss's ``truncate=False`` does not), ``swiglu_limit`` 7 (mlx-lm's
#: fixed clamp; gpt-oss's default), a window shorter than the prompt on the even layers.
_GPT_OSS = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
            "swiglu_limit": 7.0, "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip


@pytest.fixture(scope="module", params=[False, True], ids=["mxfp4", "mxfp4+q4"])
def gpt_oss_mlx_folder(tmp_path_factory: pytest.TempPathFactory, request: Any) -> Path:
    """mlx-lm's folder of a tiny gpt-oss: OpenAI's MXFP4 layout (the experts' ``*_blocks`` and
    ``*_scales``, ``quantization_config`` ``mxfp4``: the only gpt-oss checkpoint mlx-lm 0.32
    converts) through ``mlx_lm.convert``, which keeps the experts' codes in MLX's ``mxfp4``
    mode (gate and up de-interleaved) and the rest in floats, or with ``quantize=True`` the
    other matrices in 4-bit affine groups of 64 and the routers in 8 bits (per-layer entries
    without a mode: affine, as MLX's ``to_quantized`` reads them)."""
    from safetensors.numpy import load_file, save_file

    from test_oracle_gpt_oss import quantize_mxfp4

    root = tmp_path_factory.mktemp("gpt_oss_mlx")
    hf_dir, out = root / "hf", root / "mlx"
    config = transformers.GptOssConfig(vocab_size=V, bos_token_id=1, eos_token_id=2, **_GPT_OSS)
    torch.manual_seed(3)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn_like(p) * 0.15)
            else:  # norms near 1; biases and sinks near 0
                p.copy_(
                    torch.rand_like(p) * 0.4 + 0.8 if "norm" in name else torch.randn_like(p) * 0.1
                )
    model.save_pretrained(hf_dir)
    file = str(hf_dir / "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = np.ascontiguousarray(tensors.pop(name).swapaxes(1, 2))  # (X, out, in)
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(rows)
    save_file(tensors, file, metadata={"format": "pt"})
    config_json = json.loads((hf_dir / "config.json").read_text())
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    config_json |= {"rope_theta": 10000.0, "quantization_config": mxfp4}
    (hf_dir / "config.json").write_text(json.dumps(config_json))
    save_hf_tokenizer(hf_dir, vocab_size=V)
    mlx_lm.convert(hf_path=str(hf_dir), mlx_path=str(out), quantize=request.param, q_bits=4,
                   q_group_size=64)  # fmt: skip
    return out


def test_gpt_oss_folder_logits_match_mlx_lm(gpt_oss_mlx_folder: Path, backend: str) -> None:
    """mlx-lm's gpt-oss folder (``quantization`` ``mode: "mxfp4"``): the experts' ``uint32``
    words and ``uint8`` exponents read as :class:`~portable_llm.MXFP4Weight` (``router``,
    ``experts.*_proj.bias`` by mlx-lm's names), the logits mlx-lm's own model gives."""
    ref, _ = mlx_lm_utils.load_model(gpt_oss_mlx_folder)
    want = np.array(ref(mx.array(IDS)).astype(mx.float32))
    model = pl.load(gpt_oss_mlx_folder, backend=backend, dtype="float32", dequantize=False)
    moe = model.layers[0].moe
    experts = (moe.experts_gate, moe.experts_up, moe.experts_down)
    assert all(isinstance(w, pl.MXFP4Weight) for w in experts)
    assert [w.shape for w in experts] == [(4, 32, 64), (4, 32, 64), (4, 64, 32)]
    quant = json.loads((gpt_oss_mlx_folder / "config.json").read_text())["quantization"]
    q4 = "model.layers.0.self_attn.q_proj" in quant  # the other matrices quantized too
    assert isinstance(model.layers[0].attn.wq, QuantizedWeight) == q4
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend, dtype="float32")
