"""Host syncs as the device runtime sees them, independently of afd's own counter (host_syncs.py), which sees
only the reads afd marks: an implicit sync (a `.item()` nobody counted, a copy that blocks) shows here.

With AFD_SYNC_WATCH=PREFIX set, a node's CUDA or NPU backend turns its runtime's sync debug mode to "warn"
(`torch.cuda.set_sync_debug_mode`, torch_npu's `torch.npu.set_sync_debug_mode`): each synchronizing operation
then raises the warning "called a synchronizing CUDA operation" (NPU: "... NPU operation"). This catches
each one, counts it by the line of afd's code that caused it, and rewrites `PREFIX.PID.json` after every one:
the count, the count per site, the first ten sites in the order they first synced, and the process's arguments
(`--node NAME`). `make test-device`'s
`syncs` check reads it (tests/device/checks_host_syncs.py). A debugging aid: each sync costs a Python stack walk.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Callable

ENV = "AFD_SYNC_WATCH"
MESSAGE = re.compile(r"called a synchronizing (CUDA|NPU) operation")
FIRST = 10
_PACKAGES = ("/afd/", "/attention_node/", "/ffn_node/")
_HELPERS = ("backend/sync_watch.py", "backend/host_syncs.py")


class SyncWatch:
    def __init__(self, path: str):
        self.path = path
        self.count = 0
        self.sites: dict[str, int] = {}
        self._lock = threading.Lock()
        self._shown = warnings.showwarning

    def install(self, set_mode: Callable[[str], None]) -> None:
        warnings.filterwarnings("always", message=MESSAGE.pattern)  # every sync, not once per line
        warnings.showwarning = self._show
        set_mode("warn")
        self._write()

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if not MESSAGE.search(str(message)):
            return self._shown(message, category, filename, lineno, file, line)
        site = _site(f"{filename}:{lineno}")
        with self._lock:
            self.count += 1
            self.sites[site] = self.sites.get(site, 0) + 1
            self._write()

    def _write(self) -> None:
        doc = {"count": self.count, "sites": self.sites, "first": list(self.sites)[:FIRST], "argv": sys.argv[1:]}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, self.path)


def _site(fallback: str) -> str:
    """`function at package/file.py:line` of the innermost frame of afd's code, else where the warning points.
    This module and afd's counter (host_syncs.py's to_list, to_int) are passed over: their caller is the site."""
    for frame in reversed(traceback.extract_stack(limit=60)):
        if frame.filename.endswith(_HELPERS) or not any(p in frame.filename for p in _PACKAGES):
            continue
        return f"{frame.name} at {'/'.join(frame.filename.rsplit('/', 2)[-2:])}:{frame.lineno}"
    return fallback


_watch: SyncWatch | None = None


def from_env(set_mode: Callable[[str], None]) -> SyncWatch | None:
    """The process's watch, installed with the runtime's `set_sync_debug_mode` by the first backend built when
    AFD_SYNC_WATCH is set; None when it is not."""
    global _watch
    prefix = os.environ.get(ENV)
    if prefix and _watch is None:
        _watch = SyncWatch(f"{prefix}.{os.getpid()}.json")
        _watch.install(set_mode)
    return _watch
