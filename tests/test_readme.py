"""The README's commands, run as written against the README's demo (`afd serve demo`). Only the port
differs, so that the test never collides with a server already on :8000, and `afd bench` lines run 8 prompts
(a later --num-prompts wins): what is tested is that each line works, not the load it puts on the demo."""

from __future__ import annotations

import re
import subprocess
import sys

import forked_python
import pytest
from cluster_helpers import ROOT
from serve_helpers import Served, free_port_run

pytestmark = pytest.mark.multiprocess
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)


def _shell_lines() -> list[str]:
    out = []
    for lang, body in BLOCKS:
        if lang:
            continue
        joined = re.sub(r"\\\n\s*", "", body)  # continuation lines
        out += [ln.split("  #")[0].strip() for ln in joined.splitlines() if ln.strip()]
    return out


def _on(port: int, cmd: str) -> str:
    return cmd.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    line = next(c for c in _shell_lines() if c == "afd serve demo")  # the README's first command
    port = free_port_run(1)
    s = Served(
        [*line.split()[2:], "--port", str(port)],
        tmp_path_factory.mktemp("readme") / "serve.log",
        [f"http://127.0.0.1:{port}"],
    )
    try:
        s.wait_ready()
        yield port
    finally:
        assert s.stop() == 0


def test_the_readmes_curl_and_bench_lines_work_against_its_demo(demo):
    cmds = [c for c in _shell_lines() if c.startswith(("curl http://127.0.0.1:8000", "afd bench --base-url"))]
    assert len(cmds) >= 2 and any(c.startswith("curl") for c in cmds)
    bin_dir = str(ROOT / ".venv" / "bin") if (ROOT / ".venv" / "bin" / "afd").exists() else None
    env_path = f"{bin_dir}:" if bin_dir else ""
    for cmd in cmds:
        r = subprocess.run(
            [
                "bash",
                "-c",
                f'PATH="{env_path}$PATH" {_on(demo, cmd)} --fail-with-body'
                if cmd.startswith("curl")
                else f'PATH="{env_path}$PATH" {_on(demo, cmd)} --disable-tqdm --num-prompts 8',
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
        if cmd.startswith("afd bench"):
            assert "Successful requests:                     8" in r.stdout, r.stdout
        else:
            assert '"completion_tokens":16' in r.stdout, r.stdout


def test_the_readmes_python_runs():
    (code,) = [body for lang, body in BLOCKS if lang == "python"]
    r = forked_python.run([sys.executable, "-c", code], cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
