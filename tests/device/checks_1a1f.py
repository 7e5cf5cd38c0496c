"""Check `1a1f`: with two devices or more, `afd launch` of one attention node (device 0) and one FFN node
(device 1) over NCCL / HCCL, greedy requests through the OpenAI API vs CPU fp32 tokens. Also the 1A1F
cluster YAML the other cluster checks start from."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from checks_colocated import cpu_reference
from device_common import CLUSTER_READY_TIMEOUT, ROOT, Target, say
from device_env import dtype_supported
from device_report import Result
from hf_reference import PROMPTS

API_TOKENS = 16  # greedy tokens per request in the 1A1F check
MEASURED = f"tokens of {len(PROMPTS)} concurrent greedy API requests on a 1A1F cluster vs CPU fp32"


class Launched:
    """`afd launch FILE` as a user runs it, in its own session; stop() sends SIGTERM, as Ctrl-C would."""

    def __init__(self, config: Path, log: Path):
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "afd", "launch", str(config)],
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, url: str, timeout: float) -> None:
        from cluster_helpers import health

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"afd launch exited with {self.proc.returncode} before the API was ready")
            if health(url) == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the cluster was not ready within {timeout:.0f}s")

    def stop(self) -> None:
        from afd.cluster.processes import descendants

        if self.proc.poll() is not None:
            return
        nodes = descendants(self.proc.pid)  # the launcher starts each node in a session of its own
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *nodes]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def cluster_config(tmp: Path, ckpt: str, target: Target, name: str, **cluster) -> tuple[Path, dict]:
    """The YAML of a 1A1F cluster on free local ports, attention on device 0 and FFN on device 1 (both on
    device 0 of a one-GPU machine, cluster.share_devices; cpu for the dry run), with `cluster` over the generous
    defaults; and the YAML as a dict."""
    import yaml
    from cluster_helpers import cluster_yaml

    # generous timeouts: a device node creates its context, loads, and forms NCCL/HCCL before it answers
    timeouts = {"startup_timeout": 180, "heartbeat_timeout": 30, "comm_timeout": 120}
    shared = {"share_devices": True} if target.shared else {}
    path = cluster_yaml(tmp, ckpt, name=name, cluster={**timeouts, **shared, **cluster})
    doc = yaml.safe_load(path.read_text())
    devices = dict(zip(("attention", "ffn"), target.node_devices() or ()))
    for node in doc["nodes"]:  # Node.device_type / device_index
        node["device"] = devices[node["role"]]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, doc


def api_url(doc: dict) -> str:
    attention = next(n for n in doc["nodes"] if n["role"] == "attention")
    return f"http://127.0.0.1:{attention['ports']['http']}"


def _complete(url: str, prompt: list[int]) -> list[int]:
    from cluster_helpers import post

    status, body = post(
        url,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": API_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        timeout=120,
    )
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body}")
    return body["choices"][0]["token_ids"]


def check_1a1f(target: Target, ckpt: str, steps: int) -> Result:
    name = f"1A1F over {target.dist.upper()} via the OpenAI API"
    if target.node_devices() is None:
        return Result(name, "skip", target.too_few_devices())
    ok, why = dtype_supported(target, "float32")
    if not ok:
        return Result(name, "skip", f"compared in fp32, which this device refuses: {why}")
    ref = [ids[:API_TOKENS] for ids in cpu_reference(ckpt, max(steps, API_TOKENS))[0]]  # greedy: a prefix
    with tempfile.TemporaryDirectory(prefix="afd-device-1a1f-") as tmp:
        config, doc = cluster_config(Path(tmp), ckpt, target, "device-1a1f")
        url = api_url(doc)
        cluster = Launched(config, Path(tmp) / "launch.log")
        try:
            t0 = time.perf_counter()
            cluster.wait_ready(url, CLUSTER_READY_TIMEOUT)
            t1 = time.perf_counter()
            with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: the engine batches them
                got = list(pool.map(lambda p: _complete(url, p), PROMPTS))
            t2 = time.perf_counter()
        except Exception as e:
            say(f"-- afd launch log (last lines)\n{cluster.tail()}")
            return Result(name, "fail", f"{type(e).__name__}: {e}")
        finally:
            cluster.stop()
    figures = {
        "requests": len(PROMPTS),
        "tokens_each": API_TOKENS,
        "ready_s": round(t1 - t0, 1),
        "requests_s": round(t2 - t1, 2),
    }
    wrong = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    if wrong:
        i = wrong[0]
        return Result(
            name,
            "fail",
            f"{len(wrong)} of {len(PROMPTS)} requests differ from CPU fp32 (prompt {i}: {got[i]} vs {ref[i]})",
            figures,
        )
    return Result(name, "pass", f"{len(PROMPTS)} concurrent greedy requests equal CPU fp32 tokens", figures)
