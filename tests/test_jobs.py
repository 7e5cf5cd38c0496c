"""The offline worker's job mailbox (afd.cluster.jobs): jobs in order, results back, then stop."""

from __future__ import annotations

import json
import shutil

from afd.cluster.jobs import STOP, JobMailbox, jobs_of


def test_a_mailbox_hands_over_jobs_in_order_then_stop(tmp_path):
    launcher, node = JobMailbox(str(tmp_path / "attn0")), jobs_of(str(tmp_path / "attn0"), None)
    assert node.take(0) is None  # nothing yet: the node idles
    launcher.submit(0, {"prompts": [[1]]})
    launcher.submit(1, {"prompts": [[2]]})
    launcher.stop()
    assert node.take(0) == {"prompts": [[1]]} and node.take(1) == {"prompts": [[2]]}
    assert node.take(2) == STOP  # stop comes after every job submitted before it
    assert launcher.result(0) is None
    node.put_result(0, {"outputs": [[5]]})
    assert launcher.result(0) == {"outputs": [[5]]}
    files = sorted(p.name for p in (tmp_path / "attn0").iterdir())
    assert files == ["job-0.json", "job-1.json", "result-0.json", "stop"]  # written whole: no .tmp left


def test_a_removed_mailbox_means_stop(tmp_path):
    node = JobMailbox(str(tmp_path / "attn0"))
    shutil.rmtree(tmp_path / "attn0")  # the launcher's temporary directory went away with it
    assert node.take(0) == STOP


def test_a_prompts_file_is_one_job(tmp_path):
    job, out = tmp_path / "prompts.json", tmp_path / "out.json"
    job.write_text(json.dumps({"prompts": [[1, 2]], "max_tokens": 3}))
    one = jobs_of(str(job), str(out))
    assert one.take(0) == {"prompts": [[1, 2]], "max_tokens": 3} and one.take(1) == STOP
    one.put_result(0, {"outputs": [[4, 5, 6]]})
    assert json.loads(out.read_text()) == {"outputs": [[4, 5, 6]]}
