"""Continuous batching (models/batch.py): every request gets the tokens it gets alone.

The oracle is :func:`portable_llm.generate` run on each request alone (its dense KV cache, the
whole prompt at once): greedy ids equal token for token, whatever the arrival order, the
prefill chunk and the batch size, with unequal prompts and requests that end at different
steps. The tiny random checkpoints have clear greedy winners (``random_tensors``), so float32
rounding does not flip a token; NumPy runs in float64.
"""

from __future__ import annotations

import ast
import copy
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.cli.cli import main
from portable_llm.generation.batch import BatchGenerator, Request, batch_generate
from portable_llm.models import load
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer

FAMILIES = ["llama", "mistral", "qwen3", "qwen2_moe"]
#: (prompt length, max_new_tokens) of the requests of the main test: unequal prompts, and
#: requests that end at different steps.
SHAPES = [(3, 6), (9, 3), (5, 8), (12, 5), (1, 4)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(f"batch_{family}")
        cfg = tiny_config(family)
        write_checkpoint(folder, cfg, seed=40 + i)
        if family == "llama":
            write_tokenizer(folder, vocab_size=cfg["vocab_size"])
        out[family] = folder
    return out


def _model(folders: dict, family: str, backend: str) -> pl.Model:
    dtype = "float64" if backend == "numpy" else "float32"
    return load(folders[family], backend=backend, dtype=dtype)


def _op_by_op(model: pl.Model) -> pl.Model:
    """The model without its prepared forward (the public ops, layer by layer)."""
    slow = copy.copy(model)
    slow.prepared = None
    return slow


def _prompt(seed: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 300, size=n)]


_ALONE: dict[tuple, list[int]] = {}
_MODELS: dict[str, pl.Model] = {}


def _alone(model: pl.Model, prompt: list[int], new: int, stop: tuple[int, ...] = ()) -> list[int]:
    """``generate`` on one prompt alone (greedy), remembered per backend and checkpoint."""
    key = (model.backend.name, model.config.model_type, tuple(prompt), new, stop)
    if key not in _ALONE:
        _ALONE[key] = list(pl.generate(model, prompt, max_new_tokens=new, stop=stop))
    return list(_ALONE[key])


def _run(gen: BatchGenerator, later: list[Request] = (), every: int = 2) -> dict:
    """Step ``gen`` until done, adding one of ``later`` every ``every`` steps; each request's
    tokens and finish reason by id, checking that a request's last event is its only finish."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    pending = list(later)
    steps = 0
    while gen.has_work or pending:
        if pending and steps % every == 0:
            gen.add(pending.pop(0))
        for rid, token, reason in gen.step():
            assert rid not in reasons, f"request {rid} got a token after it finished"
            tokens.setdefault(rid, []).append(token)
            if reason is not None:
                reasons[rid] = reason
        steps += 1
        assert steps < 500, "the generator does not finish"
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def _expected(model: pl.Model, requests: list[Request]) -> list[tuple[list[int], str]]:
    """Each request alone: its tokens (a final stop token included) and finish reason."""
    out = []
    for r in requests:
        stop = tuple(r.stop or ())
        ids = _alone(model, list(r.prompt_ids), r.max_new_tokens, stop)
        if len(ids) < r.max_new_tokens:  # generate stopped at a stop token (not yielded)
            full = _alone(model, list(r.prompt_ids), len(ids) + 1)
            out.append((full, "stop"))
        else:
            out.append((ids, "length"))
    return out


def _requests(model: pl.Model) -> list[Request]:
    """SHAPES, the third request with a stop id it meets at its 3rd token (computed alone)."""
    reqs = [Request(_prompt(i, n), new, stop=()) for i, (n, new) in enumerate(SHAPES)]
    third = _alone(model, list(reqs[2].prompt_ids), reqs[2].max_new_tokens)
    stop = third[2]
    if stop in third[:2]:  # it must end there, not earlier
        pytest.fail(f"the stop id {stop} occurs before the 3rd token of {third}")
    reqs[2].stop = (stop,)
    return reqs


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize(("chunk", "order"), [(1, "fifo"), (3, "reversed"), (64, "fifo")])
def test_greedy_equals_each_request_alone(
    folders: dict, backend: str, chunk: int, order: str
) -> None:
    model = _model(folders, "llama", backend)
    reqs = _requests(model)
    expected = _expected(model, reqs)
    if order == "reversed":
        reqs, expected = reqs[::-1], expected[::-1]
    gen = BatchGenerator(model, max_batch=3, prefill_chunk=chunk, page_size=4)
    first = [gen.add(r) for r in reqs[:2]]  # two at once, the others arrive while they run
    got = _run(gen, reqs[2:])
    assert first == [0, 1]
    assert [got[i] for i in range(len(reqs))] == expected
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)


@pytest.mark.slow_on("jax")
def test_a_long_prompt_never_stalls_the_running_requests(folders: dict, backend: str) -> None:
    """The scheduling rule: every step decodes each running request; prefill advances by at
    most ``prefill_chunk`` tokens in total, first come first served; a request whose prefill
    completes gets its first token in that step."""
    model = _model(folders, "llama", backend)
    prompts = [_prompt(70, 3), _prompt(71, 37), _prompt(72, 2)]
    news = [12, 3, 3]
    gen = BatchGenerator(model, max_batch=3, prefill_chunk=8, page_size=4)
    tokens: dict[int, list[int]] = {}
    steps = []

    def step() -> None:
        events = gen.step()
        steps.append([rid for rid, _, _ in events])
        for rid, token, _ in events:
            tokens.setdefault(rid, []).append(token)

    gen.add(Request(prompts[0], news[0], stop=()))
    step()  # its 3 tokens prefilled, its first token sampled
    gen.add(Request(prompts[1], news[1], stop=()))  # 37 tokens: 8, 8, 8, 8, then 5
    gen.add(Request(prompts[2], news[2], stop=()))  # 2 tokens: the 3 that request 1 leaves
    for _ in range(6):
        step()
    # Request 0 decodes every step; 1 and 2 get their first tokens in the 5th step.
    assert steps == [[0]] + [[0]] * 4 + [[0, 1, 2]] * 2
    while gen.has_work:
        step()
    assert [tokens[i] for i in range(3)] == [
        _alone(model, p, n) for p, n in zip(prompts, news, strict=True)
    ]


@given(
    shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 5)), min_size=1, max_size=4),
    arrivals=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    chunk=st.integers(1, 10),
    max_batch=st.integers(1, 3),
    page_size=st.sampled_from([1, 2, 4, 16]),
)
def test_any_schedule_gives_each_request_its_tokens_alone(
    folders: dict, shapes: list, arrivals: list, chunk: int, max_batch: int, page_size: int
) -> None:
    """Hypothesis: requests of any lengths arriving at any steps, any chunk, batch and page
    size (NumPy float64): each request's tokens are those ``generate`` gives it alone."""
    model = _MODELS.get("numpy") or _MODELS.setdefault("numpy", _model(folders, "llama", "numpy"))
    reqs = [Request(_prompt(80 + i, n), new, stop=()) for i, (n, new) in enumerate(shapes)]
    when = sorted(range(len(reqs)), key=lambda i: (arrivals[i], i))  # arrival order
    gen = BatchGenerator(model, max_batch=max_batch, prefill_chunk=chunk, page_size=page_size)
    ids: dict[int, int] = {}
    got: dict[int, list[int]] = {}
    step = 0
    while when or gen.has_work:
        while when and arrivals[when[0]] <= step:
            i = when.pop(0)
            ids[gen.add(reqs[i])] = i
        for rid, token, _ in gen.step():
            got.setdefault(ids[rid], []).append(token)
        step += 1
    for i, r in enumerate(reqs):
        assert got[i] == _alone(model, list(r.prompt_ids), r.max_new_tokens), f"request {i}"
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("family", FAMILIES)
def test_families_and_the_op_by_op_path(folders: dict, backend: str, family: str) -> None:
    """Sliding windows (mistral: 4, qwen2_moe: 3, shorter than the sequences), q/k norms
    (qwen3), MoE layers; and a model without a prepared forward (each row run alone through
    ``model(ids, cache=...)``)."""
    model = _model(folders, family, backend)
    reqs = [Request(_prompt(10 + i, n), new, stop=()) for i, (n, new) in enumerate(SHAPES[:3])]
    expected = _expected(model, reqs)
    for prepared in (True, False):
        m = model if prepared else _op_by_op(model)
        assert (m.prepared is not None) is prepared
        gen = BatchGenerator(m, max_batch=4, prefill_chunk=4, page_size=2)
        for r in reqs:
            gen.add(r)
        got = _run(gen)
        assert [got[i] for i in range(len(reqs))] == expected, f"prepared={prepared}"


@pytest.mark.slow_on("jax")
def test_requests_wait_for_pages_and_reuse_them(folders: dict, backend: str) -> None:
    """A pool with room for one request: the others wait, then reuse its pages."""
    model = _model(folders, "llama", backend)
    reqs = [Request(_prompt(20 + i, 6), 5, stop=()) for i in range(3)]
    gen = BatchGenerator(model, max_batch=3, pool_pages=3, page_size=4)  # 10 tokens: 3 pages
    for r in reqs:
        gen.add(r)
    seen = []
    got: dict[int, list[int]] = {}
    while gen.has_work:
        for rid, token, _ in gen.step():
            got.setdefault(rid, []).append(token)
        seen.append(gen.pools[0].num_free)
    assert min(seen) == 0 and gen.pools[0].num_pages == 3  # one request at a time, no growth
    assert [got[i] for i in range(3)] == [t for t, _ in _expected(model, reqs)]
    assert all(pool.num_free == 3 for pool in gen.pools)


@pytest.mark.slow_on("jax")
def test_the_pools_grow_for_a_long_prompt(folders: dict, backend: str) -> None:
    model = _model(folders, "llama", backend)
    req = Request(_prompt(30, 300), 3, stop=())
    gen = BatchGenerator(model, max_batch=1, page_size=16, max_seq_len=400)
    before = gen.pools[0].num_pages
    gen.add(req)
    got = _run(gen)
    assert gen.pools[0].num_pages > before == 16  # 256 tokens: 16 pages, grown for 302
    assert all(pool.num_pages == gen.pools[0].num_pages for pool in gen.pools)
    assert got[0] == _expected(model, [req])[0]


def test_max_seq_len_is_enforced_before_any_page_is_allocated(folders: dict) -> None:
    model = _model(folders, "llama", "numpy")
    gen = BatchGenerator(model, page_size=4)  # max_seq_len: max_position_embeddings (128)
    assert gen.max_seq_len == 128
    gen.add(Request(_prompt(0, 120), 8))  # 128 tokens: fits
    free = [pool.num_free for pool in gen.pools]
    with pytest.raises(ValueError, match=r"120 tokens\) plus max_new_tokens \(9\) is 129"):
        gen.add(Request(_prompt(0, 120), 9))
    short = BatchGenerator(model, max_seq_len=10)
    with pytest.raises(ValueError, match=r"more than max_seq_len \(10\)"):
        short.add(Request(_prompt(0, 8), 3))
    assert not short.has_work
    assert [pool.num_free for pool in gen.pools] == free
    fixed = BatchGenerator(model, pool_pages=2, page_size=4)
    with pytest.raises(ValueError, match=r"needs 3 pages of 4 tokens, more than pool_pages \(2\)"):
        fixed.add(Request(_prompt(0, 6), 4))
    assert not fixed.has_work


@pytest.mark.slow_on("jax")
def test_an_exception_in_a_step_frees_every_page(folders: dict, backend: str) -> None:
    model = _model(folders, "llama", backend)
    calls = []

    def flaky(logits: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("sampler failed")
        return pl.greedy(logits)

    gen = BatchGenerator(model, max_batch=2, prefill_chunk=4, page_size=2)
    gen.add(Request(_prompt(1, 5), 8))
    gen.add(Request(_prompt(2, 7), 8, sampler=flaky))
    gen.add(Request(_prompt(3, 3), 8))  # waiting
    with pytest.raises(RuntimeError, match="sampler failed"):
        while gen.has_work:
            gen.step()
    assert len(calls) == 3
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)
    assert not gen.has_work
    # The generator is usable again, and its pages reused.
    rid = gen.add(Request(_prompt(1, 5), 4, stop=()))
    assert _run(gen)[rid][0] == _alone(model, _prompt(1, 5), 4)


def test_seeded_samplers_draw_as_alone(folders: dict) -> None:
    """Each request's seeded sampler sees its own row, once per token: the same draws as
    ``generate`` with that seed (NumPy float64, so the logits agree to rounding)."""
    model = _model(folders, "llama", "numpy")
    opts = {"temperature": 1.5, "top_p": 0.95}
    prompts = [_prompt(50 + i, n) for i, n in enumerate((4, 7, 2))]
    gen = BatchGenerator(model, prefill_chunk=5, page_size=4)
    for i, p in enumerate(prompts):
        gen.add(Request(p, 10, sampler=pl.make_sampler(**opts, seed=i), stop=()))
    got = _run(gen)
    for i, p in enumerate(prompts):
        alone = list(pl.generate(model, p, max_new_tokens=10, stop=(), seed=i, **opts))
        assert got[i] == (alone, "length")


@pytest.mark.slow_on("jax")
def test_batch_generate_ids_and_text(folders: dict, backend: str) -> None:
    model = _model(folders, "llama", backend)
    prompts = [_prompt(60, 5), _prompt(61, 2), _prompt(62, 9)]
    got = batch_generate(model, prompts, max_new_tokens=5, max_batch=2, prefill_chunk=3)
    assert got == [_alone(model, p, 5, tuple(model.config.eos_token_id)) for p in prompts]
    texts = ["The cache keeps", "RMSNorm divides each vector", "A"]
    got_text = batch_generate(model, texts, max_new_tokens=6)
    assert got_text == ["".join(pl.generate(model, t, max_new_tokens=6)) for t in texts]
    assert batch_generate(model, prompts, max_new_tokens=0) == [[], [], []]


def test_bad_arguments_are_clear_errors(folders: dict) -> None:
    model = _model(folders, "llama", "numpy")
    for kwargs, match in [
        ({"max_batch": 0}, "max_batch"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"pool_pages": 0}, "pool_pages"),
        ({"page_size": 0}, "page_size"),
        ({"max_seq_len": 0}, "max_seq_len"),
    ]:
        with pytest.raises(ValueError, match=match):
            BatchGenerator(model, **kwargs)
    gen = BatchGenerator(model)
    for req, err, match in [
        (Request([], 3), ValueError, "no tokens"),
        (Request([1, 300], 3), ValueError, r"\[0, 300\) \(vocab_size\), got 1 to 300"),
        (Request([[1, 2]], 3), ValueError, r"shape \(1, 2\)"),
        (Request([1, 2], -1), ValueError, "max_new_tokens"),  # 0: ends at once
        (Request([1, 2], 3, sampler=5), TypeError, "sampler must be callable"),  # type: ignore[arg-type]
        (Request([1, 2], 3, stop="x"), TypeError, "stop must be"),
    ]:
        with pytest.raises(err, match=match):
            gen.add(req)
    with pytest.raises(TypeError, match="expected a Request, got list"):
        gen.add([1, 2])  # type: ignore[arg-type]
    assert not gen.has_work
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)
    with pytest.raises(TypeError, match="all strings or all token-id"):
        batch_generate(model, ["a", [1, 2]], max_new_tokens=2)


def test_cli_batch_prints_each_stream_and_the_aggregate_speed(folders: dict, capsys) -> None:
    model = _model(folders, "llama", "numpy")
    prompts = ["The cache keeps", "RMSNorm divides"]
    args = [str(folders["llama"]), "--max-tokens", "4", "--dtype", "float64"]
    assert main(["batch", *args, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    out = capsys.readouterr().out
    for i, p in enumerate(prompts):
        text = "".join(pl.generate(model, p, max_new_tokens=4))
        streamed = [
            line[len(f"[{i}] ") :] for line in out.splitlines() if line.startswith(f"[{i}] ")
        ]
        assert "".join(ast.literal_eval(piece) for piece in streamed) == text
        assert re.search(rf"^--- \[{i}\] (stop|length), \d tokens\n{re.escape(text)}$", out, re.M)
    assert "2 requests" in out and "tokens/s" in out
    for bad, message in [  # usage errors (exit status 2), in the flags' words
        ([], "at least one --prompt or --ids"),
        (["--ids", "1,2", "--max-tokens", "0"], "--max-tokens: expected an integer >= 1"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["batch", str(folders["llama"]), *bad])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


# -- hardening (issue 22): pages freed on every exception path, bounded lengths, threads ----------
def test_a_sampler_that_raises_on_the_first_token_frees_its_pages(folders: dict) -> None:
    """The request has left the prefill list when its first token is sampled: its pages must
    come back all the same, or the next request waits forever for a full pool."""
    model = _model(folders, "llama", "numpy")

    def broken(logits: object) -> object:
        raise RuntimeError("sampler failed")

    gen = BatchGenerator(model, pool_pages=3, page_size=4)  # room for one request
    gen.add(Request(_prompt(1, 6), 5, sampler=broken))
    with pytest.raises(RuntimeError, match="sampler failed"):
        gen.step()
    assert all(pool.num_free == 3 for pool in gen.pools) and not gen.has_work
    rid = gen.add(Request(_prompt(2, 6), 5, stop=()))
    assert _run(gen)[rid][0] == _alone(model, _prompt(2, 6), 5)


@pytest.mark.parametrize(
    ("sampler", "match"),
    [
        (lambda logits: np.asarray([300]), r"drew 300, outside \[0, 300\)"),
        (lambda logits: np.asarray([1, 2]), "must return one integer id"),
        (lambda logits: np.asarray([1.5]), "must return one integer id"),
    ],
)
def test_a_sampler_returning_a_bad_id_is_an_error_that_frees_the_pages(
    folders: dict, sampler: object, match: str
) -> None:
    model = _model(folders, "llama", "numpy")
    gen = BatchGenerator(model, page_size=4)
    gen.add(Request(_prompt(1, 3), 4, stop=()))
    gen.add(Request(_prompt(2, 3), 4, sampler=sampler, stop=()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        while gen.has_work:
            gen.step()
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)


def test_without_max_position_embeddings_the_length_is_still_bounded(tmp_path) -> None:
    """A config without ``max_position_embeddings``: ``max_new_tokens=10**7`` is refused in
    ``add``, before a page is reserved (it used to reserve gigabytes per layer)."""
    from portable_llm.generation.batch import DEFAULT_MAX_SEQ_LEN

    cfg = tiny_config("qwen2")
    del cfg["max_position_embeddings"]
    write_checkpoint(tmp_path, cfg, seed=3)
    model = load(tmp_path, backend="numpy", dtype="float64")
    assert model.max_seq_len is None
    gen = BatchGenerator(model, page_size=4)
    assert gen.max_seq_len == DEFAULT_MAX_SEQ_LEN
    sizes = [pool.num_pages for pool in gen.pools]
    with pytest.raises(ValueError, match=rf"more than max_seq_len \({DEFAULT_MAX_SEQ_LEN}\)"):
        gen.add(Request(_prompt(0, 5), 10**7))
    assert not gen.has_work and [pool.num_pages for pool in gen.pools] == sizes
    assert BatchGenerator(model, max_seq_len=10**8).max_seq_len == 10**8  # an explicit choice


def test_a_pool_that_fails_to_grow_frees_every_page_and_keeps_the_ids_aligned(
    folders: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 1's pool fails to grow (MemoryError) after layer 0's grew: the step frees every
    page, and later requests (one that fits, one that grows the pools again) get their tokens."""
    model = _model(folders, "llama", "numpy")
    gen = BatchGenerator(model, max_batch=1, page_size=4, max_seq_len=400)  # 64 pages: 256 tokens
    small, big = Request(_prompt(5, 6), 4, stop=()), Request(_prompt(6, 300), 3, stop=())
    real = type(gen.pools[1]).grow

    def fail(self: object, *args: object) -> None:
        raise MemoryError("no room")

    monkeypatch.setattr(gen.pools[1], "grow", fail.__get__(gen.pools[1]))
    gen.add(big)
    with pytest.raises(MemoryError):
        gen.step()
    assert not gen.has_work
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)
    assert gen.pools[0].num_pages > gen.pools[1].num_pages  # grown half-way
    monkeypatch.setattr(gen.pools[1], "grow", real.__get__(gen.pools[1]))
    for req in (small, big):
        rid = gen.add(req)
        assert _run(gen)[rid][0] == _alone(model, list(req.prompt_ids), req.max_new_tokens)
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)


def test_step_belongs_to_one_thread_while_requests_hold_caches(folders: dict) -> None:
    """``add`` from any thread; ``step`` from another thread while requests run is a
    RuntimeError that changes nothing; once every request finished, any thread may step."""
    import threading

    model = _model(folders, "llama", "numpy")
    gen = BatchGenerator(model, page_size=4)
    out: dict[str, object] = {}

    def in_thread(fn: object) -> object:
        def run() -> None:
            try:
                out["value"] = fn()  # type: ignore[operator]
            except BaseException as e:
                out["value"] = e

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out.pop("value")

    first = in_thread(lambda: gen.add(Request(_prompt(7, 4), 5, stop=())))
    assert first == 0
    tokens = [t for _, t, _ in gen.step()]  # this thread now steps request 0
    free = [pool.num_free for pool in gen.pools]
    error = in_thread(gen.step)
    assert isinstance(error, RuntimeError) and "step() from one thread" in str(error)
    assert [pool.num_free for pool in gen.pools] == free and gen.has_work
    while gen.has_work:
        tokens += [t for _, t, _ in gen.step()]
    assert tokens == _alone(model, _prompt(7, 4), 5)
    rid = gen.add(Request(_prompt(8, 4), 3, stop=()))
    got = in_thread(lambda: _run(gen))  # the generator is empty: another thread takes it
    assert got[rid][0] == _alone(model, _prompt(8, 4), 3)  # type: ignore[index]


def test_a_text_request_is_a_clear_error(folders: dict) -> None:
    gen = BatchGenerator(_model(folders, "llama", "numpy"))
    with pytest.raises(ValueError, match=r"add: prompt_ids must be a 1-D sequence .* got str"):
        gen.add(Request("hello"))
    assert not gen.has_work
