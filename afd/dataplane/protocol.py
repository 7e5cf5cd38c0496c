"""Every data-plane message between attention and FFN nodes, and the order they come in.

Per forward step, between each attention node a and each FFN node f (NCCL and HCCL ignore tags, so
this order is the protocol):

    a -> f   StepHeader                              (HEADER_LEN int64)
    for layer in 0..L-1, for micro-batch i in 0..M-1 with tokens_i > 0:
        a -> f   m  [tokens_i, hidden]               (MoE input, the model dtype; layout.exchange_dtype
                                                      fp8 or int8: uint8 [tokens_i, hidden + 4], see below)
        f -> a   y  [tokens_i, hidden]               (f's share of the MoE output, the model dtype)

With `layout.routing: attention` the attention rank runs the router and each (layer, micro-batch) is,
for every FFN node f it exchanges with (afd.dataplane.dispatch):

    a -> f   count  [1] int64                        (n: how many of the tokens_i rows go to f)
    a -> f   rows   uint8 [n, row_bytes]             (if n > 0: each token's MoE input as above, then its
                                                      K expert ids as int32 and K weights as float32; an id
                                                      of -1 is a slot another node computes)
    f -> a   y      [n, hidden]                      (if n > 0: f's weighted sum over the slots it got)

so a token crosses only to the nodes holding one of its chosen experts; identity experts stay on the
attention side. The FFN node learns n from the count before it posts the rows' receive.

With `layout.exchange_dtype` fp8 or int8 (every node reads it from the YAML), `m` crosses quantized, one
message still: each row is the token's hidden bytes quantized (float8_e4m3fn bits, or symmetric int8)
followed by the 4 bytes of its float32 scale, dequantized by the FFN node before the experts (`quantize`,
`dequantize`). Bytes per layer and direction: `exchange_bytes`.

Both sides know every size from the header, so each message goes into a preallocated buffer and an
FFN node needs no request state. A header with LEAVE says a has no more steps; SHUTDOWN stops f.
Each pair's messages start afresh (step 0) whenever the pair forms (afd.dataplane.pairs).

An attention node with nothing to run sends an IDLE header instead (it keeps its FFN peers' step
going and tells them it is alive); f answers it, once the step is done, with an IdleAck:

    f -> a   IdleAck  (1 int64: how many attention peers had work in that step)

so an idle node paces itself by the busy nodes' steps and backs off only when all are idle.

Which layers a step runs is in its header: the model's MoE layers (cfg.moe_layers), or, with the MTP
flag, only the multi-token-prediction module's MoE layer (the FFN half's `mtp_layers`, an index after
the decoder's layers: DeepSeek-V3's `num_hidden_layers`). Speculative decoding sends such a step after
each forward step, to draft the next tokens; an FFN node serving several attention nodes runs the
union of their steps' layers in increasing order, each peer's tokens only in the layers its header
names, so every pair still sees its messages in its own order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are made: `afd check-config` reads exchange_bytes without it
    import torch

MAGIC = 0xAFD0
MAX_MICRO_BATCHES = 4
HEADER_LEN = 4 + MAX_MICRO_BATCHES

FLAG_LEAVE = 1
"""The sender will send nothing more; the FFN node stops waiting for it."""
FLAG_SHUTDOWN = 2
"""The FFN node exits after this header."""
FLAG_IDLE = 4
"""No tokens this step: a heartbeat from an attention node with nothing to run."""
# 8 was REFORM (a whole-plane generation change), retired with per-pair worlds; a header carrying it is refused
FLAG_MTP = 16
"""The step runs only the MTP module's MoE layer (afd.model.mtp), not the decoder's MoE layers."""


IDLE_ACK_LEN = 1


class ProtocolError(RuntimeError):
    """A peer sent something that is not a valid message at this point of the protocol."""


@dataclass(frozen=True)
class StepHeader:
    step_id: int
    tokens: tuple[int, ...] = field(default_factory=tuple)
    """Token count of each micro-batch (at most MAX_MICRO_BATCHES)."""
    flags: int = 0

    def __post_init__(self):
        if len(self.tokens) > MAX_MICRO_BATCHES:
            raise ValueError(f"{len(self.tokens)} micro-batches; at most {MAX_MICRO_BATCHES}")

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    def encode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        t = out if out is not None else torch.empty(HEADER_LEN, dtype=torch.int64)
        t.zero_()
        t[0], t[1], t[2], t[3] = MAGIC, self.step_id, self.flags, len(self.tokens)
        if self.tokens:
            t[4 : 4 + len(self.tokens)] = torch.tensor(self.tokens, dtype=torch.int64)
        return t

    @classmethod
    def decode(cls, t: torch.Tensor, sender: int) -> StepHeader:
        from afd.backend import host_syncs

        return cls.from_values(host_syncs.to_list(t), sender)

    @classmethod
    def from_values(cls, v: list[int], sender: int) -> StepHeader:
        """A header from its HEADER_LEN values, read on the host (a receiver of several reads them at once)."""
        if v[0] != MAGIC:
            raise ProtocolError(f"rank {sender}: expected a step header, got magic {v[0]:#x}")
        m = v[3]
        if not 0 <= m <= MAX_MICRO_BATCHES or any(n < 0 for n in v[4 : 4 + m]):
            raise ProtocolError(f"rank {sender}: malformed step header {v}")
        return cls(step_id=v[1], tokens=tuple(v[4 : 4 + m]), flags=v[2])


# ---- the MoE input's wire format (layout.exchange_dtype) ------------------------------------------------

DIRECTIONS = ("to_ffn", "to_attention")
"""afd_exchange_bytes_total's directions: the MoE inputs an attention rank sends, the results it receives."""
SCALE_BYTES = 4
"""A quantized row's scale: float32, after its hidden bytes."""
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QMAX = {"int8": 127.0, "fp8": 448.0}
"""The largest magnitude of each 8-bit format: symmetric int8 (-127..127), float8_e4m3fn (max normal 448)."""


def element_bytes(dtype) -> int:
    """Bytes per element of a model dtype: its name (float32, bfloat16, float16) or a torch.dtype."""
    return _ELEMENT_BYTES[dtype] if isinstance(dtype, str) else dtype.itemsize


def packed_width(hidden: int, exchange_dtype: str) -> int:
    """Bytes per row of a quantized MoE input: one byte per hidden element, then the float32 scale."""
    if exchange_dtype not in QMAX:
        raise ValueError(f"layout.exchange_dtype: {exchange_dtype!r} is not quantized ({', '.join(QMAX)})")
    return hidden + SCALE_BYTES


def exchange_bytes(tokens: int, hidden: int, dtype, exchange_dtype: str = "same") -> dict[str, int]:
    """Bytes one attention rank exchanges with one FFN node per MoE layer for `tokens` tokens, by direction
    (DIRECTIONS): the MoE input T * H elements of the model dtype, or T * (H + 4) bytes quantized; the
    result T * H elements of the model dtype. What RemoteMoE counts (afd_exchange_bytes_total)."""
    b = element_bytes(dtype)
    if exchange_dtype == "same":
        to_ffn = tokens * hidden * b
    else:
        to_ffn = tokens * packed_width(hidden, exchange_dtype)
    return {"to_ffn": to_ffn, "to_attention": tokens * hidden * b}


def _bits_dtype(exchange_dtype: str) -> torch.dtype:
    import torch

    return {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[exchange_dtype]


def quantize(m: torch.Tensor, exchange_dtype: str) -> torch.Tensor:
    """The message of MoE input `m` [T, H]: uint8 [T, H + 4], each row's elements divided by its scale
    (absmax / QMAX: dynamic, per token) in 8 bits, then the scale's float32 bytes. One message per
    (layer, micro-batch) rather than the bits and the scales apart: no extra op (and wait, and an op's fixed
    cost, next to a decode step's few KiB) per layer, and the FFN node receives every peer's rows into one
    buffer as before. uint8 on the wire on every backend: HCCL's dtypes as the fake models them
    (HCCL_DTYPES) have no float8, and gloo's send of float8_e4m3fn, which it accepts on CPU (checked with
    torch 2.13's gloo), would carry the same bytes."""
    import torch

    from afd.quant.formats import quantize_rows_fp8, quantize_rows_int8

    if exchange_dtype == "int8":
        bits, scale = quantize_rows_int8(m)
    else:  # one group of the whole row: a scale per token
        bits, scale = quantize_rows_fp8(m, m.shape[1])
    return torch.cat([bits.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def dequantize(packed: torch.Tensor, exchange_dtype: str, out: torch.Tensor) -> torch.Tensor:
    """`out` [T, H] (the model dtype) = the rows of a quantized MoE input `packed` [T, H + 4] times their
    scales, computed in float32 and rounded once to out's dtype."""
    import torch

    hidden = out.shape[1]
    bits = packed[:, :hidden].view(_bits_dtype(exchange_dtype))
    scale = packed[:, hidden:].contiguous().view(torch.float32)  # [T, 1]; copied: a row's offset may not be 4-aligned
    return torch.mul(bits.to(torch.float32), scale, out=out)


# ---- layout.routing attention: the dispatched rows ---------------------------------------------------

COUNT_BYTES = 8
"""The per-(layer, micro-batch) count each FFN node gets before its rows: one int64."""
ROUTE_BYTES = 8
"""Per chosen expert of a dispatched row: its id (int32) and its weight (float32)."""


def hidden_bytes(hidden: int, dtype, exchange_dtype: str = "same") -> int:
    """Bytes of one token's MoE input on the wire: hidden elements of the model dtype, or packed (H + 4)."""
    return hidden * element_bytes(dtype) if exchange_dtype == "same" else packed_width(hidden, exchange_dtype)


def row_bytes(hidden: int, dtype, top_k: int, exchange_dtype: str = "same") -> int:
    """Bytes of one dispatched row: the token's MoE input, then K ids and K weights."""
    return hidden_bytes(hidden, dtype, exchange_dtype) + top_k * ROUTE_BYTES


def dispatch_bytes(rows: list[int], hidden: int, dtype, top_k: int, exchange_dtype: str = "same") -> dict[str, int]:
    """Bytes one attention rank exchanges in one (layer, micro-batch) under routing attention, by direction,
    where rows[f] tokens go to FFN node f: a count to every node, each node's rows, and a result row back
    per row sent. What RoutedMoE counts (afd_exchange_bytes_total)."""
    n = sum(rows)
    return {
        "to_ffn": COUNT_BYTES * len(rows) + n * row_bytes(hidden, dtype, top_k, exchange_dtype),
        "to_attention": n * hidden * element_bytes(dtype),
    }


def pack_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One message of dispatched rows: x [n, *] (the MoE input, or its quantized bytes), ids [n, K]
    (int32 on the wire), weights [n, K] (float32) -> uint8 [n, row_bytes]."""
    import torch

    parts = [x.contiguous().view(torch.uint8), ids.to(torch.int32).view(torch.uint8), weights.float().view(torch.uint8)]
    return torch.cat(parts, dim=1)


def unpack_rows(packed: torch.Tensor, width: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_rows: (x bytes uint8 [n, width], ids int64 [n, K], weights float32 [n, K]); the
    caller views x's bytes as the model dtype (or dequantizes them). Copied out: a column slice of a row
    may not be aligned for a wider dtype."""
    import torch

    x = packed[:, :width]
    ids = packed[:, width : width + 4 * top_k].contiguous().view(torch.int32).to(torch.int64)
    w = packed[:, width + 4 * top_k :].contiguous().view(torch.float32)
    return x, ids, w


EXCHANGE_TABLE_TOKENS = (1, 16, 64, 512)


def exchange_table(
    hidden: int, moe_layers: int, ffn_nodes: int, dtype: str, exchange_dtype: str, tokens=EXCHANGE_TABLE_TOKENS
) -> str:
    """What `afd check-config` prints for a disaggregated YAML: exchange_bytes per MoE layer and FFN node,
    and per step (every MoE layer, every FFN node: each gets the whole input), for a few token counts."""

    def human(n: int) -> str:
        for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if n >= scale:
                return f"{n / scale:.1f} {unit}"
        return f"{n} B"

    width = 12
    lines = [
        f"MoE exchange per attention rank (layout.exchange_dtype {exchange_dtype}, model {dtype}, hidden {hidden})",
        "  bytes as afd_exchange_bytes_total counts them (afd.dataplane.protocol.exchange_bytes)",
        f"    {'':<32}" + "".join(f"{'T=' + str(t):>{width}}" for t in tokens),
    ]
    for d in DIRECTIONS:
        per_layer = [exchange_bytes(t, hidden, dtype, exchange_dtype)[d] for t in tokens]
        lines.append(f"    {d + ' per layer and node':<32}" + "".join(f"{human(n):>{width}}" for n in per_layer))
        step = [n * moe_layers * ffn_nodes for n in per_layer]
        lines.append(f"    {d + ' per step':<32}" + "".join(f"{human(n):>{width}}" for n in step))
    lines.append(f"  per step: {moe_layers} MoE layer(s) x {ffn_nodes} FFN node(s)")
    return "\n".join(lines)
