"""The API key from a file (--api-key-file), the environment ($AFD_API_KEY) or the command line (--api-key,
with a warning: a command line is visible to every user of the host in `ps`); and the `http` section of the
cluster YAML, whose fields are every serving command's flags."""

from __future__ import annotations

import argparse
import sys

import forked_python
import pytest
from cluster_helpers import ROOT, cluster_yaml

from afd.cluster.token import api_key
from afd.config.loader import from_dict
from afd.config.schema import ClusterConfigError


def _args(**kw):
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})


def test_the_key_comes_from_a_file_the_environment_or_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AFD_API_KEY", "from-env")
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert api_key(_args(api_key_file=str(f))) == "from-file"
    assert api_key(_args()) == "from-env"
    assert capsys.readouterr().err == ""
    assert api_key(_args(api_key="from-argv")) == "from-argv"
    assert "visible" in capsys.readouterr().err  # the warning
    (tmp_path / "empty").write_text("\n")
    for bad, match in (
        (_args(api_key_file=str(tmp_path / "empty")), "empty"),
        (_args(api_key_file=str(tmp_path / "missing")), "missing"),
        (_args(api_key="k", api_key_file=str(f)), "give one"),
    ):
        with pytest.raises(ValueError, match=match):
            api_key(bad)


@pytest.mark.parametrize("command", [["afd", "serve"], ["afd", "launch"], ["attention_node.main"]])
def test_every_command_that_takes_a_key_takes_a_key_file(command):
    if command == ["attention_node.main"]:
        from attention_node.main import build_server_parser

        text = build_server_parser().format_help()
    else:
        r = forked_python.run([sys.executable, "-m", *command, "--help"], cwd=ROOT, timeout=120)
        text = r.stdout
    assert "--api-key-file" in text and "--ssl-certfile" in text and "--timeout-header" in text


def test_an_unreadable_key_file_is_one_line(tiny_checkpoint, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint)
    argv = ["--config", str(path), "--node", "attn0", "--api-key-file", str(tmp_path / "nope")]
    r = forked_python.run([sys.executable, "-m", "attention_node.main", *argv], cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--api-key-file" in r.stderr, r.stderr


def _doc(**http) -> dict:
    node = {"name": "a", "role": "attention", "host": "127.0.0.1", "ports": {"control": 1, "data": 2, "http": 3}}
    return {"model": {"path": "demo"}, "http": http, "nodes": [node]}


def test_the_http_section_loads_checks_and_round_trips():
    cfg = from_dict(_doc(header_timeout=3, max_body_bytes="1MiB", ssl_certfile="c.pem", ssl_keyfile="k.pem"))
    assert cfg.http.header_timeout == 3.0 and cfg.http.max_body_bytes == 1 << 20 and cfg.http.scheme == "https"
    assert from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["http"]["max_body_bytes"] == "1MiB"
    assert from_dict(_doc()).http.keep_alive_timeout == 5.0  # vLLM's
    for bad, where in (
        (_doc(body_timeout=0), "http.body_timeout: must be positive"),
        (_doc(ssl_certfile="c.pem"), "ssl_certfile and ssl_keyfile go together"),
        (_doc(idle=1), "http.idle: unknown key"),
    ):
        with pytest.raises(ClusterConfigError, match=where):
            from_dict(bad)


def test_printed_commands_carry_the_key_by_its_file_never_its_value(tmp_path, monkeypatch, capsys):
    """`afd launch --print-commands`: each attention node's line names the key file; a key given by value is
    left out, with a note, since a command line is visible in `ps`."""
    from afd.entrypoints.cli import main

    monkeypatch.setenv("AFD_CLUSTER_TOKEN", "t")  # no token file made for this test
    path = cluster_yaml(tmp_path, "demo")
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    assert main(["launch", str(path), "--print-commands", "--api-key-file", str(key)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(("--api-key-file " + str(key) in x) == ("afd-attention" in x) for x in lines)
    assert main(["launch", str(path), "--print-commands", "--api-key", "s3cret"]) == 0
    out, err = capsys.readouterr()
    assert "s3cret" not in out and "--api-key-file FILE" in err
