"""The FFN node: a stateless server that runs the MoE half of every layer for its attention peers."""
