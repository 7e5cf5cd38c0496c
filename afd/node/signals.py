"""SIGTERM/SIGINT handling that works while the main thread is blocked inside a C++ wait.

Python runs signal handlers only between bytecodes, so a process blocked in a data-plane wait would not
notice SIGTERM until the wait timed out. Instead the signals are blocked in every thread and a watcher
thread takes them with sigwait, runs the stop handler, and exits the process. `exit_on_signal` must run
before anything starts a thread (torch and grpc do at import): threads inherit the blocked mask. It also
makes SIGUSR1 dump every thread's stack.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("afd")

_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_handler: list[Callable[[int], None]] = []
_exit_code: list[int] = []


def set_stop_handler(fn: Callable[[int], None]) -> None:
    """What to do (drain, leave the data plane) between the signal and the exit."""
    _handler[:] = [fn]


def exit_with(code: int) -> None:
    """Stops this process as SIGTERM would (the stop handler, then the exit), but with exit code `code`: what a
    node that can no longer serve does, so that its supervisor starts it again (afd.cluster.supervise restarts
    a process that exits non-zero)."""
    _exit_code[:] = [code]
    os.kill(os.getpid(), signal.SIGTERM)


def exit_on_signal(code: int = 0) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    # `kill -USR1 PID` writes every thread's Python stack to the node's stderr, also while it is blocked
    # inside a C++ wait: what a stuck node is doing, without a debugger
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def watch() -> None:
        signum = signal.sigwait(_SIGNALS)
        log.info("received %s, exiting", signal.Signals(signum).name)
        for fn in _handler:
            try:
                fn(signum)
            except Exception as e:
                log.warning("while stopping: %s", e)
        logging.shutdown()
        os._exit(_exit_code[0] if _exit_code else code)

    threading.Thread(target=watch, name="afd-signal-watch", daemon=True).start()
