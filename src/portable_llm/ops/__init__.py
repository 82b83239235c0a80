"""The ops: activations, norms, linear/MLP, embedding, MoE, sampling, quantization, kernel sets."""
