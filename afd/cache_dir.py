"""afd's cache folder on this host: $AFD_CACHE_DIR, else $XDG_CACHE_HOME/afd (~/.cache/afd). The demo
checkpoint, `afd profile`'s hardware spec and the kernel cache live under it. Imports nothing but os: `afd serve
demo` finds its checkpoint before torch is imported."""

from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("AFD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "afd"
    )
