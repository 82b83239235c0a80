"""generate_step, make_sampler, make_logits_processors; generate's batches and prompt cache.

The sampled decode is checked against a loop written here with NumPy: float64 logits of the
whole sequence (:func:`portable_llm.testing.decoder.decoder_logits`), the repetition penalty,
the filtered distribution of :func:`portable_llm.testing.reference.sampling_probs`, and the
inverse CDF at the same uniform draw (the backend's generator seeded as ``make_sampler`` seeds
it). A sandbox-escaping chat template is refused: ``test_chat_template.py``
(``test_template_cannot_run_code_or_change_its_inputs``).
"""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.models import load
from portable_llm.testing import assert_close, reference
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer
from portable_llm.testing.decoder import decoder_logits

NEW = 6  # new tokens per run
PROMPT = 4  # prompt length of the id tests (the shapes of test_models.py: JAX's cache stays warm)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(folder, config, tensors) of a tiny float32 Mistral with a tokenizer."""
    folder = tmp_path_factory.mktemp("mistral")
    cfg = tiny_config("mistral")
    tensors = write_checkpoint(folder, cfg, seed=3)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return folder, cfg, tensors


def _prompt(seed: int, n: int = PROMPT) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 300, size=n)]


def _take(n: int, steps) -> list:
    """The first ``n`` tokens of a ``generate_step`` iterator."""
    return [token for token, _ in islice(steps, n)]


def _penalised(logits: np.ndarray, seen: list[int], penalty: float, context: int) -> np.ndarray:
    """CTRL's repetition penalty on the last ``context`` ids, in float64."""
    out = logits.copy()
    for t in set(seen[-context:]):
        out[t] = logits[t] * penalty if logits[t] < 0 else logits[t] / penalty
    return out


def _inverse_cdf(probs: np.ndarray, logits: np.ndarray, u: float) -> int:
    """The token ``sample`` draws at uniform ``u``: tokens ranked by logit (ties: lower id)."""
    order = np.argsort(-logits, kind="stable")
    cdf = np.cumsum(probs[order])
    j = int(np.sum(cdf <= u * cdf[-1]))
    return int(order[min(j, int(np.sum(probs > 0)) - 1)])


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_sampled_steps_with_a_repetition_penalty_equal_a_numpy_loop(
    mistral: tuple, backend: str, penalty: float
) -> None:
    folder, cfg, tensors = mistral
    model = load(folder, backend=backend, dtype="float32")
    bk = pl.get_backend(backend)
    options = {"temperature": 0.9, "top_k": 40, "top_p": 0.95}
    seed, context, steps = 11, 5, 8
    sampler = pl.make_sampler(**options, seed=seed)
    processors = pl.make_logits_processors(
        repetition_penalty=penalty, repetition_context_size=context
    )
    prompt = _prompt(1)
    got, got_logprobs = [], []
    run = pl.generate_step(model, prompt, sampler=sampler, logits_processors=processors)
    for token, logprobs in islice(run, steps):
        got.append(token)
        got_logprobs.append(logprobs)

    seq, keys = list(prompt), np.random.default_rng(seed)
    like = pl.asarray(np.zeros((1, cfg["vocab_size"]), np.float32), backend=backend)
    for step in range(steps):
        logits = _penalised(decoder_logits(np.array(seq), tensors, cfg)[-1], seq, penalty, context)
        want_logprobs = np.log(reference.softmax(logits))
        assert_close(got_logprobs[step], want_logprobs, backend=backend, dtype="float32")
        key = int(keys.integers(0, 2**63))  # make_sampler's seed for this step
        u = float(bk.to_numpy(bk.uniform(bk.rng(key, like), (1, 1), like))[0, 0])
        want = _inverse_cdf(reference.sampling_probs(logits, **options), logits, u)
        assert got[step] == want, (step, got, seq[len(prompt) :])
        seq.append(want)
    assert len(set(got)) > 1  # the draws vary: the test compares more than one token


def test_greedy_steps_with_a_penalty_avoid_repeats_as_the_reference(mistral: tuple) -> None:
    folder, cfg, tensors = mistral
    model = load(folder, dtype="float32")
    prompt, penalty = _prompt(2), 4.0
    processors = pl.make_logits_processors(repetition_penalty=penalty)
    steps = pl.generate_step(model, prompt, logits_processors=processors)
    got = _take(NEW, steps)
    seq = list(prompt)
    for _ in range(NEW):
        logits = decoder_logits(np.array(seq), tensors, cfg)[-1]
        seq.append(int(np.argmax(_penalised(logits, seq, penalty, 20))))
    assert got == seq[len(prompt) :]
    plain = _take(NEW, pl.generate_step(model, prompt))
    assert plain != got  # the penalty changed the greedy path (else the test shows nothing)


@pytest.mark.slow_on("jax")
def test_generate_step_batch_equals_each_row_alone(mistral: tuple, backend: str) -> None:
    folder, _, _ = mistral
    model = load(folder, backend=backend, dtype="float32")
    rows = [_prompt(3, 2), _prompt(4, PROMPT), _prompt(5, 3)]
    ids, left_padding = pl.left_pad(rows)
    batch = _take(NEW, pl.generate_step(model, ids, left_padding=left_padding))
    assert all(isinstance(step, np.ndarray) and step.shape == (3,) for step in batch)
    for b, row in enumerate(rows):
        alone = _take(NEW, pl.generate_step(model, row))
        assert [int(step[b]) for step in batch] == alone


@pytest.mark.slow_on("jax")
def test_generate_batch_of_texts_equals_each_text_alone(mistral: tuple, backend: str) -> None:
    folder, _, _ = mistral
    model = load(folder, backend=backend, dtype="float32")
    texts = ["The keys", "Rotary embeddings turn", "A"]
    assert len({len(model.tokenizer.encode(t)) for t in texts}) == 3  # unequal lengths
    gen = pl.generate(model, texts, max_new_tokens=NEW, stop=())
    steps = list(gen)
    assert all(len(step) == 3 for step in steps)
    for b, text in enumerate(texts):
        alone = pl.generate(model, text, max_new_tokens=NEW, stop=())
        assert "".join(step[b] for step in steps) == "".join(alone)
    assert gen.stats.finish_reason == "length"
    assert gen.stats.generated_tokens == 3 * NEW


def test_batch_rows_stop_alone_and_the_batch_when_all_have(mistral: tuple) -> None:
    folder, _, _ = mistral
    model = load(folder, dtype="float32")
    texts = ["The keys", "Rotary embeddings turn"]
    free = [list(pl.generate(model, model.tokenizer.encode(t), max_new_tokens=NEW, stop=()))
            for t in texts]  # fmt: skip
    stop = free[0][2]
    assert stop not in free[1]  # row 1 never meets row 0's stop token: it runs to the end
    gen = pl.generate(model, texts, max_new_tokens=NEW, stop=[stop])
    steps = list(gen)
    want0 = model.tokenizer.decode(free[0][: free[0].index(stop)])
    assert "".join(s[0] for s in steps) == want0
    assert "".join(s[1] for s in steps) == model.tokenizer.decode(free[1])
    assert gen.stats.finish_reason == "length"
    both = pl.generate(model, texts, max_new_tokens=NEW, stop=[free[0][0], free[1][0]])
    assert list(both) == [] and both.stats.finish_reason == "stop"


@pytest.mark.parametrize("ends", ["length", "stop"])
def test_prompt_cache_over_two_turns_equals_a_fresh_run(
    mistral: tuple, backend: str, ends: str
) -> None:
    folder, _, _ = mistral
    model = load(folder, backend=backend, dtype="float32")
    first, second = _prompt(6), _prompt(7, 3)
    free = list(pl.generate(model, first, max_new_tokens=NEW, stop=()))
    stop = () if ends == "length" else [free[3]]
    cache = model.make_cache()
    turn1 = pl.generate(model, first, max_new_tokens=NEW, stop=stop, prompt_cache=cache)
    reply1 = list(turn1)
    assert turn1.stats.finish_reason == ends
    said = reply1 if ends == "length" else [*reply1, free[3]]  # a stop token ends the turn
    assert cache[0].offset == len(first) + len(said)  # every token of turn 1 is in the cache
    turn2 = list(pl.generate(model, second, max_new_tokens=NEW, stop=(), prompt_cache=cache))
    fresh = list(pl.generate(model, [*first, *said, *second], max_new_tokens=NEW, stop=()))
    assert turn2 == fresh


def test_finish_reason_and_the_stop_token(mistral: tuple) -> None:
    folder, _, _ = mistral
    model = load(folder, dtype="float32")
    prompt = _prompt(8)
    free = pl.generate(model, prompt, max_new_tokens=NEW, stop=())
    ids = list(free)
    assert free.stats.finish_reason == "length" and free.stats.stop_token is None
    stopped = pl.generate(model, prompt, max_new_tokens=NEW, stop=[ids[2]])
    assert list(stopped) == ids[: ids.index(ids[2])]
    assert stopped.stats.finish_reason == "stop" and stopped.stats.stop_token == ids[2]


def test_make_sampler_is_greedy_at_zero_and_reproducible_with_a_seed(backend: str) -> None:
    x, x_r = pl.testing.random_array(0, (3, 50), "float32", backend=backend, low=-3, high=3)
    np.testing.assert_array_equal(pl.to_numpy(pl.make_sampler()(x)), np.argmax(x_r, axis=-1))
    draws = [[pl.to_numpy(s(x)).tolist() for _ in range(4)]
             for s in (pl.make_sampler(temperature=1.0, seed=5) for _ in range(2))]  # fmt: skip
    assert draws[0] == draws[1]
    assert len({tuple(d) for d in draws[0]}) > 1  # one seed, but a new draw per call


@pytest.mark.parametrize(
    ("factory", "kwargs", "error", "match"),
    [
        ("make_sampler", {"temperature": -1}, ValueError, "make_sampler: temperature"),
        ("make_sampler", {"top_k": 0}, ValueError, "make_sampler: top_k"),
        ("make_sampler", {"top_p": 0.0}, ValueError, "make_sampler: top_p"),
        ("make_sampler", {"seed": True}, TypeError, "make_sampler: seed"),
        ("make_logits_processors", {"repetition_penalty": 0}, ValueError, "repetition_penalty"),
        ("make_logits_processors", {"repetition_context_size": 0}, ValueError, "context_size"),
    ],
)
def test_factories_check_their_arguments(factory, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        getattr(pl, factory)(**kwargs)


def test_generate_checks_the_new_arguments(mistral: tuple) -> None:
    folder, _, _ = mistral
    model = load(folder, dtype="float32")
    with pytest.raises(ValueError, match="generate: repetition_penalty"):
        pl.generate(model, [1, 2], repetition_penalty=-1.0)
    with pytest.raises(ValueError, match="generate: prompt_cache must hold one cache per layer"):
        pl.generate(model, [1, 2], prompt_cache=[])
    with pytest.raises(ValueError, match="prompt_cache is for one prompt"):
        pl.generate(model, ["a", "b"], prompt_cache=model.make_cache())


# -- the decode loop's device path: ids fed back unchecked, pipelining ----------------------------


def _with_nan_row(model: pl.Model, token: int) -> pl.Model:
    """The model with the embedding row of ``token`` NaN (its LM head kept finite): the first
    forward fed ``token`` gives NaN logits."""
    bk = model.backend
    table = pl.to_numpy(model.embed).copy()
    if model.lm_head is None:
        model.lm_head = model.embed
    table[token] = np.nan
    model.embed = bk.from_numpy(table, model.device)
    return model


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_at_a_later_step_stop_with_the_error(
    mistral: tuple, backend: str, temperature: float, ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedding row of the first new token ``k >= 1`` not seen before is NaN: the step
    that feeds it (step ``k + 1``) has no distribution. The error names that step, greedy (the
    row maximum read on the host) or sampled (the sampler's -1 mark), with or without the next
    step queued first."""
    folder, _, _ = mistral
    monkeypatch.setattr(pl.get_backend(backend), "pipelines", lambda device=None: ahead)
    prompt = _prompt(9)
    options = {"temperature": temperature, "seed": 4, "stop": ()}
    free = list(pl.generate(load(folder, backend=backend, dtype="float32"), prompt,
                            max_new_tokens=NEW, **options))  # fmt: skip
    k = next(k for k in range(1, NEW) if free[k] not in prompt + free[:k])
    model = _with_nan_row(load(folder, backend=backend, dtype="float32"), free[k])
    gen = pl.generate(model, prompt, max_new_tokens=NEW, **options)
    assert [next(gen) for _ in range(k + 1)] == free[: k + 1]
    step = k + 1
    with pytest.raises(
        ValueError, match=rf"logits of step {step} \(after {len(prompt) + step} tokens\) are NaN"
    ):
        next(gen)


def test_decode_step_takes_ids_unchecked_where_the_model_call_checks(
    mistral: tuple, backend: str
) -> None:
    """``Model.decode_step`` reads no ids back: an id outside ``[0, V)`` gives NaN logits (a
    row of NaN embeddings, the masked lookup), where ``model(...)`` raises; valid ids give
    ``model(...)``'s logits."""
    folder, cfg, _ = mistral
    model = load(folder, backend=backend, dtype="float32")
    V = cfg["vocab_size"]
    prompt = pl.asarray([_prompt(10)], backend=backend)
    a, b = model.make_cache(), model.make_cache()
    model(prompt, cache=a)
    model(prompt, cache=b)
    token = pl.asarray([[7]], backend=backend)
    assert_close(model.decode_step(token, cache=a), model(token, cache=b, last_only=True))
    with pytest.raises(ValueError, match=rf"embedding: ids must lie in \[0, {V}\)"):
        model(pl.asarray([[V]], backend=backend), cache=model.make_cache())
    bad = model.decode_step(pl.asarray([[V]], backend=backend), cache=a)  # (1, 1, V)
    assert np.isnan(pl.to_numpy(bad)).all()


def test_embedding_without_the_check_reads_nothing_back(backend: str) -> None:
    """``embedding(check=False)``: valid ids give the checked lookup bit for bit; an id
    outside ``[0, V)`` gives a row of NaN instead of the ValueError."""
    table, table_r = pl.testing.random_array(5, (10, 4), "float32", backend=backend)
    ids = pl.asarray(np.array([[3, 0, 9]]), backend=backend)
    np.testing.assert_array_equal(
        pl.to_numpy(pl.embedding(ids, table, check=False)), table_r[[3, 0, 9]][None]
    )
    bad = pl.asarray(np.array([[2, -1, 10]]), backend=backend)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\)"):
        pl.embedding(bad, table)
    got = pl.to_numpy(pl.embedding(bad, table, check=False))  # (1, 3, 4)
    np.testing.assert_array_equal(got[0, 0], table_r[2])
    assert np.isnan(got[0, 1:]).all()
    with pytest.raises(TypeError, match="embedding: check must be a bool"):
        pl.embedding(ids, table, check=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("ahead", [False, True])
def test_pipelining_queues_the_next_step_before_the_token_is_read(
    mistral: tuple, backend: str, ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipelining (where Backend.pipelines; forced on, or off, here on every backend, so that
    the MLX path runs on the CPU too): when token 0 is yielded, step 1 (which feeds it) is
    already in the caches; without it token 0 is fed only when token 1 is asked for. A logits
    processor (which needs the host's ids) turns it off. The tokens are the same every way."""
    folder, _, _ = mistral
    model = load(folder, backend=backend, dtype="float32")
    monkeypatch.setattr(model.backend, "pipelines", lambda device=None: ahead)
    prompt = _prompt(11)
    want = list(pl.generate(model, prompt, max_new_tokens=NEW, stop=(), repetition_penalty=1.0))
    cache = model.make_cache()
    steps = pl.generate_step(model, prompt, cache=cache)
    got = [next(steps)[0]]
    assert cache[0].offset == len(prompt) + ahead
    got += _take(NEW - 1, steps)
    assert cache[0].offset == len(prompt) + NEW - 1 + ahead
    assert got == want
    held = model.make_cache()
    never = pl.make_logits_processors(repetition_penalty=1.0 + 1e-9)  # no effect on greedy ids
    stepped = pl.generate_step(model, prompt, cache=held, logits_processors=never)
    assert _take(NEW, stepped) == want
    assert held[0].offset == len(prompt) + NEW - 1


# -- hardening (issue 22): what a step refuses, and a prompt cache a failed call leaves alone -----
def test_generate_step_refuses_bad_padding_and_bad_sampler_output(mistral: tuple) -> None:
    model = load(mistral[0], dtype="float32")
    ids = np.asarray([_prompt(1), _prompt(2)])  # (2, 4)
    for pads, match in [([0, 4], r"in \[0, L\) = \[0, 4\)"), ([0], r"must be 2 ints")]:
        with pytest.raises(ValueError, match=match):
            pl.generate_step(model, ids, left_padding=np.asarray(pads))
    for sampler, match in [
        (lambda logits: np.asarray([1, 2]), r"ids of shape \(B,\) = \(1,\)"),
        (lambda logits: np.asarray([300]), r"drew 300, outside \[0, 300\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            next(pl.generate_step(model, _prompt(3), sampler=sampler))


class _FailsAfterPrefill:
    """A model that fills the caches with the prompt, then fails (a failed step 0)."""

    def __init__(self, model: pl.Model) -> None:
        self.model = model
        self.vocab_size, self.tokenizer = model.vocab_size, model.tokenizer
        self.eos_token_ids, self.make_cache = model.eos_token_ids, model.make_cache

    def __call__(self, ids, /, *, cache, last_only=False):
        self.model(ids, cache=cache, last_only=last_only)
        raise RuntimeError("the head failed")


def test_a_prompt_cache_is_rewound_when_the_first_step_fails(tmp_path) -> None:
    """(Full-attention layers: a sliding-window ring that wrapped cannot rewind.)"""
    write_checkpoint(tmp_path, tiny_config("qwen2"), seed=4)
    model = load(tmp_path, dtype="float32")
    cache = model.make_cache()
    first = list(pl.generate(model, _prompt(4), max_new_tokens=3, stop=(), prompt_cache=cache))
    held = [c.offset for c in cache]
    with pytest.raises(RuntimeError, match="the head failed"):
        list(pl.generate(_FailsAfterPrefill(model), _prompt(5), prompt_cache=cache))
    assert [c.offset for c in cache] == held
    # The conversation goes on as if the failed call never happened.
    fresh = model.make_cache()
    list(pl.generate(model, _prompt(4), max_new_tokens=3, stop=(), prompt_cache=fresh))
    want = list(pl.generate(model, _prompt(6), max_new_tokens=3, stop=(), prompt_cache=fresh))
    assert (
        first
        and list(pl.generate(model, _prompt(6), max_new_tokens=3, stop=(), prompt_cache=cache))
        == want
    )
    with pytest.raises(TypeError, match=r"prompt_cache holds None at \[0, 1\]"):
        pl.generate(model, _prompt(5), prompt_cache=[None, None])
