"""Attention <-> FFN exchange of hidden states: transport, step protocol, the MoE exchange, overlap, prefetch."""
