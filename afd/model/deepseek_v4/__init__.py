"""DeepSeek-V4 (`model_type: deepseek_v4`): mHC streams, sliding-window + CSA / HCA compressed attention, hash MoE."""
