"""The launcher (afd.cluster.processes) on stand-in processes: a death is named with its log tail, waits
have deadlines, and stop goes attention first, then FFN, killing what ignores SIGTERM."""

from __future__ import annotations

import sys
import time

import pytest

from afd.cluster.processes import ClusterError, Command, NodeExited, NodeProcesses

# on SIGTERM: append its name to the file (or ignore the signal), then exit
STAND_IN = """
import signal, sys, time
name, out, ignore = sys.argv[1], sys.argv[2], sys.argv[3] == "ignore"
def bye(*_):
    with open(out, "a") as fh:
        fh.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else bye)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def stand_in(name: str, stage: str, out, ignore: bool = False) -> Command:
    return Command(name, (sys.executable, "-c", STAND_IN, name, str(out), "ignore" if ignore else "exit"), stage)


def test_a_process_that_dies_is_named_with_its_log_tail(tmp_path):
    with NodeProcesses(str(tmp_path)) as procs:
        procs.start(Command("attn0", (sys.executable, "-c", "print('no model here'); raise SystemExit(3)")))
        with pytest.raises(NodeExited, match=r"node attn0 exited with code 3; its log ends:\nno model here"):
            procs.wait_until(lambda: False, 30, "nothing")


def test_every_wait_has_a_deadline(tmp_path):
    with NodeProcesses(str(tmp_path)) as procs:
        procs.start(stand_in("ffn0", "ffn", tmp_path / "order"))
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match="timed out after 1s waiting for godot"):
            procs.wait_until(lambda: False, 1, "godot")
        assert time.monotonic() - t0 < 5


def test_stop_goes_attention_first_then_ffn_and_kills_what_ignores_sigterm(tmp_path):
    out = tmp_path / "order"
    procs = NodeProcesses(str(tmp_path))
    procs.start_all(  # started FFN first: the order of stopping is the stages', not the start's
        [
            stand_in("ffn0", "ffn", out),
            stand_in("attn0.tp1", "tp", out),
            stand_in("attn0", "attention", out),
            stand_in("attn1", "attention", out, ignore=True),
        ]
    )
    procs.wait_until(lambda: all("ready" in procs.log(n) for n in procs.procs), 30, "the stand-ins")
    t0 = time.monotonic()
    killed = procs.stop(grace=1.0)
    assert killed == ["attn1"] and time.monotonic() - t0 >= 1.0
    assert out.read_text().split() == ["attn0", "attn0.tp1", "ffn0"]
    assert all(p.popen.poll() is not None for p in procs.procs.values())
