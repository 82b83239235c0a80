"""``portable-llm serve`` over issue 31's families: a hybrid model's recurrent states join the
server's continuous batching.

Each model is random (NumPy-written, the decoder's own tensor names) and served on NumPy
(uvicorn in a thread, 127.0.0.1, a free port). Several clients at once, streamed and not, get
exactly the tokens :func:`portable_llm.generate` gives each prompt alone, and the engine decoded
more than one request in a step. LFM2 (short convolutions beside attention: per-request state
slots in the paged batch), gpt-oss (attention sinks, sliding windows, the clamped SwiGLU's
MoE) and DeepSeek V3 (latent attention, grouped routing with shared experts).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import skip_reason

if skip_reason("numpy") is not None:  # the server runs the model on NumPy
    pytest.skip(skip_reason("numpy"), allow_module_level=True)
pytest.importorskip("starlette", reason="the serve extra (starlette) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

import portable_llm as pl  # noqa: E402
from portable_llm.checkpoint.weights import expected_shapes  # noqa: E402
from portable_llm.decoder.config import DecoderConfig  # noqa: E402
from portable_llm.serve import create_app  # noqa: E402
from portable_llm.testing.checkpoints import write_tokenizer  # noqa: E402
from servers import alone, serving  # noqa: E402

BASE: dict[str, Any] = {
    "vocab_size": 300, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "rms_norm_eps": 1e-5,
}  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    "lfm2": {
        "intermediate_size": 72, "num_hidden_layers": 3, "norm_eps": 1e-5,
        "layer_types": ["conv", "full_attention", "conv"], "conv_L_cache": 3,
        "conv_bias": True, "block_multiple_of": 16,
    },
    "gpt_oss": {
        "intermediate_size": 32, "num_hidden_layers": 2, "head_dim": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.0,
    },
    "deepseek_v3": {
        "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 12,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 8,
        "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    },
}  # fmt: skip


def _write(path: Path, model_type: str) -> Path:
    """A random checkpoint of ``model_type`` under the decoder's names, and a BPE tokenizer."""
    from safetensors.numpy import save_file

    cfg = {"model_type": model_type, **BASE, **CONFIGS[model_type]}
    rng = np.random.default_rng(7)
    tensors = {
        name: (rng.uniform(0.8, 1.2, shape) if name.endswith("norm.weight")
               else rng.standard_normal(shape) * 0.2).astype(np.float32)
        for name, shape in expected_shapes(DecoderConfig.from_dict(cfg)).items()
    }  # fmt: skip
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(path, vocab_size=cfg["vocab_size"])
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[pl.Model, str, Any]]:
    folder = _write(tmp_path_factory.mktemp(request.param), request.param)
    model = pl.load(folder, backend="numpy", dtype="float32")
    app = create_app(model, model_name="m", max_batch=8, pool_pages=64, prefill_chunk=64)
    with serving(app) as url:
        yield model, url, app.state.engine


def test_concurrent_requests_get_their_greedy_tokens(served: tuple[pl.Model, str, Any]) -> None:
    """Six clients at once (three streamed), prompts of 3-40 tokens: each response's text and
    token count are ``generate``'s for its prompt alone (greedy), and some steps decoded
    several requests together."""
    model, url, engine = served
    rng = np.random.default_rng(5)
    prompts = [[int(i) for i in rng.integers(3, 300, size=int(n))]
               for n in (3, 40, 11, 25, 7, 18)]  # fmt: skip
    lengths = [12, 5, 9, 12, 3, 10]
    wants = [alone(model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    engine.max_decoded = 0

    async def one(prompt: list[int], n: int, stream: bool) -> tuple[str, int]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as c:
            made = await c.completions.create(
                model="m", prompt=prompt, max_tokens=n, temperature=0, stream=stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            )  # fmt: skip
            if not stream:
                return made.choices[0].text, made.usage.completion_tokens
            text, usage = [], None
            async for chunk in made:
                text += [ch.text for ch in chunk.choices]
                usage = chunk.usage or usage
            return "".join(text), usage.completion_tokens

    async def all_() -> list[tuple[str, int]]:
        return await asyncio.gather(
            *(one(p, n, i % 2 == 1) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)))
        )

    assert asyncio.run(all_()) == wants
    assert engine.max_decoded > 1
