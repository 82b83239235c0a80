"""GLM-4.5 (``glm4_moe``) beside transformers: what its family's rows of
``tests/test_oracle_families.py`` (logits in float32 and bfloat16, cached decode, greedy,
batched and speculative tokens, left padding) do not check.

- the other spellings of the config: transformers 4's top-level ``rope_theta`` and
  ``partial_rotary_factor`` (a quarter of each head turned), no q/k norms, no biases, one group,
  weights not renormalised; a multi-token-prediction layer past ``num_hidden_layers``;
- the router's correction bias stays float32 in a bfloat16 model, as transformers keeps it;
- a ``config.json`` that leaves every GLM-specific key out reads as ``Glm4MoeConfig``'s
  defaults (half of each head turned, 128 experts, ``rms_norm_eps`` 1e-5, ...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close
from test_oracle_families import IDS, _build, hf_logits

pytestmark = pytest.mark.oracle
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

OTHER = {  # v5 spelling of the other options; test_transformers_4_spelling respells it
    "partial_rotary_factor": 0.25, "use_qk_norm": False, "attention_bias": False,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.25},
}  # fmt: skip


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("glm4_moe")
    return folder, _build("glm4_moe", folder, seed=31)


@pytest.mark.slow_on("jax", "array_api_strict")  # one more model: ~20 s on JAX
def test_other_options_match_transformers(backend: str, tmp_path: Path) -> None:
    hf = _build("glm4_moe", tmp_path, seed=5, **OTHER)
    model = pl.load(tmp_path, backend=backend, dtype="float32")
    assert dict(model.config.rope["scaling"])["partial_rotary_factor"] == 0.25
    want = hf_logits(hf, IDS)
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend)
    cache = model.make_cache()
    parts = [pl.to_numpy(model(pl.asarray(IDS[:, :9], backend=backend), cache=cache))]
    parts.append(pl.to_numpy(model(pl.asarray(IDS[:, 9:], backend=backend), cache=cache)))
    assert_close(np.concatenate(parts, axis=1), want, backend="numpy")


def test_transformers_4_spelling(glm: tuple[Path, Any], tmp_path: Path) -> None:
    """A v4 ``config.json``: ``rope_theta`` and ``partial_rotary_factor`` at the top, no
    ``rope_parameters``; the experts one tensor per expert (what ``save_pretrained`` writes);
    a multi-token-prediction layer past ``num_hidden_layers`` (GLM-4.5's checkpoints hold one,
    ``model.layers.46``), which is not run, as transformers does not run it."""
    from safetensors.numpy import load_file, save_file

    folder, hf = glm
    config = json.loads((folder / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params["rope_theta"]
    config["partial_rotary_factor"] = params["partial_rotary_factor"]
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    n = config["num_hidden_layers"]
    mtp = {f"model.layers.{n}.{k[len('model.layers.2.') :]}": v for k, v in tensors.items()
           if k.startswith("model.layers.2.")}  # fmt: skip
    mtp[f"model.layers.{n}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"))
    model = pl.load(tmp_path, backend="numpy", dtype="float32")
    assert_close(model(IDS), hf_logits(hf, IDS), backend="numpy")


def test_the_router_bias_stays_float32(glm: tuple[Path, Any], backend: str) -> None:
    bk = pl.get_backend(backend)
    if "bfloat16" not in bk.float_dtypes():
        pytest.skip(f"{backend} has no bfloat16")
    folder, hf = glm
    model = pl.load(folder, backend=backend, dtype="bfloat16")
    moe = model.layers[1].moe
    assert moe is not None and moe.e_score_correction_bias.dtype == bk.xp.float32
    want = hf.model.layers[1].mlp.gate.e_score_correction_bias.detach().numpy()
    np.testing.assert_array_equal(pl.to_numpy(moe.e_score_correction_bias), want)


def test_class_defaults_are_transformers() -> None:
    from portable_llm.decoder.config import DecoderConfig

    sizes = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 8, "vocab_size": 300}  # fmt: skip
    spelled = transformers.Glm4MoeConfig(**sizes).to_dict()
    ours = DecoderConfig.from_dict({**sizes, "model_type": "glm4_moe"}).to_dict()
    theirs = DecoderConfig.from_dict(spelled).to_dict()
    ignored = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
    assert {k: v for k, v in ours.items() if k not in ignored} == {
        k: v for k, v in theirs.items() if k not in ignored
    }
    assert ours["rope"]["scaling"]["partial_rotary_factor"] == 0.5
    assert ours["num_key_value_heads"] == 8 and ours["rms_norm_eps"] == 1e-5
    assert ours["moe_layers"] == (False, True, True, True)
