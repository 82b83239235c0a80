"""A float64 NumPy forward pass of a checkpoint: the reference the model tests compare against.

It reads the HF ``config.json`` dict and the tensors by their HF names itself, and composes the
textbook formulas of :mod:`portable_llm.testing.reference`
(no dispatch, no dtype rules, no code shared
with :mod:`portable_llm.models`): a bias is used when its tensor exists, a layer is a mixture of
experts when its router exists, a layer's window comes from the config the way HF's modeling
files read it. One sequence at a time, every position.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.testing import reference as ref

__all__ = ["decoder_logits"]


def _windows(cfg: dict[str, Any]) -> list[int | None]:
    n, mt, w = cfg["num_hidden_layers"], cfg["model_type"], cfg.get("sliding_window")
    if mt in ("mistral", "mixtral"):
        return [w] * n
    if mt == "llama" or not cfg.get("use_sliding_window", False):
        return [None] * n
    kinds = cfg["layer_types"]  # the tests always write layer_types for windowed Qwen configs
    return [w if kind == "sliding_attention" else None for kind in kinds]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    default = 1e6 if cfg["model_type"] == "mixtral" else 1e4  # HF's default_theta
    base = (scaling or {}).get("rope_theta", cfg.get("rope_theta", default))
    return float(base), scaling


def _experts(t: dict[str, np.ndarray], p: str, X: int) -> tuple[np.ndarray, ...]:
    """Router and stacked experts ``(X, I, E)``, ``(X, I, E)``, ``(X, E, I)`` of layer prefix p."""
    if p + "block_sparse_moe.gate.weight" in t:  # Mixtral: w1 gate, w3 up, w2 down
        q = p + "block_sparse_moe."
        names = ("w1", "w3", "w2")
        stacks = [np.stack([t[f"{q}experts.{e}.{n}.weight"] for e in range(X)]) for n in names]
        return (t[q + "gate.weight"], *stacks)
    q = p + "mlp."
    names = ("gate_proj", "up_proj", "down_proj")
    stacks = [np.stack([t[f"{q}experts.{e}.{n}.weight"] for e in range(X)]) for n in names]
    return (t[q + "gate.weight"], *stacks)


def decoder_logits(ids: Any, tensors: dict[str, np.ndarray], cfg: dict[str, Any]) -> np.ndarray:
    """Logits ``(L, V)`` in float64 of the token ids ``(L,)`` at positions ``0 .. L - 1``."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    E, H = cfg["hidden_size"], cfg["num_attention_heads"]
    H_kv = cfg.get("num_key_value_heads") or H
    D = cfg.get("head_dim") or E // H
    eps = cfg["rms_norm_eps"]
    act = {"swish": "silu"}.get(cfg.get("hidden_act", "silu"), cfg.get("hidden_act", "silu"))
    base, scaling = _rope(cfg)
    mpe = cfg.get("max_position_embeddings")
    ids = np.asarray(ids)
    L = ids.shape[0]
    positions = np.arange(L)
    h = ref.embedding(ids, t["model.embed_tokens.weight"])  # (L, E)
    for i, window in enumerate(_windows(cfg)):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        x = ref.rms_norm(h, t[p + "input_layernorm.weight"], eps)
        heads = []
        for n, count in (("q", H), ("k", H_kv), ("v", H_kv)):
            y = ref.linear(x, t[f"{a}{n}_proj.weight"], t.get(f"{a}{n}_proj.bias"))
            y = y.reshape(L, count, D).transpose(1, 0, 2)  # (heads, L, D)
            if n != "v" and f"{a}{n}_norm.weight" in t:
                y = ref.rms_norm(y, t[f"{a}{n}_norm.weight"], eps)
            if n != "v":
                y = ref.rope(y, positions, base, scaling=scaling, max_position_embeddings=mpe)
            heads.append(y)
        q, k, v = heads
        o = ref.scaled_dot_product_attention(q, k, v, mask="causal", window=window)  # (H, L, D)
        o = o.transpose(1, 0, 2).reshape(L, H * D)
        h = h + ref.linear(o, t[a + "o_proj.weight"], t.get(a + "o_proj.bias"))
        x = ref.rms_norm(h, t[p + "post_attention_layernorm.weight"], eps)
        moe = p + "mlp.gate.weight" in t or p + "block_sparse_moe.gate.weight" in t
        if moe:
            X = cfg.get("num_local_experts") or cfg["num_experts"]
            norm = cfg["model_type"] == "mixtral" or cfg.get("norm_topk_prob", False)
            s = p + "mlp.shared_expert."
            shared = None
            if s + "gate_proj.weight" in t:
                shared = tuple(t[f"{s}{n}_proj.weight"] for n in ("gate", "up", "down"))
            y = ref.moe(
                x, *_experts(t, p, X), top_k=cfg["num_experts_per_tok"], norm_topk_prob=norm,
                shared=shared, shared_gate=t.get(p + "mlp.shared_expert_gate.weight"), act=act,
            )  # fmt: skip
        else:
            m = p + "mlp."
            y = ref.linear(
                ref.ACTIVATIONS[act](
                    ref.linear(x, t[m + "gate_proj.weight"], t.get(m + "gate_proj.bias"))
                )
                * ref.linear(x, t[m + "up_proj.weight"], t.get(m + "up_proj.bias")),
                t[m + "down_proj.weight"],
                t.get(m + "down_proj.bias"),
            )
        h = h + y
    h = ref.rms_norm(h, t["model.norm.weight"], eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return ref.linear(h, head)  # (L, V)
