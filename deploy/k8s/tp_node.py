"""The G TP ranks of one attention node, run as one unit in one container (README.md, "Attention TP").

    python3 tp_node.py G afd-attention --config FILE --node NODE --bind-host 0.0.0.0

starts the command G times: rank 0 as it is (it serves the API, the probes and the control port), rank
R > 0 with `--tp-rank R` appended. The container holds the node's G devices, numbered 0..G-1 inside it,
so rank R finds its device (the node's `npu:0` + R) there. What `afd launch` does for a whole host, this
does for one node:

- SIGTERM/SIGINT (the kubelet signals only this process, PID 1) go to every rank at once: rank 0 drains
  and leaves, the others follow it out (attention_node/tp_rank.py);
- a rank that exits on its own takes the others down (SIGTERM, SIGKILL after KILL_AFTER s), and the
  script exits non-zero, so the kubelet restarts the container: every rank of the node together, as
  its data-plane ranks must be formed together.

Standard library only: it runs under any python3 of the image, from the ConfigMap render.py makes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

KILL_AFTER = 120.0
"""Seconds the other ranks get to stop after one exits on its own: > engine.shutdown_timeout + 10 (how long
a rank > 0 waits for rank 0 to leave) in configmap.yaml. After the kubelet's SIGTERM its grace period rules."""


def rank_command(command: list[str], rank: int) -> list[str]:
    return command + (["--tp-rank", str(rank)] if rank else [])


def exit_code(codes: list[int]) -> int:
    """The first failure (a signal -S as 128 + S, as a shell reports it), else 0."""
    code = next((c for c in codes if c), 0)
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: tp_node.py G COMMAND [ARG...]", file=sys.stderr)
        return 2
    ranks, command = int(argv[0]), argv[1:]
    procs: list[subprocess.Popen] = []
    stopping: list[int] = []

    def stop_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def on_signal(signum, _frame) -> None:
        stopping.append(signum)
        stop_all()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    for r in range(ranks):
        if not stopping:
            procs.append(subprocess.Popen(rank_command(command, r)))
    if stopping:  # a signal between a Popen and its append missed that rank
        stop_all()
    while not stopping and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    first = next((r for r, p in enumerate(procs) if p.returncode is not None), None)
    deadline = None
    if not stopping:
        code = procs[first].returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        print(f"tp_node: TP rank {first} {how}; stopping the node's other ranks", file=sys.stderr, flush=True)
        stop_all()
        deadline = time.monotonic() + KILL_AFTER
    for r, p in enumerate(procs):
        try:
            p.wait(None if deadline is None else max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"tp_node: TP rank {r} did not stop in {KILL_AFTER:.0f}s; killing it", file=sys.stderr, flush=True)
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    # a rank leaving on its own is never a healthy end: non-zero even if it said 0, so the node restarts
    return exit_code(codes) if stopping else exit_code([codes[first], *codes]) or 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
