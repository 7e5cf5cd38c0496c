"""What a newcomer meets in the first hour: the printed curl example carries the Authorization header
when the API needs a key (never the key itself), `afd bench-step --steps 1` is refused with why, and `demo` is
served as `demo`."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd.config.loader import load
from afd.entrypoints.cli import main
from afd.entrypoints.launch import _Launcher


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


def test_demo_is_served_under_the_name_it_was_given():
    from afd.cluster.topology import served_model_name

    assert served_model_name("demo") == "demo"  # a client that followed `afd serve demo` sends model="demo"
    assert served_model_name("demo", "m") == "m" and served_model_name("/ckpt/x") == "/ckpt/x"


def _bench_parsers():
    from afd.entrypoints.cli import build_parser

    _, sub = build_parser()
    return {name: p for name, p in sub.choices.items() if name.startswith("bench")}


SIGNED = {"--seed"}
"""Int flags of the benchmarks with no minimum: a seed may be any integer."""


def test_every_benchmark_count_says_and_checks_its_minimum(capsys):
    for name, p in _bench_parsers().items():
        for action in p._actions:
            if not action.option_strings or action.type is None or action.option_strings[0] in SIGNED:
                continue
            flag = action.option_strings[0]
            assert action.type is not int, f"afd {name} {flag}: an int with no minimum"
            minimum = getattr(action.type, "minimum", None)
            if minimum is None:
                continue
            assert f"at least {minimum}" in (action.help or ""), f"afd {name} {flag}: the help hides the minimum"
            with pytest.raises(SystemExit):
                p.parse_args([flag, str(minimum - 1)])
            assert f"{minimum - 1}: at least {minimum}" in capsys.readouterr().err
