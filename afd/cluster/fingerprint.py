"""A model fingerprint every node computes alike, so the coordinator can refuse a node that would
serve a different model: the config, the dtype, and the checkpoint files' names and sizes (or the
dummy-weights seed). Cheap: no tensor is read."""

from __future__ import annotations

import hashlib
import json
import os


def model_fingerprint(path: str, dtype: str, dummy_weights: bool, seed: int) -> str:
    h = hashlib.sha256()
    with open(os.path.join(path, "config.json")) as f:
        h.update(json.dumps(json.load(f), sort_keys=True).encode())
    h.update(f"dtype={dtype}".encode())
    if dummy_weights:
        h.update(f"dummy-weights seed={seed}".encode())
    else:
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors") or name == "model.safetensors.index.json":
                h.update(f"{name}:{os.path.getsize(os.path.join(path, name))}".encode())
    return h.hexdigest()
