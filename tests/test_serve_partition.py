"""``portable-llm serve`` over a model split over devices (issue 32): rank 0 serves HTTP, every
rank steps the same batch.

The lockstep is checked in this process first: rank 0's engine (the app's, driven by the
``openai`` client) hands its messages to a second engine on a second copy of the model, which
runs :meth:`~portable_llm.serve.engine.Engine.follow`; both record every token they draw, and
they must be the same, step by step, for greedy, sampled (seeded or not), ``n`` > 1,
penalized, constrained and cancelled requests. Then the real thing, in processes of their own
with bounded time: ``portable-llm serve --tensor-parallel 2`` (and ``--pipeline-parallel 2``)
as 2 torch ranks over gloo and as 2 MLX ranks over its ring, and ``--tensor-parallel 4`` (and
``--tensor-parallel 2 --pipeline-parallel 2``, slow) on a JAX mesh of 4 host devices; each
answers token for token as the one-device server of its backend does at temperature 0, and
every rank exits when rank 0 stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import skip_reason

pytest.importorskip("starlette", reason="the serve extra (starlette) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
httpx = pytest.importorskip("httpx2", reason="the openai client's HTTP library")

import portable_llm as pl  # noqa: E402
from portable_llm.partition import Engine as PartitionEngine  # noqa: E402
from portable_llm.partition.engine import HEAD_BYTES  # noqa: E402
from portable_llm.serve import create_app  # noqa: E402
from portable_llm.serve.engine import Engine  # noqa: E402
from portable_llm.testing.checkpoints import (  # noqa: E402
    SENTENCES,
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)
from portable_llm.testing.partition import free_port, host_devices_env  # noqa: E402
from servers import serving  # noqa: E402

#: Seconds a request may take (a rank out of step would hang it)
TIMEOUT = 120
#: JAX compiles each op anew per shape: two requests at once (a streamed chat, a completion)
JAX_REQUESTS = range(1, 3)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def _folder(folder: Path) -> Path:
    cfg = tiny_config("llama", max_position_embeddings=512)
    write_checkpoint(folder, cfg, seed=11)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return folder


def _recorded(engine: Engine) -> list[list[tuple[int, int, str | None]]]:
    """Every step's events of ``engine``'s generator, as they come."""
    steps: list[list[tuple[int, int, str | None]]] = []
    step = engine.generator.step

    def recording() -> list[tuple[int, int, str | None]]:
        events = step()
        steps.append(list(events))
        return events

    engine.generator.step = recording  # type: ignore[method-assign]
    return steps


@pytest.mark.skipif(bool(skip_reason("numpy")), reason=str(skip_reason("numpy")))
def test_a_follower_draws_the_tokens_of_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The messages carry everything a request's tokens depend on: a follower steps the same
    batch and draws the same tokens as rank 0, unseeded sampling included (rank 0 draws the
    seed); rank 0 speaks every ``HEARTBEAT`` s while idle, and the follower returns when rank 0
    stops."""
    monkeypatch.setattr("portable_llm.serve.engine.HEARTBEAT", 0.05)
    folder = _folder(tmp_path)
    lead, other = (pl.load(folder, backend="numpy", dtype="float32") for _ in range(2))
    wire: queue.Queue[bytes] = queue.Queue()
    sent: list[tuple[Any, bool, bool]] = []

    def send(message: Any) -> Any:  # rank 0: the message as the other ranks get it
        wire.put(pickle.dumps(message))
        sent.append(message)
        return message

    def receive(message: Any) -> Any:
        assert message is None
        return pickle.loads(wire.get(timeout=60))

    follower = Engine(other, max_batch=4, prefill_chunk=16, page_size=8, broadcast=receive)
    theirs = _recorded(follower)
    thread = threading.Thread(target=follower.follow, daemon=True)
    thread.start()
    app = create_app(lead, model_name="tiny", max_batch=4, prefill_chunk=16, page_size=8,
                     broadcast=send)  # fmt: skip
    ours = _recorded(app.state.engine)
    # a stop string met at the 4th of 20 greedy tokens: the request is cancelled there
    stop = "".join(pl.generate(lead, "A stop string", max_new_tokens=4))
    requests: list[dict[str, Any]] = [
        {"prompt": "Rotary embeddings turn", "max_tokens": 9, "temperature": 0},
        {"prompt": "The cache keeps", "max_tokens": 12, "temperature": 1.0},  # no seed
        {"prompt": "Each page", "max_tokens": 7, "temperature": 0.8, "top_p": 0.9, "n": 3},
        {"prompt": "Keys and values", "max_tokens": 10, "temperature": 1.0, "seed": 3,
         "frequency_penalty": 1.5, "logit_bias": {"5": 30}},
        {"prompt": "A stop string", "max_tokens": 20, "temperature": 0, "stop": [stop]},
        {"prompt": "JSON:", "max_tokens": 30, "temperature": 1.0,
         "extra_body": {"response_format": {"type": "json_schema", "json_schema": {
             "name": "a", "schema": SCHEMA, "strict": True}}}},
    ]  # fmt: skip
    with (
        serving(app) as url,
        _client(url) as client,
    ):
        with ThreadPoolExecutor(len(requests)) as pool:  # at once: in one batch
            answers = list(
                pool.map(lambda r: client.completions.create(model="tiny", **r), requests)
            )
        assert answers[4].choices[0].finish_reason == "stop"  # cancelled by its stop string
        time.sleep(0.3)  # idle
        assert thread.is_alive()  # still following while rank 0 serves
    thread.join(30)  # rank 0's server stopped: so does the follower
    assert not thread.is_alive()
    assert sent[-1] == ([], False, True)  # the stop
    assert sent[-3:-1] == [([], False, False)] * 2  # idle: heartbeats, nothing to do
    assert len(ours) > 1 and sum(len(step) > 1 for step in ours) > 1  # batched steps
    assert theirs == ours
    assert answers[2].choices[0].text != answers[2].choices[1].text  # the draws are random


def _answers(url: str, which: range = range(5)) -> list[str]:
    """The texts of a few greedy requests sent at once (``which`` of: chat whole and streamed,
    three completions, the last of a prompt whose message to the other ranks takes a second
    collective), then of an unseeded sampled one (its text is random; the ranks must
    keep step)."""
    chat = [{"role": "user", "content": "What does the cache keep?"}]

    def one(i: int) -> str:
        with _client(url) as client:
            if i == 0:
                r = client.chat.completions.create(
                    model="m", messages=chat, max_tokens=8, temperature=0
                )
                return str(r.choices[0].message.content)
            if i == 1:
                chunks = client.chat.completions.create(
                    model="m", messages=chat, max_tokens=8, temperature=0, stream=True
                )
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            prompts = ["Rotary embeddings turn", "Each page holds", " ".join(SENTENCES * 2)]
            c = client.completions.create(
                model="m", prompt=prompts[i - 2], max_tokens=6 + i, temperature=0
            )
            return str(c.choices[0].text)

    with ThreadPoolExecutor(len(which)) as pool:
        texts = list(pool.map(one, which))
    with _client(url) as client:
        r = client.completions.create(model="m", prompt="Hi", max_tokens=5, temperature=1.0)
        assert r.usage is not None and r.usage.completion_tokens >= 1
    return texts


def _one_device(folder: Path, backend: str, which: range = range(5)) -> list[str]:
    model = pl.load(folder, backend=backend, dtype="float32")
    with serving(create_app(model, model_name="m", max_batch=8, prefill_chunk=16)) as url:
        return _answers(url, which)


@contextlib.contextmanager
def _ranks(
    log: Path, commands: list[list[str]], envs: list[dict[str, str]], port: int
) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """Start the ranks (rank 0 first), wait for rank 0's ``/health`` (240 s at most), yield its
    URL and the processes; kill whatever still runs at the end."""
    outs = [open(log.with_suffix(f".{i}"), "wb") for i in range(len(commands))]  # noqa: SIM115
    procs = [
        subprocess.Popen(c, env=e, stdout=o, stderr=subprocess.STDOUT)
        for c, e, o in zip(commands, envs, outs, strict=True)
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            failed = [p.returncode for p in procs if p.poll() is not None]
            if failed or time.monotonic() > deadline:
                raise AssertionError(f"the ranks did not start ({failed}): {_tail(log)}")
            time.sleep(0.5)
        yield url, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for o in outs:
            o.close()


def _tail(log: Path) -> str:
    return " | ".join(f.read_text(errors="replace")[-1500:] for f in sorted(log.parent.glob(
        log.name + ".*")))  # fmt: skip


def _stop(procs: list[subprocess.Popen[bytes]], log: Path) -> None:
    """Stop rank 0 as Ctrl-C would: every rank exits, with 0."""
    procs[0].send_signal(signal.SIGINT)
    for p in procs:
        p.wait(timeout=60)
    assert [p.returncode for p in procs] == [0] * len(procs), _tail(log)


def _serve(folder: Path, backend: str, port: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "portable_llm", "serve", str(folder), "--backend", backend,
        "--dtype", "float32", "--port", str(port), "--model-name", "m", "--max-batch", "8",
        "--prefill-step-size", "16", "--log-level", "warning", *flags,
    ]  # fmt: skip


def _rank_envs(engine: str, world: int, folder: Path) -> list[dict[str, str]]:
    """The environment of each rank as torchrun (torch, gloo) or ``mlx.launch --backend
    ring`` (a hostfile of one address per rank) gives it."""
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    if engine == "torch":
        master = str(free_port())
        return [
            {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master}
            for r in range(world)
        ]  # fmt: skip
    hostfile = folder / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(world)]))
    return [{**base, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(world)]


BOTH = ["--tensor-parallel", "2", "--pipeline-parallel", "2"]


@pytest.mark.parametrize(
    ("engine", "flags"),
    [
        pytest.param("torch", ["--tensor-parallel", "2"], id="torch-tp2"),
        pytest.param("torch", ["--pipeline-parallel", "2"], id="torch-pp2"),
        pytest.param("mlx", ["--tensor-parallel", "2"], id="mlx-tp2"),
        pytest.param("mlx", ["--pipeline-parallel", "2"], id="mlx-pp2"),  # chunked prefill
        # 4 ranks: the message goes over stage 0's TP group, then along both pipelines
        pytest.param("torch", BOTH, id="torch-pp2xtp2", marks=pytest.mark.slow),
        pytest.param("mlx", BOTH, id="mlx-pp2xtp2", marks=pytest.mark.slow),  # NeighborGroups
    ],
)  # fmt: skip
def test_ranks_answer_as_one_device(tmp_path: Path, engine: str, flags: list[str]) -> None:
    """``serve --tensor-parallel 2`` (or ``--pipeline-parallel 2``, or both on 4 ranks) as
    ranks of torch over gloo or MLX over its ring, each started as its launcher starts it:
    rank 0 answers as one device of the backend, and every rank exits when it stops."""
    if skip_reason(engine):
        pytest.skip(str(skip_reason(engine)))
    folder = _folder(tmp_path / "ckpt")
    want = _one_device(folder, engine)
    port = free_port()
    world = 4 if flags == BOTH else 2
    commands = [_serve(folder, engine, port, *flags)] * world
    envs = _rank_envs(engine, world, tmp_path)
    with _ranks(tmp_path / "log", commands, envs, port) as (url, procs):
        assert _answers(url) == want
        _stop(procs, tmp_path / "log")


@pytest.mark.skipif(bool(skip_reason("torch")), reason=str(skip_reason("torch")))
def test_a_rank_gone_stops_the_server(tmp_path: Path) -> None:
    """When a rank dies, rank 0's next message fails: the request gets an error, and rank 0
    stops serving and exits with 1, saying why (a launcher then ends the job)."""
    folder = _folder(tmp_path / "ckpt")
    port = free_port()
    commands = [_serve(folder, "torch", port, "--tensor-parallel", "2")] * 2
    log = tmp_path / "log"
    with _ranks(log, commands, _rank_envs("torch", 2, tmp_path), port) as (url, procs):
        procs[1].kill()
        procs[1].wait()
        with _client(url) as client, pytest.raises(openai.APIError):
            client.completions.create(model="m", prompt="Hi", max_tokens=4, temperature=0)
        assert procs[0].wait(timeout=60) == 1
    assert "the other ranks cannot be reached" in log.with_suffix(".0").read_text()


@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--tensor-parallel", "4"], id="tp4"),  # the plain model, sharded: ~45 s
        pytest.param(  # two stages driven op by op: ~2 min on the shared 2-core machine
            ["--tensor-parallel", "2", "--pipeline-parallel", "2"], id="pp2xtp2",
            marks=pytest.mark.slow,
        ),
    ],
)  # fmt: skip
def test_jax_mesh_of_four_answers_as_one_device(tmp_path: Path, flags: list[str]) -> None:
    """``serve`` on JAX: one process over a mesh of 4 host devices answers as one JAX
    device."""
    folder = _folder(tmp_path / "ckpt")
    want = _one_device(folder, "jax", JAX_REQUESTS)
    port = free_port()
    env = host_devices_env(4)
    command = _serve(folder, "jax", port, *flags)
    with _ranks(tmp_path / "log", [command], [env], port) as (url, procs):
        assert _answers(url, JAX_REQUESTS) == want
        _stop(procs, tmp_path / "log")


def test_a_split_needs_a_backend_with_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    from portable_llm.cli.cli import main

    assert main(["serve", "m", "--backend", "numpy", "--tensor-parallel", "2"]) == 1
    err = capsys.readouterr().err
    assert "need a backend with collectives (jax, torch, mlx); got 'numpy'" in err


class _Ranks(PartitionEngine):
    """Rank ``rank`` of a TP pair whose broadcast is a list: rank 0 appends, rank 1 takes."""

    def __init__(self, rank: int, wire: list[np.ndarray]) -> None:
        class Group:
            def size(self) -> int:
                return 2

            def rank(self) -> int:
                return rank

        self.bind_groups(Group(), None)
        self.wire = wire

    def broadcast_bytes(self, group: Any, data: np.ndarray) -> np.ndarray:
        if group.rank() == 0:
            self.wire.append(data.copy())
            return data
        sent = self.wire.pop(0)
        assert sent.shape == data.shape and sent.dtype == data.dtype == np.uint8
        return sent


def _boundary(extra: int) -> bytes:
    """Bytes whose pickle fills the head (8 bytes of length, then the pickle) and ``extra``."""
    overhead = len(pickle.dumps(b"x" * 600)) - 600
    return b"x" * (HEAD_BYTES - 8 - overhead + extra)


@pytest.mark.parametrize(
    ("message", "collectives"),
    [
        pytest.param(([], True, False), 1, id="a step"),
        pytest.param(([("add", 7, {"prompt_ids": list(range(2000))})], True, False), 2,
                     id="a long prompt"),
        pytest.param(_boundary(0), 1, id="a full head"),
        pytest.param(_boundary(1), 2, id="one byte more"),
    ],
)  # fmt: skip
def test_broadcast_object_sends_a_short_message_in_one_collective(
    message: Any, collectives: int
) -> None:
    """The framing of ``Engine.broadcast_object`` (over any engine's byte broadcast): the
    object arrives whole, in one collective when it fits in ``HEAD_BYTES``, else two."""
    wire: list[np.ndarray] = []
    assert _Ranks(0, wire).broadcast_object(message) == message
    assert len(wire) == collectives
    assert _Ranks(1, wire).broadcast_object(None) == message
    assert wire == []
