"""A model written as a learner of tiny-llm's course writes it, driven by every front.

``TinyQwen`` knows nothing of portable_llm: its own KV cache (``update_and_fetch``, ``rewind``),
NumPy or MLX arrays, a tokenizer with only ``encode``/``decode``, no ``vocab_size``. It answers
the optional members of the protocol (issue 29): ``release_cache``, ``materialize``,
``rewind_cache`` and ``decode_batch`` (batched decode over its own caches, without page pools).
Each front's greedy tokens are checked against the plain loop below (``model(...)`` then
``argmax``, nothing of portable_llm), and the model counts what it was asked to do.
"""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from conftest import only_on, skip_reason
from portable_llm.generation import LanguageModel
from portable_llm.generation.protocol import (
    BatchDecodingModel,
    MaterializingModel,
    ReleasingModel,
    RewindingModel,
    SizedVocabularyModel,
)
from portable_llm.testing.checkpoints import write_tokenizer

V, E, H, H_KV, D, FFN, LAYERS = 64, 32, 4, 2, 8, 48, 2

numpy_only = only_on("numpy")  # checks of generation itself, run once (in the NumPy env)
BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(bool(skip_reason(name)), reason=name))
    for name in ("numpy", "mlx")
]


class TinyKvCache:
    """tiny-llm's cache: keys and values ``(1, H_kv, S, D)`` of one layer, one request."""

    def __init__(self, xp: Any) -> None:
        self.xp, self.keys, self.values, self.offset = xp, None, None, 0

    def update_and_fetch(self, k: Any, v: Any) -> tuple[Any, Any]:
        cat = self.xp.concatenate
        self.keys = k if self.keys is None else cat([self.keys, k], axis=2)
        self.values = v if self.values is None else cat([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def rewind(self, n: int) -> None:
        self.offset -= n
        self.keys, self.values = self.keys[:, :, : self.offset], self.values[:, :, : self.offset]


class CharTokenizer:
    """A course's tokenizer: one id per character of an alphabet; ``encode`` and ``decode``."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids)


ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?\n"[:V]


class TinyQwen:
    """A two-layer Qwen-like decoder of random weights (seed), on ``numpy`` or ``mlx``."""

    eos_token_ids = ()

    def __init__(self, backend: str, seed: int = 0, tokenizer: Any = None, vocab: int = V) -> None:
        self.xp: Any = np
        if backend == "mlx":
            import mlx.core as mx

            self.xp = mx
        dtype = np.float32 if backend == "mlx" else np.float64  # MLX computes in float32
        rng = np.random.default_rng(seed)

        def w(*shape: int) -> Any:
            return self.asarray((rng.standard_normal(shape) / math.sqrt(shape[0])).astype(dtype))

        self.embed, self.head = w(vocab, E) * math.sqrt(E), w(E, vocab) * 4  # untied: no echo
        self.layers = [
            {"q": w(E, H * D), "k": w(E, H_KV * D), "v": w(E, H_KV * D), "o": w(H * D, E),
             "gate": w(E, FFN), "up": w(E, FFN), "down": w(FFN, E)}
            for _ in range(LAYERS)
        ]  # fmt: skip
        self.tokenizer = tokenizer
        self.calls: list[tuple[str, int, int]] = []  # (which, B, L) per forward
        self.made = self.released = self.materialized = 0

    def asarray(self, a: Any) -> Any:
        """Ids or weights in the model's library (floats in its dtype): what a learner's
        ``mx.array(...)`` / ``np.asarray(...)`` does."""
        if self.xp is np:
            return np.asarray(a)
        a = np.asarray(a) if isinstance(a, list | np.ndarray) else a
        if isinstance(a, np.ndarray) and a.dtype == np.float64:
            a = a.astype(np.float32)
        return self.xp.array(a)

    # -- the protocol ---------------------------------------------------------------------------
    def make_cache(self) -> list[TinyKvCache]:
        self.made += 1
        return [TinyKvCache(self.xp) for _ in range(LAYERS)]

    def release_cache(self, cache: list[TinyKvCache], /) -> None:
        self.released += 1

    def materialize(self, cache: list[TinyKvCache], /) -> None:
        self.materialized += 1
        if self.xp is not np:  # MLX: the pending keys and values, computed now
            self.xp.eval([a for c in cache for a in (c.keys, c.values)])

    def rewind_cache(self, cache: list[TinyKvCache], n: int, /) -> None:
        for c in cache:
            c.rewind(n)

    def __call__(self, ids: Any, /, *, cache: list[TinyKvCache], last_only: bool = False) -> Any:
        ids = self.asarray(ids)  # (B, L)
        B, L = ids.shape
        self.calls.append(("call", B, L))
        start = cache[0].offset
        pos = self.asarray(np.tile(np.arange(start, start + L), (B, 1)))  # (B, L)
        h = self.embed[ids]  # (B, L, E)
        for w, c in zip(self.layers, cache, strict=True):
            q, k, v = self._qkv(w, _rms(self.xp, h), pos)
            keys, values = c.update_and_fetch(k, v)  # (B, H_kv, S, D)
            S = self.asarray(np.arange(keys.shape[2]))  # (S,)
            seen = S[None, None, None, :] <= pos[:, None, :, None]  # (B, 1, L, S): causal
            h = h + self._attend(w, q, keys, values, seen)
            h = h + self._mlp(w, _rms(self.xp, h))
        if last_only:
            h = h[:, -1:, :]
        return _rms(self.xp, h) @ self.head  # (B, L, V)

    def decode_batch(self, ids: Any, /, *, caches: list[list[TinyKvCache]]) -> Any:
        """One token per row, each row over its own caches: keys right-padded to the longest
        row, the padding masked, each row at its own position."""
        xp = self.xp
        ids = self.asarray(ids)  # (B, 1)
        B = ids.shape[0]
        self.calls.append(("batch", B, 1))
        offsets = [c[0].offset for c in caches]
        pos = self.asarray(np.asarray(offsets)[:, None])  # (B, 1)
        h = self.embed[ids]  # (B, 1, E)
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(w, _rms(xp, h), pos)
            rows = [c[i].update_and_fetch(k[b : b + 1], v[b : b + 1]) for b, c in enumerate(caches)]
            S = max(kb.shape[2] for kb, _ in rows)
            keys = xp.concatenate([self._pad(kb, S) for kb, _ in rows], axis=0)  # (B, H_kv, S, D)
            values = xp.concatenate([self._pad(vb, S) for _, vb in rows], axis=0)
            lengths = self.asarray(np.asarray([kb.shape[2] for kb, _ in rows])[:, None, None, None])
            seen = self.asarray(np.arange(S))[None, None, None, :] < lengths  # (B, 1, 1, S)
            h = h + self._attend(w, q, keys, values, seen)
            h = h + self._mlp(w, _rms(xp, h))
        return _rms(xp, h) @ self.head  # (B, 1, V)

    def _pad(self, a: Any, S: int) -> Any:  # (1, H_kv, S_b, D) -> (1, H_kv, S, D)
        zeros = self.xp.zeros((1, H_KV, S - a.shape[2], D), dtype=a.dtype)
        return self.xp.concatenate([a, zeros], axis=2)

    # -- the pieces -----------------------------------------------------------------------------
    def _qkv(self, w: dict, x: Any, pos: Any) -> tuple[Any, Any, Any]:
        B, L, _ = x.shape

        def heads(y: Any, n: int) -> Any:
            return y.reshape(B, L, n, D).transpose(0, 2, 1, 3)  # (B, n, L, D)

        q, k = heads(x @ w["q"], H), heads(x @ w["k"], H_KV)
        return self._rope(q, pos), self._rope(k, pos), heads(x @ w["v"], H_KV)

    def _rope(self, x: Any, pos: Any) -> Any:  # x (B, n, L, D), pos (B, L): rotate-half
        xp, half = self.xp, D // 2
        angles = pos[..., None] * self.asarray(10000.0 ** (-np.arange(half) / half))  # (B, L, D/2)
        angles = xp.concatenate([angles, angles], axis=-1)[:, None]  # (B, 1, L, D)
        rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * xp.cos(angles) + rotated * xp.sin(angles)

    def _attend(self, w: dict, q: Any, keys: Any, values: Any, seen: Any) -> Any:
        xp = self.xp
        B, _, L, _ = q.shape
        keys, values = xp.repeat(keys, H // H_KV, axis=1), xp.repeat(values, H // H_KV, axis=1)
        scores = q @ keys.swapaxes(-1, -2) / math.sqrt(D)  # (B, H, L, S)
        scores = xp.where(seen, scores, -math.inf)
        p = xp.exp(scores - scores.max(axis=-1, keepdims=True))
        o = (p / p.sum(axis=-1, keepdims=True)) @ values  # (B, H, L, D)
        return o.transpose(0, 2, 1, 3).reshape(B, L, H * D) @ w["o"]

    def _mlp(self, w: dict, x: Any) -> Any:
        gate = x @ w["gate"]
        return (gate / (1 + self.xp.exp(-gate)) * (x @ w["up"])) @ w["down"]


def _rms(xp: Any, x: Any) -> Any:
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def plain_greedy(model: TinyQwen, prompt: list[int], n: int) -> list[int]:
    """The loop a learner writes: prefill, then one token at a time, argmax on the host."""
    cache = [TinyKvCache(model.xp) for _ in range(LAYERS)]
    logits = model(np.asarray([prompt]), cache=cache)
    out = []
    for _ in range(n):
        token = int(np.argmax(np.asarray(logits[0, -1])))
        out.append(token)
        logits = model(np.asarray([[token]]), cache=cache)
    model.calls.clear()
    return out


PROMPTS = [[3, 14, 15, 9, 26, 5, 35], [8, 9], [7, 9, 3, 2]]


@numpy_only
def test_the_model_follows_the_protocol_without_pl_types() -> None:
    model = TinyQwen("numpy")
    assert isinstance(model, LanguageModel)
    assert not isinstance(model, SizedVocabularyModel)  # V comes from the first logits
    for optional in (ReleasingModel, MaterializingModel, RewindingModel, BatchDecodingModel):
        assert isinstance(model, optional)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_is_the_plain_loop(backend: str) -> None:
    model = TinyQwen(backend)
    for prompt in PROMPTS:
        want = plain_greedy(model, prompt, 8)
        made = model.made
        assert list(pl.generate(model, prompt, max_new_tokens=8)) == want
        # every make_cache() list went back (the front's check's and the run's)
        assert model.released == model.made > made
        # a chunked prefill: the model materializes each chunk whose logits are dropped
        before = model.materialized
        assert list(pl.generate(model, prompt, max_new_tokens=8, prefill_step_size=2)) == want
        assert model.materialized - before == (len(prompt) - 1) // 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_generate_batches_over_the_models_own_caches(backend: str) -> None:
    model = TinyQwen(backend)
    want = [plain_greedy(model, p, 6) for p in PROMPTS]
    assert pl.batch_generate(model, PROMPTS, max_new_tokens=6, stop=()) == want
    batched = [B for kind, B, _ in model.calls if kind == "batch"]
    assert batched and max(batched) == len(PROMPTS)  # the rows of a step in one forward
    assert all(B == 1 for kind, B, _ in model.calls if kind == "call")  # the prefills
    assert model.released == model.made  # each request's caches, when it ended
    # a chunked prefill under continuous batching: each dropped chunk materialized
    assert pl.batch_generate(model, PROMPTS, max_new_tokens=6, prefill_chunk=2) == want
    model.materialized = 0  # one prompt of 7 tokens: chunks of 2, 2, 2 (materialized) and 1
    assert pl.batch_generate(model, PROMPTS[:1], max_new_tokens=6, prefill_chunk=2) == want[:1]
    assert model.materialized == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_generate_is_the_target_plain_loop(backend: str) -> None:
    target, draft = TinyQwen(backend, seed=0), TinyQwen(backend, seed=1)
    for prompt in PROMPTS:
        want = plain_greedy(target, prompt, 10)
        gen = pl.speculative_generate(target, draft, prompt, max_new_tokens=10)
        assert list(gen) == want
        assert gen.stats.draft_tokens > 0  # (a draft of other weights: some are rejected)
        assert target.released == target.made and draft.released == draft.made


def _draft_forwards(target: TinyQwen, draft: TinyQwen, prompt: list[int], **options: Any) -> int:
    draft.calls.clear()
    list(pl.speculative_generate(target, draft, prompt, **options))
    return len(draft.calls)


@numpy_only
def test_the_draft_is_lazy_about_stops() -> None:
    """The draft runs only when its proposals can be used: not when the target's first token
    stops or is the last one asked for, and never past a stop token it proposes. The same
    weights make the draft propose the target's greedy tokens ``g``."""
    target, draft = TinyQwen("numpy"), TinyQwen("numpy")
    prompt = PROMPTS[0]
    g = plain_greedy(target, prompt, 12)
    assert g[2] not in g[:2]
    # The eager draft prefilled the prompt (1 forward) and proposed k = 4 (4 forwards) before
    # the target's first token was known: 5 forwards in each case below.
    assert _draft_forwards(target, draft, prompt, max_new_tokens=12, stop=[g[0]]) == 0
    assert _draft_forwards(target, draft, prompt, max_new_tokens=1, stop=()) == 0
    # Round 1 proposes g[1], then g[2], a stop: 2 forwards (the first one with the prompt).
    gen = pl.speculative_generate(target, draft, prompt, max_new_tokens=12, stop=[g[2]])
    draft.calls.clear()
    assert list(gen) == g[:2]
    assert [L for _, _, L in draft.calls] == [len(prompt) + 1, 1]
    assert gen.stats.draft_tokens == 2 and gen.stats.accepted_tokens == 2
    assert draft.released == draft.made and target.released == target.made


@numpy_only
def test_max_new_tokens_0_returns_nothing_on_every_front() -> None:
    model = TinyQwen("numpy", tokenizer=CharTokenizer(ALPHABET))
    prompt = PROMPTS[0]
    assert list(pl.generate(model, prompt, max_new_tokens=0)) == []
    assert list(pl.generate(model, "hello", max_new_tokens=0)) == []
    assert list(pl.generate(model, ["hi", "hello"], max_new_tokens=0)) == []
    assert pl.batch_generate(model, PROMPTS, max_new_tokens=0) == [[], [], []]
    assert list(pl.speculative_generate(model, TinyQwen("numpy"), prompt, max_new_tokens=0)) == []
    gen = pl.BatchGenerator(model)
    assert gen.add(pl.Request(prompt, max_new_tokens=0)) == 0
    assert not gen.has_work and gen.step() == []
    assert gen.add(pl.Request(prompt, max_new_tokens=1)) == 1  # the ids go on
    assert model.calls == []  # no forward ran
    assert model.released == model.made


@numpy_only
def test_a_request_takes_tokens_decoded_elsewhere() -> None:
    """``BatchGenerator.feed``: the request's next tokens are the fed ones, then it goes on
    from them as the plain loop does from the prompt plus those tokens."""
    model = TinyQwen("numpy")
    gen = pl.BatchGenerator(model)
    a = gen.add(pl.Request(PROMPTS[0], max_new_tokens=6, stop=()))
    b = gen.add(pl.Request(PROMPTS[1], max_new_tokens=6, stop=()))
    fed = [40, 41]
    assert gen.feed(a, fed) and not gen.feed(99, [1])
    out: dict[int, list[int]] = {a: [], b: []}
    while gen.has_work:
        for rid, token, _ in gen.step():
            out[rid].append(token)
            if rid == a and len(out[a]) == 4:
                assert gen.feed(a, [7])  # mid-stream too
    rest = plain_greedy(model, PROMPTS[0] + fed, 2)
    after = plain_greedy(model, PROMPTS[0] + fed + rest + [7], 1)
    assert out[a] == [*fed, *rest, 7, *after]
    assert out[b] == plain_greedy(model, PROMPTS[1], 6)
    with pytest.raises(ValueError, match=r"feed: tokens\[0\] must be >= 0"):
        gen.feed(a, [-1])


@numpy_only
def test_a_tokenizer_with_only_encode_and_decode() -> None:
    tok = CharTokenizer(ALPHABET)
    model = TinyQwen("numpy", tokenizer=tok)
    want = tok.decode(plain_greedy(model, tok.encode("hello world"), 8))
    assert "".join(pl.generate(model, "hello world", max_new_tokens=8, stop=())) == want
    assert pl.batch_generate(model, ["hello world"], max_new_tokens=8, stop=()) == [want]
    draft = TinyQwen("numpy", seed=1, tokenizer=CharTokenizer(ALPHABET))
    text = pl.speculative_generate(model, draft, "hello world", max_new_tokens=8, stop=())
    assert "".join(text) == want
    # the pair check, for two tokenizers that state no vocabulary: the ids of one text
    other = TinyQwen("numpy", seed=1, tokenizer=CharTokenizer(ALPHABET[::-1]))
    with pytest.raises(ValueError, match="the draft's tokenizer differs from the target's"):
        pl.speculative_generate(model, other, "hello", max_new_tokens=2)


class SizedTinyQwen(TinyQwen):
    vocab_size = V


@numpy_only
def test_without_vocab_size_every_option_reads_v_from_the_logits() -> None:
    """Sampling filters, penalties and ``logit_bias`` give the same tokens whether the model
    states ``V`` or generation reads it from the first logits."""
    options = dict(
        max_new_tokens=10, temperature=0.9, top_k=8, seed=3, logit_bias={5: 4.0},
        frequency_penalty=0.5, stop=(),
    )  # fmt: skip
    for prompt in PROMPTS:
        want = list(pl.generate(SizedTinyQwen("numpy"), prompt, **options))
        assert list(pl.generate(TinyQwen("numpy"), prompt, **options)) == want
    request = dict(max_new_tokens=8, presence_penalty=1.0, logit_bias={9: 3.0}, stop=())
    got = []
    for model in (SizedTinyQwen("numpy"), TinyQwen("numpy")):
        gen = pl.BatchGenerator(model)
        out: dict[int, list[int]] = {gen.add(pl.Request(p, **request)): [] for p in PROMPTS}
        while gen.has_work:
            for rid, token, _ in gen.step():
                out[rid].append(token)
        got.append(out)
    assert got[0] == got[1]
    with pytest.raises(ValueError, match=r"\[0, 64\) \(vocab_size\)"):
        pl.generate(SizedTinyQwen("numpy"), [V], max_new_tokens=1)


@numpy_only
def test_logit_bias_without_v_builds_no_row_of_2_31_floats() -> None:
    """Without ``V``, ``logit_bias`` is checked pair by pair (a dense row of the unknown
    vocabulary's bound was 8 GiB of float32: ``make_logits_processors(logit_bias=...)``)."""
    tracemalloc.start()
    try:
        processors = pl.make_logits_processors(logit_bias={5: 2.0, "7": -1.5})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20
    logits = np.zeros((1, V), np.float32)
    (biased,) = [p([[1, 2]], logits) for p in processors]
    assert biased[0, 5] == 2.0 and biased[0, 7] == -1.5 and np.count_nonzero(biased) == 2
    with pytest.raises(ValueError, match=r"logit_bias: token id 64 is outside \[0, 64\)"):
        pl.make_logits_processors(logit_bias={V: 1.0})[0]([[1]], logits)


@numpy_only
def test_a_tokenizers_library_tokenizer_as_it_is(tmp_path: Any) -> None:
    """A ``tokenizers.Tokenizer`` (``encode`` gives an ``Encoding``) gives the text a
    ``pl.Tokenizer`` of the same file gives; the pair check compares their vocabularies."""
    raw = write_tokenizer(tmp_path, vocab_size=300)
    ours = pl.Tokenizer(raw)
    prompt = "the cat sat"
    for tok in (raw, ours):
        model = TinyQwen("numpy", tokenizer=tok, vocab=300)
        want = ours.decode(plain_greedy(model, ours.encode_prompt(prompt), 12))
        assert "".join(pl.generate(model, prompt, max_new_tokens=12, stop=())) == want
    target = TinyQwen("numpy", tokenizer=raw, vocab=300)  # the two libraries' vocabularies
    draft = TinyQwen("numpy", seed=1, tokenizer=ours, vocab=300)
    gen = pl.speculative_generate(target, draft, prompt, max_new_tokens=12, stop=())
    assert "".join(gen) == want
    other = write_tokenizer(tmp_path / "other", vocab_size=280)
    with pytest.raises(ValueError, match=r"draft's tokenizer differs .* first differences"):
        pl.speculative_generate(
            target, TinyQwen("numpy", tokenizer=other, vocab=300), prompt, max_new_tokens=2
        )


@numpy_only
@pytest.mark.parametrize("member", ["release_cache", "materialize", "rewind_cache", "decode_batch"])
def test_an_optional_member_that_is_not_callable_is_named(member: str) -> None:
    model = TinyQwen("numpy")
    setattr(model, member, 5)
    for front in (
        lambda: pl.generate(model, [1, 2], max_new_tokens=1),
        lambda: pl.BatchGenerator(model),
        lambda: pl.speculative_generate(model, TinyQwen("numpy"), [1, 2], max_new_tokens=1),
    ):
        with pytest.raises(TypeError, match=rf"TinyQwen.{member} must be callable, got int"):
            front()


@numpy_only
def test_a_draft_of_another_vocabulary_is_refused_at_its_first_logits() -> None:
    """Neither model states ``vocab_size``: the draft's first logits are checked against the
    target's ``V``."""
    target, draft = TinyQwen("numpy"), TinyQwen("numpy", vocab=300)
    gen = pl.speculative_generate(target, draft, PROMPTS[0], max_new_tokens=4, stop=())
    with pytest.raises(ValueError, match=r"the draft's vocab_size \(300\) differs from the tar"):
        list(gen)
    assert draft.released == draft.made and target.released == target.made  # on failure too
