"""Generation over the model protocol (generation/protocol.py): models that are not a
``pl.Model`` go through ``generate``, ``generate_step``, ``batch_generate`` and
``speculative_generate``, and give the ``pl.Model``'s greedy tokens, token for token.

Two models are built from the weights of one tiny Qwen2 checkpoint: ``NumpyQwen2``, plain
NumPy in float64 with its own KV cache (no ``pl`` op at all), and ``TorchQwen2``, a
``torch.nn.Module`` whose forward calls ``pl`` ops over ``pl.KVCache`` caches (float32, as the
``pl.Model`` it is compared with). ``PagedTorchQwen2`` adds the paged members, over
``pl.PagedKVCache`` caches, so the batch generator pages it. The tiny random checkpoints have
clear greedy winners (``random_tensors``), so rounding does not flip a token.
"""

from __future__ import annotations

import math
from itertools import islice
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from conftest import skip_reason
from portable_llm.generation import LanguageModel, PagedLanguageModel
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer

CFG = tiny_config("qwen2")  # q/k/v biases, tied head, plain RoPE (theta 1e6)
PROMPTS = [[17, 40, 121, 9, 230], [5, 77], [250, 3, 3, 8, 91, 14, 160]]
NEW = 8


# -- a model in plain NumPy ------------------------------------------------------------------------
class NumpyCache:
    """Keys and values ``(B, H_kv, S, D)`` of one layer, grown by concatenation."""

    def __init__(self) -> None:
        self.k: np.ndarray | None = None
        self.v: np.ndarray | None = None
        self.offset = 0

    def update(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.k = k if self.k is None else np.concatenate([self.k, k], axis=2)
        self.v = v if self.v is None else np.concatenate([self.v, v], axis=2)
        self.offset += k.shape[2]
        return self.k, self.v

    def trim(self, n: int) -> int:  # speculative decoding rewinds
        assert self.k is not None and self.v is not None
        self.offset -= n
        self.k, self.v = self.k[:, :, : self.offset], self.v[:, :, : self.offset]
        return n


class NumpyQwen2:
    """A Qwen2 decoder in NumPy (float64): the protocol's members and a forward pass."""

    def __init__(self, weights: dict[str, np.ndarray], cfg: dict, tokenizer: Any = None) -> None:
        self.w = {k: v.astype(np.float64) for k, v in weights.items()}
        self.cfg = cfg
        self.vocab_size = cfg["vocab_size"]
        self.eos_token_ids = (cfg["eos_token_id"],)
        self.tokenizer = tokenizer

    def make_cache(self) -> list[NumpyCache]:
        return [NumpyCache() for _ in range(self.cfg["num_hidden_layers"])]

    def __call__(self, ids: Any, /, *, cache: list[NumpyCache], last_only: bool = False) -> Any:
        w, eps = self.w, self.cfg["rms_norm_eps"]
        h = w["model.embed_tokens.weight"][np.asarray(ids)]  # (B, L, E)
        for i, c in enumerate(cache):
            p = f"model.layers.{i}."
            h = h + self.attention(_rms(h, w[p + "input_layernorm.weight"], eps), p, c)
            r = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = r @ w[p + "mlp.gate_proj.weight"].T, r @ w[p + "mlp.up_proj.weight"].T
            h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        if last_only:
            h = h[:, -1:, :]
        return _rms(h, w["model.norm.weight"], eps) @ w["model.embed_tokens.weight"].T

    def attention(self, x: np.ndarray, p: str, cache: NumpyCache) -> np.ndarray:
        B, L, _ = x.shape
        H, H_kv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        D = self.cfg["hidden_size"] // H
        a = p + "self_attn."

        def proj(n: str, heads: int) -> np.ndarray:
            y = x @ self.w[f"{a}{n}_proj.weight"].T + self.w[f"{a}{n}_proj.bias"]
            return y.reshape(B, L, heads, D).transpose(0, 2, 1, 3)  # (B, heads, L, D)

        pos = np.arange(cache.offset, cache.offset + L)
        q = _rope(proj("q", H), pos, self.cfg["rope_theta"])
        k = _rope(proj("k", H_kv), pos, self.cfg["rope_theta"])
        k, v = cache.update(k, proj("v", H_kv))  # (B, H_kv, S, D)
        k, v = np.repeat(k, H // H_kv, axis=1), np.repeat(v, H // H_kv, axis=1)
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)  # (B, H, L, S)
        scores = np.where(np.arange(k.shape[2]) <= pos[:, None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        o = (probs / probs.sum(-1, keepdims=True)) @ v  # (B, H, L, D)
        return o.transpose(0, 2, 1, 3).reshape(B, L, H * D) @ self.w[a + "o_proj.weight"].T


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """HF's RoPE (halves rotated) of ``x`` ``(B, H, L, D)`` at positions ``pos`` ``(L,)``."""
    D = x.shape[-1]
    angles = pos[:, None] * theta ** (-np.arange(0, D, 2) / D)  # (L, D/2)
    cos, sin = np.cos(np.tile(angles, 2)), np.sin(np.tile(angles, 2))  # (L, D)
    rotated = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], axis=-1)
    return x * cos + rotated * sin


# -- a torch module of pl ops --------------------------------------------------------------------
def _torch_classes() -> tuple[type, type]:
    import torch

    class TorchQwen2(torch.nn.Module):
        """A Qwen2 decoder as a torch module whose forward calls ``pl`` ops."""

        def __init__(self, weights: dict[str, np.ndarray], cfg: dict, tokenizer: Any = None):
            super().__init__()
            self.w = {k: torch.from_numpy(v.astype(np.float32)) for k, v in weights.items()}
            self.cfg = cfg
            self.vocab_size = cfg["vocab_size"]
            self.eos_token_ids = (cfg["eos_token_id"],)
            self.tokenizer = tokenizer

        def make_cache(self, *, left_padding: Any = None) -> list[pl.KVCache]:
            if left_padding is not None:  # (B,) NumPy ints: pad tokens per row
                left_padding = torch.as_tensor(left_padding)
            layers = self.cfg["num_hidden_layers"]
            return [pl.KVCache(left_padding=left_padding) for _ in range(layers)]

        def forward(self, ids: Any, *, cache: Any, last_only: bool = False) -> Any:
            w, cfg, eps = self.w, self.cfg, self.cfg["rms_norm_eps"]
            h = pl.embedding(torch.as_tensor(ids), w["model.embed_tokens.weight"])  # (B, L, E)
            for i, layer_cache in enumerate(cache):
                p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
                x = pl.rms_norm(h, w[p + "input_layernorm.weight"], eps=eps)
                h = h + pl.attention(
                    x, **{f"w{n}": w[f"{a}{n}_proj.weight"] for n in "qkvo"},
                    **{f"b{n}": w[f"{a}{n}_proj.bias"] for n in "qkv"},
                    num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
                    rope={"base": cfg["rope_theta"]}, cache=layer_cache,
                )  # fmt: skip
                x = pl.rms_norm(h, w[p + "post_attention_layernorm.weight"], eps=eps)
                mlp = [w[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up", "down")]
                h = h + pl.mlp(x, *mlp)
            if last_only:
                h = h[:, -1:, :]
            h = pl.rms_norm(h, w["model.norm.weight"], eps=eps)
            return pl.unembed(h, w["model.embed_tokens.weight"])  # (B, L, V)

    class PagedTorchQwen2(TorchQwen2):
        """The same module, paged: each row runs alone over its ``pl.PagedKVCache`` caches (a
        drop-in for a batch-1 ``pl.KVCache``)."""

        max_seq_len = CFG["max_position_embeddings"]

        def make_page_pools(self, num_pages: int, page_size: int) -> list[pl.PagePool]:
            H, H_kv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
            D = self.cfg["hidden_size"] // H
            shape = (num_pages, page_size, H_kv, D)
            layers = self.cfg["num_hidden_layers"]
            return [pl.PagePool(*shape, "float32", backend="torch") for _ in range(layers)]

        def forward_paged(self, ids: Any, /, *, caches: Any, logits: bool = True) -> Any:
            rows = [
                self([row], cache=c, last_only=True)[:, -1, :]
                for row, c in zip(ids, caches, strict=True)
            ]
            return torch.cat(rows) if logits else None  # (B, V)

    return TorchQwen2, PagedTorchQwen2


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(folder, weights, draft folder): the tiny Qwen2 and a draft of other random weights."""
    root = tmp_path_factory.mktemp("protocol")
    weights = write_checkpoint(root / "target", CFG, seed=11)
    write_tokenizer(root / "target", vocab_size=CFG["vocab_size"])
    write_checkpoint(root / "draft", CFG, seed=12)
    return root / "target", weights, root / "draft"


def _own(kind: str, checkpoint: tuple, tokenizer: Any = None) -> Any:
    if kind == "numpy":
        return NumpyQwen2(checkpoint[1], CFG, tokenizer)
    TorchQwen2, PagedTorchQwen2 = _torch_classes()
    cls = PagedTorchQwen2 if kind == "torch_paged" else TorchQwen2
    return cls(checkpoint[1], CFG, tokenizer)


def _reference(kind: str, folder: Any) -> pl.Model:
    """The pl.Model of the same weights: NumPy float64 for the NumPy model, else torch."""
    if kind == "numpy":
        return pl.load(folder, backend="numpy", dtype="float64")
    return pl.load(folder, backend="torch", dtype="float32")


KINDS = [
    pytest.param("numpy", marks=pytest.mark.skipif(bool(skip_reason("numpy")), reason="numpy")),
    *[
        pytest.param(k, marks=pytest.mark.skipif(bool(skip_reason("torch")), reason="torch"))
        for k in ("torch", "torch_paged")
    ],
]

_GREEDY: dict[tuple, list[int]] = {}


def _greedy(model: pl.Model, prompt: list[int], new: int = NEW) -> list[int]:
    key = (model.backend.name, tuple(prompt), new)
    if key not in _GREEDY:
        _GREEDY[key] = list(pl.generate(model, prompt, max_new_tokens=new, stop=()))
    return _GREEDY[key]


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_the_models_follow_the_protocol(checkpoint: tuple, kind: str) -> None:
    own, ref = _own(kind, checkpoint), _reference(kind, checkpoint[0])
    assert isinstance(own, LanguageModel) and isinstance(ref, PagedLanguageModel)
    assert isinstance(own, PagedLanguageModel) is (kind == "torch_paged")
    ids = np.asarray([PROMPTS[0]])
    got, want = own(ids, cache=own.make_cache()), ref(ids, cache=ref.make_cache())
    np.testing.assert_allclose(pl.to_numpy(got), pl.to_numpy(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_and_generate_step_equal_the_pl_model(checkpoint: tuple, kind: str) -> None:
    own, ref = _own(kind, checkpoint), _reference(kind, checkpoint[0])
    for prompt in PROMPTS:
        assert list(pl.generate(own, prompt, max_new_tokens=NEW, stop=())) == _greedy(ref, prompt)
    steps = pl.generate_step(own, PROMPTS[2], prefill_step_size=2)  # chunked prefill too
    assert [token for token, _ in islice(steps, NEW)] == _greedy(ref, PROMPTS[2])


@pytest.mark.parametrize("kind", KINDS)
def test_batch_generate_equals_the_pl_model(checkpoint: tuple, kind: str) -> None:
    own, ref = _own(kind, checkpoint), _reference(kind, checkpoint[0])
    want = [_greedy(ref, p, 6) for p in PROMPTS]
    assert pl.batch_generate(own, PROMPTS, max_new_tokens=6, prefill_chunk=4, stop=()) == want
    gen = pl.BatchGenerator(own, max_batch=2, prefill_chunk=3, page_size=2)
    assert (len(gen.pools) == CFG["num_hidden_layers"]) is (kind == "torch_paged")
    for p in PROMPTS:
        gen.add(pl.Request(p, 6, stop=()))
    got: dict[int, list[int]] = {}
    while gen.has_work:
        for rid, token, _ in gen.step():
            got.setdefault(rid, []).append(token)
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_generate_equals_the_pl_model(checkpoint: tuple, kind: str) -> None:
    """The own model as the target (a draft of other weights: rejections rewind its caches),
    and as the draft of the pl.Model."""
    own, ref = _own(kind, checkpoint), _reference(kind, checkpoint[0])
    other = pl.load(checkpoint[2], backend="numpy", dtype="float64")  # rejected proposals
    want = _greedy(ref, PROMPTS[0])
    gen = pl.speculative_generate(own, other, PROMPTS[0], max_new_tokens=NEW, stop=())
    assert list(gen) == want
    assert gen.stats.accepted_tokens < gen.stats.draft_tokens
    gen = pl.speculative_generate(ref, own, PROMPTS[0], max_new_tokens=NEW, stop=())
    assert list(gen) == want
    assert gen.stats.accepted_tokens == gen.stats.draft_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_text_prompts_through_the_models_tokenizer(checkpoint: tuple, kind: str) -> None:
    ref = _reference(kind, checkpoint[0])
    own = _own(kind, checkpoint, ref.tokenizer)
    text = "The cache keeps"
    want = "".join(pl.generate(ref, text, max_new_tokens=NEW, stop=()))
    assert "".join(pl.generate(own, text, max_new_tokens=NEW, stop=())) == want
    if kind != "numpy":  # a left-padded batch: make_cache(left_padding=...)
        texts = [text, "RMSNorm divides each vector"]
        batch = list(pl.generate(own, texts, max_new_tokens=NEW, stop=()))
        assert batch == list(pl.generate(ref, texts, max_new_tokens=NEW, stop=()))


def test_an_object_without_the_members_is_a_clear_type_error() -> None:
    class Half:
        vocab_size = 10

        def __call__(self, ids: Any, /, *, cache: Any, last_only: bool = False) -> Any:
            return np.zeros((1, 1, 10))

    for run in (
        lambda: pl.generate(Half(), [1, 2]),
        lambda: pl.generate_step(Half(), [1, 2]),
        lambda: pl.BatchGenerator(Half()),
        lambda: pl.batch_generate(Half(), [[1, 2]]),
        lambda: pl.speculative_generate(Half(), Half(), [1, 2]),
    ):
        with pytest.raises(TypeError, match="lacks tokenizer, eos_token_ids, make_cache"):
            run()


def test_logits_of_the_wrong_shape_are_a_clear_error(checkpoint: tuple) -> None:
    own = _own("numpy", checkpoint)
    own.vocab_size = 100  # the logits have 300 columns
    with pytest.raises(
        ValueError, match=r"returned logits of shape \(1, 1, 300\), expected \(1, any, 100\)"
    ):
        list(pl.generate(own, PROMPTS[1], max_new_tokens=2))
