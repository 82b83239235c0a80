"""The config.json of the families beyond Llama (GPT-2, Phi-2, Phi-3, Gemma 2/3, Llama 4,
SmolLM3, OLMo 2, Granite, StarCoder2, Cohere 2, LFM2, Falcon-H1), as transformers 5 writes it and in
transformers 4's spellings, read into DecoderConfig's fields; a folder of an unsupported family
is refused by its model type before anything else.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.checkpoint import CheckpointError
from portable_llm.decoder.config import READ_MODEL_TYPES, SUPPORTED_MODEL_TYPES, DecoderConfig

SIZES = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 100}

# Trimmed from what transformers 5.23's save_pretrained writes (PretrainedConfig.to_dict).
V5: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
             "n_embd": 32, "n_head": 4, "n_inner": None, "n_layer": 2, "n_positions": 64,
             "scale_attn_weights": True, "tie_word_embeddings": True, "vocab_size": 100,
             "bos_token_id": 50256, "eos_token_id": 50256},
    "phi": {**SIZES, "model_type": "phi", "num_hidden_layers": 2, "hidden_act": "gelu_new",
            "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "qk_layernorm": False,
            "num_key_value_heads": 4, "tie_word_embeddings": False,
            "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                                "rope_type": "default"}},
    "phi3": {**SIZES, "model_type": "phi3", "num_hidden_layers": 2, "hidden_act": "silu",
             "rms_norm_eps": 1e-05, "max_position_embeddings": 4096, "num_key_value_heads": 4,
             "original_max_position_embeddings": 4096, "sliding_window": 16,
             "rope_parameters": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                 "rope_type": "default"}, "tie_word_embeddings": False},
    "gemma2": {**SIZES, "model_type": "gemma2", "num_hidden_layers": 2, "num_key_value_heads": 2,
               "head_dim": 8, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4096,
               "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0,
                                                          "rope_type": "default"},
               "tie_word_embeddings": True},
    "gemma3_text": {**SIZES, "model_type": "gemma3_text", "num_hidden_layers": 7,
                    "num_key_value_heads": 2, "head_dim": 8, "attn_logit_softcapping": None,
                    "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
                    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "sliding_window": 512,
                    "layer_types": ["sliding_attention"] * 5 + ["full_attention",
                                                                "sliding_attention"],
                    "rope_parameters": {
                        "full_attention": {"rope_theta": 1000000.0, "rope_type": "linear",
                                           "factor": 8.0},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
                    "tie_word_embeddings": True},
    "llama4_text": {**SIZES, "model_type": "llama4_text", "num_hidden_layers": 4,
                    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size_mlp": 96,
                    "attention_chunk_size": 8192, "attn_scale": 0.1,
                    "attn_temperature_tuning": True, "floor_scale": 8192,
                    "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
                    "moe_layers": [1, 3], "no_rope_layers": [1, 1, 1, 0],
                    "num_experts_per_tok": 1, "num_local_experts": 4, "rms_norm_eps": 1e-05,
                    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
                    "use_qk_norm": True, "tie_word_embeddings": False},
    "smollm3": {**SIZES, "model_type": "smollm3", "num_hidden_layers": 4,
                "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-06,
                "rope_parameters": {"rope_theta": 2000000.0, "rope_type": "default"},
                "use_sliding_window": True, "sliding_window": 16, "no_rope_layers": [1, 1, 1, 0],
                "no_rope_layer_interval": 4,
                "layer_types": ["full_attention"] * 3 + ["sliding_attention"],
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True},
    "olmo2": {**SIZES, "model_type": "olmo2", "num_hidden_layers": 4, "num_key_value_heads": 2,
              "hidden_act": "silu", "rope_parameters": {"rope_theta": 10000.0,
                                                        "rope_type": "default"},
              "attention_bias": False, "rms_norm_eps": 1e-05, "tie_word_embeddings": False},
    "granite": {**SIZES, "model_type": "granite", "num_hidden_layers": 4,
                "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-06,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                "attention_bias": False, "mlp_bias": False, "embedding_multiplier": 12.0,
                "logits_scaling": 8.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0078125, "tie_word_embeddings": False},
    "starcoder2": {**SIZES, "model_type": "starcoder2", "num_hidden_layers": 4,
                   "num_key_value_heads": 2, "hidden_act": "gelu_pytorch_tanh",
                   "norm_epsilon": 1e-05, "rope_parameters": {"rope_theta": 10000.0,
                                                              "rope_type": "default"},
                   "sliding_window": 16, "use_bias": True, "tie_word_embeddings": True},
    "cohere2": {**SIZES, "model_type": "cohere2", "num_hidden_layers": 4,
                "num_key_value_heads": 2, "logit_scale": 0.0625, "hidden_act": "silu",
                "layer_norm_eps": 1e-05, "tie_word_embeddings": True,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                "attention_bias": False, "sliding_window": 16,
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "head_dim": 8},
    "lfm2": {**SIZES, "model_type": "lfm2", "num_hidden_layers": 4, "num_key_value_heads": 2,
             "norm_eps": 1e-05, "tie_word_embeddings": True, "conv_bias": False,
             "conv_L_cache": 3, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": True, "full_attn_idxs": [1, 3],
             "layer_types": ["conv", "full_attention", "conv", "full_attention"],
             "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
             "max_position_embeddings": 128000},
    "falcon_h1": {**SIZES, "model_type": "falcon_h1", "num_hidden_layers": 2,
                  "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-05,
                  "tie_word_embeddings": False, "mamba_d_ssm": 32, "mamba_n_heads": 4,
                  "mamba_d_head": 8, "mamba_n_groups": 2, "mamba_d_state": 16,
                  "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
                  "mamba_conv_bias": True, "mamba_proj_bias": False,
                  "mamba_norm_before_gate": False, "mamba_rms_norm": False,
                  "time_step_limit": [0.0, {"__float__": "Infinity"}], "projectors_bias": False,
                  "embedding_multiplier": 5.66, "lm_head_multiplier": 0.039,
                  "mlp_multipliers": [0.88, 0.59], "key_multiplier": 0.39,
                  "attention_out_multiplier": 0.94, "attention_in_multiplier": 1.0,
                  "ssm_multipliers": [0.35, 0.25, 0.5, 0.35, 0.35], "ssm_in_multiplier": 1.25,
                  "ssm_out_multiplier": 0.24,
                  "rope_parameters": {"rope_theta": 1e11, "rope_type": "default"}},
}  # fmt: skip

# The same models in transformers 4's spellings (rope_theta, rope_scaling, per-family patterns).
V4: dict[str, dict[str, Any]] = {
    "gpt2": V5["gpt2"],  # GPT-2's own names are the same in both
    "phi": {**{k: v for k, v in V5["phi"].items() if k != "rope_parameters"},
            "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_scaling": None},
    "phi3": {**{k: v for k, v in V5["phi3"].items() if k != "rope_parameters"},
             "rope_theta": 10000.0, "rope_scaling": None, "partial_rotary_factor": 1.0},
    "gemma2": {**{k: v for k, v in V5["gemma2"].items() if k not in ("rope_parameters",
                                                                     "layer_types")},
               "rope_theta": 10000.0},
    "gemma3_text": {**{k: v for k, v in V5["gemma3_text"].items()
                       if k not in ("rope_parameters", "layer_types")},
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                    "sliding_window_pattern": 6},
    "llama4_text": {**{k: v for k, v in V5["llama4_text"].items()
                       if k not in ("rope_parameters", "layer_types", "moe_layers",
                                    "no_rope_layers")},
                    "rope_theta": 500000.0, "interleave_moe_layer_step": 2,
                    "no_rope_layer_interval": 4},
    # SmolLM3 without its lists: the NoPE layers every no_rope_layer_interval-th, they slide
    "smollm3": {**{k: v for k, v in V5["smollm3"].items()
                   if k not in ("rope_parameters", "layer_types", "no_rope_layers")},
                "rope_theta": 2000000.0},
    "olmo2": {**{k: v for k, v in V5["olmo2"].items() if k != "rope_parameters"},
              "rope_theta": 10000.0, "rope_scaling": None},
    "granite": {**{k: v for k, v in V5["granite"].items() if k != "rope_parameters"},
                "rope_theta": 10000.0, "rope_scaling": None},
    "starcoder2": {**{k: v for k, v in V5["starcoder2"].items() if k != "rope_parameters"},
                   "rope_theta": 10000.0, "rope_scaling": None},
    "cohere2": {**{k: v for k, v in V5["cohere2"].items()
                   if k not in ("rope_parameters", "layer_types")},
                "rope_theta": 10000.0, "sliding_window_pattern": 4},
    # LFM2's original names: block_ff_dim, tie_embedding, full_attn_idxs without layer_types
    "lfm2": {**{k: v for k, v in V5["lfm2"].items()
                if k not in ("rope_parameters", "layer_types", "intermediate_size",
                             "tie_word_embeddings")},
             "rope_theta": 1000000.0, "block_ff_dim": 64, "tie_embedding": True},
    # Falcon-H1: rope_theta, and time_step_limit's infinity as JSON's Infinity
    "falcon_h1": {**{k: v for k, v in V5["falcon_h1"].items()
                     if k not in ("rope_parameters", "time_step_limit")},
                  "rope_theta": 1e11, "time_step_limit": [0.0, math.inf]},
}  # fmt: skip


@pytest.mark.parametrize("version", ["v5", "v4"])
@pytest.mark.parametrize("family", list(V5))
def test_family_fields(family: str, version: str) -> None:
    cfg = DecoderConfig.from_dict((V5 if version == "v5" else V4)[family])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (32, 4, 100)
    n = cfg.num_hidden_layers
    want: dict[str, Any] = {
        "gpt2": dict(norm="layer", position_embedding="learned", gated_mlp=False,
                     qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True,
                     intermediate_size=128, hidden_act="gelu_new", rms_norm_eps=1e-5,
                     num_key_value_heads=4, max_position_embeddings=64),
        "phi": dict(norm="layer", parallel_block=True, gated_mlp=False, lm_head_bias=True,
                    qkv_bias=True, o_bias=True, mlp_bias=True, hidden_act="gelu_new"),
        "phi3": dict(norm="rms", gated_mlp=True, sliding_window=16,
                     layer_types=("sliding_attention",) * n),
        "gemma2": dict(norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                       attn_scale=256**-0.5, attn_softcap=50.0, final_softcap=30.0,
                       hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                       layer_types=("sliding_attention", "full_attention"), sliding_window=4096),
        "gemma3_text": dict(norm_offset=1.0, qk_norm=True, attn_softcap=None, final_softcap=None,
                            sliding_window=512, layer_types=("sliding_attention",) * 5
                            + ("full_attention", "sliding_attention")),
        "llama4_text": dict(intermediate_size=96, moe_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=1, router="sigmoid", qk_l2_norm=True,
                            shared_expert_intermediate_size=64, attention_chunk_size=8192,
                            moe_layers=(False, True, False, True),
                            no_rope_layers=(False, False, False, True),
                            layer_types=("chunked_attention",) * 3 + ("full_attention",)),
        "smollm3": dict(no_rope_layers=(False, False, False, True), sliding_window=16,
                        layer_types=("full_attention",) * 3 + ("sliding_attention",),
                        tie_word_embeddings=True, o_bias=False, attn_temperature_tuning=False),
        "olmo2": dict(post_norms=True, qk_norm=True, qk_norm_whole=True, rms_norm_eps=1e-5,
                      sandwich_norms=False),
        "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                        attn_scale=0.0078125, logit_scale=0.125),
        "starcoder2": dict(norm="layer", norm_bias=True, gated_mlp=False, qkv_bias=True,
                           o_bias=True, mlp_bias=True, rms_norm_eps=1e-5,
                           hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                           sliding_window=16, layer_types=("sliding_attention",) * n),
        "cohere2": dict(norm="layer", norm_bias=False, parallel_block=True, logit_scale=0.0625,
                        head_dim=8, no_rope_layers=(False, False, False, True),
                        layer_types=("sliding_attention",) * 3 + ("full_attention",),
                        sliding_window=16, rms_norm_eps=1e-5, tie_word_embeddings=True),
        # the MLP: int(2 * 64 / 3) = 42, rounded up to a multiple of 256
        "lfm2": dict(qk_norm=True, intermediate_size=256, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, sliding_window=None,
                     layer_types=("conv", "full_attention", "conv", "full_attention"),
                     mixer={"conv_L_cache": 3, "conv_bias": False}),
        "falcon_h1": dict(embedding_multiplier=5.66, logit_scale=0.039, head_dim=8,
                          num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None,
                          layer_types=("full_attention",) * n, mixer={
                              "n_groups": 2, "head_dim": 8, "norm_before_gate": False,
                              "eps": 1e-5, "in_multiplier": 1.25, "dt_limit": (0.0, math.inf),
                              "chunk_size": 256,
                              "ssm_multipliers": (0.35, 0.25, 0.5, 0.35, 0.35), "d_ssm": 32,
                              "n_heads": 4, "d_state": 16, "rms_norm": False, "d_conv": 4,
                              "conv_bias": True, "proj_bias": False, "projectors_bias": False,
                              "mlp_multipliers": (0.88, 0.59), "attention_in_multiplier": 1.0,
                              "attention_out_multiplier": 0.94, "key_multiplier": 0.39,
                              "ssm_out_multiplier": 0.24}),
    }[family]  # fmt: skip
    assert {k: getattr(cfg, k) for k in want} == want
    if family == "phi":
        assert cfg.rope["scaling"]["partial_rotary_factor"] == 0.5
    if family == "smollm3":  # HF's default theta when v4 gives none is 2e6 too
        assert cfg.rope["base"] == 2e6
    if family == "cohere2":  # interleaved RoPE pairs
        assert cfg.rope["traditional"] is True
    if family == "falcon_h1":  # Falcon-H1's released theta
        assert cfg.rope["base"] == 1e11
    if family == "gemma3_text":  # each layer type its own RoPE
        assert cfg.rope["base"] == 1e6 and cfg.rope["scaling"]["factor"] == 8.0
        assert cfg.rope_local is not None and cfg.rope_local["base"] == 1e4
        assert cfg.rope_local["scaling"]["rope_type"] == "default"


def test_v4_and_v5_read_alike() -> None:
    for family in V5:
        a, b = DecoderConfig.from_dict(V5[family]), DecoderConfig.from_dict(V4[family])
        assert a.to_dict() == b.to_dict(), family


def test_families_are_not_loaded_until_the_decoder_runs_them(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    for family in READ_MODEL_TYPES:
        assert family not in SUPPORTED_MODEL_TYPES
        (tmp_path / "config.json").write_text(json.dumps(V5[family]))
        with pytest.raises(CheckpointError, match=f"unsupported model_type '{family}'; supp"):
            pl.load(tmp_path)


def test_unsupported_family_is_named_before_any_other_check(tmp_path: Path) -> None:
    """A BERT folder (its encoder weights hold no decoder layer): the model type is the
    answer, not a layer-count mismatch."""
    from safetensors.numpy import save_file

    cfg = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 100}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weights = {f"encoder.layer.{i}.attention.self.query.weight": np.zeros((32, 32), np.float32)
               for i in range(2)}  # fmt: skip
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        pl.load(tmp_path)
    message = str(info.value)
    assert "unsupported model_type 'bert'; supported: " in message
    assert message.endswith(", ".join(SUPPORTED_MODEL_TYPES))


@pytest.mark.parametrize("case", ["no weights", "bad quantization", "partitioned"])
def test_unsupported_family_is_named_before_the_folder_is_read(tmp_path: Path, case: str) -> None:
    """The model type comes before the weights files, an mlx-lm ``quantization`` entry and a
    partitioned load's reading."""
    cfg: dict[str, Any] = {"model_type": "bert", "num_hidden_layers": 2}
    if case == "bad quantization":
        cfg["quantization"] = {"bits": 7, "group_size": 5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'bert'; supported: "):
        if case == "partitioned":
            from portable_llm.checkpoint.build import LoadOptions
            from portable_llm.checkpoint.partitioned import read_partitioned

            read_partitioned(tmp_path, LoadOptions(), None)
        else:
            pl.load(tmp_path)


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_theta": 1e6}}},
         "must give full_attention and sliding_attention"),
        ("llama4_text", {"no_rope_layers": [1, 0]}, "no_rope_layers must list 4 flags"),
        ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope"}}, "needs the field 'short_factor'"),
        ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers must list 4 flags"),
        ("granite", {"logits_scaling": 0}, "logits_scaling must be finite and > 0.0"),
        ("granite", {"residual_multiplier": "1"}, "residual_multiplier must be a real number"),
        ("starcoder2", {"use_bias": 1}, "use_bias must be true or false"),
        ("cohere2", {"layer_types": "sliding_attention"}, "layer_types must be a list"),
        ("cohere2", {"logit_scale": -1.0}, "logit_scale must be finite and > 0.0"),
        ("lfm2", {"layer_types": ["conv", "mamba", "conv", "conv"]},
         "lfm2's layer_types must list"),
        ("lfm2", {"conv_L_cache": 0}, "conv_L_cache must be"),
        ("lfm2", {"conv_bias": "no"}, "conv_bias must be true or false"),
        ("falcon_h1", {"mamba_n_heads": 5}, r"mamba_n_heads \* mamba_d_head must equal"),
        ("falcon_h1", {"mamba_n_groups": 3}, "mamba_n_groups=3 must divide mamba_n_heads=4"),
        ("falcon_h1", {"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers must list 5 reals"),
        ("falcon_h1", {"key_multiplier": 0}, "key_multiplier must be finite and > 0.0"),
        ("falcon_h1", {"mlp_multipliers": 2.0}, "mlp_multipliers must list 2 reals"),
        ("falcon_h1", {"time_step_limit": [0.5, 0.1]}, r"time_step_limit\[1\] must be"),
        ("falcon_h1", {"mamba_rms_norm": "yes"}, "mamba_rms_norm must be true or false"),
    ],
)  # fmt: skip
def test_bad_family_configs(family: str, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecoderConfig.from_dict({**V5[family], **change})


def test_gemma2_is_read_from_its_family_file() -> None:
    """Gemma 2 lives in decoder/families/gemma2.py (issue 29): its model type is supported
    through the registry, and its class defaults, fields, sliding layers and layer recipe are
    the file's: a config.json that leaves them out gets HF's Gemma2Config defaults."""
    from portable_llm.decoder.families import FAMILIES, gemma2, layer_reader

    assert FAMILIES["gemma2"] is gemma2.FAMILY and "gemma2" in SUPPORTED_MODEL_TYPES
    assert layer_reader("gemma2") is gemma2.read_layer
    left_out = ("head_dim", "hidden_activation", "attn_logit_softcapping", "layer_types",
                "final_logit_softcapping", "tie_word_embeddings", "sliding_window")  # fmt: skip
    d = {k: v for k, v in V5["gemma2"].items() if k not in left_out}
    cfg = DecoderConfig.from_dict({**d, "num_hidden_layers": 3})
    # Gemma2Config's defaults: head_dim 256, gelu_pytorch_tanh, caps 50 and 30, tied, window
    # 4096 on the even layers (v4's rule)
    assert (cfg.head_dim, cfg.hidden_act, cfg.tie_word_embeddings) == (
        256,
        "gelu_pytorch_tanh",
        True,
    )
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == (50.0, 30.0, 4096)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.norm_offset, cfg.embed_scale, cfg.sandwich_norms) == (1.0, True, True)
    assert cfg.attn_scale == 256**-0.5
