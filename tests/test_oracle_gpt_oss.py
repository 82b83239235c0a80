"""gpt-oss's distinctive pieces beyond the family tests of ``tests/test_oracle_families.py``
(which run the tiny random ``gpt_oss`` model against transformers on every backend): the MXFP4
checkpoint users hold, and the config as transformers reads it.

The MXFP4 folder is the tiny model's, its experts quantized to MXFP4 in transformers' layout
(``mlp.experts.gate_up_proj_blocks`` ``(X, 2I, E / 32, 16)`` and ``_scales``, the rows gate and
up interleaved; ``down_proj_blocks`` ``(X, E, I / 32, 16)``), with ``quantization_config``
``mxfp4``. ``pl.load`` keeps the experts quantized (:class:`~portable_llm.MXFP4Weight`); its
logits equal those of transformers' ``GptOssForCausalLM`` whose experts are transformers' own
dequantization of the same codes (``convert_moe_packed_tensors``, what ``from_pretrained`` runs
on such a checkpoint without a GPU kernel), and cached decode, ``batch_generate`` (paged) and
``speculative_generate`` give the plain greedy tokens.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close

pytestmark = pytest.mark.oracle
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

from test_oracle_families import FAMILIES, IDS, V, _build, hf_logits  # noqa: E402

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` ``(.., N, K)`` as transformers' MXFP4 pair: blocks ``(.., N, K / 32, 16)`` (byte
    ``j`` holds codes ``2j`` low and ``2j + 1`` high) and E8M0 scales ``(.., N, K / 32)``: each
    block's scale the power of two that brings its largest magnitude to at most 6, each value
    the nearest E2M1 one."""
    blocks = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)  # (.., N, K / 32, 32)
    top = np.abs(blocks).max(axis=-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(top, 1e-30) / 6.0))  # (.., N, K / 32, 1)
    scaled = blocks / np.exp2(exp)
    idx = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(axis=-1)  # (.., 32): magnitude code
    codes = (idx | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # (.., N, K / 32, 16)
    # C order: safetensors writes a NumPy array's memory as it lies
    return np.ascontiguousarray(packed, np.uint8), np.ascontiguousarray(exp[..., 0] + 127, np.uint8)


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The folder of the tiny gpt-oss with MXFP4 experts, and transformers' model of the
    same weights (its experts dequantized by transformers)."""
    from safetensors.numpy import load_file, save_file

    float_dir, out = tmp_path_factory.mktemp("gpt_oss_float"), tmp_path_factory.mktemp("mxfp4")
    hf = _build("gpt_oss", float_dir, seed=11)
    tensors = load_file(str(float_dir / "model.safetensors"))
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            f = f"model.layers.{i}.mlp.experts."
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)  # (X, in, out)
                rows = param.detach().transpose(1, 2).numpy()  # (X, out, in)
                blocks, scales = quantize_mxfp4(rows)
                tensors.pop(f + proj)
                tensors[f + proj + "_blocks"], tensors[f + proj + "_scales"] = blocks, scales
                hf_w = mxfp4.convert_moe_packed_tensors(
                    torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
                )  # (X, in, out), transformers' own reading of the codes
                param.copy_(hf_w)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out, hf


def test_mxfp4_checkpoint_loads_quantized_and_matches_transformers(mxfp4_model, backend):
    folder, hf = mxfp4_model
    model = pl.load(folder, backend=backend, dtype="float32")
    moe = model.layers[0].moe
    assert moe is not None
    experts = (moe.experts_gate, moe.experts_up, moe.experts_down)
    assert all(isinstance(w, pl.MXFP4Weight) for w in experts)
    X, E, I = 4, 64, 32  # noqa: E741
    assert [w.shape for w in experts] == [(X, I, E), (X, I, E), (X, E, I)]
    want = hf_logits(hf, IDS)
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend)
    slow = copy.copy(model)  # the op-by-op path
    slow.prepared, slow.compiled = None, None
    assert_close(slow(pl.asarray(IDS, backend=backend)), want, backend=backend)


@pytest.mark.slow_on("jax", "array_api_strict")
def test_mxfp4_checkpoint_decodes_as_transformers(mxfp4_model, backend):
    """Cached decode (the compiled step where there is one: JAX dequantizes the experts inside
    it), the greedy tokens of transformers, the paged batch and speculative decoding."""
    folder, hf = mxfp4_model
    model = pl.load(folder, backend=backend, dtype="float32")
    cache = model.make_cache()
    parts = [pl.to_numpy(model(pl.asarray(IDS[:, :5], backend=backend), cache=cache))]
    for j in range(5, IDS.shape[1]):
        parts.append(pl.to_numpy(model(pl.asarray(IDS[:, j : j + 1], backend=backend),
                                       cache=cache)))  # fmt: skip
    assert_close(np.concatenate(parts, axis=1), hf_logits(hf, IDS), backend="numpy")
    prompt, other = IDS[0, :7], IDS[1, :5]
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt[None]), do_sample=False, max_new_tokens=8,
                          min_new_tokens=8, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = out[0, len(prompt) :].tolist()
    assert list(pl.generate(model, prompt, max_new_tokens=8, stop=())) == want
    got = pl.batch_generate(model, [prompt, other], max_new_tokens=8, stop=())
    assert list(got[0]) == want
    assert list(got[1]) == list(pl.generate(model, other, max_new_tokens=8, stop=()))
    spec = pl.speculative_generate(model, model, prompt, num_draft_tokens=3, max_new_tokens=8,
                                   stop=())  # fmt: skip
    assert list(spec) == want


def test_mxfp4_blocks_are_checked(mxfp4_model, tmp_path):
    """A blocks tensor of the wrong shape, or scales that are not uint8, are named."""
    from safetensors.numpy import load_file, save_file

    folder, _ = mxfp4_model
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name].astype(np.float32)
    tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"] = tensors[
        "model.layers.1.mlp.experts.gate_up_proj_blocks"
    ][:, :-2]
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(pl.CheckpointError) as err:
        pl.load(tmp_path, backend="numpy")
    msg = str(err.value)
    assert f"{name} (F32, MXFP4's are U8)" in msg
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks (4, 62, 2, 16) (config implies " \
           "(4, 64, 2, 16))" in msg  # fmt: skip


@pytest.mark.parametrize(
    "spelling",
    [{}, {"num_experts": 4, "num_local_experts": None},
     {"rope_parameters": None, "rope_theta": 10000.0,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                       "truncate": False, "original_max_position_embeddings": 64}}],
)  # fmt: skip
def test_config_reads_as_transformers(spelling):
    """transformers 5's names, and the transformers 4 spellings (``num_experts``,
    ``rope_theta`` beside ``rope_scaling``) read to the same config; a config that leaves out
    every gpt-oss key reads as ``GptOssConfig``'s defaults (its ``to_dict``)."""
    from portable_llm.decoder.config import DecoderConfig

    given = {**FAMILIES["gpt_oss"][1], "vocab_size": V, "model_type": "gpt_oss"}
    want = DecoderConfig.from_dict(transformers.GptOssConfig(**given).to_dict())
    spelled = {k: v for k, v in {**given, **spelling}.items() if v is not None}
    assert DecoderConfig.from_dict(spelled) == want
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 16, "vocab_size": V}  # fmt: skip
    ours = DecoderConfig.from_dict({**sizes, "model_type": "gpt_oss"}).to_dict()
    theirs = DecoderConfig.from_dict(transformers.GptOssConfig(**sizes).to_dict()).to_dict()
    ignored = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert {k: v for k, v in ours.items() if k not in ignored} == {
        k: v for k, v in theirs.items() if k not in ignored
    }
    assert ours["swiglu_limit"] == 7.0 and ours["sliding_window"] == 128
    assert ours["layer_types"] == ("sliding_attention", "full_attention") * 2


def test_tensor_parallel_split_is_refused_by_name():
    """Split over ranks, the experts' ``down_proj`` bias would be added once per rank before
    the all-reduce: refused by name, not run wrong."""
    from portable_llm.decoder.config import DecoderConfig
    from portable_llm.partition.plan import plan_partition

    cfg = DecoderConfig.from_dict({**FAMILIES["gpt_oss"][1], "vocab_size": V,
                                   "model_type": "gpt_oss"})  # fmt: skip
    with pytest.raises(ValueError, match=r"gpt_oss's experts' down_proj bias .* tensor_parallel=1"):
        plan_partition(cfg, tp=(2, 0))
    assert plan_partition(cfg, tp=(1, 0), pp=(2, 1)) is not None  # pipeline stages: planned
