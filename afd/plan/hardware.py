"""A hardware spec for devices that are not here: one accelerator's peak figures, read from a small YAML file,
each figure with its public source. afd.plan.roofline turns a spec and a model into the same CostModel that
`afd profile` measures on this machine (afd.plan.costs), so that `afd plan` reasons the same way about both.

The schema (units in the key names; decimal prefixes, as vendors quote them):

    name: h200
    description: free text
    compute_tflops: {bf16: 989, fp16: 989, fp8: 1979, int8: 1979}   # dense tensor peak; null: not supported
    memory: {bandwidth_tb_s: 4.8, capacity_gb: 141}
    links:
      intra_node: {fabric: NVLink 4, bandwidth_gb_s: 450, latency_us: 2}   # per device, one direction
      inter_node: {fabric: InfiniBand NDR, bandwidth_gb_s: 50, latency_us: 5}
    launch_overhead_us: 4                 # per kernel
    sources:                              # every figure: its own path or a section above it
      compute_tflops: https://...
      memory.bandwidth_tb_s: https://...

A spec is chosen by name (afd/plan/specs/NAME.yaml) or by a file path (`load_spec`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd.cache_dir import cache_dir

SPECS_DIR = Path(__file__).parent / "specs"
COMPUTE_DTYPES = ("bf16", "fp16", "fp8", "int8", "fp32")
"""fp32: what a CPU serves in (the measured `cpu` spec has it); accelerator specs leave it out."""
LINK_KEYS = ("intra_node", "inter_node")


class SpecError(ValueError):
    """A hardware spec that cannot be read: the message names the file and the key."""


@dataclass(frozen=True)
class LinkSpec:
    """One fabric, per device and direction: t(bytes) = latency + bytes / bandwidth."""

    fabric: str
    bandwidth: float
    """Bytes per second."""
    latency: float
    """Seconds."""


@dataclass(frozen=True)
class HardwareSpec:
    """One device's peaks in SI units (FLOP/s, B/s, bytes, s), as loaded; `sources` maps each figure's path
    (or a section's) to where it comes from."""

    name: str
    compute: tuple[tuple[str, float], ...]
    """(dtype, FLOP/s) for each dtype the device computes in; a dtype absent here it cannot run GEMMs in."""
    memory_bandwidth: float
    memory_capacity: float
    intra_node: LinkSpec
    inter_node: LinkSpec
    launch_overhead: float
    sources: tuple[tuple[str, str], ...]
    description: str = ""
    origin: str = ""
    """The file it was read from."""

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s in `dtype` (bf16, fp16, fp8, int8, fp32); SpecError if the device has none."""
        for d, v in self.compute:
            if d == dtype:
                return v
        have = ", ".join(d for d, _ in self.compute)
        raise SpecError(f"hardware {self.name!r} has no {dtype} compute (it has {have})")

    def link(self, fabric: str) -> LinkSpec:
        if fabric not in LINK_KEYS:
            raise SpecError(f"unknown fabric {fabric!r}; expected one of {', '.join(LINK_KEYS)}")
        return self.intra_node if fabric == "intra_node" else self.inter_node


def available_specs() -> list[str]:
    """The names `load_spec` takes: the shipped spec files, and `cpu` (measured by `afd profile`)."""
    return sorted({p.stem for p in SPECS_DIR.glob("*.yaml")} | {"cpu"})


CPU_SPEC = "cpu"
"""The name of this machine's measured spec (`--hardware cpu`)."""


def cpu_spec_path() -> Path:
    """Where `afd profile` keeps this machine's spec ($AFD_CACHE_DIR, else $XDG_CACHE_HOME/afd)."""
    return Path(cache_dir()) / "hardware" / f"{CPU_SPEC}.yaml"


def load_spec(name_or_path: str) -> HardwareSpec:
    """A shipped spec by name (`a3`, `h200`), or any spec file by path (anything with a path separator or a
    .yaml / .yml suffix, or an existing file)."""
    p = Path(name_or_path)
    is_path = os.sep in name_or_path or p.suffix in (".yaml", ".yml") or p.is_file()
    if not is_path and name_or_path == "cpu":
        p = cpu_spec_path()
        if not p.is_file():
            raise SpecError(f"no measured cpu spec at {p}: `afd profile FILE` measures this CPU and writes it")
    elif not is_path:
        p = SPECS_DIR / f"{name_or_path}.yaml"
        if not p.is_file():
            raise SpecError(
                f"unknown hardware {name_or_path!r}; expected one of {', '.join(available_specs())} or a spec file"
            )
    if not p.is_file():
        raise SpecError(f"hardware spec {str(p)!r}: no such file")
    import yaml

    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{p}: not valid YAML ({e})") from None
    return parse_spec(d, str(p))


def parse_spec(d: Any, where: str = "<spec>") -> HardwareSpec:
    """A HardwareSpec from the YAML's dict, every key and value checked; SpecError names the key."""
    _keys(
        d,
        where,
        "",
        required=("name", "compute_tflops", "memory", "links", "launch_overhead_us", "sources"),
        optional=("description",),
    )
    figures: list[str] = []
    comp = _section(d, "compute_tflops", where)
    _keys(comp, where, "compute_tflops.", required=("bf16",), optional=COMPUTE_DTYPES[1:])
    compute = []
    for dt in COMPUTE_DTYPES:
        if comp.get(dt) is not None:
            compute.append((dt, _positive(comp[dt], where, f"compute_tflops.{dt}") * 1e12))
            figures.append(f"compute_tflops.{dt}")
        elif dt == "bf16":
            raise SpecError(f"{where}: compute_tflops.bf16 is required (the model dtype's GEMMs)")
    mem = _section(d, "memory", where)
    _keys(mem, where, "memory.", required=("bandwidth_tb_s", "capacity_gb"))
    figures += ["memory.bandwidth_tb_s", "memory.capacity_gb"]
    links = _section(d, "links", where)
    _keys(links, where, "links.", required=LINK_KEYS)
    parsed = {}
    for k in LINK_KEYS:
        ln = _section(links, k, where, f"links.{k}")
        _keys(ln, where, f"links.{k}.", required=("fabric", "bandwidth_gb_s", "latency_us"))
        if not isinstance(ln["fabric"], str) or not ln["fabric"]:
            raise SpecError(f"{where}: links.{k}.fabric must be a name, got {ln['fabric']!r}")
        bw = _positive(ln["bandwidth_gb_s"], where, f"links.{k}.bandwidth_gb_s") * 1e9
        lat = _non_negative(ln["latency_us"], where, f"links.{k}.latency_us") * 1e-6
        parsed[k] = LinkSpec(ln["fabric"], bw, lat)
        figures += [f"links.{k}.bandwidth_gb_s", f"links.{k}.latency_us"]
    figures.append("launch_overhead_us")
    sources = _check_sources(d["sources"], figures, where)
    name = d["name"]
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}: name must be a non-empty string, got {name!r}")
    return HardwareSpec(
        name=name,
        compute=tuple(compute),
        memory_bandwidth=_positive(mem["bandwidth_tb_s"], where, "memory.bandwidth_tb_s") * 1e12,
        memory_capacity=_positive(mem["capacity_gb"], where, "memory.capacity_gb") * 1e9,
        intra_node=parsed["intra_node"],
        inter_node=parsed["inter_node"],
        launch_overhead=_non_negative(d["launch_overhead_us"], where, "launch_overhead_us") * 1e-6,
        sources=sources,
        description=str(d.get("description") or ""),
        origin=where,
    )


def _check_sources(src: Any, figures: list[str], where: str) -> tuple[tuple[str, str], ...]:
    """Every figure has a source on its own path or a section above it; a source must name a figure or a
    section (a typo would otherwise leave a figure unsourced without a word)."""
    if not isinstance(src, dict):
        raise SpecError(f"{where}: sources must be a map of figure -> URL or document")
    sections = {f.rsplit(".", i)[0] for f in figures for i in range(f.count(".") + 1)}
    for k, v in src.items():
        if k not in sections:
            raise SpecError(f"{where}: sources.{k}: names no figure of the spec")
        if not isinstance(v, str) or not v.strip():
            raise SpecError(f"{where}: sources.{k} must be a URL or a document's name, got {v!r}")
    for f in figures:
        if not any(f == k or f.startswith(k + ".") for k in src):
            raise SpecError(f"{where}: {f} has no source (add sources.{f} or a source for its section)")
    return tuple(sorted(src.items()))


def _keys(d: Any, where: str, prefix: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    if not isinstance(d, dict):
        raise SpecError(f"{where}: {prefix.rstrip('.') or 'the spec'} must be a map, got {type(d).__name__}")
    for k in d:
        if k not in required + optional:
            raise SpecError(f"{where}: {prefix}{k}: unknown key; expected one of {', '.join(required + optional)}")
    for k in required:
        if k not in d:
            raise SpecError(f"{where}: {prefix}{k} is missing")


def _section(d: dict, key: str, where: str, path: str | None = None) -> dict:
    v = d[key]
    if not isinstance(v, dict):
        raise SpecError(f"{where}: {path or key} must be a map, got {v!r}")
    return v


def _number(v: Any, where: str, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SpecError(f"{where}: {key} must be a number, got {v!r}")
    return float(v)


def _positive(v: Any, where: str, key: str) -> float:
    x = _number(v, where, key)
    if not x > 0:
        raise SpecError(f"{where}: {key} must be positive, got {v!r}")
    return x


def _non_negative(v: Any, where: str, key: str) -> float:
    x = _number(v, where, key)
    if x < 0:
        raise SpecError(f"{where}: {key} must not be negative, got {v!r}")
    return x
