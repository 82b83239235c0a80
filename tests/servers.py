"""The server tests' helpers: an app run by uvicorn in a thread, and a tiny model for it.

Imported by the test modules of the server (``test_serve*.py``); they import uvicorn only where
the serve extra is installed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import portable_llm as pl
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 (a free port) in a thread; yield its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
        assert not thread.is_alive()


def tiny_model(folder: Path, *, context: int = 1024, seed: int = 11) -> pl.Model:
    """A random Llama-shaped checkpoint with a BPE tokenizer and a chat template, on NumPy."""
    cfg = tiny_config("llama", max_position_embeddings=context)
    write_checkpoint(folder, cfg, seed=seed)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return pl.load(folder, backend="numpy", dtype="float32")


def alone(model: pl.Model, ids: list[int], max_tokens: int, **options: Any) -> tuple[str, int]:
    """``generate``'s text for ``ids`` and the tokens it drew (a final stop token included)."""
    gen = pl.generate(model, ids, max_new_tokens=max_tokens, **options)
    new = list(gen)
    drawn = len(new) + (gen.stats.finish_reason == "stop")
    return model.tokenizer.decode(new), drawn


def chat_ids(model: pl.Model, messages: list[dict]) -> list[int]:
    """The prompt ids the server makes of ``messages`` (the model's chat template)."""
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return model.tokenizer.encode_prompt(text)
