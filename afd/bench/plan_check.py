"""`afd bench-plan`: does the simulator (afd.plan.simulate) predict this machine's decode step? (the target:
predictions match measurements here)

One run profiles the demo model (afd.plan.profile on a generated 1A1F YAML: the CostModel), measures the
decode step of local clusters (afd.cluster.local) at 1A1F, 1A2F and 2A1F, each without overlap, with overlap
(m=1) and ping-pong (m=2), 1A2F under both routings, 1A1F also behind an emulated link (afd.cluster.link,
where root and tc allow), in rounds whose order rotates (afd.bench.common.interleaved); then predicts each
from the profile with Scenario.from_cluster on the very cluster YAML that ran, and tabulates both.

What is compared: attention node 0's step reports time the runner (`seconds`: the layers, the exchange,
embedding and logits), not the engine's scheduling and sampling around it, which the profile's step overhead
includes; the profile measured that outside share (step - execute per batch size), and the prediction
subtracts its fit. `--replay FILE` re-predicts a stored run with the current simulator (no measuring).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from afd.bench.common import count_flag, interleaved
from afd.bench.plan_check_predict import rows_of
from afd.bench.plan_check_table import Case, table, threads_table, to_json

OUTPUT = "docs/bench/plan_check.json"
PROFILE = "profile"
"""The rotation's name for a round's profile."""


def cases(link: str | None) -> list[Case]:
    """The configurations the issue names: every ratio in every overlap mode, 1A2F in both routings, 1A1F
    behind the link."""
    modes = ((False, 1), (True, 1), (True, 2))
    out = [
        Case(a, f, o, m, r)
        for a, f, rs in ((1, 1, ("ffn",)), (1, 2, ("ffn", "attention")), (2, 1, ("ffn",)))
        for r in rs
        for o, m in modes
    ]
    if link:
        out += [Case(1, 1, o, m, "ffn", link) for o, m in modes]
    return out


def add_parser(sub) -> None:
    from afd.config.flags import DefaultsHelpFormatter

    p = sub.add_parser(
        "bench-plan",
        help="the simulator's predicted decode step against the measured one, on the demo model",
        formatter_class=DefaultsHelpFormatter,
    )
    count_flag(p, "--batch-size", 16, help="sequences per attention node")
    count_flag(p, "--prompt-len", 32)
    count_flag(p, "--steps", 10, minimum=3, help="timed decode steps per run (2 more warm up)")
    count_flag(p, "--repeats", 2, help="rounds of every configuration (medians over steps and rounds)")
    count_flag(p, "--profile-steps", 10, help="timed decode steps per batch size of the profile")
    p.add_argument("--link", default="200mbit", help="the emulated link's RATE[,DELAY] for 1A1F ('' to skip)")
    p.add_argument("--only", default=None, help="semicolon-separated config names (as printed) to run")
    p.add_argument("--replay", default=None, metavar="FILE", help="re-predict a stored run (no measuring)")
    p.add_argument("--output", default=OUTPUT, help="the JSON written")
    p.set_defaults(func=run)


def _decode(report: dict, batch: int, warmup: int = 2) -> list[dict]:
    return [s for s in report["steps"][1:] if s["tokens"] == batch][warmup:]


def case_job(case: Case, link=None):
    """The local cluster of the demo a case runs (across the emulated link where given: its hosts)."""
    from afd.cluster.local_config import local_job

    kw: dict[str, Any] = dict(overlap=case.overlap, micro_batches=case.micro_batches, routing=case.routing)
    return local_job(
        "demo", case.attention_nodes, case.ffn_nodes, dtype="float32", **kw, **(link.hosts if link else {})
    )


def measure(case: Case, batch: int, prompt_len: int, steps: int, link) -> dict:
    """One cluster run: the decode steps of attention node 0 (seconds, ffn_wait) and the cluster YAML it ran."""
    import yaml

    from afd.bench.common import synthetic_prompts
    from afd.cluster.local import LocalCluster

    link = link if case.link else None
    prompts = synthetic_prompts(batch * case.attention_nodes, prompt_len, 512)
    with LocalCluster(case_job(case, link), ffn_command_prefix=link.prefix if link else ()) as cluster:
        cluster.start()
        doc = yaml.safe_load(Path(cluster.dir, "cluster.yaml").read_text())
        # untimed: the nodes' first job pays their first-use costs (as afd.plan.profile_check's warm-up)
        cluster.generate(synthetic_prompts(batch * case.attention_nodes, prompt_len, 512, 40_000), 3, ignore_eos=True)
        nodes = {n: cluster.process(n).pid for n in cluster.processes.procs}
        ours = [os.getpid(), *nodes.values()]
        before, threads = _cpu(ours), _threads(nodes)
        _, reports = cluster.generate(prompts, steps + 3, ignore_eos=True)
        after, threads = _cpu(ours), _threads(nodes, threads)
        cluster.close()
    forward = len(reports[0]["steps"])  # the prefill's and every decode step's
    cpu = {n: (after[3][pid] - before[3][pid]) / forward for n, pid in nodes.items()}
    return {
        "steps": [[s["seconds"], s["ffn_wait"]] for s in _decode(reports[0], batch)],
        "cluster": doc,
        "other_cores": other_cores(before, after),
        "cpu_per_step": cpu,
        "threads_per_step": {n: [v / forward for v in t] for n, t in threads.items()},
    }


def _threads(nodes: dict[str, int], before: dict | None = None) -> dict[str, list[float]]:
    """Per node: [its main thread's CPU seconds, its run-queue wait, the other threads' CPU (the transport's
    loops, gRPC, HTTP), their wait] (afd.cluster.cpus.thread_schedstat); with `before`, since then."""
    from afd.cluster.cpus import thread_schedstat

    out = {}
    for name, pid in nodes.items():
        t = [0.0] * 4
        for tid, (run, wait) in thread_schedstat(pid).items():
            i = 0 if tid == pid else 2
            t[i], t[i + 1] = t[i] + run, t[i + 1] + wait
        out[name] = t if before is None else [a - b for a, b in zip(t, before[name])]
    return out


def _cpu(pids: list[int]) -> tuple[float, float, float, dict[int, float]]:
    """(now, the host's busy seconds: every state but idle and iowait, steal included, this job's processes'
    CPU seconds, each one's) from /proc (https://man7.org/linux/man-pages/man5/proc_stat.5.html)."""
    from afd.cluster.cpus import process_cpu_seconds

    t = time.perf_counter()
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, *rest = (int(x) for x in f.readline().split()[1:9])
    each = {pid: process_cpu_seconds(pid) for pid in pids}
    busy = (user + nice + system + sum(rest)) / os.sysconf("SC_CLK_TCK")
    return t, busy, sum(each.values()), each


def other_cores(before: tuple, after: tuple) -> float:
    """Cores' worth of CPU the host spent on other work between two _cpu readings: what the machine's other
    users took from the job's node processes."""
    wall = after[0] - before[0]
    busy = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, busy / wall) if wall > 0 else 0.0


def _profile(tmp: str, steps: int, log) -> tuple[dict, dict]:
    """The demo's profile (profile_json's dict: the CostModel and its measurements) on a 1A1F YAML, and the
    runner-outside share of its steps (a line)."""
    from afd.cluster.local_config import local_config
    from afd.plan.costs import fit
    from afd.plan.profile import profile
    from afd.plan.profile_fit import profile_json

    cfg = local_config(1, 1, {"model": {"path": "demo", "dtype": "float32"}, "layout": {"overlap": False}})
    path = Path(tmp, "profile.yaml")
    path.write_text(cfg.to_yaml())
    m, costs = profile(str(path), (4, 8, 16), context=32, steps=steps, repeats=1, link_repeats=10, log=log)
    outside = fit([float(s.batch) for s in m.steps], [max(0.0, s.step - s.execute) for s in m.steps])
    return json.loads(profile_json(costs, m)), dataclasses.asdict(outside)  # measurements kept: --replay refits


def run(args) -> int:
    from afd.cluster.cpus import usable_cpus

    if args.replay:
        doc = json.loads(Path(args.replay).read_text())
    else:
        doc = _measure_all(args, log=lambda s: print(s, flush=True))
        doc["setting"]["host_cores"] = usable_cpus()
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(doc, indent=1))  # the measurements first: --replay can redo the rest
    rows = rows_of(doc)
    s = doc["setting"]
    print(
        f"\ndemo model ({s['weights']}), batch {s['batch']} per attention node, prompt {s['prompt_len']}, "
        f"{s['steps']} decode steps x {s['repeats']} rounds; {s['machine']}"
    )
    for note in s.get("notes", []):
        print(f"note: {note}")
    print(table(rows))
    if threads := threads_table(doc["runs"]):
        print(f"\nper forward step, each node's threads (/proc/PID/task/TID/schedstat):\n{threads}")
    out = to_json(rows, s) | {k: doc[k] for k in ("profile", "outside_runner", "profiles", "runs") if k in doc}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.output}")
    return 0


def _measure_all(args, log) -> dict:
    import contextlib
    import os

    from afd.cluster.link import EmulatedLink, LinkError, LinkSpec

    notes, qdisc = [], ""
    spec = LinkSpec.parse(args.link) if args.link else None
    stack = contextlib.ExitStack()
    link = None
    if spec is not None:
        try:
            link = stack.enter_context(EmulatedLink(spec))
            notes.append(f"1A1F behind an emulated link: {link.qdisc} each way (FFN nodes in a netns)")
            qdisc = link.qdisc
        except LinkError as e:
            notes.append(f"emulated link skipped: {e}")
            spec = None
    todo = cases(args.link if spec else None)
    if args.only:
        want = {n.strip() for n in args.only.split(";")}
        todo = [c for c in todo if c.name in want]
    with stack, tempfile.TemporaryDirectory() as tmp:
        by_name = {c.name: c for c in todo}

        def one(name: str, r: int):
            if name == PROFILE:
                return _profile(tmp, args.profile_steps, log)
            return measure(by_name[name], args.batch_size, args.prompt_len, args.steps, link)

        # the profile is one more name in the rotation: each round's runs are predicted from that round's
        # profile, so a slow spell of the shared machine moves both sides of a ratio, not one
        got = interleaved([PROFILE, *by_name], args.repeats, one, log)
    profiles = got.pop(PROFILE)
    load = os.getloadavg()
    machine = f"{os.cpu_count()} cores shared with other work (load {load[0]:.1f} / {load[2]:.1f} at the end)"
    setting = {
        "weights": "the demo checkpoint's seeded weights (float32)",
        "batch": args.batch_size,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "repeats": args.repeats,
        "machine": machine,
        "notes": notes,
        "link_qdisc": qdisc,
    }
    runs = [{"case": dataclasses.asdict(by_name[n]), "rounds": rs} for n, rs in got.items()]
    rounds = [{"profile": p, "outside_runner": o} for p, o in profiles]
    return {
        "setting": setting,
        "profile": profiles[0][0],
        "outside_runner": profiles[0][1],
        "profiles": rounds,
        "runs": runs,
    }
