"""Receive buffers of the exchange, reused across layers and steps."""

from __future__ import annotations

import torch


class BufferPool:
    """Receive buffers reused across layers and steps: views into per-key tensors that only grow."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self._bufs: dict[object, torch.Tensor] = {}

    def get(self, key, rows: int, cols: int) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols:
            buf = self._bufs[key] = torch.empty(max(rows, 1), cols, device=self.device, dtype=self.dtype)
        return buf[:rows]

    def retire(self, key) -> torch.Tensor:
        """Takes `key`'s buffer out of the pool (the next get makes a new one) and returns it: a receive into
        it may still be queued after its pair was aborted."""
        return self._bufs.pop(key)
