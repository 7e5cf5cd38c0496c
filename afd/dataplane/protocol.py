"""Every data-plane message between attention and FFN nodes, and the order they come in.

Per forward step, between each attention node a and each FFN node f (NCCL and HCCL ignore tags, so
this order is the protocol):

    a -> f   StepHeader                              (HEADER_LEN int64)
    for layer in 0..L-1, for micro-batch i in 0..M-1 with tokens_i > 0:
        a -> f   m  [tokens_i, hidden]               (MoE input, the model dtype)
        f -> a   y  [tokens_i, hidden]               (f's share of the MoE output)

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

import torch

from afd.backend import host_syncs

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
        t = out if out is not None else torch.empty(HEADER_LEN, dtype=torch.int64)
        t.zero_()
        t[0], t[1], t[2], t[3] = MAGIC, self.step_id, self.flags, len(self.tokens)
        if self.tokens:
            t[4 : 4 + len(self.tokens)] = torch.tensor(self.tokens, dtype=torch.int64)
        return t

    @classmethod
    def decode(cls, t: torch.Tensor, sender: int) -> StepHeader:
        v = host_syncs.to_list(t)
        if v[0] != MAGIC:
            raise ProtocolError(f"rank {sender}: expected a step header, got magic {v[0]:#x}")
        m = v[3]
        if not 0 <= m <= MAX_MICRO_BATCHES or any(n < 0 for n in v[4 : 4 + m]):
            raise ProtocolError(f"rank {sender}: malformed step header {v}")
        return cls(step_id=v[1], tokens=tuple(v[4 : 4 + m]), flags=v[2])
