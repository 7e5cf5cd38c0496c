"""What a config field says about itself: its command-line option, the rule its value keeps and its
documentation, declared once beside the field in afd.config.schema. afd.config.flags generates every
command's flags from them, and afd.config.loader's YAML loader checks the same rules."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from argparse import ArgumentTypeError
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Rule:
    """What a field's value must be, beyond its type: the YAML loader and the flag's parser both check it."""

    ok: Callable[[Any], bool]
    says: str
    """The refusal, before `, got VALUE`."""

    def why_not(self, value: Any) -> str | None:
        """None where `value` keeps the rule (None, an unset optional field, always does)."""
        if value is None or self.ok(value):
            return None
        return f"{self.says}, got {value!r}"


POSITIVE = Rule(lambda v: v > 0, "must be positive")
AT_LEAST_0 = Rule(lambda v: v >= 0, "must be >= 0")
MICRO_BATCHES = Rule(lambda v: 0 <= v <= 4, "must be in 0..4 (0: automatic)")
SPECULATIVE = Rule(lambda v: v in (0, 1, 2), "must be 0 (off), 1 or 2")
FRACTION = Rule(lambda v: 0 < v <= 1, "must be in (0, 1]")


def one_of(choices: tuple[str, ...]) -> Rule:
    return Rule(lambda v: v in choices, f"expected {', '.join(choices)}")


@dataclass(frozen=True)
class FlagSpec:
    """A config field's command-line option."""

    name: str
    """The option as typed, e.g. `--max-num-seqs`."""
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    """Turns the option's text into the field's value (and refuses bad text); default: the field's type."""
    metavar: str | None = None


def opt(
    default: Any,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    rule: Rule | None = None,
) -> Any:
    """A config field with its default; with `flag`, the command-line option that sets it; with `rule` (or
    `choices`), what its value must be, wherever it is set."""
    meta: dict[str, Any] = {"flag": FlagSpec(flag, choices, parse, metavar)} if flag else {}
    if rule is not None or choices is not None:
        meta["rule"] = rule if rule is not None else one_of(choices)  # type: ignore[arg-type]
    return field(default=default, metadata=meta)


def flag_of(f) -> FlagSpec | None:
    """The command-line option a dataclass field declared (None: the YAML alone sets it)."""
    return f.metadata.get("flag")


def rule_of(f) -> Rule | None:
    """The rule a dataclass field's value keeps (None: its type says all)."""
    return f.metadata.get("rule")


def checked(parse: Callable[[str], Any], rule: Rule | None) -> Callable[[str], Any]:
    """A flag's argparse type: `parse`, then the field's rule (argparse prints the refusal)."""
    if rule is None:
        return parse

    def typed(text: str) -> Any:
        value = parse(text)
        if (why := rule.why_not(value)) is not None:
            raise ArgumentTypeError(why)
        return value

    return typed


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal that follows it in the class body, on one line."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


# ---- option parsers (argparse `type=`): the command line's checks of what the YAML's loader checks ----

_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def byte_count(v: Any) -> int | None:
    """A size as the YAML writes it (268435456, 256MiB, 1GiB) in bytes; None when it is not one."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v if v > 0 else None
    if isinstance(v, str):
        if v.isdigit():
            return int(v) or None
        for unit, mult in _UNITS.items():
            num = v[: -len(unit)].strip()
            if v.endswith(unit) and num.replace(".", "", 1).isdigit():
                return int(float(num) * mult) or None
    return None


def size_arg(text: str) -> int:
    value = byte_count(text)
    if value is None:
        raise ArgumentTypeError(f"expected a byte count like 256MiB, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def at_least(minimum: int):
    """An argparse type: an int no smaller than `minimum` (the benchmarks' and the planner's count flags say
    their minimum in their help, and a smaller value is refused before anything starts)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < minimum:
            raise ArgumentTypeError(f"{n}: at least {minimum}")
        return n

    parse.minimum = minimum  # type: ignore[attr-defined]
    return parse


def count_arg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def micro_batches_arg(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 4:
        raise ArgumentTypeError(f"must be in 0..4 (0: automatic), got {value}")
    return value


def speculative_count(text: str) -> int:
    value = int(text)
    if value not in (0, 1, 2):
        raise ArgumentTypeError(f"must be 0 (off), 1 or 2, got {value}")
    return value


DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's --dtype names for the dtypes afd names in full."""


def fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def dtype_arg(text: str) -> str:
    """--dtype: auto, float32, bfloat16, float16, or vLLM's half and float for the last and the first."""
    return DTYPE_ALIASES.get(text, text)
