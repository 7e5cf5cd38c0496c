"""A Hugging Face cache laid out as huggingface_hub lays it out (models--ORG--NAME/ with blobs/, snapshots/<commit>/
links into blobs, refs/<branch> naming the commit), so that hub names resolve offline in tests."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def lay_out(cache: Path, repo_id: str, checkpoint: str | Path, ref: str = "main") -> Path:
    """Copies `checkpoint`'s files into `cache` as the snapshot of `repo_id` at branch/tag `ref`; returns the
    snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(Path(checkpoint).iterdir()):
        if not f.is_file():
            continue
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snap / f.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snap), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap
