"""Check `syncs`: host syncs per decode step on each node of a 1A1F cluster on the device, read from each
node's afd_host_syncs_total (attention: its API's /metrics; FFN: its metrics port). The bound: a
decode step syncs the host once per node (the sampled tokens on the attention node, the step header on the
FFN node); per-layer or per-micro-batch waits would show as several.

Idle steps (an attention node with nothing to run) cost one sync on both nodes too, and /metrics does not
say how many ran, so they cannot be subtracted one by one as the fake NPU's per-site report allows
(tests/npu_fake.py). Instead two requests with the same prompt run in two windows built alike (a quiet
pause, a scrape, the request, a scrape): one decodes SHORT tokens, the other EXTRA more. The prefill, the
scrapes (the FFN's reads its expert counts) and the idle steps around each request cancel in the
difference, which is EXTRA decode steps' syncs, up to the idle steps' jitter: SLACK.

afd's counter sees only the reads afd marks. So the nodes also run with AFD_SYNC_WATCH (afd/backend/sync_watch.py):
the device runtime's own sync debug mode ("warn") counts every synchronizing operation, marked or not, by the
line of afd's code that caused it. Its count per decode step is held to the same bound, and the row names each
node's first ten sync sites."""

from __future__ import annotations

import glob
import json
import tempfile
import time
from pathlib import Path

from checks_1a1f import api_url, cluster_config
from device_common import Target, wait_ready
from device_report import Result
from hf_reference import PROMPTS

SHORT = 8  # tokens of the short request
EXTRA = {False: 96, True: 32}  # decode steps the long request adds, by --quick
# Per decode step and node. A regression costs at least one more sync per step (a host wait per layer or
# micro-batch costs several), while the windows' idle steps differ by a few syncs at most: 0.25 x 96 = 24.
SLACK = 0.25
QUIET_S = 1.0  # before each window: the engine's idle backoff settles at its maximum (ALONE_BACKOFF_MAX)
REQUEST_TIMEOUT = 120
MEASURED = "afd_host_syncs_total per decode step on each node of a 1A1F cluster (long minus short request)"


def _watched(watch: Path, roles: dict[str, str]) -> dict[str, dict]:
    """Each node's sync watch (its runtime's count), by role: {} where no runtime counts (the CPU)."""
    out = {}
    for f in glob.glob(f"{watch}.*.json"):
        doc = json.loads(Path(f).read_text())
        argv = doc.get("argv", [])
        name = argv[argv.index("--node") + 1] if "--node" in argv else None
        if name in roles:
            out[roles[name]] = doc
    return out


def _scrape(urls: dict[str, str], watch: Path | None = None, roles: dict[str, str] | None = None) -> dict[str, float]:
    """Each node's afd_host_syncs_total, its runtime's count (`<role>_runtime`, where it counts), and the
    attention node's decode steps so far."""
    from cluster_helpers import get
    from metrics_text import samples, total

    out = {}
    for role, url in urls.items():
        code, body = get(url, "/metrics", timeout=10)
        if code != 200:
            raise RuntimeError(f"{role} /metrics: HTTP {code}")
        got = samples(body.decode())
        out[role] = total(got, "afd_host_syncs_total")
        if role == "attention":
            out["decode_steps"] = total(got, "afd_step_seconds_count", phase="decode")
    for role, doc in (_watched(watch, roles or {}) if watch is not None else {}).items():
        out[f"{role}_runtime"] = doc["count"]
    return out


def _window(urls: dict[str, str], url: str, tokens: int, watch=None, roles=None) -> dict[str, float]:
    """What one greedy request of `tokens` tokens adds to each count, EOS ignored so that every token is a step."""
    from cluster_helpers import post

    time.sleep(QUIET_S)
    before = _scrape(urls, watch, roles)
    body = {"prompt": PROMPTS[0], "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    code, out = post(url, "/v1/completions", body, timeout=REQUEST_TIMEOUT)
    if code != 200:
        raise RuntimeError(f"a {tokens}-token request: HTTP {code}: {out}")
    after = _scrape(urls, watch, roles)
    return {k: after[k] - before.get(k, 0) for k in after}


def judge(kind: str, extra: int, short: dict[str, float], long: dict[str, float], sites: dict | None = None) -> Result:
    """Syncs per decode step on each node from the two windows, by afd's counter and by the runtime's
    (`<role>_runtime`, where the runtime counts: not the CPU); on the CPU (the dry run) nothing is counted,
    the host being the device, so only the step count is held there. sites: each role's first ten sync sites."""
    name = "host syncs per decode step, 1A1F"
    steps = long["decode_steps"] - short["decode_steps"]
    counted = [k for k in ("attention", "ffn", "attention_runtime", "ffn_runtime") if k in long and k in short]
    per_step = {role: (long[role] - short[role]) / extra for role in counted}
    figures = {
        "decode_steps": int(steps),
        **{f"{role}_per_step": round(v, 3) for role, v in per_step.items()},
        **{f"{role}_short_long": f"{short[role]:.0f}/{long[role]:.0f}" for role in counted},
        "slack": SLACK,
        **{f"{role}_first_sites": "; ".join(first) for role, first in (sites or {}).items()},
    }
    if steps != extra:  # one decode step per token: else the per-step figures divide by the wrong count
        return Result(name, "fail", f"the long request ran {steps:.0f} more decode steps, not {extra}", figures)
    if kind == "cpu":
        if any(per_step.values()):
            return Result(name, "fail", f"the CPU counted host syncs: {per_step}", figures)
        return Result(name, "pass", "0 on CPU, which counts none (a dry run: the device's bound is 1 + slack)", figures)
    problems = [
        f"{role} {v:.2f} per step > 1 + {SLACK}" for role, v in per_step.items() if not v <= 1 + SLACK
    ] + [  # each decode step reads its sampled tokens (attention) or its step header (FFN) once
        f"{role} {v:.2f} per step < 1 - {SLACK}: afd_host_syncs_total misses the step's read"
        for role, v in per_step.items()
        if v < 1 - SLACK
    ]
    if not any(role.endswith("_runtime") for role in per_step):
        problems.append("the runtime counted nothing (AFD_SYNC_WATCH: no set_sync_debug_mode warning was seen)")
    if problems:
        return Result(name, "fail", "; ".join(problems), figures)
    return Result(name, "pass", f"every node within 1 +- {SLACK} sync per decode step, by afd and its runtime", figures)


def check_host_syncs(target: Target, ckpt: str, quick: bool, env: dict | None = None) -> Result:
    """env: the node processes' extra environment (the fake NPU's, in tests/test_device_check.py)."""
    from cluster_helpers import Cluster

    if target.node_devices() is None:
        return Result("host syncs per decode step, 1A1F", "skip", target.too_few_devices())
    extra = EXTRA[quick]
    with tempfile.TemporaryDirectory(prefix="afd-device-syncs-") as tmp:
        path, doc = cluster_config(Path(tmp), ckpt, target, "device-syncs")
        ffn = next(n for n in doc["nodes"] if n["role"] == "ffn")
        url = api_url(doc)
        urls = {"attention": url, "ffn": f"http://127.0.0.1:{ffn['ports']['metrics']}"}
        roles = {n["name"]: n["role"] for n in doc["nodes"]}
        watch = Path(tmp) / "sync-watch"
        with Cluster(path, env={**(env or {}), "AFD_SYNC_WATCH": str(watch)}) as c:
            c.start_all()
            wait_ready(c)
            _window(urls, url, SHORT + extra, watch, roles)  # warm-up: one-time copies and set-up are not a step's
            short = _window(urls, url, SHORT, watch, roles)
            long = _window(urls, url, SHORT + extra, watch, roles)
        sites = {role: doc["first"] for role, doc in _watched(watch, roles).items()}
    return judge(target.kind, extra, short, long, sites)
