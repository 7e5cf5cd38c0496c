"""Kernels chosen by timing them on the machine at hand, once per machine.

One operation (a dense or grouped GEMM, plain or 8-bit) has several kernels that compute its numbers, and which
is fastest depends on the CPU, not on its feature flags alone. At 16 rows of a [2048 x 1024] weight, one thread:
bf16 F.linear took 2.5 ms on an AVX-512 CPU without AVX-512 BF16 and fp32 1.1 ms, where a CPU with AVX-512 BF16
ran bf16 2-2.7x faster than fp32; torch._int_mm took 0.22 ms with VNNI and 66 ms on an AVX2-only CPU.

So the first call of each case (operation, dtype, weight shape, row class) times every candidate that computes
the case's numbers on this machine, in interleaved rounds whose order rotates, and keeps the fastest median. The
choice is logged once, exported (afd_kernel_info) and written to the kernel cache, keyed by the machine (CPU
model and flags, torch's version and CPU capability, the ISA limits in the environment, threads): the next start,
and every node of this machine, takes it without timing. A file lock makes the nodes of one machine agree: the
one that times a case writes it before another reads it. Under torch.compile's tracing nothing is timed (the
cached choice, else the first candidate).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from afd.cache_dir import cache_dir

log = logging.getLogger("afd.backend")

FORCE_ENV = "AFD_KERNELS"
"""Kernels named rather than timed: "fp32" (every operation that offers it), or "linear=native,w8a8_grouped=fp32"
(one operation's). What a test that holds afd to another program bit for bit sets, so that both run one kernel."""
CACHE_ENV = "AFD_KERNEL_CACHE"
"""The kernel cache's path; empty: none (every process times its cases)."""
ISA_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
"""Environment variables that change which instructions torch's CPU kernels use (make test-avx2 sets them)."""
ROUNDS = 5
MIN_RUN_S = 5e-4
"""A candidate faster than this is run several times per timing, so that the timer's own cost does not decide."""
OUT_OF_RACE = 4.0
LOCK_WAIT_S = 60.0


def row_class(rows: int) -> int:
    """The rows a case is timed at: 1 (a decode step of a few sequences), 16, 64, or 256 (prefill)."""
    return 1 if rows <= 4 else 16 if rows <= 32 else 64 if rows <= 128 else 256


@dataclass(frozen=True)
class Case:
    """op: the operation (linear, grouped, w8a8_linear, w8a8_grouped); dtype: the activations' and output's;
    k, n: the weight's in and out features; rows: the row class (row_class)."""

    op: str
    dtype: str
    k: int
    n: int
    rows: int

    @property
    def label(self) -> str:
        return f"{self.op} {self.dtype} {self.k}x{self.n} T{self.rows}"


@dataclass
class Choice:
    kernel: str
    medians_ms: dict[str, float] = field(default_factory=dict)
    """Each timed candidate's median, in ms (empty where the cache gave the choice without its figures)."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Candidates not timed, and why (they compute other numbers on this machine)."""
    source: str = "timed"

    def describe(self, case: Case) -> str:
        timed = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(self.medians_ms.items(), key=lambda kv: kv[1]))
        out = f"{case.label}: {self.kernel} ({self.source}{': ' + timed if timed else ''})"
        return out + "".join(f"; {k} left out: {why}" for k, why in self.left_out.items())


def cpu_info() -> tuple[str, list[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo ("unknown CPU", [] without one)."""
    model, flags = "unknown CPU", []
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):  # noqa: SIM115 (read to the first processor's flags)
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = sorted(value.split())
                break
    return model, flags


def machine_key() -> str:
    """What a kernel's speed depends on besides the case: the CPU, torch, the ISA limits (machine_prefix), and
    this process's threads."""
    return f"{machine_prefix()} | {torch.get_num_threads()} thread(s)"


def machine_prefix() -> str:
    model, flags = cpu_info()
    digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12]
    isa = "".join(f" {k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k))
    return f"{model} | flags {digest} | torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}{isa}"


def forced(op: str) -> str | None:
    """The kernel FORCE_ENV names for `op`, if it names one."""
    return _forced(os.environ.get(FORCE_ENV, ""), op)


@functools.lru_cache(maxsize=64)
def _forced(setting: str, op: str) -> str | None:
    named = None
    for entry in setting.split(","):
        key, eq, value = entry.strip().partition("=")
        if eq and key == op:
            return value
        if not eq and key:
            named = key
    return named


def default_cache_path() -> str:
    """CACHE_ENV, else kernels.json in afd's cache folder (afd.cache_dir)."""
    return os.environ[CACHE_ENV] if CACHE_ENV in os.environ else os.path.join(cache_dir(), "kernels.json")


class KernelChoice:
    """The choices of one process: choose() at each call, timing a case the first time it is met."""

    def __init__(self, path: str | None = None, timer: Callable[[], float] = time.perf_counter):
        self.path = default_cache_path() if path is None else path
        self.timer = timer
        self._chosen: dict[Case, Choice] = {}
        self._lock = threading.Lock()
        self._timing = threading.local()
        """The case this thread is timing, if any: a candidate that meets another case raises, not hangs."""
        self._machine: str | None = None

    @property
    def machine(self) -> str:
        if self._machine is None:
            self._machine = machine_key()
        return self._machine

    def choose(
        self, case: Case, kernels: dict[str, Callable], inputs: Callable[[], tuple], left_out: dict[str, str]
    ) -> str:
        """The kernel for `case` among `kernels` (name -> the kernel; the first is the default) less those
        `left_out` (name -> why: they compute other numbers here): named in FORCE_ENV, chosen before, cached for
        this machine, or timed now, each kernel run on inputs() (made once: the case's row class)."""
        offered = [name for name in kernels if name not in left_out]
        named = forced(case.op)
        if named in offered:  # before what was chosen: a test may set it on the way
            return named
        choice = self._chosen.get(case)
        if choice is not None:
            return choice.kernel
        if torch.compiler.is_compiling():  # no timing inside a trace
            return offered[0]
        if self._lock.locked() and getattr(self._timing, "case", None) is not None:
            # this thread holds the lock and the cache's file lock: waiting on them again would never end
            raise RuntimeError(f"kernel choice: {case.label} met while timing {self._timing.case.label}")
        with self._lock:
            if case not in self._chosen:
                self._chosen[case] = self._choose(case, {n: kernels[n] for n in offered}, inputs, left_out)
                log.info("kernel %s", self._chosen[case].describe(case))
        return self._chosen[case].kernel

    def choices(self) -> dict[Case, Choice]:
        return dict(self._chosen)

    def _choose(self, case: Case, kernels: dict[str, Callable], inputs: Callable[[], tuple], left_out) -> Choice:
        if len(kernels) == 1:
            return Choice(next(iter(kernels)), left_out=left_out, source="the only candidate")
        with self._file_lock():
            cached = self._read().get(case.label)
            if cached is not None and cached.get("kernel") in kernels:
                return Choice(cached["kernel"], cached.get("medians_ms", {}), left_out, "cached")
            self._timing.case = case
            try:
                args = inputs()
                medians = self.time({name: functools.partial(k, *args) for name, k in kernels.items()})
            finally:
                self._timing.case = None
            choice = Choice(min(medians, key=medians.__getitem__), medians, left_out)
            self._write(case, choice)
        return choice

    def time(self, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Each candidate's median time in ms over ROUNDS rounds, every round running each once, in an order
        that rotates (the machine is shared: a slow moment falls on a different candidate each round). A candidate
        whose first run took over OUT_OF_RACE times the fastest first run is not run again (its figure is that
        run): bf16's own GEMM held to AVX2 took 2.2 s where the fp32 one took 15 ms, and a start should not pay
        for it ROUNDS times over."""
        first, reps = {}, {}
        for name, run in runs.items():  # warm (first-call costs) and size each run to MIN_RUN_S
            t0 = self.timer()
            run()
            first[name] = self.timer() - t0
            reps[name] = max(1, min(50, int(MIN_RUN_S / max(first[name], 1e-9))))
        fastest = min(first.values())
        names = [n for n in runs if first[n] <= OUT_OF_RACE * fastest or first[n] < MIN_RUN_S]
        samples: dict[str, list[float]] = {name: [] for name in names}
        for r in range(ROUNDS):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                run, n = runs[name], reps[name]
                t0 = self.timer()
                for _ in range(n):
                    run()
                samples[name].append((self.timer() - t0) / n * 1e3)
        return {name: statistics.median(samples[name]) if name in samples else first[name] * 1e3 for name in runs}

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """The cache's lock, so that the nodes of a machine time each case once and agree; past LOCK_WAIT_S (a
        process stuck holding it) this one times without it."""
        if not self.path:
            yield
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path + ".lock", "a") as f:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("kernel cache %s: locked for over %gs; timing without it", self.path, LOCK_WAIT_S)
                        yield
                        return
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read_all(self) -> dict:
        if not self.path:
            return {}
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):  # none yet, or unreadable: timed again and rewritten
            return {}
        return data if isinstance(data, dict) else {}

    def _read(self) -> dict:
        mine = self._read_all().get(self.machine)
        return mine if isinstance(mine, dict) else {}

    def _write(self, case: Case, choice: Choice) -> None:
        if not self.path:
            return
        data = self._read_all()
        data.setdefault(self.machine, {})[case.label] = {"kernel": choice.kernel, "medians_ms": choice.medians_ms}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: the choice holds for this process
            log.warning("kernel cache %s not written: %s", self.path, e)


FLAGS_OF_NOTE = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
"""The CPU flags that decide which kernels torch has fast (the rest are in machine_key's digest)."""


def environment() -> dict:
    """What `afd env` prints: the machine as the kernel cache keys it, the flags of note, torch, and this
    machine's cached kernel choices at each thread count a node ran with."""
    from afd.backend.cpu_quant import int_mm_exact

    model, flags = cpu_info()
    choice = KernelChoice()
    machine = machine_prefix()
    kernels = {}
    for key, entries in choice._read_all().items():
        if key.startswith(machine + " | ") and isinstance(entries, dict):
            threads = key.removeprefix(machine + " | ")
            kernels.update({f"{label} ({threads})": entry for label, entry in entries.items()})
    return {
        "machine": machine,
        "cpu": model,
        "cpu_flags": " ".join(f for f in FLAGS_OF_NOTE if f in flags) or "(none of note)",
        "torch": f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}",
        "threads": torch.get_num_threads(),
        "int_mm_exact": int_mm_exact(),
        "kernel_cache": choice.path or "(none)",
        "kernels": kernels,
    }


_PROCESS: KernelChoice | None = None


def process_choice() -> KernelChoice:
    """This process's choices (the backend's kernels consult it; the node's metrics read it)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = KernelChoice()
    return _PROCESS
