"""Hugging Face hub names as checkpoints (`afd serve Qwen/Qwen3-30B-A3B`), as vLLM takes them: the local
cache first, then a download where the network allows it; HF_HUB_OFFLINE=1 forbids the download.

The files fetched are the ones afd reads (config, safetensors weights and their index, tokenizer files,
chat templates): a repository's other formats (.bin, .gguf, ONNX) are never downloaded."""

from __future__ import annotations

import logging
import os
import re

from afd.model.config import ConfigError

log = logging.getLogger("afd.model")

FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
"""What afd reads of a checkpoint: config.json, weights (+ index), tokenizer and its chat template."""
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""A hub repo id: `name` or `org/name`. Paths that start with `.`, `/` or `~` are local and never looked up."""


def is_hub_name(path: str) -> bool:
    return bool(_NAME.match(path)) and ".." not in path


def checkpoint_dir(
    path: str, revision: str | None = None, download_dir: str | None = None, download: bool = True
) -> str:
    """The local directory of `path`: itself if it is a directory, else the snapshot of hub repo `path`
    (download False: only a cached one). Raises ConfigError naming the name and what was tried."""
    if os.path.isdir(path) or not is_hub_name(path):
        return path  # a directory, or a path that is not one: read_config_json names what is wrong
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
    except ImportError:
        raise ConfigError(f"{path}: not a directory here, and huggingface_hub is not installed to look it up") from None
    cache = download_dir or constants.HF_HUB_CACHE
    where = f"{path}{'@' + revision if revision else ''}"
    try:
        return snapshot_download(
            path, revision=revision, cache_dir=download_dir, allow_patterns=FILES, local_files_only=True
        )
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE or not download:
        why = "HF_HUB_OFFLINE is set, so nothing is downloaded" if download else "nothing is downloaded here"
        raise ConfigError(f"{where}: not a directory here and not in the Hugging Face cache ({cache}); {why}") from None
    log.info("%s: not in the Hugging Face cache (%s): downloading %s", where, cache, ", ".join(FILES))
    try:
        return snapshot_download(path, revision=revision, cache_dir=download_dir, allow_patterns=FILES)
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{where}: not a directory here, not in the Hugging Face cache ({cache}), and the download failed: {first}"
        ) from None
