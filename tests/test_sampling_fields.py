"""The sampling fields of issue 32 in the Python API: penalties, ``logit_bias``, ``min_tokens``,
``ignore_eos``, ``n``.

:func:`portable_llm.apply_penalties` is checked against
:func:`portable_llm.testing.reference.penalties` (float64 NumPy, token by token) on every
backend, plus properties; generation against a float64 loop that runs the whole sequence
through the model each step and applies the reference; :class:`BatchGenerator` rows (each with
its own penalties, in one batched step) against :func:`generate` alone; ``n`` against its
prefill count and pages.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

import portable_llm as pl
from portable_llm.generation.batch import BatchGenerator, Request
from portable_llm.models import load
from portable_llm.testing import assert_close, random_array, reference
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from portable_llm.testing.strategies import seeds

V = 12  # vocabulary of the op tests (one shape: JAX compiles once)
B = 4


def _case(seed: int, backend: str, dtype: str) -> tuple:
    """Random logits, counts, prompt masks, per-row penalties, biases and bans; the op's
    arguments (on ``backend``) and the reference's."""
    rng = np.random.default_rng(seed)
    x, x_r = random_array(seed, (B, V), dtype, backend=backend, low=-4, high=4)
    generated = [[int(t) for t in rng.integers(0, V, size=rng.integers(0, 6))] for _ in range(B)]
    prompts = [[int(t) for t in rng.integers(0, V, size=rng.integers(1, 4))] for _ in range(B)]
    counts = np.zeros((B, V), np.int32)
    prompt_mask = np.zeros((B, V), bool)
    for b in range(B):
        np.add.at(counts[b], generated[b], 1)
        prompt_mask[b, prompts[b]] = True
    freq = rng.uniform(-2, 2, size=B).astype(np.float32)
    pres = rng.uniform(-2, 2, size=B).astype(np.float32)
    rep = rng.uniform(0.5, 2.0, size=B).astype(np.float32)
    bias = np.where(rng.random((B, V)) < 0.3, rng.uniform(-100, 100, (B, V)), 0.0)
    bias = bias.astype(np.float32)
    banned = rng.random((B, V)) < 0.1

    def arr(a: np.ndarray):
        return pl.asarray(a, backend=backend)

    args = (x, arr(counts))
    kwargs = {
        "prompt_mask": arr(prompt_mask), "frequency_penalty": arr(freq),
        "presence_penalty": arr(pres), "repetition_penalty": arr(rep),
        "logit_bias": arr(bias), "banned": arr(banned),
    }  # fmt: skip
    ref = reference.penalties(
        x_r, generated, prompts, frequency=[float(f) for f in freq],
        presence=[float(p) for p in pres], repetition=[float(r) for r in rep],
        bias=[{t: float(bias[b, t]) for t in range(V) if bias[b, t]} for b in range(B)],
        banned=[set(np.flatnonzero(banned[b]).tolist()) for b in range(B)],
    )  # fmt: skip
    return args, kwargs, ref, x_r


def _out_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


# -- the op ------------------------------------------------------------------------------------


@given(seed=seeds())
def test_penalties_equal_the_float64_reference(backend, dtype, seed):
    args, kwargs, want, _ = _case(seed, backend, dtype)
    got = pl.apply_penalties(*args, **kwargs)
    assert_close(got, want, dtype=_out_dtype(dtype), backend=backend)


@given(seed=seeds())
def test_neutral_penalties_change_nothing(backend, dtype, seed):
    args, _, _, x_r = _case(seed, backend, dtype)
    got = pl.apply_penalties(*args, frequency_penalty=0.0, presence_penalty=0, repetition_penalty=1)
    same = pl.apply_penalties(
        *args, frequency_penalty=pl.asarray(np.zeros(B, np.float32), backend=backend),
        repetition_penalty=pl.asarray(np.ones(B, np.float32), backend=backend),
        logit_bias=pl.asarray(np.zeros(V, np.float32), backend=backend),
    )  # fmt: skip
    for out in (got, same):  # bit for bit: the logits in float32
        np.testing.assert_array_equal(pl.to_numpy(out), x_r.astype(_out_dtype(dtype)))


@given(seed=seeds())
def test_presence_penalty_changes_only_generated_tokens(backend, seed):
    args, _, _, x_r = _case(seed, backend, "float32")
    counts = pl.to_numpy(args[1])
    got = pl.to_numpy(pl.apply_penalties(*args, presence_penalty=1.5))
    np.testing.assert_array_equal(got[counts == 0], x_r[counts == 0].astype(np.float32))
    np.testing.assert_allclose(got[counts > 0], x_r[counts > 0] - 1.5, rtol=1e-6)


@given(seed=seeds())
def test_frequency_penalty_is_presence_penalty_on_tokens_seen_once(backend, seed):
    args, _, _, _ = _case(seed, backend, "float32")
    once = pl.asarray(np.minimum(pl.to_numpy(args[1]), 1), backend=backend)
    a = pl.apply_penalties(args[0], once, frequency_penalty=0.7)
    b = pl.apply_penalties(args[0], once, presence_penalty=0.7)
    np.testing.assert_array_equal(pl.to_numpy(a), pl.to_numpy(b))


@given(seed=seeds())
def test_logit_bias_of_minus_100_on_all_but_one_token_makes_greedy_pick_it(backend, seed):
    x, _ = random_array(seed, (B, V), "float32", backend=backend, low=-40, high=40)
    keep = np.random.default_rng(seed).integers(0, V, size=B)
    bias = np.full((B, V), -100.0, np.float32)
    bias[np.arange(B), keep] = 0.0
    counts = pl.asarray(np.zeros((B, V), np.int32), backend=backend)
    out = pl.apply_penalties(x, counts, logit_bias=pl.asarray(bias, backend=backend))
    np.testing.assert_array_equal(pl.to_numpy(pl.greedy(out)), keep)


@given(seed=seeds())
def test_a_repetition_penalty_above_one_never_raises_a_seen_logit(backend, seed):
    args, kwargs, _, x_r = _case(seed, backend, "float32")
    got = pl.to_numpy(
        pl.apply_penalties(*args, prompt_mask=kwargs["prompt_mask"], repetition_penalty=1.3)
    )
    seen = (pl.to_numpy(args[1]) > 0) | pl.to_numpy(kwargs["prompt_mask"])
    assert (got[seen] <= x_r[seen].astype(np.float32)).all()
    assert (np.abs(got[seen]) <= np.abs(x_r[seen]) * 1.3 + 1e-6).all()
    np.testing.assert_array_equal(got[~seen], x_r[~seen].astype(np.float32))


def test_backends_agree_with_numpy(other_backend):
    args, kwargs, _, _ = _case(7, "numpy", "float32")
    want = pl.apply_penalties(*args, **kwargs)
    moved = {k: pl.asarray(pl.to_numpy(v), backend=other_backend) for k, v in kwargs.items()}
    got = pl.apply_penalties(*(pl.asarray(pl.to_numpy(a), backend=other_backend) for a in args),
                             **moved)  # fmt: skip
    assert_close(got, pl.to_numpy(want), backend=other_backend)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"frequency_penalty": 2.5}, ValueError, "frequency_penalty must be"),
        ({"presence_penalty": -2.01}, ValueError, "presence_penalty must be"),
        ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty must be"),
        ({"repetition_penalty": True}, TypeError, "repetition_penalty must be a real"),
        ({"frequency_penalty": np.zeros(3, np.float32)}, ValueError, r"shape B.. = \(2,\)"),
        ({"presence_penalty": [0.1, 0.2]}, TypeError, "must be a real number or an array"),
        ({"prompt_mask": np.zeros((2, 5), bool)}, ValueError, r"prompt_mask must have shape"),
        ({"prompt_mask": np.zeros((2, 4), np.int32)}, TypeError, "prompt_mask must have a bool"),
        ({"logit_bias": np.zeros(3, np.float32)}, ValueError, r"\(2, 4\) or \(4,\)"),
        ({"banned": np.zeros(4, np.float32)}, TypeError, "banned must have a bool"),
    ],
)
def test_bad_options_name_the_argument(options, error, match):
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(error, match=match):
        pl.apply_penalties(x, np.zeros((2, 4), np.int32), **options)


def test_counts_of_another_shape_or_dtype_are_refused():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"apply_penalties: counts must have shape \(2, 4\)"):
        pl.apply_penalties(x, np.zeros((2, 3), np.int32))
    with pytest.raises(TypeError, match="counts must have a integer or float dtype"):
        pl.apply_penalties(x, np.zeros((2, 4), bool))


@pytest.mark.parametrize(
    ("bias", "error", "match"),
    [
        ({"12": 1.0}, ValueError, "logit_bias key '12' must be >= 0 and <= 11"),
        ({-1: 1.0}, ValueError, "must be >= 0"),
        ({"x": 1.0}, ValueError, "'x' is not a token id"),
        ({3: 100.5}, ValueError, r"logit_bias\[3\] must be"),
        ({3: "a"}, TypeError, "must be a real number"),
        ([1, 2], TypeError, "logit_bias must be a mapping"),
    ],
)
def test_logit_bias_rows_are_checked(bias, error, match):
    with pytest.raises(error, match=match):
        pl.logit_bias_row(bias, vocab_size=V)


def test_logit_bias_row_is_dense():
    row = pl.logit_bias_row({"3": -100, 5: 2.5}, vocab_size=V)
    want = np.zeros(V, np.float32)
    want[3], want[5] = -100, 2.5
    np.testing.assert_array_equal(row, want)


# -- generation ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("sampling_fields")
    write_checkpoint(path, tiny_config("llama"), seed=5)
    return path


_MODELS: dict[str, pl.Model] = {}


def _model(folder, backend: str) -> pl.Model:
    if backend not in _MODELS:
        dtype = "float64" if backend == "numpy" else "float32"
        _MODELS[backend] = load(folder, backend=backend, dtype=dtype)
    return _MODELS[backend]


PROMPT = [5, 17, 42, 17, 99, 5, 3]
#: Options of the requests of one batch: the penalties each asks for (one asks for none).
OPTIONS = [
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {},
    {"repetition_penalty": 1.8, "logit_bias": {7: 3.0, 40: -100.0}},
    {"presence_penalty": -1.0, "repetition_penalty": 0.7, "frequency_penalty": 0.3},
]


def _loop(model: pl.Model, prompt: list[int], new: int, stop=(), **o) -> list[int]:
    """Greedy tokens from the float64 reference: the whole sequence through the model each step
    (no cache), the logits of the last position penalised token by token."""
    ids, out = list(prompt), []
    least = o.get("min_tokens", 0)
    for _ in range(new):
        logits = np.asarray(pl.to_numpy(model(np.asarray([ids]))), np.float64)[:, -1, :]  # (1, V)
        x = reference.penalties(
            logits, [out], [list(prompt)], frequency=[o.get("frequency_penalty", 0.0)],
            presence=[o.get("presence_penalty", 0.0)], repetition=[o.get("repetition_penalty", 1)],
            bias=[o.get("logit_bias", {})], banned=[set(stop) if len(out) < least else set()],
        )  # fmt: skip
        token = int(np.argmax(x[0]))
        if token in stop:
            break
        out.append(token)
        ids.append(token)
    return out


@pytest.mark.parametrize("options", OPTIONS)
def test_generate_with_penalties_equals_a_float64_loop(folder, options):
    model = _model(folder, "numpy")
    got = list(pl.generate(model, PROMPT, max_new_tokens=10, stop=(),
                           repetition_context_size=None, **options))  # fmt: skip
    assert got == _loop(model, PROMPT, 10, **options)


def _run(gen: BatchGenerator) -> tuple[dict[int, list[int]], dict[int, str]]:
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    while gen.has_work:
        for rid, token, reason in gen.step():
            assert rid not in reasons
            tokens.setdefault(rid, []).append(token)
            if reason is not None:
                reasons[rid] = reason
    return tokens, reasons


# Slow on JAX (tox -e slow): 15 CPU s of compiles there (every mix of batch rows and chunk
# lengths is a new shape). The plumbing it checks (each request's options to its row) is the
# same code on every backend; JAX keeps apply_penalties' per-row float64 check and the batch
# tests below (min_tokens, ignore_eos, n).
@pytest.mark.slow_on("jax")
def test_each_row_of_a_batch_gets_its_own_penalties(folder, backend):
    model = _model(folder, backend)
    gen = BatchGenerator(model, page_size=4, prefill_chunk=5)
    prompts = [PROMPT, PROMPT[:4], [9, 9, 9, 9, 9, 9], PROMPT[2:]]
    ids = [gen.add(Request(p, 9, stop=(), **o)) for p, o in zip(prompts, OPTIONS, strict=True)]
    tokens, _ = _run(gen)
    for rid, p, o in zip(ids, prompts, OPTIONS, strict=True):
        alone = list(pl.generate(model, p, max_new_tokens=9, stop=(),
                                 repetition_context_size=None, **o))  # fmt: skip
        assert tokens[rid] == alone, o
        if backend == "numpy":
            assert tokens[rid] == _loop(model, p, 9, **o)


def test_min_tokens_bans_the_stop_tokens_until_then(folder, backend):
    model = _model(folder, backend)
    free = list(pl.generate(model, PROMPT, max_new_tokens=8, stop=()))
    stop = (free[1],)  # greedy would stop at the second token
    assert list(pl.generate(model, PROMPT, max_new_tokens=8, stop=stop)) == free[:1]
    want = _loop(model, PROMPT, 8, stop=stop, min_tokens=5) if backend == "numpy" else None
    got = list(pl.generate(model, PROMPT, max_new_tokens=8, stop=stop, min_tokens=5))
    assert len(got) >= 5 and not set(got[:5]) & set(stop)
    gen = BatchGenerator(model)
    rid = gen.add(Request(PROMPT, 8, stop=stop, min_tokens=5))
    tokens, reasons = _run(gen)
    assert [t for t in tokens[rid] if reasons[rid] == "length" or t not in stop] == got
    if want is not None:
        assert got == want


def test_ignore_eos_runs_to_max_new_tokens(folder, backend):
    model = _model(folder, backend)
    eos = next(iter(model.eos_token_ids))
    force = {eos: 100.0}  # the model would say EOS at once
    gen = BatchGenerator(model)
    a = gen.add(Request(PROMPT, 4, logit_bias=force))
    b = gen.add(Request(PROMPT, 4, logit_bias=force, ignore_eos=True))
    tokens, reasons = _run(gen)
    assert (tokens[a], reasons[a]) == ([eos], "stop")
    assert (tokens[b], reasons[b]) == ([eos] * 4, "length")
    assert list(pl.generate(model, PROMPT, max_new_tokens=4, logit_bias=force)) == []
    got = list(pl.generate(model, PROMPT, max_new_tokens=4, logit_bias=force, ignore_eos=True))
    assert got == [eos] * 4


def _counting(model: pl.Model) -> tuple[pl.Model, list[int]]:
    """``model`` whose paged forward counts the prompt tokens it is fed (chunks of > 1)."""
    fed: list[int] = []
    inner = model.forward_paged

    def forward_paged(chunks, **kw):
        fed.extend(len(c) for c in chunks if len(c) > 1)
        return inner(chunks, **kw)

    model.forward_paged = forward_paged  # type: ignore[method-assign]
    return model, fed


def test_n_sequences_prefill_the_prompt_once_and_share_its_pages(folder, backend):
    model, fed = _counting(load(folder, backend=backend, dtype="float32"))
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 300, size=10)]
    gen = BatchGenerator(model, page_size=4)
    rid = gen.add(Request(prompt, 6, stop=(), n=4))
    sampled = gen.add(Request(prompt, 6, stop=(), n=3,
                              sampler=pl.make_sampler(temperature=1.5, seed=0)))  # fmt: skip
    first_step = gen.step()  # both prefills, every sequence's first token
    assert fed == [10, 10]  # once per request, not once per sequence
    tables = {s.rid: s.caches[0].block_table for s in gen._running}
    assert sorted(tables) == [rid, rid + 1, rid + 2, rid + 3, sampled, sampled + 1, sampled + 2]
    pool = gen.pools[0]
    for first in (rid, sampled):
        group = [tables[first + i] for i in range(4 if first == rid else 3)]
        assert all(t[:2] == group[0][:2] for t in group)  # the two full prompt pages, shared
        assert all(pool.refcount(p) == len(group) for p in group[0][:2])
        assert len({t[2] for t in group}) == len(group)  # the partly filled page: copied
    tokens, reasons = _run(gen)
    assert reasons == dict.fromkeys(range(rid, rid + 7), "length")
    for r, token, _ in first_step:
        tokens[r].insert(0, token)
    greedy = list(pl.generate(model, prompt, max_new_tokens=6, stop=()))
    assert [tokens[rid + i] for i in range(4)] == [greedy] * 4
    assert pool.num_free == pool.num_pages and gen._promised == 0


def test_n_greedy_sequences_equal_generate(folder, backend):
    model = _model(folder, backend)
    gen = BatchGenerator(model, page_size=4)
    rid = gen.add(Request(PROMPT, 7, stop=(), n=3, frequency_penalty=1.0))
    tokens, _ = _run(gen)
    alone = list(pl.generate(model, PROMPT, max_new_tokens=7, stop=(), frequency_penalty=1.0))
    assert [tokens[rid + i] for i in range(3)] == [alone] * 3


def test_n_sampled_sequences_differ_and_repeat_with_the_seed(folder):
    model = _model(folder, "numpy")

    def run() -> list[list[int]]:
        gen = BatchGenerator(model, page_size=4)
        rid = gen.add(Request(PROMPT, 8, stop=(), n=5,
                              sampler=pl.make_sampler(temperature=2.0, seed=11)))  # fmt: skip
        tokens, _ = _run(gen)
        return [tokens[rid + i] for i in range(5)]

    first = run()
    assert first == run()
    assert len({tuple(t) for t in first}) > 1


def test_cancelling_a_sequence_of_n_frees_what_it_held(folder):
    model = _model(folder, "numpy")
    gen = BatchGenerator(model, page_size=4, prefill_chunk=4)
    rid = gen.add(Request(PROMPT, 5, stop=(), n=3))
    gen.step()  # the prompt (7 tokens) is half prefilled: the siblings wait for it
    assert gen._promised > 0
    assert gen.cancel(rid + 2)
    tokens, reasons = _run(gen)
    assert sorted(reasons) == [rid, rid + 1]
    pool = gen.pools[0]
    assert pool.num_free == pool.num_pages and gen._promised == 0
    rid = gen.add(Request(PROMPT, 5, stop=(), n=2))
    gen.step()
    gen.step()  # the prefill done: both sequences decode, on shared pages
    assert sorted(s.rid for s in gen._running) == [rid, rid + 1]
    assert gen.cancel(rid)  # the first: its sibling keeps the shared pages
    tokens, reasons = _run(gen)
    assert list(reasons) == [rid + 1] and len(tokens[rid + 1]) == 4
    assert pool.num_free == pool.num_pages


def test_n_on_a_model_without_pages_prefills_each_sequence(folder):
    class Plain:
        """The model through the plain LanguageModel protocol (no paged forward)."""

        def __init__(self, model):
            self._m = model
            self.vocab_size, self.tokenizer = model.vocab_size, model.tokenizer
            self.eos_token_ids = model.eos_token_ids

        def make_cache(self, **kw):
            return self._m.make_cache(**kw)

        def __call__(self, ids, **kw):
            return self._m(ids, **kw)

    model = _model(folder, "numpy")
    gen = BatchGenerator(Plain(model))
    rid = gen.add(Request(PROMPT, 5, stop=(), n=2, presence_penalty=1.0))
    tokens, _ = _run(gen)
    alone = list(pl.generate(model, PROMPT, max_new_tokens=5, stop=(), presence_penalty=1.0))
    assert tokens == {rid: alone, rid + 1: alone}


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("frequency_penalty", 2.5, ValueError, "frequency_penalty must be"),
        ("presence_penalty", -3, ValueError, "presence_penalty must be"),
        ("repetition_penalty", 0, ValueError, "repetition_penalty must be"),
        ("logit_bias", {300: 1.0}, ValueError, "logit_bias key 300 must be >= 0 and <= 299"),
        ("logit_bias", {1: -101}, ValueError, r"logit_bias\[1\] must be"),
        ("min_tokens", 6, ValueError, "min_tokens must be >= 0 and <= 5"),
        ("min_tokens", -1, ValueError, "min_tokens must be"),
        ("ignore_eos", "yes", TypeError, "ignore_eos must be a bool"),
        ("n", 17, ValueError, "n must be >= 1 and <= 16"),
        ("n", 0, ValueError, "n must be >= 1"),
    ],
)
def test_bad_request_fields_are_refused_when_added(folder, field, value, error, match):
    model = _model(folder, "numpy")
    gen = BatchGenerator(model)
    with pytest.raises(error, match=f"BatchGenerator.add: {match}"):
        gen.add(Request(PROMPT, 5, **{field: value}))
    assert not gen.has_work
    if field != "n":
        with pytest.raises(error, match=f"generate: {match}"):
            pl.generate(model, PROMPT, max_new_tokens=5, **{field: value})


def test_stop_may_be_a_set(folder):
    """A set of stop ids (the server passes them so, and ``min_tokens`` reads them) works as a
    tuple does; it used to reach the array lookup and raise."""
    model = _model(folder, "numpy")
    free = list(pl.generate(model, PROMPT, max_new_tokens=6, stop=()))
    stop = free[2]
    want = free[: free.index(stop)]
    assert list(pl.generate(model, PROMPT, max_new_tokens=6, stop={stop})) == want
    assert list(pl.generate(model, PROMPT, max_new_tokens=6, stop=frozenset({stop}))) == want


def test_a_decode_step_penalises_every_row_in_one_call(folder):
    """Four decoding requests with different penalties (and one with none): one
    ``apply_penalties`` per step for the whole batch, never one per row."""
    model = _model(folder, "numpy")
    gen = BatchGenerator(model, prefill_chunk=64)
    for o in OPTIONS:
        gen.add(Request(PROMPT, 6, stop=(), **o))
    gen.step()  # every prefill and first token
    assert len(gen._running) == len(OPTIONS)
    with pl.trace() as t:
        events = gen.step()
    assert len(events) == len(OPTIONS)
    assert len(t.ops("apply_penalties")) == 1
