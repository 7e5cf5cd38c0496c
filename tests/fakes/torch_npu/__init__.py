"""A fake torch_npu for CPU tests (tests/fakes is put on sys.path only by tests that ask for it).

Importing it does what importing torch_npu does for afd: registers the "npu" device and `torch.npu`
(device.py, with its streams in streams.py, its memory in memory.py and its counts in syncs.py), npu
generators (generator.py), the "hccl" process group (hccl.py, its works' waits in hccl_work.py, its collectives
in hccl_collectives.py) and the fused ops afd calls (ops.py, which loads
npu_grouped_matmul from ops_grouped_matmul.py, npu_prefetch from ops_prefetch.py and npu_mm_reduce_scatter_base
from ops_mm_reduce_scatter.py; ops_attention.py, the router's npu_moe_gating_top_k in ops_gating.py,
ops_prolog.py, the weight format casts ops_prolog.py checks in ops_format.py, and the quantized GEMMs in
ops_quant.py, whose npu_grouped_matmul takes the quantized scenarios and hands the others to
ops_grouped_matmul.py's). Each module says which behaviour of the real package it reproduces, and where that
behaviour is documented.
"""

import atexit
import json
import os
import threading
import time

from . import device as npu
from . import generator, hccl
from .ops import npu_mm_reduce_scatter_base, npu_prefetch  # noqa: F401  (torch_npu.<op>)
from .ops_attention import npu_fused_infer_attention_score  # noqa: F401
from .ops_format import get_npu_format, npu_format_cast  # noqa: F401
from .ops_gating import npu_moe_gating_top_k  # noqa: F401  (torch_npu.<op>)
from .ops_prolog import npu_mla_prolog_v3  # noqa: F401
from .ops_quant import (  # noqa: F401  (after .ops: its npu_grouped_matmul hands unquantized calls to ops_grouped_matmul.py's op)
    npu_dynamic_quant,
    npu_grouped_matmul,
    npu_quant_matmul,
    npu_weight_quant_batchmatmul,
)

__version__ = "0.0.0+fake"
FAKE_ONLY = ("report", "FAKE_ONLY")
"""Public names here that torch_npu has not: the fake's own counters. Every other public name is torch_npu
2.14.0's, with its registered schema's arguments (tests/test_vendor_npu.py holds both)."""

npu.install()
generator.install()
hccl.install()


def report() -> dict:
    return {"device": {k: v for k, v in npu.STATS.items()}, "hccl": dict(hccl.STATS)}


def _write_report() -> None:
    path = os.environ.get("AFD_FAKE_NPU_REPORT")
    if path:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(report(), f)
        os.replace(tmp, f"{path}.{os.getpid()}.json")


def _keep_writing() -> None:
    # afd's nodes leave by os._exit (no atexit): the report is rewritten twice a second instead (or every
    # AFD_FAKE_NPU_REPORT_S seconds, for a test that compares it with another count at one moment)
    every = float(os.environ.get("AFD_FAKE_NPU_REPORT_S", "0.5"))
    while True:
        _write_report()
        time.sleep(every)


atexit.register(_write_report)
if os.environ.get("AFD_FAKE_NPU_REPORT"):
    threading.Thread(target=_keep_writing, name="fake-npu-report", daemon=True).start()
