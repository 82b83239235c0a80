"""GGUF files: block types bit for bit against ``gguf.quants``, small files written with
``gguf.GGUFWriter`` (metadata, tensors, tokenizer) read back exactly, kept quantized, and the
errors of broken files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from conftest import numpy_only
from portable_llm.checkpoint.gguf_blocks import (
    AFFINE_FORMATS,
    BLOCK_SIZES,
    affine_parts,
    dequantize_blocks,
    pack_codes,
)
from portable_llm.checkpoint.weights import expected_shapes
from portable_llm.models import CheckpointError, DecoderConfig
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import SENTENCES, write_checkpoint, write_tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
T = gguf.GGMLQuantizationType

# -- block types -------------------------------------------------------------------------------


def random_blocks(kind: str, n: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """``n`` random blocks of ``kind`` with finite fp16 scales (``gguf`` cannot quantize the
    K-quants, but it can dequantize any bytes)."""
    _, nbytes = BLOCK_SIZES[kind]
    b = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)

    def f16(k: int, lo: float, hi: float) -> np.ndarray:
        return (rng.uniform(lo, hi, (n, k)) * scale).astype(np.float16).view(np.uint8)

    if kind in ("Q4_0", "Q5_0", "Q8_0"):
        b[:, :2] = f16(1, -2, 2)
    elif kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        b[:, :4] = f16(2, -2, 2)
    elif kind == "Q6_K":
        b[:, 208:] = f16(1, -2, 2)
    elif kind == "F16":
        b[:] = f16(1, -3, 3)
    elif kind == "F32":
        b[:] = rng.uniform(-3, 3, (n, 1)).astype(np.float32).view(np.uint8)
    elif kind == "MXFP4":
        b[:, 0] = rng.integers(110, 145, n)  # E8M0 exponents 2**-17 .. 2**17
    return b


@pytest.mark.parametrize("kind", list(BLOCK_SIZES))
def test_block_dequantize_bit_for_bit(kind: str) -> None:
    """Every supported block type decodes to exactly the bits ``gguf.quants.dequantize`` gives
    (signed zeros included)."""
    rng = np.random.default_rng(list(BLOCK_SIZES).index(kind))
    blocks = random_blocks(kind, 97, rng)
    ours = dequantize_blocks(kind, blocks)
    want = gguf.quants.dequantize(blocks.reshape(-1), T[kind]).astype(np.float32)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.reshape(-1).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", list(AFFINE_FORMATS))
def test_affine_parts_are_exact(kind: str) -> None:
    """``scales * q + biases`` per group (32 weights, Q6_K's 16) equals ggml's value exactly,
    in float32 arithmetic; the codes fit the bits and use them."""
    rng = np.random.default_rng(7)
    blocks = random_blocks(kind, 33, rng)
    q, scales, biases = affine_parts(kind, blocks)
    (n, per), (bits, group) = (blocks.shape[0], BLOCK_SIZES[kind][0]), AFFINE_FORMATS[kind]
    assert q.shape == (n, per) and scales.shape == biases.shape == (n, per // group)
    assert scales.dtype == biases.dtype == np.float32
    used = 6 if kind == "Q6_K" else bits  # Q6_K's 6-bit codes are kept one a byte
    assert int(q.max()) < 2**used and int(q.max()) >= 2 ** (used - 1)
    w = scales[:, :, None] * q.reshape(n, -1, group).astype(np.float32) + biases[:, :, None]
    want = gguf.quants.dequantize(blocks.reshape(-1), T[kind]).astype(np.float32)
    np.testing.assert_array_equal(w.reshape(-1), want)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_codes_is_mlx_layout(bits: int) -> None:
    """Packed codes equal ``mx.quantize``'s, for the codes ``mx.quantize`` chose."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    w = np.random.default_rng(bits).standard_normal((6, 128)).astype(np.float32)
    packed, scales, biases = (
        np.array(a) for a in mx.quantize(mx.array(w), group_size=32, bits=bits)
    )
    q = np.array(mx.dequantize(*map(mx.array, (packed, scales, biases)), group_size=32, bits=bits))
    codes = np.rint((q - np.repeat(biases, 32, 1)) / np.repeat(scales, 32, 1)).astype(np.uint8)
    np.testing.assert_array_equal(pack_codes(codes, bits), packed)


@pytest.mark.parametrize("kind", list(AFFINE_FORMATS))
def test_affine_blocks_as_quantized_weight(kind: str, backend: str) -> None:
    """Blocks become a ``QuantizedWeight`` whose ``dequantize`` is ggml's value (float32)."""
    quant = pytest.importorskip("portable_llm.ops.quant", reason="ops.quant not there yet")
    rng = np.random.default_rng(3)
    per = BLOCK_SIZES[kind][0]
    blocks = random_blocks(kind, 8 * 256 // per, rng)  # 8 rows of 256
    q, scales, biases = affine_parts(kind, blocks)
    bits, group = AFFINE_FORMATS[kind]
    arr = lambda a: pl.asarray(a, backend=backend)  # noqa: E731
    qw = quant.QuantizedWeight(
        arr(pack_codes(q.reshape(8, 256), bits)),
        arr(scales.reshape(8, 256 // group)),
        arr(biases.reshape(8, 256 // group)),
        bits=bits,
        group_size=group,
    )
    want = dequantize_blocks(kind, blocks).reshape(8, 256)
    assert_close(pl.to_numpy(quant.dequantize(qw)), want)


# -- small GGUF files --------------------------------------------------------------------------

# Per layer, the type of each matrix (all block types, every K-quant on a 256-wide ffn_down).
LAYER_TYPES = [
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q5_1",
     "ffn_gate": "Q8_0", "ffn_up": "F16", "ffn_down": "Q4_K"},
    {"attn_q": "Q8_0", "attn_k": "Q5_1", "attn_v": "BF16", "attn_output": "Q4_1",
     "ffn_gate": "Q4_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_1", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_output": "F32",
     "ffn_gate": "Q5_1", "ffn_up": "Q4_0", "ffn_down": "Q5_K"},
]  # fmt: skip
_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
EPS = float(np.float32(1e-5))  # GGUF stores it as float32


def family_config(arch: str, **change: Any) -> dict[str, Any]:
    """A 3-layer ``config.json`` dict that a GGUF of ``arch`` describes exactly."""
    cfg = {
        "model_type": arch, "vocab_size": 300, "hidden_size": 32, "intermediate_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16 if arch == "qwen3" else 8, "rms_norm_eps": EPS, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": arch == "qwen3",
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    return {**cfg, **change}


def _to_gguf(hf: str) -> tuple[str, str]:
    """``(gguf name, layer-role)`` of an HF tensor name."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf], ""
    _, _, i, rest = hf.split(".", 3)
    stem, suffix = rest.rsplit(".", 1)
    role = next(g for g, h in _HF.items() if h == stem)
    return f"blk.{i}.{role}.{suffix}", role


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (convert_hf_to_gguf.py)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' ``LlamaTensorProcessor._reverse_permute_weights``."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_tokenizer_meta(folder: Path) -> dict[str, Any]:
    """Tokenizer metadata of a byte-level BPE (``write_tokenizer``) as llama.cpp writes it."""
    tok = write_tokenizer(folder, vocab_size=300)
    spec = json.loads(tok.to_str())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [f"[PAD{i}]" for i in range(300)]
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in ("<pad>", "<s>", "<|endoftext|>") else 1 for t in tokens]
    types = [5 if t.startswith("[PAD") else k for t, k in zip(tokens, types, strict=True)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokens": tokens, "types": types, "merges": merges, "hf": tok}


TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" + (
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def write_gguf(
    path: Path,
    arch: str,
    cfg: dict[str, Any],
    tensors: dict[str, np.ndarray],
    *,
    types: dict[str, str] | None = None,
    tok: dict[str, Any] | None = None,
    skip_keys: tuple[str, ...] = (),
    skip_tensors: tuple[str, ...] = (),
    rng: np.random.Generator | None = None,
    pre: str = "smollm",
    add_bos: bool = False,
    template: str = TEMPLATE,
) -> dict[str, np.ndarray]:
    """Write ``tensors`` (HF names and layout) as llama.cpp would: q/k rows permuted (llama),
    each matrix in its type (K-quants: random blocks in place of the tensor). Returns the HF
    weights the file holds (dequantized by ``gguf.quants``, permutation undone)."""
    rng = rng or np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    kv = {
        f"{arch}.block_count": cfg["num_hidden_layers"],
        f"{arch}.context_length": cfg["max_position_embeddings"],
        f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": cfg["num_attention_heads"],
        f"{arch}.attention.head_count_kv": cfg["num_key_value_heads"],
        f"{arch}.attention.key_length": cfg["head_dim"],
        f"{arch}.rope.dimension_count": cfg["head_dim"],
    }
    for key, value in kv.items():
        if key not in skip_keys:
            w.add_uint32(key, value)
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if tok is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(add_bos)
        w.add_chat_template(template)
    held = {}
    for hf, value in tensors.items():
        name, role = _to_gguf(hf)
        if name in skip_tensors:
            continue
        kind = (types or {}).get(name, "F32" if value.ndim == 1 else "Q8_0")
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        permute = arch == "llama" and role in heads and name.endswith(".weight")
        stored = _permute(value, heads[role]) if permute else value
        if kind in ("Q4_K", "Q5_K", "Q6_K", "Q2_K"):
            nbytes = gguf.GGML_QUANT_SIZES[T[kind]][1]
            scale = 2e-3 if kind == "Q6_K" else 5e-3
            blocks = (
                random_blocks(kind, stored.size // 256, rng, scale)
                if kind != "Q2_K"
                else rng.integers(0, 256, (stored.size // 256, nbytes), dtype=np.uint8)
            )
            data = blocks.reshape(stored.shape[0], -1)
        elif kind in ("F32", "F16"):
            data = stored.astype(np.float16 if kind == "F16" else np.float32)
        else:
            data = gguf.quants.quantize(stored.astype(np.float32), T[kind])
        w.add_tensor(name, data, raw_dtype=T[kind])
        if kind != "Q2_K":
            back = gguf.quants.dequantize(data, T[kind]).astype(np.float32).reshape(value.shape)
            held[hf] = _reverse_permute(back, heads[role]) if permute else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(DecoderConfig.from_dict(cfg)).items():
        if name.endswith("norm.weight"):
            a = rng.uniform(0.8, 1.2, shape)
        elif len(shape) == 1:
            a = rng.uniform(-0.2, 0.2, shape)
        else:
            a = rng.uniform(-2.0, 2.0, shape) / np.sqrt(shape[-1])
        out[name] = a.astype(np.float32)
    return out


def layer_types(cfg: dict[str, Any]) -> dict[str, str]:
    types = {"token_embd.weight": "Q8_0", "output.weight": "Q4_0"}
    for i in range(cfg["num_hidden_layers"]):
        types.update({f"blk.{i}.{r}.weight": k for r, k in LAYER_TYPES[i % 3].items()})
    return types


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A llama GGUF with every block type, its tokenizer, and the weights it holds."""
    folder = tmp_path_factory.mktemp("gguf_llama")
    cfg = family_config("llama")
    tok = gguf_tokenizer_meta(folder / "tok")
    file = folder / "tiny.gguf"
    held = write_gguf(file, "llama", cfg, random_weights(cfg), types=layer_types(cfg), tok=tok)
    return file, held


def test_llama_file_weights_and_config(llama_file: tuple[Path, dict[str, np.ndarray]]) -> None:
    """``dequantize=True``: every weight is exactly what ``gguf.quants`` decodes, with
    llama.cpp's q/k permutation undone as transformers undoes it; the config is the metadata's."""
    file, held = llama_file
    model = pl.load(file, dequantize=True)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 3, 32)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rms_norm_eps) == (256, 300, EPS)
    assert cfg.rope["base"] == 10000.0 and not cfg.tie_word_embeddings
    assert model.generation_config["eos_token_id"] == [2]
    b0 = model.layers[0]
    np.testing.assert_array_equal(
        pl.to_numpy(b0.attn.wq), held["model.layers.0.self_attn.q_proj.weight"]
    )
    np.testing.assert_array_equal(
        pl.to_numpy(b0.attn.wk), held["model.layers.0.self_attn.k_proj.weight"]
    )
    np.testing.assert_array_equal(pl.to_numpy(model.embed), held["model.embed_tokens.weight"])
    np.testing.assert_array_equal(pl.to_numpy(model.lm_head), held["lm_head.weight"])
    for i, kind in enumerate(("Q4_K", "Q6_K", "Q5_K")):
        got = pl.to_numpy(model.layers[i].mlp.w_down)
        np.testing.assert_array_equal(got, held[f"model.layers.{i}.mlp.down_proj.weight"], kind)


def _folder_of(tmp_path: Path, cfg: dict[str, Any], held: dict[str, np.ndarray]) -> Path:
    write_checkpoint(tmp_path, cfg, tensors=held)
    return tmp_path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_logits_equal_the_same_weights_as_a_folder(
    arch: str, backend: str, tmp_path: Path
) -> None:
    """A GGUF model (dequantized) gives the logits of the HF folder holding the same weights,
    per family (llama: q/k permuted; qwen2: q/k/v biases; qwen3: q/k norms, head_dim 16)."""
    cfg = family_config(arch)
    held = write_gguf(
        tmp_path / "m.gguf", arch, cfg, random_weights(cfg, 1), types=layer_types(cfg)
    )
    if cfg["tie_word_embeddings"]:
        assert "lm_head.weight" not in held
    ref = pl.load(_folder_of(tmp_path / "hf", cfg, held), backend=backend, dtype="float32")
    model = pl.load(tmp_path / "m.gguf", backend=backend, dequantize=True)
    assert model.tokenizer is None  # no tokenizer metadata in this file
    ids = [[5, 17, 42, 99, 3, 250, 7]]
    assert_close(model(ids), ref(ids))


def _quantized_ops(backend: str) -> Any:
    """``portable_llm.ops.quant``, or a skip while the ops do not take a ``QuantizedWeight``."""
    quant = pytest.importorskip("portable_llm.ops.quant", reason="ops.quant not there yet")
    from portable_llm.ops.embedding import embedding

    qw = quant.quantize(pl.asarray(np.ones((2, 32), np.float32), backend=backend), group_size=32)
    try:
        embedding(pl.asarray([[0]], backend=backend), qw)
    except TypeError:
        pytest.skip("embedding does not take a QuantizedWeight yet (issue 11's ops)")
    return quant


def test_kept_quantized_equals_dequantized(
    llama_file: tuple[Path, dict[str, np.ndarray]], backend: str
) -> None:
    """``dequantize=False`` keeps the affine types as ``QuantizedWeight`` (Q6_K as 8-bit codes
    in groups of 16; F16, BF16 as floats); the logits equal the dequantized model's (the
    conversion is exact); ``"auto"`` dequantizes Q6_K everywhere (no kernel takes its groups)."""
    quant = _quantized_ops(backend)
    file, _ = llama_file
    kept = pl.load(file, backend=backend, dequantize=False)
    floats = pl.load(file, backend=backend, dequantize=True)
    b0, b1 = kept.layers[0], kept.layers[1]
    assert isinstance(kept.embed, quant.QuantizedWeight) and kept.embed.bits == 8
    assert isinstance(b0.attn.wq, quant.QuantizedWeight) and b0.attn.wq.bits == 4
    assert isinstance(b0.attn.wv, quant.QuantizedWeight) and b0.attn.wv.bits == 5
    assert (
        isinstance(b0.mlp.w_down, quant.QuantizedWeight) and b0.mlp.w_down.group_size == 32
    )  # Q4_K
    q6 = b1.mlp.w_down  # Q6_K
    assert isinstance(q6, quant.QuantizedWeight) and (q6.bits, q6.group_size) == (8, 16)
    assert not isinstance(b0.mlp.w_up, quant.QuantizedWeight)  # F16
    for name in ("wq", "wk"):  # the permutation is undone on the packed rows too
        want = getattr(floats.layers[0].attn, name)
        assert_close(quant.dequantize(getattr(b0.attn, name)), want)
    np.testing.assert_array_equal(
        pl.to_numpy(quant.dequantize(q6)), pl.to_numpy(floats.layers[1].mlp.w_down)
    )
    ids = [[5, 17, 42, 99, 3, 250, 7]]
    assert_close(kept(ids), floats(ids))
    auto = pl.load(file, backend=backend)
    assert not isinstance(auto.layers[1].mlp.w_down, quant.QuantizedWeight)


def test_dtype(llama_file: tuple[Path, dict[str, np.ndarray]], backend: str) -> None:
    """Float weights (and scales) come in ``dtype``; default float32."""
    file, held = llama_file
    bk = pl.get_backend(backend)
    if "bfloat16" not in bk.float_dtypes():
        pytest.skip(f"{backend} has no bfloat16")
    model = pl.load(file, backend=backend, dtype="bfloat16", dequantize=True)
    assert bk.dtype_name(model.embed.dtype) == "bfloat16"
    got = pl.to_numpy(model.embed).astype(np.float32)
    want = held["model.embed_tokens.weight"]
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)
    with pytest.raises(ValueError, match="float dtype"):
        pl.load(file, backend=backend, dtype="int32")


# -- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_from_metadata(
    llama_file: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """The GGUF tokenizer encodes as the ``tokenizer.json`` it was written from; control tokens
    stay whole; the chat template, BOS/EOS come from the metadata."""
    file, _ = llama_file
    tok = pl.load(file, dequantize=True).tokenizer
    ref = gguf_tokenizer_meta(tmp_path)["hf"]
    texts = [*SENTENCES, "  two  spaces\tand a tab\n", "<|endoftext|>x<s>", "ünïcödé ☃ 日本 🤖"]
    for text in texts:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text).ids)
    assert tok.encode("a<|endoftext|>b")[1] == 2
    assert tok.config["eos_token"] == "<|endoftext|>" and tok.config["bos_token"] == "<s>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s>user: hi\n<s>assistant:"


def test_add_bos_token(tmp_path: Path) -> None:
    """``tokenizer.ggml.add_bos_token`` puts the BOS id first (transformers' post-processor)."""
    cfg = family_config("qwen2", num_hidden_layers=1)
    tok = gguf_tokenizer_meta(tmp_path / "tok")
    file = tmp_path / "bos.gguf"
    write_gguf(file, "qwen2", cfg, random_weights(cfg), tok=tok)
    # rewrite with add_bos_token = True (GGUFWriter writes each key once)
    reader = gguf.GGUFReader(file)
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is False
    plain = pl.load(file).tokenizer.encode("hello")
    file2 = tmp_path / "bos2.gguf"
    _copy_with(file, file2, {"tokenizer.ggml.add_bos_token": True})
    assert pl.load(file2).tokenizer.encode("hello") == [1, *plain]


def test_chat_template_error_names_the_file(tmp_path: Path) -> None:
    cfg = family_config("qwen2", num_hidden_layers=1)
    tok = gguf_tokenizer_meta(tmp_path / "tok")
    file = tmp_path / "tpl.gguf"
    bad = "{{ raise_exception('only user turns') }}"
    write_gguf(file, "qwen2", cfg, random_weights(cfg), tok=tok, template=bad)
    tokenizer = pl.load(file).tokenizer
    with pytest.raises(ValueError, match=r"tpl\.gguf: tokenizer\.chat_template.*only user turns"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def rewrite_gguf(src: Path, dst: Path, change: dict[str, tuple[Any, Any]]) -> Path:
    """Copy GGUF ``src`` to ``dst`` with metadata ``key: (value, GGUFValueType)`` changed or
    added (``(value, None)``: the source's type; ``(None, None)`` drops the key); tensors
    unchanged."""
    vt = gguf.GGUFValueType
    reader = gguf.GGUFReader(src)
    fields = {
        key: (f.contents(), f.types[0], f.types[-1] if f.types[0] == vt.ARRAY else None)
        for key, f in reader.fields.items()
        if not key.startswith("GGUF.")
    }
    for key, (value, kind) in change.items():
        if value is None and kind is None:
            fields.pop(key, None)
        elif kind is None:
            fields[key] = (value, *fields[key][1:])
        else:
            item = vt.INT32 if kind == vt.ARRAY and isinstance(value[0], int) else vt.STRING
            fields[key] = (value, kind, item if kind == vt.ARRAY else None)
    w = gguf.GGUFWriter(str(dst), fields.pop("general.architecture")[0])
    for key, (value, kind, sub) in fields.items():
        w.add_key_value(key, value, kind, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _copy_with(src: Path, dst: Path, change: dict[str, Any]) -> None:
    """Copy a GGUF, changing metadata values (keeping their types)."""
    rewrite_gguf(src, dst, {key: (value, None) for key, value in change.items()})


# -- errors --------------------------------------------------------------------------------------


def test_missing_tensor(tmp_path: Path) -> None:
    cfg = family_config("llama")
    file = tmp_path / "m.gguf"
    write_gguf(file, "llama", cfg, random_weights(cfg), skip_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(
        CheckpointError, match=r"m\.gguf.*missing tensors \(1\): blk\.1\.ffn_up\.weight"
    ):
        pl.load(file)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    cfg = family_config("llama")
    file = tmp_path / "m.gguf"
    write_gguf(file, "llama", cfg, random_weights(cfg), types={"blk.2.ffn_down.weight": "Q2_K"})
    with pytest.raises(
        CheckpointError, match=r"m\.gguf.*blk\.2\.ffn_down\.weight has GGUF type Q2_K"
    ):
        pl.load(file)


def test_unsupported_architecture(tmp_path: Path) -> None:
    cfg = family_config("llama")
    file = tmp_path / "m.gguf"
    write_gguf(file, "falcon", cfg, random_weights(cfg))
    with pytest.raises(CheckpointError, match=r"m\.gguf.*unsupported GGUF architecture 'falcon'"):
        pl.load(file)


def test_missing_metadata_key(tmp_path: Path) -> None:
    cfg = family_config("qwen2")
    file = tmp_path / "m.gguf"
    write_gguf(file, "qwen2", cfg, random_weights(cfg), skip_keys=("qwen2.feed_forward_length",))
    with pytest.raises(CheckpointError, match=r"m\.gguf.*qwen2\.feed_forward_length is missing"):
        pl.load(file)


def test_misshapen_tensor(tmp_path: Path) -> None:
    cfg = family_config("qwen2")
    file = tmp_path / "m.gguf"
    weights = random_weights(cfg)
    up = "model.layers.0.mlp.up_proj.weight"
    weights[up] = weights[up][:128]
    write_gguf(file, "qwen2", cfg, weights)
    with pytest.raises(
        CheckpointError,
        match=r"blk\.0\.ffn_up\.weight \(128, 32\) \(metadata implies \(256, 32\)\)",
    ):
        pl.load(file)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_or_garbage_file(tmp_path: Path, keep: float) -> None:
    cfg = family_config("qwen2", num_hidden_layers=1)
    file = tmp_path / "m.gguf"
    write_gguf(file, "qwen2", cfg, random_weights(cfg))
    data = file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"cut\.gguf"):
        pl.load(cut)
    with pytest.raises(FileNotFoundError, match=r"no GGUF file .*absent\.gguf"):
        pl.load(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"junk\.gguf"):
        pl.load(tmp_path / "junk.gguf")


# -- command line --------------------------------------------------------------------------------


@pytest.mark.parametrize("kept", [False, True])
def test_generate_command(
    llama_file: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kept: bool,
) -> None:
    """``portable-llm generate model.gguf --chat`` runs the chat template of the metadata: on a
    file of float tensors (F16, F32, BF16), and on the file with every quantized type."""
    from portable_llm.cli.cli import main

    if kept:
        _quantized_ops("numpy")
        file, _ = llama_file
    else:
        cfg = family_config("llama")
        floats = {n: ("F16" if k in AFFINE_FORMATS else k) for n, k in layer_types(cfg).items()}
        file = tmp_path / "floats.gguf"
        tok = gguf_tokenizer_meta(tmp_path / "tok")
        write_gguf(file, "llama", cfg, random_weights(cfg, 2), types=floats, tok=tok)
    code = main(["generate", str(file), "--chat", "--prompt", "The keys", "--max-new-tokens", "4"])
    out = capsys.readouterr()
    assert code == 0, out.err
    model = pl.load(file)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "The keys"}])
    want = "".join(pl.generate(model, prompt, max_new_tokens=4))
    assert want and out.out.startswith(want + "\n")


@numpy_only
def test_bench_model_gguf(
    llama_file: tuple[Path, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench --model x.gguf``: the file kept quantized on NumPy, next to a stand-in for
    llama.cpp (the real one never runs in tests), and the decode ratio read off the two rows;
    a peer that is not installed is a note, not a row."""
    import io

    from portable_llm.cli import model_bench

    file, _ = llama_file
    seen = []

    def peer(path: Path, dtype: str) -> tuple[float, Any]:
        seen.append(path)
        return 0.0, lambda ids, n: (0.5, (n - 1) / 4.0)  # 4 tokens/s after the first

    monkeypatch.setattr(model_bench, "GGUF_PEERS", (("llama.cpp", "numpy", peer),))
    out = io.StringIO()
    assert model_bench.run_model_bench(["numpy"], quick=True, folder=file, file=out) == 0
    rows = {line.split()[0]: line.split() for line in out.getvalue().splitlines() if line}
    ours, theirs = rows["portable_llm"], rows["llama.cpp"]
    assert seen == [file] and ours[1:3] == ["numpy", "float32"] and float(theirs[6]) == 4.0
    ratio = f"decode / llama.cpp: numpy float32 {float(ours[6]) / 4.0:.2f}x"
    assert float(ours[6]) > 0 and ratio in out.getvalue()

    monkeypatch.setattr(model_bench, "GGUF_PEERS", (("llama.cpp", "no_such_module_h6", peer),))
    out = io.StringIO()
    assert model_bench.run_model_bench(["numpy"], quick=True, folder=file, file=out) == 0
    assert "llama.cpp skipped: no_such_module_h6 is not installed" in out.getvalue()
    assert "decode / llama.cpp" not in out.getvalue() and seen == [file]
