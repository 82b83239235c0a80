"""speculative_generate: greedy output identical to the target's, sampled output distributed as
the target's, both caches rewound with trim.

Greedy: the draft is the target behind a wrapper that moves the argmax of chosen generated
positions to another token, so the mismatches fall exactly on the first, a middle or the last
proposal of a round; and a draft with perturbed weights (a real second model). The counts of
proposed and accepted tokens are checked against the round rule replayed on the host.
Sampling: two bigram models over V = 8 tokens whose logits the test sets; the marginals of
the first generated tokens are compared with the target's exact ones (the filtered
distributions of :func:`portable_llm.testing.reference.sampling_probs`, chained) by a
chi-square test whose threshold comes from the sample size and a fixed false-alarm rate; the
same threshold is shown to reject the draft's own distribution.
"""

from __future__ import annotations

import re
from statistics import NormalDist
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.models import load
from portable_llm.testing import reference
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer

NEW = 12
K = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(target folder, perturbed-draft folder, other-tokenizer folder) of a tiny float32 Llama
    whose greedy continuation of PROMPT has no repeats to hide a bug."""
    root = tmp_path_factory.mktemp("spec")
    cfg = tiny_config("llama")
    target, draft, other = root / "target", root / "draft", root / "other"
    tensors = write_checkpoint(target, cfg, seed=5)
    write_tokenizer(target, vocab_size=cfg["vocab_size"])
    rng = np.random.default_rng(0)
    noisy = {k: v + 0.05 * np.std(v) * rng.standard_normal(v.shape) for k, v in tensors.items()}
    write_checkpoint(draft, cfg, tensors={k: v.astype(np.float32) for k, v in noisy.items()})
    write_tokenizer(draft, vocab_size=cfg["vocab_size"])
    write_checkpoint(other, cfg, seed=6)
    write_tokenizer(other, vocab_size=cfg["vocab_size"], eos="</s>")
    return target, draft, other


PROMPT = [17, 40, 121, 9, 230]


class _Wrong:
    """``model`` whose greedy choice at the chosen generated positions is another token.

    A call with the caches at offset ``o`` and ``L`` tokens predicts positions ``o + 1 ..
    o + L``; generated token ``g`` sits at position ``len(PROMPT) + g``.
    """

    def __init__(self, model: pl.Model, wrong: set[int]) -> None:
        self._model, self._wrong = model, wrong
        self.backend, self.device = model.backend, model.device
        self.vocab_size, self.tokenizer = model.vocab_size, model.tokenizer
        self.eos_token_ids, self.make_cache = model.eos_token_ids, model.make_cache

    def __call__(self, ids: Any, /, *, cache: Any, last_only: bool = False) -> Any:
        offset, L = cache[0].offset, ids.shape[1]
        logits = self._model(ids, cache=cache, last_only=last_only)  # (1, L | 1, V)
        bk = self.backend
        host = bk.to_numpy(logits).copy()
        for j in range(host.shape[1]):
            g = offset + (L - host.shape[1]) + j + 1 - len(PROMPT)
            if g in self._wrong:
                best = int(np.argmax(host[0, j]))
                host[0, j, (best + 1) % host.shape[-1]] = host[0, j, best] + 1.0
        return bk.from_numpy(host, self.device)


def _schedule(wrong: set[int]) -> tuple[int, int]:
    """(proposed, accepted) by the round rule: a round proposes generated tokens ``done ..
    done + n - 1`` (``n = min(K, NEW - done - 1)``), keeps those before the first wrong one,
    and adds the target's own token."""
    done = 1  # token 0 comes with the prefill
    proposed = accepted = 0
    while done < NEW:
        n = min(K, NEW - done - 1)
        a = next((i for i in range(n) if done + i in wrong), n)
        proposed, accepted, done = proposed + n, accepted + a, done + a + 1
    return proposed, accepted


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize(
    "wrong",
    [{1}, {3}, {4}, {1, 2, 3, 4}, {2, 6, 7, 11}],
    ids=["first", "middle", "last", "every", "scattered"],
)
def test_greedy_equals_the_target_with_mismatches(llama: tuple, backend: str, wrong: set) -> None:
    """Round 1 proposes generated tokens 1..4 (token 0 comes from the prefill): a wrong token 1
    is its first proposal, 3 a middle one, 4 the last."""
    model = load(llama[0], backend=backend, dtype="float32")
    want = list(pl.generate(model, PROMPT, max_new_tokens=NEW, stop=()))
    gen = pl.speculative_generate(
        model, _Wrong(model, wrong), PROMPT, num_draft_tokens=K, max_new_tokens=NEW, stop=()
    )
    assert list(gen) == want
    s = gen.stats
    assert (s.draft_tokens, s.accepted_tokens) == _schedule(wrong)
    assert s.generated_tokens == NEW and s.finish_reason == "length"
    assert s.acceptance_rate == s.accepted_tokens / s.draft_tokens


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_a_perturbed_draft_equals_the_target(
    llama: tuple, backend: str, k: int
) -> None:
    model = load(llama[0], backend=backend, dtype="float32")
    draft = load(llama[1], backend=backend, dtype="float32")
    want = list(pl.generate(model, PROMPT, max_new_tokens=NEW, stop=()))
    gen = pl.speculative_generate(
        model, draft, PROMPT, num_draft_tokens=k, max_new_tokens=NEW, stop=()
    )
    assert list(gen) == want
    assert 0 < gen.stats.accepted_tokens < gen.stats.draft_tokens  # both paths were taken


def test_stop_token_inside_a_proposal_ends_as_generate(llama: tuple, backend: str) -> None:
    model = load(llama[0], backend=backend, dtype="float32")
    plain = list(pl.generate(model, PROMPT, max_new_tokens=NEW, stop=()))
    for at in (0, 2, 5):  # the prefill's token, inside round 1's proposals, its bonus token
        eos = plain[at]
        want_gen = pl.generate(model, PROMPT, max_new_tokens=NEW, stop=[eos])
        want = list(want_gen)
        # The draft is the target itself: round 1 accepts all K proposals.
        gen = pl.speculative_generate(
            model, model, PROMPT, num_draft_tokens=K, max_new_tokens=NEW, stop=[eos]
        )
        assert list(gen) == want == plain[: plain.index(eos)]
        assert gen.stats.stop_token == want_gen.stats.stop_token == eos
        assert gen.stats.finish_reason == "stop"


class _Unused:
    def __init__(self, model: pl.Model) -> None:
        self.vocab_size, self.tokenizer = model.vocab_size, model.tokenizer
        self.eos_token_ids, self.make_cache = model.eos_token_ids, model.make_cache

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("num_draft_tokens=0 must not run the draft")


@pytest.mark.parametrize("max_new", [0, 1, 7])
def test_no_draft_tokens_is_plain_decoding(llama: tuple, backend: str, max_new: int) -> None:
    model = load(llama[0], backend=backend, dtype="float32")
    want = list(pl.generate(model, PROMPT, max_new_tokens=max_new, stop=()))
    gen = pl.speculative_generate(
        model, _Unused(model), PROMPT, num_draft_tokens=0, max_new_tokens=max_new, stop=()
    )
    assert list(gen) == want
    assert gen.stats.draft_tokens == 0 and gen.stats.rounds == max(max_new - 1, 0)


def test_text_prompt_streams_the_targets_text(llama: tuple) -> None:
    model = load(llama[0], dtype="float32")
    draft = load(llama[1], dtype="float32")
    want = "".join(pl.generate(model, "The cache keeps", max_new_tokens=NEW, stop=()))
    got = "".join(
        pl.speculative_generate(model, draft, "The cache keeps", max_new_tokens=NEW, stop=())
    )
    assert got == want and got


def test_mismatched_vocabularies_fail_before_running(llama: tuple, tmp_path) -> None:
    model = load(llama[0], dtype="float32")
    other_tokenizer = load(llama[2], dtype="float32")
    with pytest.raises(ValueError, match="tokenizer differs"):
        pl.speculative_generate(model, other_tokenizer, PROMPT)
    write_checkpoint(tmp_path, tiny_config("llama", vocab_size=320), seed=1)
    bigger = load(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match=r"vocab_size \(320\) differs from the target's \(300\)"):
        pl.speculative_generate(model, bigger, PROMPT)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"num_draft_tokens": -1}, ValueError, "num_draft_tokens"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"prefill_step_size": 0}, ValueError, "prefill_step_size"),
        ({"num_draft_tokens": 2.0}, TypeError, "num_draft_tokens"),
    ],
)
def test_bad_options_are_refused_before_running(
    llama: tuple, options: dict, error: type, match: str
) -> None:
    model = load(llama[0], dtype="float32")
    with pytest.raises(error, match=match):
        pl.speculative_generate(model, _Unused(model), PROMPT, **options)
    with pytest.raises(ValueError, match="not a batch"):
        pl.speculative_generate(model, model, ["a", "b"])


def test_cli_generate_with_a_draft(llama: tuple, capsys: pytest.CaptureFixture) -> None:
    from portable_llm.cli.cli import main

    want = list(pl.generate(load(llama[0]), PROMPT, max_new_tokens=NEW))  # ends at EOS
    ids = ",".join(map(str, PROMPT))
    args = ["generate", str(llama[0]), "--ids", ids, "--max-new-tokens", str(NEW)]
    assert main([*args, "--draft", str(llama[1]), "--num-draft-tokens", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ",".join(map(str, want))
    assert re.fullmatch(r"draft Model\(.*\)", out[-2])
    assert re.fullmatch(
        r"speculative: \d+ of \d+ proposed tokens accepted \(acceptance rate "
        r"[\d.]+\), \d+ verifying forwards",
        out[-1],
    )
    assert main([*args, "--draft", str(llama[2])]) == 1  # another tokenizer
    assert "tokenizer differs" in capsys.readouterr().err


# -- sampling: the output has the target's distribution ------------------------------------------
V = 8


class _Bigram:
    """A model over V tokens whose logits at a position are ``table[token there]``; it keeps the
    caches' offsets as a real model does (so trim rewinds them)."""

    def __init__(self, table: np.ndarray, backend: str) -> None:
        self.backend = pl.get_backend(backend)
        self.device = self.backend.device_of(self.backend.xp.zeros(1))
        self.vocab_size, self.tokenizer, self.eos_token_ids = V, None, ()
        self._table = self.backend.from_numpy(table.astype(np.float32), self.device)  # (V, V)

    def make_cache(self) -> list[pl.KVCache]:
        return [pl.KVCache()]

    def __call__(self, ids: Any, /, *, cache: Any, last_only: bool = False) -> Any:
        xp = self.backend.xp
        ids = pl.asarray(ids, backend=self.backend.name, device=self.device)
        L = ids.shape[1]
        k = xp.zeros((1, 1, L, 1), dtype=xp.float32, device=self.device)
        cache[0].update_and_fetch(k, k)
        cache[0].make_mask()
        logits = xp.take(self._table, xp.reshape(ids, (-1,)), axis=0)[None, ...]  # (1, L, V)
        return logits[:, -1:, :] if last_only else logits


def _chi2_limit(cells: int, alpha: float) -> float:
    """The chi-square quantile 1 - alpha with cells - 1 degrees of freedom (Wilson-Hilferty)."""
    k = cells - 1
    z = NormalDist().inv_cdf(1 - alpha)
    return k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    assert not counts[probs == 0].any(), (counts, probs)  # a filtered-out token was drawn
    live = probs > 0
    n = counts.sum()
    return float((((counts - n * probs) ** 2)[live] / (n * probs[live])).sum())


SAMPLES = 1500
_SLOW = ("torch", "jax", "mlx", "array_api_strict")  # per sample: caches and small ops
OPTIONS = [
    pytest.param({"temperature": 1.0}, id="plain", marks=pytest.mark.slow_on(*_SLOW[1:])),
    pytest.param(
        {"temperature": 1.3, "top_k": 5, "top_p": 0.9},
        id="top_k_top_p",
        marks=pytest.mark.slow_on(*_SLOW),
    ),
    pytest.param(
        {"temperature": 1.5, "top_k": 6, "min_p": 0.02},
        id="top_k_min_p",
        marks=pytest.mark.slow_on(*_SLOW),
    ),
]


@pytest.mark.parametrize("options", OPTIONS)
def test_sampled_tokens_have_the_targets_distribution(backend: str, options: dict) -> None:
    rng = np.random.default_rng(1)
    target_table = rng.normal(0, 1.5, (V, V))
    draft_table = target_table + rng.normal(0, 1.2, (V, V))  # accepted about half the time
    target, draft = _Bigram(target_table, backend), _Bigram(draft_table, backend)
    steps, prompt = 3, [3]
    counts = np.zeros((steps, V))
    accepted = proposed = 0
    for i in range(SAMPLES):
        gen = pl.speculative_generate(
            target, draft, prompt, num_draft_tokens=2, max_new_tokens=steps, stop=(), seed=i,
            **options,
        )  # fmt: skip
        for j, token in enumerate(gen):
            counts[j, token] += 1
        accepted += gen.stats.accepted_tokens
        proposed += gen.stats.draft_tokens
    assert 0.2 < accepted / proposed < 0.9  # both acceptance and correction were exercised

    def marginals(table: np.ndarray) -> np.ndarray:
        move = reference.sampling_probs(table, **options)  # (V, V): row = previous token
        out = [move[prompt[-1]]]
        for _ in range(steps - 1):
            out.append(out[-1] @ move)
        return np.array(out)  # (steps, V)

    want, draft_only = marginals(target_table), marginals(draft_table)
    alpha = 1e-4 / steps  # Bonferroni over the positions
    for j in range(steps):
        limit = _chi2_limit(int((want[j] > 0).sum()), alpha)
        assert _chi2(counts[j], want[j]) < limit, (j, counts[j], SAMPLES * want[j])
        # Power: the draft's own distribution, at this sample size, would be far past it.
        live = want[j] > 0
        gap = (draft_only[j] - want[j])[live] ** 2 / want[j][live]
        expected_stat = SAMPLES * float(gap.sum())
        assert expected_stat > 3 * limit


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_are_an_error(backend: str, temperature: float) -> None:
    table = np.random.default_rng(2).normal(0, 1, (V, V))
    broken = np.full((V, V), np.nan)  # the draft has no distribution
    target, draft = _Bigram(table, backend), _Bigram(broken, backend)
    gen = pl.speculative_generate(
        target, draft, [5], max_new_tokens=4, temperature=temperature, seed=0, stop=()
    )
    with pytest.raises(ValueError, match="NaN or all -inf"):
        list(gen)
