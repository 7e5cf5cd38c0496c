"""vLLM's `vllm serve` flags on `afd serve` and `afd launch` (afd/cluster/vllm_flags.py): vLLM's names for afd's
own flags set the same config values, its no-op switches are taken, the rest are refused in one line naming
afd's equivalent, and any error prints the subcommand's usage, not afd's."""

from __future__ import annotations

import pytest
import yaml

from afd.cluster.vllm_flags import ACCEPTED, REFUSED
from afd.entrypoints.cli import main


def _config(capsys, *argv: str) -> dict:
    assert main(["serve", "demo", "--print-config", *argv]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    del doc["nodes"]  # free ports, new each call
    return doc


def test_vllm_names_set_what_afds_own_set(capsys):
    ours = _config(capsys, "--attention-tp", "2", "--graph-mode", "eager")
    assert ours["layout"]["attention_tp"] == 2 and ours["layout"]["graph_mode"] == "eager"
    for argv in (("--tensor-parallel-size", "2", "--enforce-eager"), ("-tp", "2", "--enforce-eager")):
        assert _config(capsys, *argv) == ours
    switches = list(ACCEPTED)
    assert _config(capsys, *switches) == _config(capsys)  # taken, and nothing changes


@pytest.mark.parametrize("command", [["serve", "demo"], ["launch", "deploy/local.yaml"]])
def test_a_vllm_flag_afd_cannot_honour_names_the_equivalent(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([*command, "--num-speculative-tokens", "1", "--swap-space=4"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"usage: afd {command[0]} " in err  # the subcommand's usage, not the top-level one
    assert f"afd {command[0]}: error: --num-speculative-tokens is vLLM's; afd's equivalent: --speculative-tokens" in err
    assert "--swap-space is vLLM's; afd has none" in err
    assert REFUSED["--num-speculative-tokens"].startswith("--speculative-tokens")


def test_an_unknown_flag_is_refused_with_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "demo", "--foo-bar", "1"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and "usage: afd serve " in err
        and "afd serve: error: unrecognized arguments: --foo-bar 1" in err
    )


def test_dtype_takes_vllms_names(capsys):
    assert _config(capsys, "--dtype", "half")["model"]["dtype"] == "float16"
    assert _config(capsys, "--dtype", "float")["model"]["dtype"] == "float32"
    assert _config(capsys, "--dtype", "auto")["model"].get("dtype", "auto") == "auto"  # vLLM's default, afd's too
    with pytest.raises(SystemExit):
        main(["serve", "demo", "--dtype", "double"])
    assert "invalid choice: 'double'" in capsys.readouterr().err
