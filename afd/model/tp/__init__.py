"""Attention-side tensor parallelism: the group and its collectives (comm), the layers cut across ranks
(layers, shard) and the bytes each mode moves (volume); its layout and modes are configuration
(afd/config/tp.py)."""
