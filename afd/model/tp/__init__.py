"""Attention-side tensor parallelism: the layout (config), the group and its collectives (comm), the
layers cut across ranks (layers, shard) and the bytes each mode moves (volume)."""
