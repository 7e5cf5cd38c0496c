"""DeepSeek-V3 (`model_type: deepseek_v3`): MLA, dense-first layers, shared + grouped-routed experts."""
