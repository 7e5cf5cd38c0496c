"""The result of `make test-device` (tests/device/check.py): a markdown table and a JSON document, written
as docs/bench/device/<device>-<date>.{md,json}. No torch here: the report is plain data."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = "afd-device-check/1"


@dataclass
class Result:
    check: str
    status: str  # "pass" | "fail" | "skip"
    reason: str = ""  # why it failed or skipped; for a pass, what held
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0
    measured: str = ""  # what the row measured, said in its check cell


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _cell(text: str) -> str:
    return str(text).replace("\n", " ").replace("|", "\\|")


def _clean(v):
    """JSON without NaN/Infinity (not JSON): such floats become strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def summary(results: list[Result]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}


def markdown_table(results: list[Result]) -> str:
    rows = ["| check | result | figures | reason | s |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        figs = ", ".join(f"{k} {_fmt(v)}" for k, v in r.figures.items())
        check = f"{r.check}: {r.measured}" if r.measured else r.check
        rows.append(f"| {_cell(check)} | {r.status} | {_cell(figs)} | {_cell(r.reason)} | {r.seconds:.1f} |")
    return "\n".join(rows)


def device_label(env: dict) -> str:
    devices = env.get("devices") or []
    name = (devices[0].get("name") if devices else None) or env.get("device_type", "none")
    return f"{len(devices)}x {name}" if len(devices) > 1 else str(name)


def markdown_report(env: dict, results: list[Result]) -> str:
    counts = summary(results)
    lines = [
        f"# afd device check: {device_label(env)}, {env.get('date', '')[:10]}",
        "",
        f"{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip.",
        "",
        markdown_table(results),
        "",
        "## Environment",
        "",
    ]
    for k, v in env.items():
        if k == "devices":
            lines += [f"- device: {', '.join(f'{a}={b}' for a, b in d.items())}" for d in v]
        else:
            lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def json_report(env: dict, results: list[Result], argv: list[str], seconds: float) -> dict:
    return _clean(
        {
            "schema": SCHEMA,
            "argv": argv,
            "seconds": round(seconds, 1),
            "environment": env,
            "summary": summary(results),
            "checks": [asdict(r) for r in results],
        }
    )


def write_report(out_dir: Path, env: dict, results: list[Result], argv: list[str], seconds: float) -> list[Path]:
    """<device>-<date>.md and .json in out_dir; a second run the same day gets -2, -3, ... (never overwrites)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_label(env).lower()).strip("-") or "device"
    stem = f"{slug}-{env.get('date', dt.date.today().isoformat())[:10]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    n, base = 1, stem
    while (out_dir / f"{stem}.json").exists() or (out_dir / f"{stem}.md").exists():
        n += 1
        stem = f"{base}-{n}"
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(markdown_report(env, results))
    js.write_text(json.dumps(json_report(env, results, argv, seconds), indent=2, allow_nan=False) + "\n")
    return [md, js]
