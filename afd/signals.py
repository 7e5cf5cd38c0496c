"""SIGTERM/SIGINT handling that works while the main thread is blocked inside a C++ wait.

Python runs signal handlers only between bytecodes, so a process blocked in a data-plane wait would not
notice SIGTERM until the wait timed out. Instead the signals are blocked in every thread and a watcher
thread takes them with sigwait, runs the given callback, and exits the process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("afd")

_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def exit_on_signal(on_signal: Callable[[int], None] | None = None, code: int = 0) -> None:
    """Call before any other thread starts (threads inherit the blocked mask)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)

    def watch() -> None:
        signum = signal.sigwait(_SIGNALS)
        log.info("received %s, exiting", signal.Signals(signum).name)
        if on_signal is not None:
            try:
                on_signal(signum)
            except Exception as e:
                log.warning("while stopping: %s", e)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=watch, name="afd-signal-watch", daemon=True).start()
