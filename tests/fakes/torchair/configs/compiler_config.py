"""Fake torchair.configs.compiler_config.CompilerConfig, for tests only.

The options afd may set, with the values torchair accepts, checked when assigned: torchair's option objects
refuse a value outside their list with ValueError, and a config refuses an option it does not have.
source: torchair configs (compiler_config.py, experimental_config.py, debug_config.py, ge_config.py,
  _option_base.py), https://github.com/Ascend/torchair/tree/7.1.0/python/torchair/configs, torchair 7.1.0
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompilerConfig"]


class _Option:
    """A value from a fixed list (None: any value), or an int in [lo, hi] when `int_range` is given."""

    def __init__(self, default: Any, allowed: list | None = None, int_range: tuple[int, int] | None = None):
        self.default, self.allowed, self.int_range = default, allowed, int_range
        self.value = default

    def check(self, v: Any) -> None:
        if self.int_range is not None:
            lo, hi = self.int_range
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"Please set an integer in [{lo}, {hi}], got {v!r}")
        elif self.allowed is not None and v not in self.allowed:
            raise ValueError(f"Value {v!r} (type: {type(v)}) not in optional list {self.allowed!r}")


class _Config:
    """Options as attributes: reading gives the value, assigning checks it; unknown names are refused."""

    def __init__(self, **options: _Option | _Config):
        object.__setattr__(self, "_options", options)

    def __getattr__(self, name: str) -> Any:
        options = object.__getattribute__(self, "_options")
        if name not in options:
            raise AttributeError(f"{type(self).__name__} has no option {name}, all options {sorted(options)}")
        opt = options[name]
        return opt.value if isinstance(opt, _Option) else opt

    def __setattr__(self, name: str, value: Any) -> None:
        options = self._options
        if name not in options:
            raise ValueError(f"{type(self).__name__} has no option {name}, all options {sorted(options)}")
        opt = options[name]
        if not isinstance(opt, _Option):
            raise ValueError(f"{type(self).__name__}.{name} is a group of options, set its members")
        opt.check(value)
        opt.value = value

    def leaves(self, prefix: str = "") -> dict[str, Any]:
        """Every option's dotted name -> value (what cache keys and comparisons use)."""
        out: dict[str, Any] = {}
        for k, opt in self._options.items():
            if isinstance(opt, _Config):
                out.update(opt.leaves(f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = opt.value
        return out


_BOOL = [True, False]


class CompilerConfig(_Config):
    """torchair.CompilerConfig: mode "max-autotune" (GE graph) or "reduce-overhead" (aclgraph capture)."""

    def __init__(self):
        super().__init__(
            mode=_Option("max-autotune", ["max-autotune", "reduce-overhead"]),
            debug=_Config(
                graph_dump=_Config(type=_Option(None, ["txt", "pbtxt", "py"])),
                run_eagerly=_Option(False, _BOOL),
            ),
            experimental_config=_Config(
                cc_parallel_enable=_Option(False, _BOOL),
                keep_inference_input_mutations=_Option(True, _BOOL),
                memory_efficiency=_Option(False, _BOOL),
                frozen_parameter=_Option(False, _BOOL),
                static_model_ops_lower_limit=_Option(None, int_range=(-1, 2**63 - 1)),
                npu_fx_pass=_Option(False, _BOOL),
                topology_sorting_strategy=_Option("DFS", ["BFS", "DFS", "RDFS", "StableRDFS"]),
                enable_ref_data=_Option(False, _BOOL),
                enable_view_optimize=_Option(True, _BOOL),
                tiling_schedule_optimize=_Option(False, _BOOL),
            ),
            ge_config=_Config(
                enable_single_stream=_Option(False, _BOOL),
                oo_level=_Option("O3", ["O1", "O3"]),
            ),
            inference_config=_Config(dynamic_gears_merge_policy=_Option("zip", ["zip", "product"])),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompilerConfig) and self.leaves() == other.leaves()

    __hash__ = None  # mutable, compared by value (as torchair's __eq__ does)


# Options that torchair 7.1.0 says "may not take effect or report error" in reduce-overhead (aclgraph) mode,
# when set to one of these values (subset of unsupport_aclgraphconfig_list in compiler_config.py, 7.1.0).
REDUCE_OVERHEAD_UNSUPPORTED = {
    "experimental_config.frozen_parameter": [True],
    "experimental_config.tiling_schedule_optimize": [True],
    "experimental_config.cc_parallel_enable": [True],
    "experimental_config.enable_ref_data": [True],
    "experimental_config.topology_sorting_strategy": ["BFS", "RDFS", "StableRDFS"],
    "ge_config.enable_single_stream": [True],
    "ge_config.oo_level": ["O1"],
}
