"""Qwen3-MoE (`model_type: qwen3_moe`): GQA attention with per-head q/k norms, softmax top-k MoE."""
