"""afd's one configuration (afd.config.schema): the YAML round-trips through it, every command's config
flags are generated from its fields, and `afd.LLM(model, **options)` builds it."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import inspect
import re

import pytest
import yaml

from afd.cluster.local_config import local_config
from afd.config.fieldspec import field_docs, flag_of
from afd.config.flags import FLAGS, SECTIONS, config_argv, config_flags, flat_overrides, overrides_of, with_overrides
from afd.config.loader import from_dict, load
from afd.config.schema import ClusterConfigError

DEPLOY = sorted(glob.glob("deploy/*.yaml"))


@pytest.mark.parametrize("path", DEPLOY)
def test_a_yaml_round_trips_unchanged(path):
    """to_dict gives back the file's mapping (its explicit defaults included), and loads into an equal config."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    cfg = load(path)
    assert cfg.to_dict() == raw
    assert from_dict(yaml.safe_load(cfg.to_yaml()), path) == cfg


def test_a_made_config_round_trips():
    cfg = local_config(2, 2, {"model": {"dtype": "bfloat16"}, "layout": {"attention_tp": 2, "tp_comm": "sp"}})
    assert from_dict(cfg.to_dict(), cfg.source) == cfg
    assert cfg.to_dict()["layout"] == {"attention_tp": 2, "tp_comm": "sp"}


def test_overrides_are_checked_as_the_yaml_is_and_keep_the_rest():
    cfg = load("deploy/cuda.yaml")
    out = with_overrides(cfg, {"engine": {"max_num_seqs": 8}, "model": {"dtype": "bfloat16"}})
    assert (out.engine.max_num_seqs, out.model.dtype) == (8, "bfloat16")
    assert dataclasses.replace(out, engine=cfg.engine, model=cfg.model) == cfg
    with pytest.raises(ClusterConfigError, match="engine.max_num_seqs: must be positive"):
        with_overrides(cfg, {"engine": {"max_num_seqs": 0}})
    with pytest.raises(ClusterConfigError, match="engine.speculative_tokens"):
        with_overrides(load("deploy/2a1f.yaml"), {"engine": {"speculative_tokens": 1}, "layout": {"attention_tp": 2}})


def test_every_config_flag_is_its_field():
    """Name, type and help come from the field: the help is the field's docstring and names its key."""
    flags = config_flags()
    seen = 0
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            spec = flag_of(f)
            if spec is None:
                continue
            seen += 1
            flag = flags[spec.name.lstrip("-").replace("-", "_")]
            assert flag.key == f"{section}.{f.name}"
            assert field_docs(cls)[f.name].replace("%", "%%") in flag.help
    assert seen == len(flags) > 20
    names = [f.name for f in flags.values()] + [f.name for f in FLAGS.values()]
    assert len(names) == len(set(names)), "a flag name defined twice"


def test_field_names_are_unique_across_sections():
    """afd.LLM takes the config's fields by name alone."""
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))
    assert flat_overrides({"dtype": "bfloat16", "kvp": 2}) == {"model": {"dtype": "bfloat16"}, "layout": {"kvp": 2}}
    with pytest.raises(ValueError, match="unknown option 'max_num_seq'"):
        flat_overrides({"max_num_seq": 2})


def test_flags_parse_into_overrides_and_back_into_argv():
    from afd.node.args import add_cluster_args

    p = argparse.ArgumentParser()
    add_cluster_args(p)
    argv = [
        "--dtype",
        "bfloat16",
        "--no-overlap",
        "--kv-cache-bytes",
        "1GiB",
        "--seed",
        "3",
        "--speculative-tokens",
        "1",
    ]
    args = p.parse_args(argv)
    assert overrides_of(args) == {
        "model": {"dtype": "bfloat16"},
        "layout": {"overlap": False},
        "engine": {"kv_cache_bytes": 1 << 30, "speculative_tokens": 1, "sampling_seed": 3},
    }
    assert overrides_of(p.parse_args(config_argv(args))) == overrides_of(args)
    with pytest.raises(SystemExit):
        p.parse_args(["--micro-batches", "5"])


def test_llm_takes_the_model_and_config_fields():
    import afd

    params = list(inspect.signature(afd.LLM.__init__).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "model"]
    assert [p.kind for p in params[2:]] == [inspect.Parameter.VAR_KEYWORD]
    with pytest.raises(ValueError, match="unknown option"):
        afd.LLM("demo", micro_batch=2)
    with pytest.raises(ClusterConfigError, match="layout.graph_mode"):
        afd.LLM("demo", graph_mode="fast")


RULED = [
    (section, f)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if f.metadata.get("rule") is not None
]


@pytest.mark.parametrize("section,f", RULED, ids=[f"{s}.{f.name}" for s, f in RULED])
def test_a_field_s_rule_is_held_by_the_yaml_and_by_its_flag_alike(section, f):
    """Each field declares its constraint once (afd.config.fieldspec.Rule, beside the field): the YAML loader
    refuses a value that breaks it, naming the key, and the field's flag (if it has one) refuses the same
    value with the same words. -1 breaks every numeric rule afd declares; a made-up word every choice."""
    from afd.config.fieldspec import rule_of

    rule = rule_of(f)
    bad = "no-such-choice" if isinstance(f.default, str) or f.default is None and "expected" in rule.says else -1
    cfg = local_config(1, 1).to_dict()
    cfg.setdefault(section, {})[f.name] = bad
    with pytest.raises(ClusterConfigError, match=re.escape(f"{section}.{f.name}: {rule.says}, got")):
        from_dict(cfg)
    spec = flag_of(f)
    if spec is not None and spec.choices is None:  # argparse refuses a choice flag's value in its own words
        p = argparse.ArgumentParser(exit_on_error=False)
        config_flags()[spec.name.lstrip("-").replace("-", "_")].add_to(p)
        with pytest.raises(argparse.ArgumentError, match=re.escape(f"{rule.says}, got")):
            p.parse_args([spec.name, str(bad)])
