"""Multi-host JAX (issue 19), run as 2 local processes joined by ``jax.distributed.initialize``
(coordinator on 127.0.0.1, CPU collectives over gloo): each process loads the shards of its own
devices of one mesh over both, and gets the logits and greedy tokens of one device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import skip_reason
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from portable_llm.testing.multihost import launch_jax_processes
from portable_llm.testing.partition import NEW_TOKENS, PROMPT

pytestmark = pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))


@pytest.mark.slow  # 35-40 s each on the shared 2-core machine
@pytest.mark.parametrize("case", ["tp2", "pp2tp2"])  # TP over both; 2 stages, TP pairs over both
def test_two_jax_processes_equal_one_device(tmp_path: Path, case: str) -> None:
    import portable_llm as pl

    write_checkpoint(tmp_path / "ckpt", tiny_config("llama"))
    model = pl.load(tmp_path / "ckpt", backend="jax")
    logits = pl.to_numpy(model([PROMPT]))
    tokens = [int(t) for t in pl.generate(model, PROMPT, max_new_tokens=NEW_TOKENS, stop=())]
    for got in launch_jax_processes(tmp_path / "ckpt", tmp_path / "out", case):
        assert_close(got["logits"], logits)
        np.testing.assert_array_equal(got["tokens"], tokens)
