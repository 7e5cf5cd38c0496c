"""Every command-line flag afd's serving commands share, defined once.

The config's flags are generated from the fields of afd.config.schema that declare one (`opt(default,
"--flag")`): name, type, choices and help (the field's docstring) come from the field, so a new knob is a
field and the code that reads it. Their default on the command line is None, "the YAML's, else the field's
default". The few flags that are not config (where a node listens, which node this is, the API key) are
defined in FLAGS below. Commands take flags by name from here (`add_flags`, `add_config_flags`);
tests/test_layout.py holds that no other module defines one of these names.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from afd.config.fieldspec import checked, count_arg, field_docs, flag_of, positive_int, rule_of
from afd.config.http_section import HttpSection
from afd.config.schema import ClusterConfig
from afd.config.sections import ClusterSection, EngineSection, Layout, ModelSection, PrefetchSection

SECTIONS = {
    "model": ModelSection,
    "layout": Layout,
    "engine": EngineSection,
    "cluster": ClusterSection,
    "prefetch": PrefetchSection,
    "http": HttpSection,
}
"""The config sections whose fields are options of `afd.LLM` and, where they declare a flag, of the CLI."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's default in --help, unless its help already says it or there is none to show."""

    @staticmethod
    def _shows(default) -> bool:  # identity checks: 0 and 0.0 equal False, yet are defaults worth showing
        return not (default is None or default is False or default is argparse.SUPPRESS)

    def add_argument(self, action):
        if action.help is None and action.option_strings and self._shows(action.default):
            action.help = "(default: %(default)s)"  # argparse prints no line at all for an option without help
        super().add_argument(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or "default" in text or not self._shows(action.default):
            return text
        return f"{text} (default: %(default)s)".lstrip()


@dataclass(frozen=True)
class Flag:
    """One command-line option."""

    name: str
    help: str
    type: Any = None
    default: Any = None
    choices: tuple | None = None
    metavar: str | None = None
    action: Any = None
    key: str | None = None
    """`section.field` of the config value it sets (None: not a config value)."""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, p, **overrides) -> None:
        kw: dict[str, Any] = {"default": self.default, "help": self.help, "dest": self.dest}
        if self.action is not None:
            kw["action"] = self.action
        else:
            kw.update(type=self.type, choices=self.choices, metavar=self.metavar)
        kw.update(overrides)
        p.add_argument(self.name, **{k: v for k, v in kw.items() if v is not None or k == "default"})


def _config_flag(section: str, cls: type, f: dataclasses.Field) -> Flag:
    spec = flag_of(f)
    assert spec is not None
    doc = field_docs(cls).get(f.name, "").replace("%", "%%")  # argparse formats help with %
    default = "" if f.default is None else f" (default: the YAML's, else {_shown(f.default)})"
    typ = typing.get_type_hints(cls)[f.name]
    base = next((a for a in typing.get_args(typ) if a is not type(None)), typ)
    key = f"{section}.{f.name}"
    if base is bool:
        return Flag(spec.name, f"{doc}{default} [{key}]", action=argparse.BooleanOptionalAction, key=key)
    typ = checked(spec.parse or base, None if spec.choices else rule_of(f))  # argparse checks choices itself
    return Flag(spec.name, f"{doc}{default} [{key}]", typ, None, spec.choices, spec.metavar, key=key)


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def config_flags() -> dict[str, Flag]:
    """The config's flags by dest, in section and field order."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if flag_of(f) is not None:
                flag = _config_flag(section, cls, f)
                out[flag.dest] = flag
    return out


FLAGS = {
    f.dest: f
    for f in (
        Flag("--config", "cluster YAML"),
        Flag("--node", "this node's name in the cluster YAML"),
        Flag(
            "--bind-host",
            "address the node's servers listen on (default: the node's host in the YAML; 0.0.0.0 in a container "
            "whose YAML host is a service name)",
        ),
        Flag(
            "--tp-rank",
            "this process's TP rank in its attention node (layout.attention_tp); ranks > 0 follow rank 0, which "
            "serves the API",
            int,
            0,
        ),
        Flag(
            "--threads",
            "torch intra-op threads (0: the YAML's, else the host's usable cores shared by its CPU nodes)",
            int,
            0,
        ),
        Flag("--host", "address the HTTP API listens on (default: the node's host; 127.0.0.1 colocated)"),
        Flag("--port", "HTTP port of the (first) attention node (default: the YAML's; 8000 for `afd serve`)", int),
        Flag(
            "--api-key",
            "require `Authorization: Bearer KEY` on /v1 routes (default: $AFD_API_KEY; on the command line the key "
            "is visible to every user of the host in `ps`: prefer --api-key-file or the environment)",
        ),
        Flag("--api-key-file", "a file holding the API key (what --api-key takes, without showing it in `ps`)"),
        Flag(
            "--device",
            "device of every node (auto: npu if torch_npu sees one, else cuda if torch sees one, else cpu; "
            "with several nodes, each has its own: the attention nodes' from index 0, then the FFN nodes')",
            str,
            "cpu",
            ("cpu", "cuda", "npu", "auto"),
        ),
        Flag("--attention-nodes", "attention node processes (default: 1)", positive_int),
        Flag("--ffn-nodes", "FFN node processes (default: 1; 0: the attention nodes run the experts)", count_arg),
        Flag(
            "--colocated",
            "both halves in one process: no data plane (with --attention-tp N: N processes, each with every expert)",
            action="store_true",
        ),
    )
}
"""The flags that are not config values."""


def add_flags(p, *names: str, **overrides: Any) -> None:
    """Adds the named flags of FLAGS (by dest); `overrides` (e.g. `help=`, `required=`) apply to each.
    `api_key` comes with `api_key_file`: every command that takes the key takes it from a file too."""
    for name in names:
        FLAGS[name].add_to(p, **overrides)
        if name == "api_key":
            FLAGS["api_key_file"].add_to(p, **overrides)


def add_config_flags(p, exclude: tuple[str, ...] = (), title: str = "configuration (overrides the YAML)") -> None:
    """Every config flag but `exclude` (dests), in a group of its own."""
    g = p.add_argument_group(title)
    for dest, flag in config_flags().items():
        if dest not in exclude:
            flag.add_to(g)


def overrides_of(args) -> dict[str, dict[str, Any]]:
    """The config values set on the command line: {section: {field: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for dest, flag in config_flags().items():
        value = getattr(args, dest, None)
        if value is not None and flag.key is not None:
            section, field = flag.key.split(".")
            out.setdefault(section, {})[field] = value
    return out


def config_argv(args, exclude: tuple[str, ...] = ()) -> list[str]:
    """The config flags set on `args` as a node command's arguments (what `afd launch` hands every node)."""
    out: list[str] = []
    for dest, flag in config_flags().items():
        value = getattr(args, dest, None)
        if value is None or dest in exclude:
            continue
        if flag.action is argparse.BooleanOptionalAction:
            out.append(flag.name if value else f"--no-{flag.name[2:]}")
        else:
            out += [flag.name, str(value)]
    return out


def with_overrides(cfg: ClusterConfig, sections: dict[str, dict[str, Any]]) -> ClusterConfig:
    """`cfg` with `sections` ({section: {field: value}}) over it, loaded and checked again as a YAML would be
    (a bad value is a ClusterConfigError naming its key)."""
    if not sections:
        return cfg
    from afd.config.loader import from_dict

    doc = cfg.to_dict()
    for section, values in sections.items():
        doc[section] = {**doc.get(section, {}), **{k: _yaml_value(v) for k, v in values.items()}}
    return from_dict(doc, cfg.source)


def _yaml_value(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def flat_overrides(options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`afd.LLM`'s keywords ({field: value}, field names being unique across SECTIONS) by section; an unknown
    keyword is a ValueError naming the known ones."""
    where = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    out: dict[str, dict[str, Any]] = {}
    for key, value in options.items():
        if key not in where:
            raise ValueError(f"unknown option {key!r} (the config's fields: {', '.join(sorted(where))})")
        out.setdefault(where[key], {})[key] = _yaml_value(value)
    return out
