"""The house plan of docs/architecture.md, checked: one-way imports, no cycles between afd's folders,
a small top level, benchmarks imported only by the CLI, device SDKs only in afd/backend."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SDKS = ("torch_npu", "torchair")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _files(package: str) -> list[Path]:
    return [p for p in (ROOT / package).rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def _folder(path: Path) -> str | None:
    """afd's subsystem folder a file belongs to (None at the top level)."""
    rel = path.relative_to(ROOT / "afd").parts
    return rel[0] if len(rel) > 1 else None


def test_node_packages_never_import_each_other():
    for own, other in (("attention_node", "ffn_node"), ("ffn_node", "attention_node")):
        for f in _files(own):
            assert not any(m.split(".")[0] == other for m in _imports(f)), f"{f} imports {other}"
    for f in _files("afd"):
        assert not any(m.split(".")[0] in ("attention_node", "ffn_node") for m in _imports(f)), f


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of the graph `edges` (each node's successors), as its nodes with the first repeated at the end;
    None where there is none (a depth-first search, in sorted order so that the answer is stable)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(n: str, path: list[str]) -> list[str] | None:
        if state.get(n) == 1:
            return path[path.index(n) :] + [n]
        if state.get(n) == 2:
            return None
        state[n] = 1
        for m in sorted(edges[n]):
            if (found := visit(m, path + [n])) is not None:
                return found
        state[n] = 2
        return None

    for n in sorted(edges):
        if (found := visit(n, [])) is not None:
            return found
    return None


def test_the_circle_finder_finds_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_afd_folders_form_no_cycle():
    folders = {p.name for p in (ROOT / "afd").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = {f: set() for f in folders}
    for f in _files("afd"):
        src = _folder(f)
        if src is None:
            continue
        for m in _imports(f):
            parts = m.split(".")
            if parts[0] == "afd" and len(parts) > 1 and parts[1] in folders and parts[1] != src:
                edges[src].add(parts[1])
    circle = find_circle(edges)
    assert circle is None, f"import cycle between afd folders: {' -> '.join(circle or [])}"
    benchers = {src for src, deps in edges.items() if "bench" in deps}
    assert benchers <= {"entrypoints"}, f"only afd.entrypoints may import afd.bench, not afd.{benchers}"
    planners = {src for src, deps in edges.items() if "plan" in deps}
    assert planners <= {"bench", "entrypoints"}, f"only afd.entrypoints and afd.bench may import afd.plan: {planners}"


def test_nothing_below_imports_the_entry_points():
    """afd/entrypoints (the CLI, afd.LLM, serve, launch, rebalance, plan) is the top floor: it may import any of
    afd, and nothing of afd or the node packages imports it (`python -m afd` aside; the tools reach afd.LLM as
    users do, `from afd import LLM`)."""
    for package in ("afd", "attention_node", "ffn_node"):
        for f in _files(package):
            if f.is_relative_to(ROOT / "afd" / "entrypoints") or f == ROOT / "afd" / "__main__.py":
                continue
            up = sorted(m for m in _imports(f) if m.startswith("afd.entrypoints"))
            assert not up, f"{f.relative_to(ROOT)} imports {up}"


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` a file imports, at any depth, but not under `if TYPE_CHECKING:`; `from pkg import
    mod` names the submodule alone (importing it runs pkg's __init__, which is not a dependency of the file's)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(m)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
        for m in ast.walk(n)
    }
    out: set[str] = set()
    for n in ast.walk(tree):
        if id(n) in typing_only:
            continue
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name in modules)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            subs = [f"{n.module}.{a.name}" for a in n.names]
            out.update(s for s in subs if s in modules)
            if n.module in modules and any(s not in modules for s in subs):
                out.add(n.module)
    return out


def test_no_import_circle_between_files():
    """No two modules of afd and the node packages import each other, directly or round a longer circle (function-
    local imports count: they hide a circle, they do not remove it)."""
    paths = {}
    for package in ("afd", "attention_node", "ffn_node"):
        for f in _files(package):
            parts = f.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    edges = {m: _module_imports(p, set(paths)) - {m} for m, p in paths.items()}
    circle = find_circle(edges)
    assert circle is None, f"import circle: {' -> '.join(circle or [])}"


def test_top_level_of_afd_is_small():
    modules = [p.name for p in (ROOT / "afd").glob("*.py")]
    assert len(modules) <= 8, modules


def test_device_sdks_only_in_the_backend():
    for package in ("afd", "attention_node", "ffn_node"):
        for f in _files(package):
            if f.is_relative_to(ROOT / "afd" / "backend"):
                continue
            assert not any(m.split(".")[0] in SDKS for m in _imports(f)), f"{f} imports a device SDK"


def test_every_flag_is_defined_in_one_place():
    """A flag afd.config.flags defines (the config's, generated from afd.config.schema, and the shared
    node flags) is defined nowhere else: no other module of the serving commands calls add_argument with its
    name. afd/bench is left out: its flags are benchmark parameters that share a name, not a meaning
    (`afd bench --model` is `vllm bench serve`'s model name to send; `bench-mtp --speculative-tokens 0,1,2`
    a sweep)."""
    from afd.config.flags import FLAGS, config_flags

    owned = {f.name for f in config_flags().values()} | {f.name for f in FLAGS.values()}
    found = []
    for package in ("afd", "attention_node", "ffn_node"):
        for f in _files(package):
            if f == ROOT / "afd" / "cluster" / "flags.py" or f.is_relative_to(ROOT / "afd" / "bench"):
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                    names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                    found += [f"{f.relative_to(ROOT)}: {n}" for n in names if n in owned]
    assert not found, "flags defined outside afd/config/flags.py: " + ", ".join(found)


def test_the_engine_parts_hand_each_other_records_not_tuples():
    """The step's parts (scheduler, runner, speculator, sampler, output processor) return records
    (afd/engine/messages.py), not tuples: no public method is annotated to return a tuple or returns a
    tuple display; and what crosses threads (the engine's inbox) or processes (the TP leader's
    broadcast) is never a tuple or dict display either."""
    parts = {
        "scheduler.py": "Scheduler",
        "runner.py": "ModelRunner",
        "speculative.py": "Speculator",
        "sampling.py": "Sampler",
        "output_processor.py": "OutputProcessor",
    }

    def tuple_annotation(node: ast.expr | None) -> bool:
        if node is None:
            return False
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ast.unparse(node)
        return any(t.strip().split("[")[0] in ("tuple", "Tuple", "typing.Tuple") for t in text.split("|"))

    engine = ROOT / "afd" / "engine"
    for name, cls_name in parts.items():
        tree = ast.parse((engine / name).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
                continue
            where = f"afd/engine/{name}: {cls_name}.{fn.name}"
            assert not tuple_annotation(fn.returns), f"{where} returns a tuple: return a record instead"
            for ret in ast.walk(fn):
                assert not (isinstance(ret, ast.Return) and isinstance(ret.value, ast.Tuple)), where
    for name in ("engine.py", "runner.py"):
        for call in ast.walk(ast.parse((engine / name).read_text())):
            sends = isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            if sends and call.func.attr in ("put", "put_nowait", "send_step"):
                assert not any(isinstance(a, (ast.Tuple, ast.Dict)) for a in call.args), (
                    f"afd/engine/{name}:{call.lineno}: a message as a tuple or dict"
                )


def _contract_hooks() -> set[str]:
    """Every member the family contract (afd/model/halves.py) declares on its base classes."""
    tree = ast.parse((ROOT / "afd" / "model" / "halves.py").read_text())
    hooks: set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                hooks.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                hooks.add(node.target.id)
    return hooks


def hook_probes(source: str, hooks: set[str]) -> list[str]:
    """getattr / hasattr calls in `source` that ask for a contract hook by name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in hooks
        ):
            out.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return out


def test_no_family_hook_is_probed_with_getattr_or_hasattr():
    """A family half declares every hook in afd/model/halves.py, with its default there: code calls the
    hook, it never asks whether the half has it."""
    hooks = _contract_hooks()
    assert {"supports_tp", "prefetch_weights", "mtp_layers", "keep_in_fp32", "post_load"} <= hooks
    assert hook_probes("ok = getattr(half, 'supports_tp', False)", hooks)  # the check sees a probe
    for package in ("afd", "attention_node", "ffn_node"):
        for f in _files(package):
            assert not hook_probes(f.read_text(), hooks), (
                f"{f} probes a family hook: {hook_probes(f.read_text(), hooks)}"
            )


def exchange_probes(source: str) -> list[str]:
    """getattr / hasattr calls in `source` on an MoE exchange (an expression naming `moe` or `exchange`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and any(w in ast.unparse(node.args[0]).lower() for w in ("moe", "exchange"))
        ):
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_no_exchange_is_probed_with_getattr_or_hasattr():
    """What an MoE exchange did in a step is the ExchangeStats its end_step returns (afd.dataplane.exchange):
    no caller asks an exchange for a counter it may not have."""
    assert exchange_probes("sent = getattr(self.runner.exchange(), 'bytes_sent', 0)")  # the check sees a probe
    for package in ("afd", "attention_node", "ffn_node"):
        for f in _files(package):
            assert not exchange_probes(f.read_text()), f"{f}: {exchange_probes(f.read_text())}"


def test_every_registered_family_keeps_the_contract():
    from afd.model import halves
    from afd.model.registry import FAMILIES

    for fam in FAMILIES.values():
        assert issubclass(fam.attention_half, halves.AttentionHalf), fam
        assert issubclass(fam.ffn_half, halves.FFNHalf), fam
        assert not fam.attention_half.__abstractmethods__ and not fam.ffn_half.__abstractmethods__, fam
        if fam.mtp_module is not None:
            block = fam.mtp_module.MTPBlock
            assert issubclass(block, halves.MTPBlock) and not block.__abstractmethods__, fam


# ---- one launcher: node processes are started only by afd/cluster/processes.py ------------------------

NODE_MODULES = ("attention_node.main", "ffn_node.main")
LAUNCHER = "afd/cluster/processes.py"
HELPER_PROCESSES = {"attention_node/large_bodies.py", "afd/cluster/forkserver.py"}
"""Files that start a child that is no node: the attention node's JSON parser for large bodies (standard
library only; it exits when the node closes its stdin), so that parsing holds the child's GIL, not the node's;
the launcher's fork server (it forks nodes only when the launcher asks, through NodeProcesses.start)."""


def _popen_calls(src: str) -> int:
    def popen(f) -> bool:
        return (isinstance(f, ast.Name) and f.id == "Popen") or (isinstance(f, ast.Attribute) and f.attr == "Popen")

    return sum(isinstance(n, ast.Call) and popen(n.func) for n in ast.walk(ast.parse(src)))


def _launch_violations(files: dict[str, str]) -> list[str]:
    """Inside the packages only the launcher starts processes; elsewhere, a file that starts processes
    names no node module (else it is a second node launcher). deploy/k8s/tp_node.py, a pod's rank
    supervisor (standard library only), runs the command it is given."""
    out = []
    for rel, src in files.items():
        if rel == LAUNCHER or rel in HELPER_PROCESSES or not _popen_calls(src):
            continue
        if rel.split("/")[0] in ("afd", "attention_node", "ffn_node"):
            out.append(f"{rel}: starts a process outside {LAUNCHER}")
        elif any(name in src for name in NODE_MODULES):
            out.append(f"{rel}: starts node processes outside {LAUNCHER}")
    return out


def test_node_processes_are_started_by_one_launcher():
    files = {
        str(p.relative_to(ROOT)): p.read_text()
        for p in ROOT.rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
    }
    assert _popen_calls(files[LAUNCHER]) == 1
    assert _launch_violations(files) == []
    # the rule catches both kinds of second launcher
    node = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-m', 'ffn_node.main'])\n"
    assert _launch_violations(
        {"tests/helper.py": node, "afd/bench/x.py": "from subprocess import Popen\nPopen(['ls'])"}
    ) == [
        f"tests/helper.py: starts node processes outside {LAUNCHER}",
        f"afd/bench/x.py: starts a process outside {LAUNCHER}",
    ]


def test_the_attention_side_is_assembled_in_one_place():
    """Halves.load (afd/engine/load.py) is the one place the attention half and the MTP layer are built from a
    checkpoint, for attention nodes, the colocated server and afd.LLM alike (an FFN node builds only the
    experts it holds)."""
    builders = ("build_attention_half", "build_mtp_layer")
    callers = set()
    for package in ("afd", "attention_node", "ffn_node"):
        for f in _files(package):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in builders:
                    callers.add(str(f.relative_to(ROOT)))
    assert callers == {"afd/engine/load.py"}, callers


def test_configuration_is_the_ground_floor():
    """afd/config (the cluster YAML's schema, what each field declares, the loader, the generated flags,
    placement and the TP layout) imports nothing of afd but afd/quant: every other part may read a config."""
    for f in _files("afd/config"):
        up = sorted(m for m in _imports(f) if m.startswith("afd.") and m.split(".")[1] not in ("config", "quant"))
        assert not up, f"{f.relative_to(ROOT)} imports {up}"
