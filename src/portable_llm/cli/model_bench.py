"""``portable-llm bench --model``: a whole checkpoint, per backend, next to transformers and mlx-lm.

A random checkpoint of Qwen2-0.5B's shape (24 layers, E=896, I=4864, H=14, H_kv=2, V=151936,
tied embeddings; about 494M parameters, 1 GB in bfloat16) is written once into a cache folder.
Each engine then loads it (timed), and runs greedy generation twice with the same shapes: a
128-token prompt and ``decode`` new tokens. The first run warms up (JAX compiles each op per
shape, torch and MLX warm their allocators); the second is reported: prefill tokens/s (prompt
tokens over the time to the first new token) and decode tokens/s (the later tokens). Every
engine runs on the same checkpoint, in the same process, one after the other.

A ``.gguf`` file runs as ``pl.load(path)`` loads it (``dequantize="auto"``: codes kept where the
measured rule says they decode faster) and dequantized at load (``dequantize=True``, the
``pl floats`` rows; then the memory of each choice and a warning line where the chosen weights
decode slower than the dequantized ones), next to llama.cpp
(``llama-cpp-python``, when installed) on the same file with torch's thread count; the table
ends with each backend's decode speed as a fraction of llama.cpp's. A ``.gguf`` file also runs in
each activation mode (``pl.load(..., activations=MODE)``: ``float`` and ``int8`` unless
``activations`` selects), one row each beside the default's, and each row's KL divergence from
the file dequantized to float64 is measured on the bundled text (the GNU GPL v3 of
``/usr/share/common-licenses``, ``KL_CTX`` tokens a chunk; llama.cpp's too, from its logits of
every position, when it is installed): the figures issue 30 judges the int8 mode by.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from portable_llm.cli.output import Phases, Table, UsageError, plural, wrap
from portable_llm.cli.report import backend_names, load_for_dtype
from portable_llm.extras import install_hint

__all__ = [
    "DEQUANTIZED",
    "KL",
    "KL_CTX",
    "LlamaCppLogits",
    "GGUF_PEERS",
    "MEMORY",
    "PEERS",
    "QWEN2_0_5B",
    "TINY",
    "run_model_bench",
    "weight_bytes",
    "write_bench_checkpoint",
]

#: Qwen2-0.5B's config.json, the fields a decoder reads.
QWEN2_0_5B: dict[str, Any] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 21,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
#: The tiny model where per-token Python overhead is the whole cost: 2 layers, E=64.
TINY: dict[str, Any] = {
    **QWEN2_0_5B,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_window_layers": 2,
}
PREFILL = 128
DECODE = 48
DEFAULT_CACHE = Path.home() / ".cache" / "portable_llm" / "bench"

# (prompt ids (1, L), new tokens) -> (prefill seconds, decode seconds of the new tokens after 1)
Runner = Callable[[np.ndarray, int], tuple[float, float]]


def write_bench_checkpoint(
    cache_dir: str | Path | None = None, config: dict[str, Any] | None = None
) -> Path:
    """The benchmark checkpoint folder, written (bfloat16) on first use."""
    from portable_llm.testing.checkpoints import write_checkpoint

    cfg = config or QWEN2_0_5B
    name = f"{cfg['model_type']}-L{cfg['num_hidden_layers']}-E{cfg['hidden_size']}-random"
    folder = Path(cache_dir or DEFAULT_CACHE) / name
    if not (folder / "model.safetensors").is_file():
        write_checkpoint(folder, cfg, seed=0, dtype="bfloat16")
    return folder


def weight_bytes(obj: Any, depth: int = 0) -> int:
    """Bytes of the arrays and quantized weights a model holds (its embedding, norms, head and
    blocks; a kernel's own repacked copy, e.g. torch's int4 layout, is not counted)."""
    if hasattr(obj, "nbytes") and hasattr(obj, "shape"):  # an array or a QuantizedWeight
        return int(obj.nbytes)
    if depth > 4 or obj is None or isinstance(obj, str | int | float | bool):
        return 0
    if isinstance(obj, dict):
        return sum(weight_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(weight_bytes(v, depth + 1) for v in obj)
    fields = getattr(obj, "__dict__", None)
    return 0 if fields is None else sum(weight_bytes(v, depth + 1) for v in fields.values())


def _model_bytes(model: Any) -> int:
    parts = (model.embed, model.norm, model.lm_head, model.layers)
    return sum(weight_bytes(p) for p in parts)


#: (backend, dtype, dequantize) -> bytes of the weights of the last model loaded that way
MEMORY: dict[tuple[str, str, bool | str], int] = {}
#: Tokens per chunk of the KL divergence on the bundled text (2 chunks; 1 with ``quick``).
KL_CTX = 128
#: (engine, backend) -> the PerplexityResult of the last run of that row on the bundled text
KL: dict[tuple[str, str], Any] = {}

#: The scored tokens of the bundled text and the base's log-probabilities of them:
#: ``(ids, bos, chunks, logprobs (T, V))``.
KlBase = tuple[list[int], int | None, int, np.ndarray]


def _ours(
    folder: Path, backend: str, dtype: str, dequantize: bool | str = "auto",
    activations: str = "auto", kl: tuple[str, KlBase] | None = None,
) -> tuple[float, Runner]:  # fmt: skip
    from portable_llm.checkpoint.loader import load
    from portable_llm.generation.generate import generate

    start = time.perf_counter()
    model = load(
        folder, backend=backend, dtype=dtype, dequantize=dequantize, activations=activations
    )
    loaded = time.perf_counter() - start
    if activations == "auto" and dequantize == "auto":
        MEMORY[backend, dtype, dequantize] = _model_bytes(model)
    elif dequantize is True:
        MEMORY[backend, dtype, True] = _model_bytes(model)
    if kl is not None:
        KL[kl[0], backend] = _kl(model, kl[1])

    def run(ids: np.ndarray, n: int) -> tuple[float, float]:
        gen = generate(model, ids[0], max_new_tokens=n, stop=())
        for _ in gen:
            pass
        return gen.stats.prefill_seconds, gen.stats.decode_seconds

    return loaded, run


def _kl(model: Any, base: KlBase) -> Any:
    """``model``'s perplexity and KL divergence from the base on the bundled text."""
    from portable_llm.generation.perplexity import perplexity

    ids, bos, chunks, logprobs = base
    return perplexity(model, ids, ctx=KL_CTX, chunks=chunks, bos=bos, base=logprobs)


def _kl_base(path: Path, quick: bool) -> KlBase:
    """The bundled text's tokens and the log-probabilities of the ``.gguf`` file ``path``
    dequantized to float64 on NumPy: the base of every row's KL divergence."""
    from portable_llm.checkpoint.loader import load
    from portable_llm.cli.perplexity import DEFAULT_TEXT
    from portable_llm.generation.perplexity import adds_bos, perplexity

    base = load(path, backend="numpy", dtype="float64", dequantize=True, activations="float")
    if base.tokenizer is None:
        raise ValueError(f"{path} has no tokenizer: the KL divergence needs one to read the text")
    text = Path(DEFAULT_TEXT).read_text(encoding="utf-8")
    ids = base.tokenizer.encode(text, add_special_tokens=False)
    bos, chunks = adds_bos(base.tokenizer), 1 if quick else 2
    kept: list[np.ndarray] = []
    perplexity(base, ids, ctx=KL_CTX, chunks=chunks, bos=bos, keep=kept.append)
    return ids, bos, chunks, np.concatenate(kept)


class LlamaCppLogits:
    """llama.cpp (``llama-cpp-python``) on a ``.gguf`` file as a model of the generation
    protocol, for :func:`~portable_llm.perplexity`: ``model(ids (1, L))`` gives the logits
    ``(1, L, V)`` of every position (``logits_all=True``), from an empty context, on
    ``threads`` threads."""

    def __init__(self, path: Path, ctx: int, threads: int = 1) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, n_threads=threads,
            n_threads_batch=threads, logits_all=True, verbose=False,
        )  # fmt: skip
        self.vocab_size = int(self.llm.n_vocab())

    def make_cache(self) -> None:
        return None

    def __call__(self, ids: Any, cache: Any = None) -> np.ndarray:
        row = [int(i) for i in np.asarray(ids)[0]]
        self.llm.reset()
        self.llm.eval(row)
        return np.array(self.llm.scores[: len(row)], dtype=np.float32)[None]  # (1, L, V)


def _transformers(folder: Path, dtype: str) -> tuple[float, Runner]:
    import torch
    import transformers

    start = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    hf.eval()
    loaded = time.perf_counter() - start

    @torch.no_grad()
    def run(ids: np.ndarray, n: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        out = hf(torch.from_numpy(ids), use_cache=True)
        token = out.logits[:, -1, :].argmax(-1, keepdim=True)  # (1, 1)
        token.item()
        t1 = time.perf_counter()
        past = out.past_key_values
        for _ in range(n - 1):
            out = hf(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1, :].argmax(-1, keepdim=True)
            token.item()
        return t1 - t0, time.perf_counter() - t1

    return loaded, run


def _mlx_lm(folder: Path, dtype: str) -> tuple[float, Runner]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    start = time.perf_counter()
    model, _ = load_model(folder)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    loaded = time.perf_counter() - start

    def run(ids: np.ndarray, n: int) -> tuple[float, float]:
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        token = mx.argmax(model(mx.array(ids), cache=cache)[:, -1, :], axis=-1, keepdims=True)
        mx.eval(token)
        t1 = time.perf_counter()
        for _ in range(n - 1):
            token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1, keepdims=True)
            mx.eval(token)
        return t1 - t0, time.perf_counter() - t1

    return loaded, run


def _row(
    engine: str,
    backend: str,
    dtype: str,
    make: Callable[[], tuple[float, Runner]],
    decode: int,
    ids: np.ndarray,
    phases: Phases,
) -> list[str]:
    on = f"{engine} on {backend} {dtype}"
    with phases(f"{on}: loading"):
        loaded, run = make()
    with phases(f"{on}: warm-up run (compiling, allocating)"):
        first = run(ids, decode)
    with phases(f"{on}: timed run"):
        prefill, dec = run(ids, decode)
    del run
    gc.collect()
    return [
        engine,
        backend,
        dtype,
        f"{loaded:.2f} s",
        f"{PREFILL / prefill:.1f}",
        f"{(decode - 1) / dec:.2f}" if decode > 1 and dec > 0 else "-",
        f"{sum(first):.2f} s",
        f"{os.getloadavg()[0]:.2f}",  # the machine may be shared: its 1-minute load
    ]


#: backend -> the other libraries' engines that run next to it: (engine name, module that must
#: be installed, (folder, dtype) -> (load seconds, runner)).
PEERS: dict[str, tuple[tuple[str, str, Callable[[Path, str], tuple[float, Runner]]], ...]] = {
    "torch": (("transformers", "transformers", _transformers),),
    "mlx": (("mlx-lm", "mlx_lm", _mlx_lm),),
}


def _threads() -> int:
    """The thread count every engine gets: torch's (its default is the core count), else 2."""
    try:
        import torch
    except ImportError:
        return 2
    return int(torch.get_num_threads())


def _llama_cpp(path: Path, dtype: str) -> tuple[float, Runner]:
    """llama.cpp on the same ``.gguf`` file: greedy over its logits, the same thread count."""
    import llama_cpp

    start = time.perf_counter()
    threads = _threads()
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=PREFILL + DECODE + 8, n_batch=PREFILL, n_threads=threads,
        n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    loaded = time.perf_counter() - start
    vocab = llm.n_vocab()

    def last_token() -> int:
        # The last position's logits, read in place (llm.scores holds them only with
        # logits_all=True, which would compute the LM head at every prompt position).
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
        return int(np.argmax(logits))

    def run(ids: np.ndarray, n: int) -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval([int(i) for i in ids[0]])
        token = last_token()
        t1 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([token])
            token = last_token()
        return t1 - t0, time.perf_counter() - t1

    return loaded, run


#: Engines that read a ``.gguf`` file themselves, run once next to all backends: (engine name,
#: module that must be installed, (file, dtype) -> (load seconds, runner)).
GGUF_PEERS: tuple[tuple[str, str, Callable[[Path, str], tuple[float, Runner]]], ...] = (
    ("llama.cpp", "llama_cpp", _llama_cpp),
)

_HEADERS = ("engine", "backend", "dtype", "load", "prefill tok/s", "decode tok/s", "warm-up",
            "load avg")  # fmt: skip
#: The widths the rows are printed at as they come (at most 100 columns).
_WIDTHS = (12, 16, 8, 8)


def run_model_bench(
    backends: Sequence[str] | None = None,
    *,
    dtype: str = "float32",
    quick: bool = False,
    cache_dir: str | Path | None = None,
    config: dict[str, Any] | None = None,
    folder: str | Path | None = None,
    file: TextIO | None = None,
    activations: Sequence[str] | None = None,
) -> int:
    """Benchmark the checkpoint on every selected backend and on the installed oracles.

    ``folder``: any checkpoint folder (config.json and safetensors) or ``.gguf`` file (kept
    quantized, next to llama.cpp); default the random checkpoint of ``config`` (Qwen2-0.5B's
    shape), written once under ``cache_dir``. ``activations``: a ``.gguf`` file's activation
    modes to run beside the default (default ``float`` and ``int8``), each with its KL
    divergence on the bundled text.
    """
    out = file if file is not None else sys.stdout
    names = backend_names(backends)
    decode = 8 if quick else DECODE
    start = time.perf_counter()
    phases = Phases("bench")
    folder, vocab = _checkpoint(folder, cache_dir, config, phases)
    print(wrap(f"checkpoint: {folder} (ready in {time.perf_counter() - start:.1f} s)"), file=out)
    gguf = folder.suffix == ".gguf"
    rows: list[list[str]] = []
    notes: list[str] = []  # the comparisons promised but not run, with why
    KL.clear()
    kl = _kl_or_why(folder, quick, phases) if gguf else None
    if isinstance(kl, str):
        notes.append(kl)
        kl = None
    table = Table(_HEADERS, _WIDTHS)
    ids = np.random.default_rng(0).integers(0, min(vocab, 1000), size=(1, PREFILL))

    def run(engine: str, name: str, dt: str, make: Callable[[], tuple[float, Runner]]) -> None:
        # each row is printed as soon as its engine has run; stderr says each phase
        if not rows:
            print(table.header(), file=out, flush=True)
        rows.append(_row(engine, name, dt, make, decode, ids, phases))
        print(table.row(rows[-1]), file=out, flush=True)

    for name in names:
        if load_for_dtype(name, dtype, out) is None:
            continue
        engines = _gguf_engines(folder, name, dtype, activations, kl) if gguf else [
            ("portable_llm", partial(_ours, folder, name, dtype))
        ]  # fmt: skip
        for engine, module, peer in PEERS.get(name, ()):
            why = _why_not(engine, module, gguf)
            if why is None:
                engines.append((engine, partial(peer, folder, dtype)))
            else:
                notes.append(f"{engine} skipped: {why}")
                phases.say(notes[-1])
        for engine, make in engines:
            run(engine, name, dtype, make)
    if not rows:
        raise UsageError(f"no selected backend is installed with {dtype}")
    for engine, module, peer in GGUF_PEERS if gguf else ():
        if _installed(module):
            run(engine, "-", "(file's)", partial(peer, folder, dtype))
            if kl is not None and engine == "llama.cpp" and _installed("llama_cpp"):
                with phases("llama.cpp: KL divergence on the bundled text"):
                    KL[engine, "-"] = _kl(LlamaCppLogits(folder, KL_CTX, _threads()), kl)
        else:
            notes.append(f"{engine} skipped: {module} is not installed")
    _print_footer(rows, notes, gguf=gguf, decode=decode, dtype=dtype, out=out)
    return 0


def _checkpoint(
    folder: str | Path | None, cache_dir: str | Path | None, config: dict[str, Any] | None,
    phases: Phases,
) -> tuple[Path, int]:  # fmt: skip
    """The checkpoint to run (``folder``, or the random one of ``config`` written once under
    ``cache_dir``) and its vocabulary size."""
    if folder is not None:
        return Path(folder), _vocab(Path(folder))
    with phases("the random checkpoint: written once, or found in the --cache-dir"):
        written = write_bench_checkpoint(cache_dir, config)
    return written, (config or QWEN2_0_5B)["vocab_size"]


def _print_footer(
    rows: list[list[str]], notes: list[str], *, gguf: bool, decode: int, dtype: str, out: TextIO
) -> None:
    """What the table measured and against whom, then the notes, ratios, choices and KL."""
    ran = sorted({r[0] for r in rows} - {"portable_llm", DEQUANTIZED})
    peers = (
        f"llama.cpp runs on the same file with {plural(_threads(), 'thread')}, as torch"
        if gguf
        else f"{' and '.join(ran)} ran on the same checkpoint"
        if ran
        else "no other engine ran"
    )
    print(file=out)
    text = (
        f"greedy decoding of {decode} tokens after a {PREFILL}-token prompt, twice; the second "
        f"run is reported (the warm-up column is the first: compilation, allocation). {peers}."
    )
    print(wrap(text, "", ""), file=out)
    for line in [*notes, *_ratios(rows), *(_choices(rows, dtype) if gguf else []), *_kl_lines()]:
        print(wrap(line), file=out)


def _kl_or_why(path: Path, quick: bool, phases: Phases) -> KlBase | str:
    """The base of the KL divergences, or why there is none (the text is missing)."""
    from portable_llm.cli.perplexity import DEFAULT_TEXT

    if not Path(DEFAULT_TEXT).is_file():
        return f"KL divergence skipped: the bundled text {DEFAULT_TEXT} is not on this machine"
    with phases("the base of the KL divergence: the file dequantized to float64 on numpy"):
        return _kl_base(path, quick)


def _gguf_engines(
    path: Path, backend: str, dtype: str, activations: Sequence[str] | None, kl: KlBase | None
) -> list[tuple[str, Callable[[], tuple[float, Runner]]]]:
    """A ``.gguf`` file's rows on ``backend``: as ``pl.load`` loads it, dequantized at load
    (the speed and memory of each choice), and in each activation mode other than the
    default's (``pl float``, ``pl int8``); each with its KL divergence when ``kl``."""
    from portable_llm.checkpoint.build import LoadOptions

    default = "int8" if LoadOptions(backend=backend).int8() else "float"
    asked = dict.fromkeys(activations or ("float", "int8"))  # in order, once each
    modes = [m for m in asked if m not in ("auto", default)]

    def ours(engine: str, **how: Any) -> tuple[str, Callable[[], tuple[float, Runner]]]:
        found = None if kl is None else (engine, kl)
        return engine, partial(_ours, path, backend, dtype, kl=found, **how)

    return [
        ours("portable_llm"),
        ours(DEQUANTIZED, dequantize=True),
        *(ours(f"pl {mode}", activations=mode) for mode in modes),
    ]


def _kl_lines() -> list[str]:
    """One line per row measured on the bundled text: its KL divergence from the file
    dequantized to float64, and its top-1 agreement and perplexity."""
    if not KL:
        return []
    any_result = next(iter(KL.values()))
    head = (
        f"KL divergence from the file dequantized to float64 on the bundled text "
        f"({any_result.tokens} tokens scored, ctx {KL_CTX}), nats:"
    )
    return [head] + [
        f"KL of {engine} on {backend}: mean {r.kl_mean:.6f}, 99th percentile "
        f"{r.kl_quantile(0.99):.6f}, top-1 {100 * r.top1_agreement:.2f} %, perplexity "
        f"{r.perplexity:.4f}"
        for (engine, backend), r in KL.items()
    ]


def _vocab(path: Path) -> int:
    """The vocabulary size of ``--model PATH`` (a .gguf file or a checkpoint folder), read
    without loading the weights; a path that is neither is a :class:`UsageError`."""
    if not path.exists():
        raise UsageError(f"--model: no such file or folder: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise UsageError(f"--model: {path} is a file but not a .gguf file")
        return _gguf_vocab(path)
    if not (path / "config.json").is_file():
        raise UsageError(f"--model: the folder {path} has no config.json")
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def _gguf_vocab(path: Path) -> int:
    """The vocabulary size of a ``.gguf`` file (its token list), read without loading it."""
    from portable_llm.checkpoint.files import CheckpointError
    from portable_llm.checkpoint.gguf_header import read_gguf_header

    try:
        tokens = read_gguf_header(path).fields.get("tokenizer.ggml.tokens")
    except CheckpointError as exc:  # not GGUF, truncated: what is wrong, at which byte
        why = str(exc).split("GGUF file: ", 1)[-1]
        raise UsageError(f"--model: {path} is not a readable GGUF file: {why}") from None
    if not isinstance(tokens, list):
        raise UsageError(f"--model: {path} has no tokenizer.ggml.tokens list")
    return len(tokens)


def _ratios(rows: list[list[str]]) -> list[str]:
    """Each portable_llm row's decode tok/s over llama.cpp's, when llama.cpp ran."""
    peer = [r for r in rows if r[0] == "llama.cpp" and r[5] != "-"]
    if not peer:
        return []
    base = float(peer[0][5])
    what = {"portable_llm": "", DEQUANTIZED: " dequantized"}  # pl MODE: " MODE activations"
    return [
        f"decode / llama.cpp: {r[1]} {r[2]}"
        f"{what.get(r[0], r[0].replace('pl ', ' ') + ' activations')} {float(r[5]) / base:.2f}x"
        for r in rows
        if (r[0] == "portable_llm" or r[0].startswith("pl ")) and r[5] != "-"
    ]


#: The engine name of the rows that load a ``.gguf`` file with ``dequantize=True``.
DEQUANTIZED = "pl floats"


def _choices(rows: list[list[str]], dtype: str) -> list[str]:
    """Per backend: the weights' memory as loaded by default (``dequantize="auto"``) and
    dequantized, and a warning line where the default weights decode slower than the
    dequantized ones."""
    rate = {(r[0], r[1]): float(r[5]) for r in rows if r[5] != "-"}
    lines = []
    for (engine, backend), codes in rate.items():
        floats = rate.get((DEQUANTIZED, backend))
        if engine != "portable_llm" or floats is None:
            continue
        mb = [MEMORY.get((backend, dtype, d), 0) / 2**20 for d in ("auto", True)]
        lines.append(
            f"{backend} {dtype}: weights as loaded {mb[0]:.0f} MiB, {codes:.2f} tok/s; "
            f"dequantized {mb[1]:.0f} MiB, {floats:.2f} tok/s"
        )
        # Only where the default load kept codes: with the same bytes both loads hold the same
        # floats (auto dequantized every matrix), and a gap between them is timing noise.
        if codes < floats and mb[0] < mb[1]:
            lines.append(
                f"warning: {backend} {dtype}: the weights as loaded decode slower "
                f"({codes:.2f} tok/s) than dequantized ({floats:.2f} tok/s); "
                f"pl.load(..., dequantize=True) trades {mb[1] - mb[0]:.0f} MiB for the speed"
            )
    return lines


def _why_not(engine: str, module: str, gguf: bool) -> str | None:
    """Why the peer ``engine`` (its library ``module``) does not run here, or ``None``."""
    if gguf:
        return f"{engine} is compared on checkpoint folders, not on a .gguf file"
    if not _installed(module):
        return f"{module} is not installed ({install_hint('oracle')})"
    return None


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
