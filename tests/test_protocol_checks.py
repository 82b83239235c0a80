"""Every member of the model protocol, and what a model or a caller hands generation, checked
at the front with an error naming it (generation/protocol.py's ``check_model``,
``check_logits``, ``check_page_pools``, ``check_cache_list``; prompt.py's ``batch_ids``).

Before these checks, a member of the wrong type or shape surfaced as whatever broke first: an
int ``eos_token_ids`` as ``'int' object is not iterable``, logits of rank 2 as an ``IndexError``,
``prompt_cache=[1, 2]`` as ``'int' object has no attribute 'offset'``, ``generate_step([])`` as
a KV cache's shape error, a sampler's string as a comparison of ``str`` and ``int``. Each case
runs through every front that reads the member (one rule, one place); a good model runs after
them, so the checks refuse only what they should.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from conftest import numpy_only, only_on
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from test_protocol import CFG, NumpyQwen2

PROMPT = [17, 40, 121, 9]
FRONTS = [
    "generate", "generate_step", "batch_generate", "speculative (target)", "speculative (draft)"
]  # fmt: skip


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    return write_checkpoint(tmp_path_factory.mktemp("qwen2"), CFG, seed=11)


def _fronts(model: Any) -> dict[str, Callable[[], Any]]:
    """Each generation front, run for two tokens over ``model``."""
    good = NumpyQwen2.__new__(NumpyQwen2)
    good.__dict__.update({k: v for k, v in model.__dict__.items() if k in ("w", "cfg")})
    good.vocab_size, good.eos_token_ids, good.tokenizer = CFG["vocab_size"], (), None
    return {
        "generate": lambda: list(pl.generate(model, PROMPT, max_new_tokens=2)),
        "generate_step": lambda: next(pl.generate_step(model, PROMPT)),
        "BatchGenerator": lambda: pl.BatchGenerator(model),
        "batch_generate": lambda: pl.batch_generate(model, [PROMPT], max_new_tokens=2),
        "speculative (target)": lambda: list(
            pl.speculative_generate(model, good, PROMPT, max_new_tokens=2)
        ),
        "speculative (draft)": lambda: list(  # 3: the lazy draft runs from the 2nd token on
            pl.speculative_generate(good, model, PROMPT, max_new_tokens=3, stop=())
        ),
    }


def _bad_member(name: str, value: Any) -> Callable[[NumpyQwen2], None]:
    return lambda m: setattr(m, name, value)


class _NoCache:
    offset = 0


MEMBERS = [
    ("vocab_size", _bad_member("vocab_size", "300"), TypeError,
     r"NumpyQwen2.vocab_size must be an int, got str '300'"),
    ("vocab_size", _bad_member("vocab_size", 0), ValueError,
     r"NumpyQwen2.vocab_size must be >= 1, got 0"),
    ("eos_token_ids", _bad_member("eos_token_ids", 2), TypeError,
     r"NumpyQwen2.eos_token_ids must be a tuple of token ids \(ints\), got int 2"),
    ("eos_token_ids", _bad_member("eos_token_ids", (2.0,)), TypeError,
     r"NumpyQwen2.eos_token_ids\[0\] must be an int, got float"),
    ("tokenizer", _bad_member("tokenizer", "gpt2"), TypeError,
     r"NumpyQwen2.tokenizer must be None or a portable_llm.Tokenizer \(or any object with "
     r"encode\(text\) and decode\(ids\)\); str lacks encode_prompt"),
    ("make_cache", _bad_member("make_cache", lambda: (c for c in [])), TypeError,
     r"NumpyQwen2.make_cache\(\) must return a list of caches .* got generator"),
    ("decode_step", _bad_member("decode_step", 5), TypeError,
     r"NumpyQwen2.decode_step must be callable, got int"),
    ("recompute_after", _bad_member("recompute_after", "4k"), TypeError,
     r"NumpyQwen2.recompute_after must be an int, got str"),
    ("max_seq_len", _bad_member("max_seq_len", 0), ValueError,
     r"NumpyQwen2.max_seq_len must be >= 1, got 0"),
]  # fmt: skip


@numpy_only
@pytest.mark.parametrize(
    ("member", "spoil", "error", "match"), MEMBERS, ids=[f"{m[0]}-{m[3][:30]}" for m in MEMBERS]
)
@pytest.mark.parametrize("front", [*FRONTS, "BatchGenerator"])
def test_a_member_of_the_wrong_type_is_named_by_every_front(
    weights: dict, member: str, spoil: Callable, error: type, match: str, front: str
) -> None:
    model = NumpyQwen2(weights, CFG)
    spoil(model)
    with pytest.raises(error, match=match):
        _fronts(model)[front]()


@numpy_only
@pytest.mark.parametrize("front", FRONTS)
def test_logits_of_the_wrong_rank_or_type(weights: dict, front: str) -> None:
    """``(B, V)`` logits (rank 2) and a list are refused where the model returns them."""
    model = NumpyQwen2(weights, CFG)
    call = model.__call__
    flat = {"__call__": lambda s, *a, **k: call(*a, **k)[:, -1, :]}  # (B, V)
    model.__class__ = type("Flat", (NumpyQwen2,), flat)
    want = r"Flat.__call__ returned logits of shape \(1, 300\), expected \(1, any, 300\)"
    with pytest.raises(ValueError, match=want):
        _fronts(model)[front]()
    model.__class__ = type("Listy", (NumpyQwen2,), {"__call__": lambda s, *a, **k: [0.0] * 300})
    with pytest.raises(TypeError, match=r"Listy.__call__ must return logits as an array .* list"):
        _fronts(model)[front]()


@numpy_only
def test_speculative_decoding_needs_caches_with_trim(weights: dict) -> None:
    model = NumpyQwen2(weights, CFG)
    model.make_cache = lambda: [_NoCache(), _NoCache()]  # type: ignore[method-assign]
    for front in ("speculative (target)", "speculative (draft)"):
        with pytest.raises(TypeError, match=r"make_cache\(\)\[0\] \(_NoCache\) has no trim\(n\)"):
            _fronts(model)[front]()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> object:
    folder = tmp_path_factory.mktemp("llama")
    write_checkpoint(folder, tiny_config("llama"), seed=4)
    return folder


@numpy_only
def test_a_paged_model_returning_too_few_rows(llama: object) -> None:
    model = pl.load(llama, backend="numpy", dtype="float32")
    paged = model.forward_paged
    model.forward_paged = lambda ids, **kw: paged(ids, **kw)[:1]  # type: ignore[method-assign]
    want = r"forward_paged returned logits of shape \(1, 300\), expected \(2, 300\)"
    with pytest.raises(ValueError, match=want):
        pl.batch_generate(model, [PROMPT, PROMPT[:2]], max_new_tokens=2)


@numpy_only
def test_page_pools_of_the_wrong_kind_or_count(llama: object) -> None:
    model = pl.load(llama, backend="numpy", dtype="float32")
    pools = model.make_page_pools
    model.make_page_pools = lambda n, p: pools(n, p)[:1]  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"one pool per layer \(2, as make_cache\(\)\) .* got 1"):
        pl.BatchGenerator(model)
    model.make_page_pools = lambda n, p: [object(), object()]  # type: ignore[method-assign]
    with pytest.raises(TypeError, match=r"make_page_pools\(\) must return a list of .*PagePool"):
        pl.BatchGenerator(model)


# -- what a caller hands generation --------------------------------------------------------------


@numpy_only
def test_a_prompt_cache_of_other_things(llama: object) -> None:
    model = pl.load(llama, backend="numpy", dtype="float32")
    with pytest.raises(TypeError, match=r"prompt_cache\[0\] must be a cache of model.make_cache"):
        pl.generate(model, PROMPT, prompt_cache=[1, 2])
    with pytest.raises(TypeError, match=r"generate_step: cache\[1\] must be a cache"):
        pl.generate_step(model, PROMPT, cache=[model.make_cache()[0], "x"])


@numpy_only
@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], r"ids has no tokens \(shape \(1, 0\)\)"),
        ([[]], r"ids has no tokens \(shape \(1, 0\)\)"),
        ([[1.5, 2.0]], r"ids must be token ids \(ints\) .* got shape \(1, 2\) of float64"),
        ([[[1]]], r"got shape \(1, 1, 1\)"),
        ([[1, 2], [3]], r"got ragged rows"),
        ([1, 300], r"token ids must lie in \[0, 300\) \(vocab_size\), got 1 to 300"),
        ("hello", r"ids must be token ids .* got str"),
    ],
)
def test_generate_step_ids(llama: object, ids: Any, match: str) -> None:
    model = pl.load(llama, backend="numpy", dtype="float32")
    with pytest.raises(ValueError, match=match):
        pl.generate_step(model, ids)


def test_a_sampler_returning_other_than_integer_ids(llama: object, backend: str) -> None:
    model = pl.load(llama, backend=backend, dtype="float32")
    bk = model.backend
    floats = lambda logits: bk.xp.zeros((1,), dtype=logits.dtype)  # noqa: E731
    for sampler, what in [
        (lambda logits: "7", "str"),
        (lambda logits: np.asarray(["7"]), "ndarray"),
        (lambda logits: [7], "list"),
        (floats, type(floats(np.zeros(1))).__name__ if backend == "numpy" else ""),
    ]:
        want = rf"an integer array of the logits' library \({backend}\), shape \(B,\) = \(1,\)"
        with pytest.raises(TypeError, match=f"sampler must return {want}; got {what}"):
            next(pl.generate_step(model, PROMPT, sampler=sampler))


# -- NumPy integer scalars, and threads ------------------------------------------------------------


def test_numpy_integer_scalars_as_ids(llama: object, backend: str) -> None:
    """A nested list of NumPy integers (``[[np.int64(5), ...]]``) is ids on every backend (MLX's
    ``mx.array`` refused it: "Invalid type int64 received in array initialization")."""
    model = pl.load(llama, backend=backend, dtype="float32")
    want = model([PROMPT])
    assert_close(model([[np.int64(t) for t in PROMPT]]), want, backend=backend)
    assert_close(model([[np.int32(t) for t in PROMPT]]), want, backend=backend)
    got = pl.asarray([np.int64(3), np.int64(4)], backend=backend)
    assert pl.to_numpy(got).tolist() == [3, 4]


@pytest.mark.slow_on("jax")
def test_eight_threads_generate_on_one_model(llama: object, backend: str) -> None:
    """Generation is thread-safe without a lock: 8 threads on one model get the tokens of one
    thread alone. The dispatcher's trace blocks are per thread (a global list let one thread's
    compiled step remove another's: ``list.remove(x): x not in list``), and MLX's compiled
    steps are released before interpreter exit (MLX aborted the process there)."""
    model = pl.load(llama, backend=backend, dtype="float32")  # first run: in the threads
    prompt = list(range(1, 40))
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = list(pl.generate(model, prompt, max_new_tokens=12, stop=()))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    alone = pl.load(llama, backend=backend, dtype="float32")
    want = list(pl.generate(alone, prompt, max_new_tokens=12, stop=()))
    assert got == {i: want for i in range(8)}


_WORKER = """
import sys, threading
import portable_llm as pl
model = pl.load(sys.argv[1], backend="mlx", dtype="float32")
out = []
run = lambda: out.append(list(pl.generate(model, [1, 2, 3], max_new_tokens=24, stop=())))
workers = [threading.Thread(target=run) for _ in range(int(sys.argv[2]))]
for w in workers:
    w.start()
for w in workers:
    w.join()
print(*sorted({len(o) for o in out}), len(out))
"""


@only_on("mlx")
@pytest.mark.parametrize(("threads", "runs"), [(1, 3), (8, 12)])
def test_mlx_generating_on_a_worker_thread_exits_cleanly(
    llama: object, threads: int, runs: int
) -> None:
    """MLX 0.32 aborted the interpreter at exit (rc 134, "terminate called without an active
    exception") in 4 of 6 runs when a compiled step had run on another thread, as a server's
    engine thread runs it; the compiled programs are now released before exit. A program
    shared by 8 threads still aborted 3 to 6 runs of 20 (issue 33 audit): each thread now runs
    its own, dropped when the thread ends (12 runs: 0.8**12 < 7% to pass by chance)."""
    for _ in range(runs):
        run = subprocess.run(
            [sys.executable, "-c", _WORKER, str(llama), str(threads)], capture_output=True,
            text=True, timeout=120, check=False,
        )  # fmt: skip
        assert (run.returncode, run.stdout.strip()) == (0, f"24 {threads}"), run.stderr[-500:]


@numpy_only
def test_a_request_sampler_returning_a_string(llama: object) -> None:
    """BatchGenerator: a request's sampler that returns a string is a TypeError naming the
    sampler (was to_numpy's "arrays of type builtins.str are not supported"), and the pages
    are freed."""
    model = pl.load(llama, backend="numpy", dtype="float32")
    gen = pl.BatchGenerator(model, page_size=4)
    gen.add(pl.Request(PROMPT, 3, sampler=lambda logits: "7", stop=()))
    with pytest.raises(TypeError, match=r"sampler of request 0 must return an integer array"):
        while gen.has_work:
            gen.step()
    assert all(pool.num_free == pool.num_pages for pool in gen.pools)


@numpy_only
@pytest.mark.parametrize("drawn", [-5, -(2**40), 300])
def test_a_sampler_drawing_outside_the_vocabulary_is_named(llama: object, drawn: int) -> None:
    """A sampler's id outside ``[0, V)`` is named as drawn, by generate_step and BatchGenerator
    alike; only ``-1`` (the mark of :func:`~portable_llm.sample` for a row with no
    distribution) is reported as NaN logits (a negative id was reported so)."""
    model = pl.load(llama, backend="numpy", dtype="float32")
    V = model.vocab_size
    assert drawn < 0 or drawn >= V

    def sampler(logits: Any) -> Any:
        return np.full((logits.shape[0],), drawn, dtype=np.int64)

    with pytest.raises(ValueError, match=rf"sampler of step 0 drew {drawn}, outside \[0, {V}\)"):
        next(pl.generate_step(model, PROMPT, sampler=sampler))
    gen = pl.BatchGenerator(model, page_size=4)
    gen.add(pl.Request(PROMPT, 3, sampler=sampler, stop=()))
    with pytest.raises(ValueError, match=rf"sampler of request 0 drew {drawn}, outside \[0, {V}\)"):
        while gen.has_work:
            gen.step()
    mark = lambda logits: np.full((logits.shape[0],), -1, dtype=np.int64)  # noqa: E731
    with pytest.raises(ValueError, match="are NaN or all -inf"):
        next(pl.generate_step(model, PROMPT, sampler=mark))
