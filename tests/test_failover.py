"""An FFN node's loss without a pause (layout.routing attention, replicas): when every expert the dead node
held has a live replica, the attention node re-forms with the others at once and routes the dead node's
tokens to the replicas (afd.node.pairing.form_pairs with `covered`); its replacement, started again by
its own command, forms its pairs in the background and takes its share back at a step boundary
(afd.node.adoption). Where an expert has no replica, the rejoin wait of tests/test_rejoin.py holds."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest
from cluster_helpers import Cluster, cluster_yaml, get, post
from hf_reference import PROMPTS, hf_greedy
from sse import Streams

from afd.control.coordinator import late_after

pytestmark = pytest.mark.multiprocess
NEW = 48
STREAM = {"max_tokens": NEW, "temperature": 0}
FAST = {"heartbeat_interval": 0.3, "heartbeat_timeout": 2, "rejoin_timeout": 60, "comm_timeout": 30}
NO_PAUSE = {**FAST, "heartbeat_timeout": 5}
"""A killed node is seen by the data plane at once; were it seen by the heartbeat instead, its streams would
stall for heartbeat_timeout, which is here longer than STALL."""
STALL = 3.0
"""The largest gap a stream may show across the kill: the re-formation with the two survivors took 0.5-0.7 s
alone or beside two busy cores, and at least 2 s (the former bound) in 1 of 6 make test runs on 2026-12-07,
beside two workers and their clusters."""
# the tiny checkpoint's 6 routed experts (tests/hf_reference.py BASE): ffn1's (2-4) are on ffn0 or ffn2 too
PLACEMENT = {"ffn0": "0-3", "ffn1": "2-4", "ffn2": "4-5"}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return [ids for ids, _ in hf_greedy(tiny_checkpoint, PROMPTS, NEW)]


@pytest.mark.parametrize("hang", [False, True], ids=["killed", "stopped"])
def test_a_killed_ffn_node_whose_experts_are_replicated_costs_no_pause(tiny_checkpoint, reference, tmp_path, hang):
    """Killed, or stopped (a hang: alive, its sockets open, its FormPair never answered): the attention node
    judges it late after three heartbeat intervals of waiting on it, and forms its pairs with the others at
    once, leaving it out, since they hold every expert."""
    layout = {"routing": "attention", "placement": PLACEMENT, "micro_batches": 2}
    path = cluster_yaml(tmp_path, tiny_checkpoint, 1, 3, name="failover", cluster=NO_PAUSE, layout=layout)
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        prompts = PROMPTS * 4  # 16 greedy streams at once
        streams = Streams(c.url(), prompts, STREAM, 180)
        assert streams.wait_started(60)
        killed = time.monotonic()
        c.procs["ffn1"].send_signal(signal.SIGSTOP) if hang else c.kill("ffn1")
        assert streams.join(120) == 0, "a stream hung"
        for (ids, errors), p in zip(streams.results, prompts):
            assert not errors, errors
            assert ids == reference[PROMPTS.index(p)]  # no token changed against HF (so against a run without the kill)
        bound = STALL + (late_after(NO_PAUSE["heartbeat_interval"], NO_PAUSE["heartbeat_timeout"]) if hang else 0)
        assert streams.largest_gap(since=killed) < bound, "a stream stalled for the lost FFN node"
        after = c.log("attn0").split("requests paused", 1)[1]
        assert "left out (down): ffn1" in after and "waiting for FFN node ffn1" not in after  # no rejoin wait
        if hang:
            c.procs["ffn1"].send_signal(signal.SIGCONT)  # back: it finds its pair gone and is formed again
        else:
            c.start("ffn1")  # the node's own command, as a supervisor would run it
        end = time.monotonic() + 90
        while "FFN node ffn1 is back" not in c.log("attn0"):
            assert time.monotonic() < end, "the replacement's pair was never adopted"
            time.sleep(0.3)
        body = {"prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "return_token_ids": True}
        code, body = post(c.url(), "/v1/completions", body)
        assert code == 200 and body["choices"][0]["token_ids"] == reference[0]
        port = c.node("ffn1")["ports"]["metrics"]
        code, text = get(f"http://127.0.0.1:{port}", "/metrics")
        tokens = re.search(rb"^afd_ffn_tokens_total\{[^}]*\} (\S+)", text, re.M)
        assert code == 200 and tokens is not None and float(tokens.group(1)) > 0, "the replacement took no tokens back"
        zero = re.search(rb"^afd_zero_expert_tokens_total\{[^}]*\} (\S+)", get(c.url(), "/metrics")[1], re.M)
        assert zero is not None and float(zero.group(1)) > 0, "the attention node applied no identity expert"


@pytest.mark.slow  # ~20 s; CI runs it in make test-slow (tests/test_rejoin.py covers the wait by default)
def test_without_a_replica_the_rejoin_wait_holds_and_status_names_the_unserved_experts(
    tiny_checkpoint, reference, tmp_path
):
    path = cluster_yaml(tmp_path, tiny_checkpoint, 1, 2, name="unserved", cluster=FAST)  # default: 0-2 | 3-5
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        c.kill("ffn1")
        end = time.monotonic() + FAST["heartbeat_timeout"] + 10
        while True:
            st = subprocess.run(
                [sys.executable, "-m", "afd", "status", str(path), "--json"],
                capture_output=True,
                text=True,
            )
            doc = json.loads(st.stdout)
            if "ffn1" in doc["lost"]:
                break
            assert time.monotonic() < end, f"the coordinator never reported ffn1 lost: {doc}"
            time.sleep(0.3)
        assert doc["unserved_experts"] == [3, 4, 5]
        text = subprocess.run([sys.executable, "-m", "afd", "status", str(path)], capture_output=True, text=True)
        assert "unserved   3-5" in text.stdout, text.stdout
        c.start("ffn1")
        body = {"prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "return_token_ids": True}
        code, body = post(c.url(), "/v1/completions", body, timeout=120)  # waits for the replacement, then runs
        assert code == 200 and body["choices"][0]["token_ids"] == reference[0]
