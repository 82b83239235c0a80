"""RecurrentCache and RecurrentSlots: the recurrent state as a cache.

A rewind of ``r`` tokens, then the same continuation, equals never having taken them (for each
recurrent op, after a verify chunk kept with ``all_states`` and after one-token decode steps);
a rewind the cache kept no state for is a ValueError; per-request slots run interleaved in
batches (rows joining and leaving) equal each request run alone, and a released slot comes
back zeroed.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close, random_array

B, L = 2, 7  # a prefill of 3, a verify chunk of 4 (3 drafts + 1), then 2 more tokens


def _conv(seed: int, backend: str):
    w, _ = random_array(seed, (6, 3), "float32", backend=backend)
    x, _ = random_array(seed + 1, (B, L, 6), "float32", backend=backend)

    def run(t0: int, t1: int, state, all_states: bool = False):
        return pl.short_conv(x[:, t0:t1, :], w, state=state, all_states=all_states)

    return run


def _delta(seed: int, backend: str):
    shapes = [(B, L, 1, 4), (B, L, 1, 4), (B, L, 2, 3), (B, L, 2), (B, L, 2)]
    lows = [-3.0, -3.0, -3.0, -1.0, 0.0]
    highs = [3.0, 3.0, 3.0, 0.0, 1.0]
    a = [random_array(seed + j, s, "float32", backend=backend, low=lo, high=hi)[0]
         for j, (s, lo, hi) in enumerate(zip(shapes, lows, highs, strict=True))]  # fmt: skip

    def run(t0: int, t1: int, state, all_states: bool = False):
        part = [t[:, t0:t1, ...] for t in a]
        return pl.gated_delta_rule(*part, state=state, qk_l2_norm=True, chunk_size=2,
                                   all_states=all_states)  # fmt: skip

    return run


def _ssd(seed: int, backend: str):
    shapes = [(B, L, 2, 3), (B, L, 2), (B, L, 1, 4), (B, L, 1, 4)]
    x, dt, b_, c_ = (random_array(seed + j, s, "float32", backend=backend)[0]
                     for j, s in enumerate(shapes))  # fmt: skip
    A = random_array(seed + 5, (2,), "float32", backend=backend, low=-2.0, high=-0.5)[0]

    def run(t0: int, t1: int, state, all_states: bool = False):
        part = [t[:, t0:t1, ...] for t in (x, dt)] + [A] + [t[:, t0:t1, ...] for t in (b_, c_)]
        return pl.ssd_scan(*part, state=state, chunk_size=2, all_states=all_states)

    return run


OPS = {"short_conv": _conv, "gated_delta_rule": _delta, "ssd_scan": _ssd}


def _state(cache: pl.RecurrentCache):
    return None if cache.state is None else cache.state[0]


@pytest.mark.slow_on("jax")  # a program per slice length; the decode-step rewinds run there
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("rejected", [0, 1, 3])
def test_a_rewind_equals_never_taking_the_steps(backend, op, rejected):
    run = OPS[op](11, backend)
    cache = pl.RecurrentCache(max_rewind=4)
    _, s = run(0, 3, None, all_states=True)  # prefill
    cache.update(s, all_states=True)
    _, s = run(3, 7, _state(cache), all_states=True)  # verify 4 tokens
    cache.update(s, all_states=True)
    assert cache.trim(rejected) == rejected and cache.offset == 7 - rejected
    keep = 7 - rejected
    _, never = run(0, keep, None)  # the same tokens, the rejected ones never taken
    assert_close(_state(cache), pl.to_numpy(never), backend=backend)
    # and the next step from the rewound state is the next step of the never-rewound run
    if keep < 7:
        y_next, _ = run(keep, 7, _state(cache))
        y_all, _ = run(0, 7, None)
        assert_close(y_next, pl.to_numpy(y_all)[:, keep:], backend=backend)


@pytest.mark.parametrize("op", sorted(OPS))
def test_decode_steps_rewind_without_all_states(backend, op):
    run = OPS[op](12, backend)
    cache = pl.RecurrentCache(max_rewind=3)
    _, s = run(0, 4, None)  # a prefill kept only at its end
    cache.update(s, tokens=4)
    for t in range(4, 7):  # one token at a time: each step's state is kept
        _, s = run(t, t + 1, _state(cache))
        cache.update(s)
    cache.trim(3)
    _, want = run(0, 4, None)
    assert_close(_state(cache), pl.to_numpy(want), backend=backend)
    with pytest.raises(ValueError, match=r"RecurrentCache.trim: no state kept at offset 2"):
        cache.trim(2)  # inside the prefill chunk, updated without all_states
    assert cache.offset == 4


def test_a_rewind_past_max_rewind_is_refused():
    cache = pl.RecurrentCache(max_rewind=1)
    for _ in range(3):
        cache.update(np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"no state kept at offset 1 .*max_rewind=1"):
        cache.trim(2)
    with pytest.raises(ValueError, match=r"RecurrentCache.trim: n must be >= 0 and <= 3"):
        cache.trim(4)
    cache.trim(1)
    assert cache.offset == 2
    with pytest.raises(ValueError, match=r"RecurrentCache.update: the states' shapes \[\(1, 3\)\]"):
        cache.update(np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"with all_states, every state must be \(B, L, ...\)"):
        cache.update(np.zeros((1, 0, 2), np.float32), all_states=True)
    cache.reset()
    assert cache.offset == 0 and cache.state is None


def test_slots_join_and_leave_a_batch_as_each_row_alone(backend):
    # three requests of 5, 3 and 4 tokens; request 2 joins after request 1 leaves its slot.
    H_k, H, D_k, D_v = 1, 2, 4, 3
    lens = [5, 3, 4]
    reqs = []
    for r, n in enumerate(lens):
        shapes = [(1, n, H_k, D_k), (1, n, H_k, D_k), (1, n, H, D_v), (1, n, H), (1, n, H)]
        lo_hi = [(-3, 3), (-3, 3), (-3, 3), (-1, 0), (0, 1)]
        pairs = enumerate(zip(shapes, lo_hi, strict=True))
        reqs.append([random_array(20 * r + j, s, "float32", backend=backend, low=lo, high=hi)[0]
                     for j, (s, (lo, hi)) in pairs])  # fmt: skip
    alone = [pl.to_numpy(pl.gated_delta_rule(*a, qk_l2_norm=True)[0]) for a in reqs]
    slots = pl.RecurrentSlots(2, [(H, D_k, D_v)], backend=backend)
    got: list[list[np.ndarray]] = [[] for _ in reqs]
    active = {0: slots.allocate(), 1: slots.allocate()}  # request -> slot
    pos = [0, 0, 0]
    waiting = [2]
    while active:
        rows = sorted(active)
        (state,) = slots.gather([active[r] for r in rows])
        step = [pl.asarray(np.concatenate([pl.to_numpy(reqs[r][j][:, pos[r] : pos[r] + 1, ...])
                                           for r in rows]), backend=backend)
                for j in range(5)]  # fmt: skip
        o, state = pl.gated_delta_rule(*step, state=state, qk_l2_norm=True)
        slots.scatter([active[r] for r in rows], state)
        for i, r in enumerate(rows):
            got[r].append(pl.to_numpy(o)[i : i + 1])
            pos[r] += 1
            if pos[r] == lens[r]:
                slots.release(active.pop(r))
                if waiting:
                    active[waiting.pop()] = slots.allocate()  # comes back zeroed
    for r in range(len(reqs)):
        assert_close(np.concatenate(got[r], axis=1), alone[r], dtype="float32")


def test_slots_bad_use():
    slots = pl.RecurrentSlots(1, [(2, 3)])
    s = slots.allocate()
    with pytest.raises(RuntimeError, match=r"all 1 slots are taken"):
        slots.allocate()
    with pytest.raises(ValueError, match=r"state 0 must have shape \(1, 2, 3\), got \(1, 3, 2\)"):
        slots.scatter([s], np.zeros((1, 3, 2), np.float32))
    slots.scatter([s], np.ones((1, 2, 3), np.float32))
    slots.reset(s)
    assert_close(slots.gather([s])[0], np.zeros((1, 2, 3), np.float32))
    slots.release(s)
    with pytest.raises(ValueError, match=r"RecurrentSlots.gather: slot 0 is not allocated"):
        slots.gather([s])
    with pytest.raises(ValueError, match=r"RecurrentSlots.release: slot must be >= 0 and <= 0"):
        slots.release(1)
