"""What a node could observe of how it was started: tests/test_forkserver.py runs it forked from the fork server
and as a plain process, and compares."""

import json
import os
import signal
import sys
import threading
import time


def _late() -> None:
    time.sleep(0.2)
    print("non-daemon thread joined at exit", flush=True)


def _facts() -> dict:
    main = sys.modules["__main__"]
    return {
        "argv": sys.argv,
        "name": __name__,
        "file": __file__,
        "main_is_this": main.__dict__ is globals(),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "env": os.environ.get("AFD_PROBE"),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "leader": os.getsid(0) == os.getpid(),
        "stdin": os.path.realpath("/proc/self/fd/0"),
        "sigint": str(signal.getsignal(signal.SIGINT)),
        "sigterm": str(signal.getsignal(signal.SIGTERM)),
        "sigchld": str(signal.getsignal(signal.SIGCHLD)),
        "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").decode().split("\0"),
        # what ps e and an operator's cat /proc/PID/environ show: the process's environment as it started
        "proc_environ": sorted(e for e in open("/proc/self/environ", "rb").read().decode().split("\0") if e)
        == sorted(f"{k}={v}" for k, v in os.environ.items()),
    }


mode = sys.argv[1]
if mode == "facts":
    threading.Thread(target=_late).start()
    print(json.dumps(_facts()), flush=True)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "raise":
    raise RuntimeError("probe failed on purpose")
elif mode == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
