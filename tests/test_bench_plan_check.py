"""`afd bench-plan`'s table and JSON from synthetic numbers, and its re-prediction of a stored run (no cluster,
no measuring): the full run is a benchmark (docs/benchmarks/planner.md), not a test."""

from __future__ import annotations

import argparse
import json

import pytest

from afd.bench import plan_check
from afd.bench.plan_check_table import Case, Row, rows_from_json, table, to_json
from tests.test_plan_simulate import costs


def test_cases_cover_every_ratio_mode_routing_and_the_link():
    names = [c.name for c in plan_check.cases("200mbit")]
    assert len(names) == len(set(names)) == 15
    assert "1A1F no overlap" in names and "2A1F ping-pong m=2" in names
    assert "1A2F overlap m=1, routing attention" in names and "1A2F no overlap, routing ffn" in names
    assert "1A1F ping-pong m=2, link 200mbit" in names
    assert len(plan_check.cases(None)) == 12


def test_table_and_json_from_synthetic_rows():
    rows = [
        Row(Case(1, 1, False, 1), 10.0, 11.0, 2.0, 2.5, 3, "ffn"),
        Row(Case(1, 2, True, 2, "attention"), 10.0, 7.0, 1.0, 0.5, 3, "attention"),
    ]
    assert rows[0].within_bar and not rows[1].within_bar
    text = table(rows)
    assert "| 1A1F no overlap | 10.00 | 11.00 | 1.10 | 2.00 / 2.50 | ffn | yes |" in text
    assert "| 1A2F ping-pong m=2, routing attention | 10.00 | 7.00 | 0.70 |" in text
    assert "1 of 2 configurations within 20%" in text
    doc = json.loads(json.dumps(to_json(rows, {"batch": 8})))
    assert doc["rows"][1]["ratio"] == pytest.approx(0.7) and doc["rows"][1]["within_bar"] is False
    assert rows_from_json(doc) == rows


def _stored(case: Case, step_s: float, wait_s: float) -> dict:
    rnd = {"steps": [[step_s, wait_s]] * 3, "cluster": plan_check.case_job(case).to_dict()}
    return {"case": case.__dict__, "rounds": [rnd, rnd]}


def test_replay_predicts_each_stored_run_from_the_stored_profile(tmp_path, capsys):
    c = costs(window=(2e-6, 3e-4), overhead=(1e-6, 2e-3))
    cases = [Case(1, 1, False, 1), Case(2, 1, True, 2), Case(1, 2, True, 1, "attention")]
    doc = {
        "setting": {
            "weights": "seeded",
            "batch": 8,
            "prompt_len": 4,
            "steps": 3,
            "repeats": 2,
            "machine": "test",
            "host_cores": 2,
        },
        "profile": json.loads(c.to_json()),
        "outside_runner": {"slope": 0.0, "intercept": 1e-3},
        "runs": [_stored(k, 0.01, 0.002) for k in cases],
    }
    src = tmp_path / "stored.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / "out.json"
    assert plan_check.run(argparse.Namespace(replay=str(src), output=str(out))) == 0
    got = json.loads(out.read_text())
    assert [r["name"] for r in got["rows"]] == [k.name for k in cases]
    first = got["rows"][0]
    assert first["measured_ms"] == pytest.approx(10.0) and first["wait_measured_ms"] == pytest.approx(2.0)
    assert got["runs"] == doc["runs"] and got["profile"] == doc["profile"]  # replayable again
    assert "configurations within 20%" in capsys.readouterr().out


def test_each_round_is_predicted_from_its_own_profile():
    """A round profiled on a slow spell predicts that round's slow runs: the ratio is each round's own,
    its median the row's."""
    from afd.bench.plan_check_predict import rows_of

    fast, slow = costs(window=(2e-6, 3e-4)), costs(window=(4e-6, 6e-4), pre=(2e-5, 1e-3))
    case = Case(1, 1, False, 1)
    run = _stored(case, 0.01, 0.002)
    run["rounds"][1] = dict(run["rounds"][1], steps=[[0.02, 0.002]] * 3)  # round 2 ran twice as slow
    outside = {"slope": 0.0, "intercept": 0.0}
    doc = {
        "setting": {"batch": 8, "host_cores": 0},
        "profiles": [{"profile": json.loads(c.to_json()), "outside_runner": outside} for c in (fast, slow)],
        "runs": [run],
    }
    (row,) = rows_of(doc)
    pred = [rows_of({**doc, "profiles": [p]})[0].predicted_ms for p in doc["profiles"]]
    assert pred[1] > pred[0]
    assert row.ratio == pytest.approx((pred[0] / 10.0 + pred[1] / 20.0) / 2)  # the median of two: their mean
    assert row.measured_ms == pytest.approx(15.0)


def test_count_flags_are_checked():
    p = argparse.ArgumentParser()
    plan_check.add_parser(p.add_subparsers())
    with pytest.raises(SystemExit):
        p.parse_args(["bench-plan", "--steps", "2"])
    with pytest.raises(SystemExit):
        p.parse_args(["bench-plan", "--repeats", "0"])
    assert p.parse_args(["bench-plan", "--steps", "3"]).steps == 3


def test_cores_left_by_other_work():
    from afd.bench.plan_check_predict import available_cores

    assert [available_cores(2, x) for x in (0.0, 0.4, 0.6, 1.0, 1.9)] == [2, 2, 1, 1, 1]


def test_a_token_bucket_under_its_rate_delays_nothing():
    from afd.bench.plan_check_predict import _shaped
    from afd.plan.scenario import Scenario
    from afd.plan.shape import Layout
    from afd.plan.simulate import simulate
    from tests.test_plan_simulate import SHAPE

    sc = Scenario(SHAPE, Layout(1, 1, 8, overlap=False), costs(bandwidth=5e9))
    pred = simulate(sc)
    tbf = "tbf rate 200mbit burst 250000 latency 50ms"
    assert _shaped(sc, pred, 25e6, tbf) is None  # ~KB per step against 25 MB/s, every message under the burst
    slow = _shaped(sc, pred, 1e3, tbf)  # 1 kB/s: the traffic exceeds the rate
    assert slow is not None and slow.costs.link.bandwidth == 1e3
    assert _shaped(sc, pred, 25e6, "netem rate 200mbit").costs.link.bandwidth == 25e6  # netem: every message


def test_other_work_is_the_hosts_busy_time_less_the_jobs():
    # 2 s: the host was busy 3 s of CPU, 1 s of it the job's -> 2 / 2 = 1 core of other work
    assert plan_check.other_cores((0.0, 10.0, 0.5, {}), (2.0, 13.0, 1.5, {})) == pytest.approx(1.0)
    assert plan_check.other_cores((0.0, 10.0, 0.5, {}), (2.0, 11.0, 1.5, {})) == 0.0  # never negative
    now = plan_check._cpu([plan_check.os.getpid()])
    assert now[2] == sum(now[3].values()) and now[1] >= now[2]


def test_threads_split_the_main_threads_cpu_from_the_others():
    """/proc/PID/task/TID/schedstat, as the runs record it: a busy main thread shows as the main thread's CPU,
    a busy second thread as the others'; a process that is gone reads as nothing."""
    import os
    import threading
    import time

    from afd.cluster.cpus import thread_schedstat

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    if not os.path.exists(f"/proc/{os.getpid()}/schedstat"):
        pytest.skip("this kernel keeps no schedstat (CONFIG_SCHED_INFO off, or not Linux)")
    spun, release = threading.Event(), threading.Event()

    def worker() -> None:  # stays alive until read: an ended thread leaves the task list, its CPU with it
        spin(0.05)
        spun.set()
        release.wait(10)

    me = {"me": os.getpid()}
    before = plan_check._threads(me)
    spin(0.05)
    t = threading.Thread(target=worker)
    t.start()
    assert spun.wait(10)
    main_cpu, main_wait, other_cpu, other_wait = plan_check._threads(me, before)["me"]
    release.set()
    t.join()
    # schedstat counts ns of CPU; each spin ran at least 50 ms of its thread's CPU time
    assert main_cpu >= 0.045 and other_cpu >= 0.045 and main_wait >= 0.0 and other_wait >= 0.0
    assert thread_schedstat(2**22 + 7) == {}  # beyond pid_max's ceiling (2^22): no such process


def test_the_threads_table_is_there_only_for_runs_that_measured_it():
    case = Case(1, 1, True, 2, "ffn", None)
    rnd = {"threads_per_step": {"attn0": [0.010, 0.001, 0.002, 0.0005], "ffn0": [0.004, 0.002, 0.003, 0.001]}}
    text = plan_check.threads_table([{"case": vars(case), "rounds": [rnd, rnd, rnd]}])
    assert f"| {case.name} | attn0 | 10.00 / 1.00 | 2.00 / 0.50 |" in text
    assert f"| {case.name} | ffn0 | 4.00 / 2.00 | 3.00 / 1.00 |" in text
    assert plan_check.threads_table([{"case": vars(case), "rounds": [{}]}]) == ""
