"""A random-init gpt-oss of 88.5 M parameters for ``benchmarks/torch_decode.py`` (no gpt-oss
checkpoint is on this machine): E=512, 8 layers alternating sliding (128) and full attention,
8 heads over 2 KV heads of 64 features with sinks and biases, YaRN (factor 4 over 1024), 8
experts of width 512, top-2, biased, the clamped SwiGLU, V=32000, untied head.

    python benchmarks/gpt_oss_random.py FOLDER
    python benchmarks/torch_decode.py --model FOLDER --new 16 --passes 2
"""

import sys

import torch
import transformers

cfg = transformers.GptOssConfig(
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    sliding_window=128,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "rope_theta": 150000.0,
        "original_max_position_embeddings": 1024,
    },
)
torch.manual_seed(0)
m = transformers.GptOssForCausalLM(cfg).eval()
with torch.no_grad():
    for n, p in m.named_parameters():
        if n.endswith("bias"):
            p.copy_(torch.randn_like(p) * 0.1)
        elif p.ndim == 1:
            p.copy_(torch.rand_like(p) * 0.4 + 0.8)
        else:
            p.copy_(torch.randn_like(p) * 0.05)
print(sum(p.numel() for p in m.parameters()) / 1e6, "M")
m.save_pretrained(sys.argv[1])
