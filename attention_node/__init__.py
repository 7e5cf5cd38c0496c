"""The attention node: HTTP API, scheduler and the attention side of every layer."""
