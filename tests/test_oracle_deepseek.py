"""DeepSeek V3 (Kimi K2's architecture) beside transformers: what its family's rows of
``tests/test_oracle_families.py`` (logits in float32 and bfloat16, cached decode, greedy,
batched and speculative tokens, left padding) do not check.

- the cache holds the latent: after a prompt, each layer's cache holds transformers' compressed
  ``c_kv`` (its cache's keys) and rotary key (its values, whose interleaved pairs HF writes
  de-interleaved), ``R + d_r`` numbers per token and layer;
- the other spellings of the config: no query LoRA (``q_proj``), rotate-half RoPE
  (``rope_interleave=false``), the default RoPE, no biases, one group, weights not
  renormalised; transformers 4's ``rope_scaling``;
- the compiled decode step (JAX: the MoE layers too; MLX: dense layers only);
- the router's correction bias stays float32 in a bfloat16 model, as transformers keeps it;
- batched (paged) generation, its latent pages holding ``[c_kv, k_pe]``, of prompts of other
  lengths equal each alone.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close
from test_oracle_families import FAMILIES, IDS, _build, hf_logits

pytestmark = pytest.mark.oracle
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GIVEN = FAMILIES["deepseek_v3"][1]
R, DR = GIVEN["kv_lora_rank"], GIVEN["qk_rope_head_dim"]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("deepseek_v3")
    return folder, _build("deepseek_v3", folder, seed=21)


@pytest.mark.slow_on("jax")  # JAX compiles each shape: ~10 s more of the oracle env
def test_the_cache_holds_the_latent(deepseek: tuple[Path, Any], backend: str) -> None:
    folder, hf = deepseek
    model = pl.load(folder, backend=backend, dtype="float32")
    cache = model.make_cache()
    model(pl.asarray(IDS, backend=backend), cache=cache)
    with torch.no_grad():
        past = hf(torch.tensor(IDS), use_cache=True).past_key_values
    S = IDS.shape[1]
    for i, c in enumerate(cache):
        k, v = (pl.to_numpy(a)[:, :, :S, :] for a in c.state)  # the slots of the tokens seen
        assert k.shape == (2, 1, S, R) and v.shape == (2, 1, S, DR)  # R + d_r per token
        assert_close(k, past.layers[i].keys.numpy(), backend="numpy")
        pairs = np.concatenate([v[..., 0::2], v[..., 1::2]], axis=-1)  # HF's de-interleaved
        assert_close(pairs, past.layers[i].values.numpy(), backend="numpy")


VARIANTS = {
    "no query LoRA, rotate-half, default RoPE, no bias": {
        "q_lora_rank": None, "rope_interleave": False, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e4},
    },
    "one group, weights not renormalised, one dense layer of two": {
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "num_hidden_layers": 2,
    },
}  # fmt: skip


@pytest.mark.slow_on("jax", "array_api_strict")  # two more models: ~50 s on JAX
@pytest.mark.parametrize("variant", VARIANTS)
def test_other_configs_match_transformers(backend: str, tmp_path: Path, variant: str) -> None:
    hf = _build("deepseek_v3", tmp_path, seed=5, **VARIANTS[variant])
    model = pl.load(tmp_path, backend=backend, dtype="float32")
    want = hf_logits(hf, IDS)
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend)
    cache = model.make_cache()
    parts = [pl.to_numpy(model(pl.asarray(IDS[:, :9], backend=backend), cache=cache))]
    parts.append(pl.to_numpy(model(pl.asarray(IDS[:, 9:], backend=backend), cache=cache)))
    assert_close(np.concatenate(parts, axis=1), want, backend="numpy")


def test_transformers_4_spelling(deepseek: tuple[Path, Any], tmp_path: Path) -> None:
    """A v4 ``config.json``: ``rope_theta`` and ``rope_scaling`` (``"type": "yarn"``), not
    ``rope_parameters``; the experts one tensor per expert (what ``save_pretrained`` writes);
    a multi-token-prediction layer past ``num_hidden_layers`` (DeepSeek V3's checkpoints hold
    one, ``model.layers.61``), which is not run, as transformers does not run it."""
    from safetensors.numpy import load_file, save_file

    folder, hf = deepseek
    config = json.loads((folder / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {**{k: v for k, v in params.items() if k != "rope_type"},
                              "type": params["rope_type"]}  # fmt: skip
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    n = config["num_hidden_layers"]
    mtp = {
        f"model.layers.{n}.{k}": v for k, v in tensors.items() if k.startswith("model.layers.0.")
    }
    mtp[f"model.layers.{n}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"))
    model = pl.load(tmp_path, backend="numpy", dtype="float32")
    assert_close(model(IDS), hf_logits(hf, IDS), backend="numpy")


@pytest.mark.parametrize("moe", [pytest.param(False, marks=pytest.mark.slow_on("jax")), True])
def test_compiled_decode(
    deepseek: tuple[Path, Any], backend: str, tmp_path: Path, moe: bool
) -> None:
    """The decode step compiled where a backend compiles one (JAX: the MoE layers too; MLX:
    dense layers only): the latent buffers updated in the traced step, transformers' logits."""
    if moe:
        folder, hf = deepseek
    else:
        folder, hf = tmp_path, _build("deepseek_v3", tmp_path, seed=3, first_k_dense_replace=3)
    model = pl.load(folder, backend=backend, dtype="float32")
    compiles = backend == "jax" or (backend == "mlx" and not moe)
    assert (model.compiled is not None) == compiles
    cache = model.make_cache()
    parts = [pl.to_numpy(model(pl.asarray(IDS[:, :4], backend=backend), cache=cache))]
    for j in range(4, IDS.shape[1]):
        parts.append(
            pl.to_numpy(model(pl.asarray(IDS[:, j : j + 1], backend=backend), cache=cache))
        )
    if compiles:
        assert model.compiled is not None and model.compiled.traces >= 1
    assert_close(np.concatenate(parts, axis=1), hf_logits(hf, IDS), backend="numpy")


def test_the_router_bias_stays_float32(deepseek: tuple[Path, Any], backend: str) -> None:
    """In a bfloat16 model the correction bias that picks the experts is float32, as
    transformers keeps it (``_keep_in_fp32_modules_strict``): rounded to bfloat16, nearby
    experts' biased scores could swap."""
    bk = pl.get_backend(backend)
    if "bfloat16" not in bk.float_dtypes():
        pytest.skip(f"{backend} has no bfloat16")
    folder, hf = deepseek
    model = pl.load(folder, backend=backend, dtype="bfloat16")
    bias = model.layers[1].moe.e_score_correction_bias
    assert bias.dtype == bk.xp.float32
    want = hf.model.layers[1].mlp.gate.e_score_correction_bias.detach().numpy()
    np.testing.assert_array_equal(pl.to_numpy(bias), want)


@pytest.mark.slow_on("jax", "array_api_strict")
def test_batched_rows_of_other_lengths(deepseek: tuple[Path, Any], backend: str) -> None:
    """Continuous batching over paged latent caches (``[c_kv, k_pe]`` pages, the absorbed
    form): three prompts of 3, 7 and 12 tokens at once give each prompt's tokens alone."""
    folder, _ = deepseek
    model = pl.load(folder, backend=backend, dtype="float32")
    prompts = [IDS[1, :3], IDS[0, :7], IDS[1, :]]
    alone = [list(pl.generate(model, p, max_new_tokens=6, stop=())) for p in prompts]
    got = pl.batch_generate(model, prompts, max_new_tokens=6, stop=())
    assert [list(g) for g in got] == alone
    pools = model.make_page_pools(4, 8)
    assert (pools[0].num_kv_heads, pools[0].head_dim) == (1, R + DR)


def test_class_defaults_are_transformers() -> None:
    """A ``config.json`` that leaves out every DeepSeek-specific key reads as
    ``DeepseekV3Config``'s defaults (``kv_lora_rank`` 512, ``q_lora_rank`` 1536, 256 experts
    in 8 groups, 3 dense layers, ``routed_scaling_factor`` 2.5, ...), which its ``to_dict``
    spells out."""
    from portable_llm.decoder.config import DecoderConfig

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 300}  # fmt: skip
    spelled = transformers.DeepseekV3Config(**sizes).to_dict()
    ours = DecoderConfig.from_dict({**sizes, "model_type": "deepseek_v3"}).to_dict()
    theirs = DecoderConfig.from_dict(spelled).to_dict()
    ignored = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
    assert {k: v for k, v in ours.items() if k not in ignored} == {
        k: v for k, v in theirs.items() if k not in ignored
    }
    assert ours["kv_lora_rank"] == 512 and ours["moe_layers"] == (False, False, False, True)


def test_paged_latent_layers_need_the_prepared_forward(deepseek: tuple[Path, Any]) -> None:
    """Paged latent layers run in the prepared forward (the paged state's absorbed attention
    over ``[c_kv, k_pe]`` pages); a model without one (weights of mixed dtypes, here the
    op-by-op forward) is refused by name, before any page is written."""
    folder, _ = deepseek
    model = copy.copy(pl.load(folder, backend="numpy", dtype="float32"))
    model.prepared, model.compiled = None, None
    with pytest.raises(ValueError, match=r"deepseek_v3\) runs paged in its prepared forward"):
        pl.batch_generate(model, [IDS[0, :4]], max_new_tokens=2, stop=())
