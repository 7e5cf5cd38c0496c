"""Check `failure`: kill -9 of the FFN node of a 1A1F cluster on the device during a decode under concurrent
streams, and the same command started again. The attention node must pause, form its pair with
the replacement within rejoin_timeout and finish every stream with CPU fp32's tokens, never restarted; the
failure must never hang (NCCL's shutdown() waits on queued work, HCCL's syncs its streams: the node aborts
its pairs instead). Every wait here has a deadline, so a hang is this row's failure, not the run's.

tests/test_rejoin.py does the same on gloo and the fake HCCL in the CPU suite; this is its run on the device."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

from checks_1a1f import api_url, cluster_config
from checks_colocated import cpu_reference
from device_common import Target, say, wait_ready
from device_report import Result
from hf_reference import PROMPTS
from sse import Streams

STREAMS = PROMPTS * 4  # 16 at once: a decode batch, and a kill that lands mid-step
TOKENS = {False: 96, True: 48}  # per stream, by --quick: long enough that the kill lands mid-decode
# Short deadlines, so that the row is quick: the FFN node's death is seen from the control plane within
# heartbeat_timeout; a replacement on a device (context, load, NCCL/HCCL) comes back well within rejoin_timeout.
TIMEOUTS = {"heartbeat_interval": 0.3, "heartbeat_timeout": 3, "comm_timeout": 20, "rejoin_timeout": 90}
PAUSE_SLACK_S = 10  # after heartbeat_timeout: the next heartbeat, and the step in flight failing
FINISH_S = 120  # after re-forming: the rest of every stream
MEASURED = (
    f"{len(STREAMS)} greedy streams on a 1A1F cluster, FFN node killed (SIGKILL) mid-decode and started again: "
    "pause, re-form within rejoin_timeout, tokens vs CPU fp32, no hang"
)


def _wait_health(url: str, code: int, timeout: float) -> float | None:
    """Seconds until /health answers `code`, or None past `timeout`."""
    from cluster_helpers import health

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if health(url) == code:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def judge(
    results: list, ref: list[list[int]], prompts: list[list[int]], hung: int, figures: dict, log_ok: bool
) -> Result:
    name = "FFN node killed mid-decode, 1A1F"
    rejoin = TIMEOUTS["rejoin_timeout"]
    problems = []
    if hung:
        problems.append(f"{hung} stream(s) still open {FINISH_S}s after re-forming: a hang")
    if figures.get("finished_at_kill", 0) >= len(prompts):
        problems.append("every stream had finished before the kill: raise TOKENS, the kill must land mid-decode")
    if figures.get("pause_s") is None:
        problems.append("the attention node never paused (/health 503) for the dead FFN node")
    if figures.get("reform_s") is None:
        problems.append(f"the attention node did not re-form within rejoin_timeout {rejoin}s (/health 200)")
    if not log_ok:
        problems.append(
            "the attention node was restarted, or its log does not say 'forming this rank's pairs again' and "
            "then 'data plane re-formed'"
        )
    errors = [e for r in results if r for e in r[1]]
    if errors:
        problems.append(f"{len(errors)} stream error(s), first: {errors[0][:200]}")
    wrong = [i for i, (r, p) in enumerate(zip(results, prompts)) if r and not r[1] and r[0] != ref[PROMPTS.index(p)]]
    if wrong:
        problems.append(
            f"{len(wrong)} stream(s) differ from CPU fp32 (first: stream {wrong[0]}): a token lost or doubled"
        )
    if problems:
        return Result(name, "fail", "; ".join(problems), figures)
    return Result(
        name,
        "pass",
        f"re-formed in {figures['reform_s']}s (<= rejoin_timeout {rejoin}s); every stream equals CPU fp32",
        figures,
    )


def check_failure(target: Target, ckpt: str, quick: bool) -> Result:
    from cluster_helpers import Cluster

    name = "FFN node killed mid-decode, 1A1F"
    if target.node_devices() is None:
        return Result(name, "skip", target.too_few_devices())
    tokens, rejoin = TOKENS[quick], TIMEOUTS["rejoin_timeout"]
    ref = [ids[:tokens] for ids in cpu_reference(ckpt, tokens)[0]]
    figures: dict = {"streams": len(STREAMS), "tokens_each": tokens, **TIMEOUTS}
    with tempfile.TemporaryDirectory(prefix="afd-device-failure-") as tmp:
        path, doc = cluster_config(Path(tmp), ckpt, target, "device-failure", **TIMEOUTS)
        url = api_url(doc)
        with Cluster(path) as c:
            c.start_all()
            wait_ready(c)
            attn_pid = c.procs["attn0"].pid
            body = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            streams = Streams(url, STREAMS, body, read_timeout=rejoin + FINISH_S)  # a read outlasts the pause
            if not streams.wait_started(60):
                return Result(name, "fail", "the streams had no first chunk within 60s", figures)
            c.procs["ffn0"].send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            figures["finished_at_kill"] = streams.finished()
            c.procs["ffn0"].wait(30)
            pause = _wait_health(url, 503, TIMEOUTS["heartbeat_timeout"] + PAUSE_SLACK_S)
            figures["pause_s"] = None if pause is None else round(time.monotonic() - t_kill, 1)
            c.start("ffn0")  # the node's own command, as a supervisor would run it
            back = _wait_health(url, 200, max(0.0, rejoin - (time.monotonic() - t_kill)))
            figures["reform_s"] = None if back is None else round(time.monotonic() - t_kill, 1)
            hung = streams.join(FINISH_S)
            figures["finish_s"] = round(time.monotonic() - t_kill, 1)
            attn_log = c.log("attn0")
            log_ok = (
                c.procs["attn0"].pid == attn_pid
                and c.procs["attn0"].poll() is None
                and "forming this rank's pairs again" in attn_log
                and "data plane re-formed" in attn_log[attn_log.index("forming this rank's pairs again") :]
            )
            result = judge(streams.results, ref, STREAMS, hung, figures, log_ok)
            if result.status == "fail":
                for node in ("attn0", "ffn0"):
                    say(f"-- {node} log (last lines)\n" + "\n".join(c.log(node).splitlines()[-30:]))
    return result
