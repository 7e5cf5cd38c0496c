"""How an attention node spans several ranks: the TP size, the communication mode, its thresholds.

Torch-free, so that `afd check-config` can validate and explain a layout without loading anything.

The modes (vllm-ascend's SP / FlashComm1 / FlashComm2, docs/design/tp-communication.md), per row-parallel
layer of G ranks:

    allreduce    y = AllReduce(partial)                         the residual stream is replicated
    sp           y = ReduceScatter(pad(partial)); norm and residual add on the token shard; AllGather
                 before the next column-parallel layer          the residual stream is a token shard
    flashcomm1   sp, but MLA's replicated down-projections (q_a_proj, kv_a_proj_with_mqa) run on the shard
                 and the ranks gather the latents, not the hidden state
    flashcomm2   flashcomm1, with o_proj regrouped: all_to_all inside the ODP group (G / P ranks), then
                 matmul + ReduceScatter inside the OTP group (P ranks). vllm-ascend recommends FC2 with FC1
                 (docs/design/tp-communication.md#limits),
                 and afd builds it that way, so its residual stream is a token shard too.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("allreduce", "sp", "flashcomm1", "flashcomm2")
SHARDED_MODES = ("sp", "flashcomm1", "flashcomm2")

DEFAULT_MIN_TOKENS = {"allreduce": 0, "sp": 1, "flashcomm1": 1001, "flashcomm2": 1001}
"""Below this many tokens in a micro-batch a mode runs as allreduce (vllm-ascend's thresholds,
docs/design/tp-communication.md#thresholds: SP's pass applies from
SP_MIN_TOKEN_NUM, 1 for MoE models; FlashComm1 only when num_tokens > 1000; FlashComm2 names no threshold
of its own and is built on FlashComm1 here, so it takes FC1's)."""


class TPConfigError(ValueError):
    """An impossible TP layout; the message names the key (`layout.attention_tp`, ...)."""


@dataclass(frozen=True)
class TPConfig:
    size: int = 1
    """Ranks of one attention node (`layout.attention_tp`): one process and one device each."""
    mode: str = "allreduce"
    """`layout.tp_comm`: allreduce, sp, flashcomm1 or flashcomm2."""
    otp: int | None = None
    """`layout.flashcomm2_otp`: the o_proj TP group size P of flashcomm2 (G > P, G % P == 0)."""
    min_tokens: int | None = None
    """`layout.tp_comm_min_tokens`: micro-batches with fewer tokens run as allreduce (None: DEFAULT_MIN_TOKENS)."""
    kvp: int = 1
    """`layout.kvp`: KV-parallel ranks N (docs/design/longcat-on-ascend.md#kvp): the KV cache is split by
    block over N consecutive ranks, which attend over their share with its log-sum-exp and merge (afd/model/kvp.py)."""

    def __post_init__(self):
        if type(self.size) is not int or self.size < 1:
            raise TPConfigError(f"layout.attention_tp: expected a positive integer, got {self.size!r}")
        if self.mode not in MODES:
            raise TPConfigError(f"layout.tp_comm: expected one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "flashcomm2":
            P = self.otp
            if type(P) is not int or P < 1:
                raise TPConfigError(
                    f"layout.flashcomm2_otp: tp_comm flashcomm2 needs the o_proj TP size P "
                    f"(a positive integer), got {P!r}"
                )
            if self.size <= P:
                raise TPConfigError(
                    f"layout.flashcomm2_otp: P = {P} must be smaller than layout.attention_tp "
                    f"= {self.size} (FlashComm2 requires tp > P)"
                )
            if self.size % P:
                raise TPConfigError(f"layout.flashcomm2_otp: P = {P} does not divide layout.attention_tp = {self.size}")
        elif self.otp is not None:
            raise TPConfigError(f"layout.flashcomm2_otp: only tp_comm flashcomm2 uses it (tp_comm is {self.mode})")
        if type(self.kvp) is not int or self.kvp < 1:
            raise TPConfigError(f"layout.kvp: expected a positive integer, got {self.kvp!r}")
        if self.size % self.kvp:
            raise TPConfigError(
                f"layout.kvp: {self.kvp} KV-parallel ranks must divide layout.attention_tp = "
                f"{self.size} (KVP runs on the ranks of one attention node)"
            )
        if self.min_tokens is not None and (type(self.min_tokens) is not int or self.min_tokens < 0):
            raise TPConfigError(f"layout.tp_comm_min_tokens: expected an integer >= 0, got {self.min_tokens!r}")

    @property
    def threshold(self) -> int:
        return DEFAULT_MIN_TOKENS[self.mode] if self.min_tokens is None else self.min_tokens

    @property
    def fc2_otp(self) -> int:
        """flashcomm2's o_proj TP size P (set whenever the mode is flashcomm2: checked above)."""
        if self.otp is None:
            raise TPConfigError("layout.flashcomm2_otp: only tp_comm flashcomm2 has an o_proj TP group")
        return self.otp

    @property
    def odp(self) -> int:
        """FC2's ODP group size G / P (1 outside flashcomm2)."""
        return self.size // self.fc2_otp if self.mode == "flashcomm2" else 1

    def check_model(self, num_heads: int, source: str = "layout.attention_tp") -> None:
        """The model against the layout: whole heads per rank."""
        if num_heads % self.size:
            raise TPConfigError(
                f"{source}: {self.size} ranks do not divide the model's {num_heads} attention "
                "heads (each rank holds whole heads)"
            )


@dataclass(frozen=True)
class ShardPlan:
    """One micro-batch's token layout over the G ranks: T tokens padded to a multiple of G, rank r
    holding rows [r * shard, (r + 1) * shard) when the mode shards the residual stream."""

    tokens: int
    size: int
    sharded: bool
    latents: bool = False
    """flashcomm1/2: gather MLA's latents instead of the hidden state."""
    fc2: bool = False

    @property
    def shard(self) -> int:
        return -(-self.tokens // self.size)

    @property
    def padded(self) -> int:
        return self.shard * self.size

    def span(self, rank: int) -> tuple[int, int]:
        """The real (unpadded) rows [lo, hi) of rank's token shard; lo == hi when it has none."""
        lo = min(rank * self.shard, self.tokens)
        return lo, min(lo + self.shard, self.tokens)


def plan(cfg: TPConfig, tokens: int) -> ShardPlan:
    sharded = cfg.size > 1 and cfg.mode in SHARDED_MODES and tokens >= cfg.threshold
    return ShardPlan(
        tokens,
        cfg.size,
        sharded,
        latents=sharded and cfg.mode in ("flashcomm1", "flashcomm2"),
        fc2=sharded and cfg.mode == "flashcomm2",
    )


def fc2_batch_ids(size: int, otp: int) -> list[list[int]]:
    """vllm-ascend's get_flashcomm2_reorgnized_batch_ids (docs/design/tp-communication.md#groups): for each
    member j of an ODP group, the token chunks
    it receives, [j, j + D, j + 2D, ...] (D = size / otp). tp 4, P 2: [[0, 2], [1, 3]]."""
    odp = size // otp
    return [[j + odp * k for k in range(otp)] for j in range(odp)]


def fc2_groups(size: int, otp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ODP groups, OTP groups) as TP-rank lists. ODP group g: consecutive ranks g*D .. g*D + D - 1;
    OTP group j: the ranks at place j of every ODP group. After the exchange, rank g*D + j holds chunks
    fc2_batch_ids[j] with the features of ODP group g (heads g*D*n .. (g+1)*D*n), and the OTP group's
    ReduceScatter leaves it chunk j + D*g = its own rank: the same token shard as sp."""
    odp = size // otp
    return (
        [[g * odp + i for i in range(odp)] for g in range(otp)],
        [[j + odp * g for g in range(otp)] for j in range(odp)],
    )
