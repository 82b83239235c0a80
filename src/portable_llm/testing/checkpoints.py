"""Random checkpoints written with NumPy and ``safetensors`` alone (no torch, no transformers).

:func:`tiny_config` gives an HF ``config.json`` dict for each supported family, and
:func:`write_checkpoint` writes a folder as ``save_pretrained`` would: ``config.json``,
``generation_config.json`` and random weights under HF's tensor names (``model.safetensors``,
or shards with ``model.safetensors.index.json``). :func:`write_tokenizer` adds a byte-level BPE
``tokenizer.json`` trained with the ``tokenizers`` library on a few sentences.
:func:`save_hf_tokenizer` (the one helper that needs transformers) saves that tokenizer with
transformers' own ``save_pretrained``, as the pinned transformers 5 writes real checkpoints
(the chat template in ``chat_template.jinja``). :data:`CHAT_TEMPLATES` holds templates shaped
like real ones. The tests, the model benchmark and users checking their own loaders use them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.backends import numpy_bfloat16

__all__ = [
    "CHAT_TEMPLATES",
    "SENTENCES",
    "checkpoint_tensors",
    "quantized_weights",
    "random_tensors",
    "save_hf_tokenizer",
    "tiny_config",
    "write_checkpoint",
    "write_tokenizer",
]

_BASE: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen2": {"rope_theta": 1e6, "tie_word_embeddings": True},
    "qwen3": {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "llama": {
        "attention_bias": True,
        "mlp_bias": True,
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "mistral": {"sliding_window": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "norm_topk_prob": False,
        "use_sliding_window": True,
        "sliding_window": 3,
        "max_window_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}

#: The sentences :func:`write_tokenizer` trains on.
SENTENCES = (
    "RMSNorm divides each vector by its root mean square.",
    "Rotary embeddings turn queries and keys by an angle that grows with the position.",
    "Grouped-query attention shares each key and value head among several query heads.",
    "A mixture of experts sends every token to the few experts its router ranks highest.",
    "The cache keeps the keys and values of the tokens seen so far. Ünïcödé: 注意力 ✓",
)


def tiny_config(model_type: str, /, **overrides: Any) -> dict[str, Any]:
    """A small ``config.json`` dict of ``model_type`` (2 layers, E=32, H=4, H_kv=2, V=300)."""
    if model_type not in _FAMILY:
        raise ValueError(f"tiny_config: unknown model_type {model_type!r}; known: {list(_FAMILY)}")
    arch = {"qwen2_moe": "Qwen2Moe", "qwen2": "Qwen2", "qwen3": "Qwen3"}.get(
        model_type, model_type.capitalize()
    )
    return {
        "model_type": model_type,
        "architectures": [f"{arch}ForCausalLM"],
        **_BASE,
        **json.loads(json.dumps(_FAMILY[model_type])),
        **overrides,
    }


def checkpoint_tensors(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a config, experts in the per-expert (``save_pretrained``)
    layout. Written from HF's modeling files, independently of :mod:`portable_llm.models`."""
    mt = cfg["model_type"]
    E, V, H = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    H_kv = cfg.get("num_key_value_heads") or H
    D = cfg.get("head_dim") or E // H
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, E)}
    qkv_bias = mt == "qwen2" or (mt == "qwen2_moe" and cfg.get("qkv_bias", True))
    qkv_bias = qkv_bias or (mt in ("llama", "qwen3") and cfg.get("attention_bias", False))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (E,)
        for n, rows in (("q", H * D), ("k", H_kv * D), ("v", H_kv * D)):
            out[f"{p}self_attn.{n}_proj.weight"] = (rows, E)
            if qkv_bias:
                out[f"{p}self_attn.{n}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (E, H * D)
        if mt in ("llama", "qwen3") and cfg.get("attention_bias", False):
            out[p + "self_attn.o_proj.bias"] = (E,)
        if mt == "qwen3":
            out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (D,)
        if mt == "mixtral":
            X, I = cfg["num_local_experts"], cfg["intermediate_size"]  # noqa: E741
            out[p + "block_sparse_moe.gate.weight"] = (X, E)
            for e in range(X):
                q = f"{p}block_sparse_moe.experts.{e}."
                out[q + "w1.weight"] = out[q + "w3.weight"] = (I, E)
                out[q + "w2.weight"] = (E, I)
        elif (
            mt == "qwen2_moe"
            and i not in cfg.get("mlp_only_layers", [])
            and ((i + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        ):
            X, I = cfg["num_experts"], cfg["moe_intermediate_size"]  # noqa: E741
            out[p + "mlp.gate.weight"] = (X, E)
            for e in range(X):
                _mlp(out, f"{p}mlp.experts.{e}.", E, I, False)
            _mlp(out, p + "mlp.shared_expert.", E, cfg["shared_expert_intermediate_size"], False)
            out[p + "mlp.shared_expert_gate.weight"] = (1, E)
        else:
            _mlp(out, p + "mlp.", E, cfg["intermediate_size"], cfg.get("mlp_bias", False))
    out["model.norm.weight"] = (E,)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (V, E)
    return out


def _mlp(out: dict[str, tuple[int, ...]], p: str, E: int, I: int, bias: bool) -> None:  # noqa: E741
    for n, shape in (("gate", (I, E)), ("up", (I, E)), ("down", (E, I))):
        out[f"{p}{n}_proj.weight"] = shape
        if bias:
            out[f"{p}{n}_proj.bias"] = shape[:1]


def random_tensors(
    cfg: dict[str, Any], *, seed: int = 0, dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """Random weights for :func:`checkpoint_tensors`: norms in ``[0.8, 1.2]``, biases in
    ``[-0.2, 0.2]``, matrices ``U(+-2/sqrt(fan_in))``, so that the logits spread over a few
    units and greedy decoding has clear winners."""
    rng = np.random.default_rng(seed)
    np_dtype = numpy_bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    out = {}
    for name, shape in checkpoint_tensors(cfg).items():
        if name.endswith("norm.weight"):
            a = rng.uniform(0.8, 1.2, size=shape)
        elif len(shape) == 1:  # biases
            a = rng.uniform(-0.2, 0.2, size=shape)
        else:
            bound = 2.0 / np.sqrt(shape[-1])
            a = rng.uniform(-bound, bound, size=shape)
        out[name] = a.astype(np_dtype)
    return out


def write_checkpoint(
    path: str | Path,
    cfg: dict[str, Any],
    /,
    *,
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 1,
    tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write ``config.json``, ``generation_config.json`` and random weights into ``path``.

    ``shards > 1`` splits the tensors over that many files with ``model.safetensors.index.json``.
    ``tensors`` replaces the random weights (to write a broken checkpoint). Returns the tensors
    written.
    """
    from safetensors.numpy import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = random_tensors(cfg, seed=seed, dtype=dtype)
    (folder / "config.json").write_text(json.dumps({**cfg, "dtype": dtype}, indent=2))
    generation = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return tensors
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return tensors


def quantized_weights(
    path: str | Path, /, *, backend: str, dtype: str = "float32", bits: int = 4,
    group_size: int = 32,
) -> dict[str, Any]:  # fmt: skip
    """The one-file checkpoint at ``path`` as a weight dict for :class:`~portable_llm.Model`:
    its projections (``*_proj.weight``), embedding and LM head quantized with
    :func:`~portable_llm.quantize` (MLX's affine format), the other weights as ``backend``
    arrays of ``dtype``."""
    from safetensors.numpy import load_file

    from portable_llm.core.arrays import asarray
    from portable_llm.ops.quant import quantize

    weights: dict[str, Any] = {}
    for name, w in load_file(str(Path(path) / "model.safetensors")).items():
        w = asarray(w.astype(np.float32), backend=backend, dtype=dtype)
        quantized = name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
        weights[name] = quantize(w, bits=bits, group_size=group_size) if quantized else w
    return weights


def write_tokenizer(path: str | Path, /, *, vocab_size: int, eos: str = "<|endoftext|>") -> Any:
    """Train a byte-level BPE of at most ``vocab_size`` ids on :data:`SENTENCES`; save it as
    ``tokenizer.json`` (with a ``tokenizer_config.json`` naming the EOS token) in ``path``.

    The EOS token gets id 2 when ``vocab_size`` allows (the :func:`tiny_config` ``eos_token_id``).
    Returns the ``tokenizers.Tokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok


#: Chat templates written like real checkpoints' (ChatML with tools as Qwen2.5's; Llama 3.1's
#: header tokens, ``namespace``, ``raise_exception`` and ``tojson(indent=4)``; a loop-control
#: one with ``{% generation %}`` blocks), using the special tokens :func:`write_tokenizer` has.
CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{%- if tools %}\n"
        "{{- '<s>system\\n' }}\n"
        "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
        "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}\n"
        "{{- '\\n\\n# Tools\\n<tools>' }}\n"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}\n"
        "{{- '\\n</tools><|endoftext|>\\n' }}\n"
        "{%- else %}\n"
        "{%- if messages[0]['role'] == 'system' %}\n"
        "{{- '<s>system\\n' + messages[0]['content'] + '<|endoftext|>\\n' }}\n"
        "{%- else %}\n"
        "{{- '<s>system\\nYou are a helpful assistant.<|endoftext|>\\n' }}\n"
        "{%- endif %}\n"
        "{%- endif %}\n"
        "{%- for message in messages %}\n"
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
        "or (message.role == 'assistant' and not message.tool_calls) %}\n"
        "{{- '<s>' + message.role + '\\n' + message.content + '<|endoftext|>' + '\\n' }}\n"
        "{%- elif message.role == 'assistant' %}\n"
        "{{- '<s>' + message.role }}\n"
        "{%- for tool_call in message.tool_calls %}\n"
        "{{- '\\n<tool_call>\\n' }}{{- tool_call | tojson }}{{- '\\n</tool_call>' }}\n"
        "{%- endfor %}\n"
        "{{- '<|endoftext|>\\n' }}\n"
        "{%- endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "{{- '<s>assistant\\n' }}\n"
        "{%- endif %}\n"
    ),
    "llama3": (
        "{{- bos_token }}\n"
        "{%- if messages[0]['role'] == 'system' %}\n"
        "    {%- set system_message = messages[0]['content']|trim %}\n"
        "    {%- set messages = messages[1:] %}\n"
        "{%- else %}\n"
        "    {%- set system_message = '' %}\n"
        "{%- endif %}\n"
        "{%- set ns = namespace(turns=0) %}\n"
        "{{- '<pad>system<pad>\\n\\n' }}\n"
        "{%- if tools is not none %}\n"
        "    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}\n"
        "{%- endif %}\n"
        "{{- system_message }}\n"
        "{{- '<|endoftext|>' }}\n"
        "{%- for message in messages %}\n"
        "    {%- if (message['role'] == 'user') != (ns.turns % 2 == 0) %}\n"
        "        {{- raise_exception('Conversation roles must alternate user/assistant') }}\n"
        "    {%- endif %}\n"
        "    {%- set ns.turns = ns.turns + 1 %}\n"
        "    {{- '<pad>' + message['role'] + '<pad>\\n\\n' + message['content'] | trim "
        "+ '<|endoftext|>' }}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<pad>assistant<pad>\\n\\n' }}\n"
        "{%- endif %}\n"
    ),
    "loops": (
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 8 %}{% break %}{% endif %}"
        "{{ loop.index }}/{{ loop.length }} {{ message['role'] | upper }}: "
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
        "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}{{ eos_token }}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
    ),
}


def save_hf_tokenizer(
    path: str | Path,
    /,
    *,
    vocab_size: int,
    chat_template: str | None = CHAT_TEMPLATES["chatml"],
    eos: str = "<|endoftext|>",
) -> Any:
    """Save :func:`write_tokenizer`'s tokenizer into ``path`` with transformers'
    ``save_pretrained``, as the pinned transformers (5.x) saves a real checkpoint's: a
    ``tokenizers``-backed tokenizer (built offline, nothing downloads), with ``chat_template``
    written to ``chat_template.jinja`` and none in ``tokenizer_config.json``.

    Returns the transformers tokenizer (its ``apply_chat_template`` is the oracle).
    """
    import tempfile

    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as scratch:
        tok = write_tokenizer(scratch, vocab_size=vocab_size, eos=eos)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token=eos, pad_token="<pad>"
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(path))
    return hf
