"""The link part of `afd profile`: one-way time of the data plane's messages against their size, between this
process (the attention end) and one child process (the FFN end), over the same transport the nodes use.

The pair is formed as an attention/FFN pair forms (afd.dataplane.pairs.PairLink): two two-rank groups from
the backend's `pair_group`, one per direction, over a prefix of one store; messages go as the exchange sends
them (`send`/`recv` of one tensor on the direction's group). Each size is a ping-pong (the attention end
sends, the FFN end receives it and sends it back on the other group), timed on the attention end; half the
round trip is the one-way time. That is the link as the data plane sees it, the transport's per-message
cost included; on one machine it is loopback TCP (gloo), not a NIC.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from afd.cluster.processes import Command, NodeProcesses

DEFAULT_SIZES = tuple(4**k for k in range(3, 12))  # 64 B .. 4 MiB
"""Message sizes in bytes: a decode step's MoE input of a few rows up to a prefill chunk's."""


@dataclass(frozen=True)
class LinkSample:
    nbytes: int
    seconds: float
    """Median one-way time (half the round trip)."""
    fastest: float = 0.0
    """The fastest one-way time: on a busy machine the median carries the wait for a core to wake the
    receiver (milliseconds on 2 shared cores), the fastest does not."""


def _pair(store, rank: int, timeout_s: float):
    """(to-ffn, to-attention): an attention/FFN pair's two groups over `store`, as PairLink forms them."""
    import torch.distributed as dist

    from afd.backend import get_backend

    backend = get_backend("cpu")
    names = [f"afd/profile/{d}" for d in ("to-ffn", "to-attention")]
    return tuple(
        backend.pair_group(dist.PrefixStore(f"{name}/", store), rank, timedelta(seconds=timeout_s), name)
        for name in names
    )


def _ffn_end(host: str, port: int, sizes: tuple[int, ...], rounds: int, timeout_s: float) -> None:
    """The child: receives each message on to-ffn and sends it back on to-attention."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(host, port, 2, False, timedelta(seconds=timeout_s))
    to_ffn, to_attention = _pair(store, 1, timeout_s)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(rounds):
        for buf in bufs:
            to_ffn.recv([buf], 0, 0).wait()
            to_attention.send([buf], 0, 0).wait()


def measure_link(
    host: str = "127.0.0.1", sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 20, timeout_s: float = 60.0
) -> list[LinkSample]:
    """Median one-way seconds per message size (each size sent `repeats` times after 2 untimed rounds). The
    FFN end is a child started by afd's one launcher (afd.cluster.processes), stopped when this returns."""
    import torch.distributed as dist

    rounds = repeats + 2
    master = dist.TCPStore(host, 0, 2, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where afd/ is
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    args = [host, str(master.port), ",".join(map(str, sizes)), str(rounds), str(timeout_s)]
    argv = (sys.executable, "-m", "afd.plan.profile_link", *args)
    with NodeProcesses() as procs:
        procs.start(Command("link-ffn", argv, stage="ffn"), env=env)
        out = _ping_pong(_pair(master, 0, timeout_s), sizes, rounds)
        procs.wait_exit(timeout_s, "the link's FFN end")
    return out


def _ping_pong(pair, sizes: tuple[int, ...], rounds: int) -> list[LinkSample]:
    import torch

    to_ffn, to_attention = pair
    bufs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    for r in range(rounds):  # sizes interleaved: the machine's slow spells hit every size alike
        for buf, ts in zip(bufs, times):
            t0 = time.perf_counter()
            to_ffn.send([buf], 1, 0).wait()
            to_attention.recv([buf], 1, 0).wait()
            if r >= 2:
                ts.append((time.perf_counter() - t0) / 2)
    return [LinkSample(n, statistics.median(ts), min(ts)) for n, ts in zip(sizes, times)]


if __name__ == "__main__":  # the FFN end: python -m afd.plan.profile_link HOST PORT SIZES ROUNDS TIMEOUT
    _h, _p, _s, _r, _t = sys.argv[1:6]
    _ffn_end(_h, int(_p), tuple(int(x) for x in _s.split(",")), int(_r), float(_t))
