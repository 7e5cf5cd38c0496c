"""`afd bench-graph --ffn`: does compiling the FFN half's layer pay on CPU? (graph mode compiles
it wherever that measures faster).

One MoE layer of the FFN half (router, then the experts this node holds), on one thread, T tokens: eager
vs `torch.compile` with inductor at static shapes. The layer cannot be one graph: which experts a token
reaches is data (`nonzero`, and the grouped GEMM's group sizes read on the host), so dynamo compiles the
routing and the expert-slot bookkeeping and breaks at those reads; the GEMMs run as they do eager. Each
case is the median of --ffn-calls timed calls; the cases are interleaved over --repeats rounds with the
order rotating, and the compiled layer must give the eager output (fp32, 1e-5).
"""

from __future__ import annotations

import time

from afd.bench.common import interleaved, median


def section_ffn(model: str, tokens: list[int], repeats: int, calls: int = 30) -> dict:
    import torch

    from afd.backend import get_backend
    from afd.backend.cpu import CpuBackend
    from afd.backend.cpu_packed import unpack
    from afd.model.checkpoint import build_ffn_half, open_reader
    from afd.model.registry import load_config

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg, backend = load_config(model), get_backend("cpu")
        assert isinstance(backend, CpuBackend)  # what get_backend("cpu") returns: its graph_compiler below
        ffn = build_ffn_half(cfg, open_reader(model, True, 0), torch.float32, backend.device)
        unpack(ffn)  # what afd.model.ffn_graph compiles: the plain weights
        layer = next(i for i in range(cfg.num_layers) if _is_moe(ffn, i))

        def eager(m):
            return ffn(backend, layer, m)

        compiled = torch.compile(eager, backend=backend.graph_compiler, dynamic=False)  # inductor
        gen = torch.Generator().manual_seed(0)
        inputs = {T: torch.randn(T, cfg.hidden_size, generator=gen) for T in tokens}
        compile_s = {}
        for T, x in inputs.items():  # compiles (one graph set per T), and checks the compiled layer
            t0 = time.perf_counter()
            got = compiled(x)
            compile_s[T] = time.perf_counter() - t0
            torch.testing.assert_close(got, eager(x), rtol=1e-5, atol=1e-5)
        fns = {"eager": eager, "compile": compiled}

        def one(name: str, r: int) -> float:
            T, mode = name.split(" ")
            fn, x = fns[mode], inputs[int(T[2:])]
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            return 1e3 * median(times)

        names = [f"T={T} {m}" for T in tokens for m in fns]
        rounds = interleaved(names, repeats, one, lambda m: print(f"  .. {m}", flush=True))
        return {
            "layer": layer,
            "calls": calls,
            "compile_seconds": compile_s,
            "results_ms": {k: median(v) for k, v in rounds.items()},
            "rounds": rounds,
        }
    finally:
        torch.set_num_threads(before)
        torch._dynamo.reset()


def _is_moe(ffn, i: int) -> bool:
    """Layer i of the FFN half holds experts (DeepSeek-V3's first layers are dense: nothing to route)."""
    try:
        return ffn.layer(i) is not None
    except (IndexError, KeyError):
        return False


def print_ffn(res: dict) -> None:
    r = res["results_ms"]
    print(
        f"\nFFN half, one MoE layer (layer {res['layer']}), one thread: ms per call, median of {res['calls']} "
        "calls, then of rounds (compiled: inductor at static shapes, graph breaks where routing is data):\n"
    )
    print("| tokens T | eager ms | compiled ms | eager / compiled | first compile s |")
    print("|---|---|---|---|---|")
    for key in [k for k in r if k.endswith(" eager")]:
        T = key.split(" ")[0]
        e, c = r[key], r[f"{T} compile"]
        print(f"| {T[2:]} | {e:.3f} | {c:.3f} | {e / c:.2f}x | {res['compile_seconds'][int(T[2:])]:.1f} |")
