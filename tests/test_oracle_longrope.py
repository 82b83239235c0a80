"""Phi-3's ``longrope`` RoPE scaling in a whole model, against transformers' ``Phi3ForCausalLM``
(random-initialised, saved offline with ``save_pretrained``) on every backend.

transformers 5 picks the factors per forward, by that forward's ``max(position_ids) + 1``:
``short_factor`` up to ``original_max_position_embeddings`` (8 here), ``long_factor`` beyond,
and multiplies cos and sin by ``sqrt(1 + ln(factor) / ln(8))``, ``factor =
max_position_embeddings / original_max_position_embeddings`` by default. The forwards below
cross the original length: a 12-token prompt (long factors throughout), a 5-token prompt
decoded one token at a time (short, then long from position 8 on, the cached keys keeping
their short rotation, as in transformers) and greedy generation past it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import MODEL_TOLERANCES, assert_close

pytestmark = pytest.mark.oracle
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_oracle_families import hf_greedy, hf_logits  # noqa: E402

V, OMPE, STEPS = 300, 8, 12
IDS = np.random.default_rng(1).integers(3, V, size=(2, 12))


def _factors(pairs: int) -> dict[str, list[float]]:
    return {
        "short_factor": np.linspace(1.0, 1.6, pairs).tolist(),
        "long_factor": np.linspace(1.0, 12.0, pairs).tolist(),
    }


# name -> Phi3Config keywords: head_dim 16 (8 pairs), or half of it rotated (4 pairs) with an
# explicit attention factor and the transformers 4 spelling ("rope_scaling", "type").
CONFIGS: dict[str, dict[str, Any]] = {
    "longrope": {
        "max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "longrope", **_factors(8)},
    },
    "longrope_partial": {
        "max_position_embeddings": 64,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "longrope", "attention_factor": 1.3, **_factors(4)},
    },
}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for seed, (name, extra) in enumerate(CONFIGS.items()):
        config = transformers.Phi3Config(
            vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, original_max_position_embeddings=OMPE, **extra,
        )  # fmt: skip
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = transformers.Phi3ForCausalLM(config).eval()
        with torch.no_grad():  # wider than the default init: varied greedy tokens
            for p in model.parameters():
                p.copy_(
                    torch.rand_like(p) * 0.4 + 0.8 if p.ndim == 1 else torch.randn_like(p) * 0.15
                )
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (folder, model)
    return out


def test_config_reads_longrope(hf_models: dict) -> None:
    folder, hf = hf_models["longrope_partial"]
    rope = pl.load(folder, backend="numpy").config.rope
    scaling = rope["scaling"]
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == OMPE
    assert hf.model.rotary_emb.attention_scaling == 1.3
    folder, hf = hf_models["longrope"]
    from portable_llm.rotary.scaling import rope_spec

    rope = pl.load(folder, backend="numpy").config.rope
    spec = rope_spec(
        "test", rope["scaling"], max_position_embeddings=rope["max_position_embeddings"]
    )
    assert spec.attention_factor == hf.model.rotary_emb.attention_scaling  # sqrt(1 + ln 4 / ln 8)


@pytest.mark.parametrize("length", [6, 12])  # within the original length, and beyond it
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(hf_models: dict, name: str, length: int, backend: str) -> None:
    folder, hf = hf_models[name]
    model = pl.load(folder, backend=backend, dtype="float32")
    ids = IDS[:, :length]
    assert_close(model(pl.asarray(ids, backend=backend)), hf_logits(hf, ids), backend=backend)


@pytest.mark.parametrize("name", CONFIGS)
def test_bfloat16_matches_transformers(hf_models: dict, name: str, backend: str) -> None:
    if "bfloat16" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no bfloat16")
    folder, hf = hf_models[name]
    hf16 = type(hf).from_pretrained(folder, dtype=torch.bfloat16).eval()
    model = pl.load(folder, backend=backend, dtype="bfloat16")
    tol = MODEL_TOLERANCES["bfloat16"]
    got = model(pl.asarray(IDS, backend=backend))
    assert_close(got, hf_logits(hf16, IDS), backend=backend, dtype="bfloat16", rtol=tol.rtol,
                 atol=tol.atol)  # fmt: skip


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_decode_across_the_original_length(hf_models: dict, name: str, backend: str) -> None:
    """A prompt of 5, then one token at a time up to 12: each forward picks its factors, as
    transformers' forwards with its cache do (not as one 12-token forward); the compiled step
    (JAX, MLX) too, by its program for the short or the long side."""
    folder, hf = hf_models[name]
    model = pl.load(folder, backend=backend, dtype="float32")
    cache = model.make_cache()
    got = [pl.to_numpy(model(pl.asarray(IDS[:, :5], backend=backend), cache=cache))]
    with torch.no_grad():
        out = hf(torch.tensor(IDS[:, :5]), use_cache=True)
        want, past = [out.logits.numpy()], out.past_key_values
        for j in range(5, IDS.shape[1]):
            step = IDS[:, j : j + 1]
            got.append(pl.to_numpy(model(pl.asarray(step, backend=backend), cache=cache)))
            out = hf(torch.tensor(step), past_key_values=past, use_cache=True)
            want.append(out.logits.numpy())
            past = out.past_key_values
    want_all = np.concatenate(want, axis=1)
    assert_close(np.concatenate(got, axis=1), want_all, backend="numpy")
    if model.compiled is not None:  # JAX, MLX: one program per side of L0
        assert model.compiled.traces == 2
    # the short factors up to position 7: one forward of 12 differs (all long) from the steps
    assert not np.allclose(hf_logits(hf, IDS)[:, 8:], want_all[:, 8:], atol=1e-3)


@pytest.mark.slow_on("jax", "array_api_strict")
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_match_transformers(hf_models: dict, name: str, backend: str) -> None:
    """A prompt of 5 grows past 8: transformers' Phi-3 generation then runs every token again
    with the long factors, and so does ``pl.generate`` (``Model.recompute_after``). A prompt of
    10 is long from the start: one forward (whatever ``prefill_step_size``), then long steps,
    on every path (batched over paged caches, speculative)."""
    folder, hf = hf_models[name]
    model = pl.load(folder, backend=backend, dtype="float32")
    assert model.recompute_after == OMPE
    prompt = IDS[0, :5]
    want = hf_greedy(hf, prompt, STEPS)
    assert len(set(want)) > 3
    assert list(pl.generate(model, prompt, max_new_tokens=STEPS, stop=())) == want
    long = IDS[1, :10]
    want = hf_greedy(hf, long, STEPS)
    got = pl.generate(model, long, max_new_tokens=STEPS, stop=(), prefill_step_size=4)
    assert list(got) == want
    assert [list(g) for g in pl.batch_generate(model, [long], max_new_tokens=STEPS, stop=())] == [
        want
    ]
    gen = pl.speculative_generate(model, model, long, num_draft_tokens=3, max_new_tokens=STEPS,
                                  stop=())  # fmt: skip
    assert list(gen) == want


@pytest.mark.slow_on("jax", "array_api_strict")
def test_left_padded_batch_matches_transformers(hf_models: dict, backend: str) -> None:
    """Two prompts (5 and 3 tokens), left-padded: transformers' batched Phi-3 generation
    recomputes when the padded length passes 8, and so does ``generate_step``."""
    folder, hf = hf_models["longrope"]
    a, b = IDS[0, :5], IDS[1, :3]
    ids, pads = np.stack([a, np.concatenate([[0, 0], b])]), np.array([0, 2])
    mask = (np.arange(5)[None] >= pads[:, None]).astype(np.int64)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
            max_new_tokens=10, min_new_tokens=10, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    model = pl.load(folder, backend=backend, dtype="float32")
    steps = pl.generate_step(model, ids, left_padding=pads)
    got = np.stack([next(steps)[0] for _ in range(10)], axis=1)
    np.testing.assert_array_equal(got, out[:, 5:].numpy())
