"""`afd bench-paged`: a tiny run end to end (two contexts, two chunk sizes and the gather): the table and
the JSON, whose figures come from every implementation at every context."""

from __future__ import annotations

import json

from bench_helpers import TINY_LONGCAT, bench_args

from afd.bench import paged as bench_paged
from afd.bench.paged_gather import BEFORE
from afd.model import paged_attention


def test_tiny_run_times_every_implementation_at_every_context(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LONGCAT))
    out = tmp_path / "paged.json"
    argv = ["--model", str(tmp_path), "--contexts", "8,40", "--chunks", "1,64", "--batch-size", "2"]
    args = bench_args(bench_paged, "bench-paged", argv + ["--steps", "2", "--repeats", "1", "--output", str(out)])
    chunk = paged_attention.CHUNK_BLOCKS
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "| 40 |" in table and "gather (before) / paged chunk=1" in table
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"8", "40"}
    for r in results.values():
        assert set(r) == {"paged chunk=1", "paged chunk=64", BEFORE, "ratio"}
        assert all(v > 0 for v in r.values())
    assert chunk == paged_attention.CHUNK_BLOCKS  # the benchmark's patches end with it
