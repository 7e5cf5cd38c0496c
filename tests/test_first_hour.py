"""What a newcomer meets in the first hour (issue 29): the printed curl example carries the Authorization header
when the API needs a key (never the key itself), and `afd bench-step --steps 1` is refused with why."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd.cli import main
from afd.cluster.config import load
from afd.cluster.launch import _Launcher


class _Said:
    def __init__(self):
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)


@pytest.mark.parametrize("env", [{}, {"AFD_API_KEY": "s3cret"}], ids=["no-key", "key"])
def test_the_curl_example_says_how_to_authorize(env, capsys):
    said = _Said()
    _Launcher(load(str(Path(__file__).parent.parent / "deploy" / "local.yaml")), None, env)._ready(
        said, ["http://127.0.0.1:8000"], curl_example=True
    )
    curl = said.lines[-1]
    assert curl.startswith("try: curl http://127.0.0.1:8000/v1/completions")
    assert ('-H "Authorization: Bearer $AFD_API_KEY"' in curl) == bool(env)
    assert "s3cret" not in curl + capsys.readouterr().out


def test_bench_step_refuses_too_few_steps_to_time(capsys):
    with pytest.raises(SystemExit):
        main(["bench-step", "--steps", "1"])
    assert "at least 3 (the first 2 decode steps warm up and are not timed)" in capsys.readouterr().err
