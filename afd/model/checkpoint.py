"""Loads each half of the model from an HF checkpoint directory, reading only that half's tensors.

A reader maps checkpoint keys (the hub's names) to tensors. `SafetensorsReader` reads a directory with
`model.safetensors`, a sharded `model.safetensors.index.json`, or several `*.safetensors` files;
`DummyReader` makes seeded random tensors from the key name, so that the two halves, in different
processes, agree on a dummy model without sharing anything but the seed.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from afd.model.config import ModelConfig
from afd.model.experts import Experts
from afd.model.halves import AttentionHalf, FFNHalf, LoadedModule
from afd.model.meta import materialize, on_meta
from afd.model.progress import Progress
from afd.model.registry import family
from afd.quant.formats import FP8, dequantize, expand_block_scale
from afd.quant.scheme import CheckpointQuant, QuantSpec

if TYPE_CHECKING:
    from afd.model.mtp import MTPLayer

_PROGRESS_MIN_BYTES = 512 << 20
M = TypeVar("M", bound=LoadedModule)


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing or does not match the model config."""


class SafetensorsReader:
    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
            weight_map = None
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for name in files:
            fp = os.path.join(path, name)
            if weight_map is None:
                h = self._open(safe_open, fp)
                self._where.update(dict.fromkeys(h.keys(), name))  # noqa: SIM118 (not a dict)
        if weight_map is not None:
            self._where = dict(weight_map)
        self._safe_open = safe_open
        self.keys_read: list[str] = []
        cfg: dict = {}
        if os.path.isfile(cfg_path := os.path.join(path, "config.json")):
            with open(cfg_path) as f:
                cfg = json.load(f)
        self.fp8 = CheckpointQuant.from_config_json(cfg)
        """The checkpoint's FP8 blocks (config.json's quantization_config), or None."""

    def _open(self, safe_open, fp: str):
        if fp not in self._handles:
            if not os.path.isfile(fp):
                raise CheckpointError(f"checkpoint shard missing: {fp}")
            self._handles[fp] = safe_open(fp, framework="pt")
        return self._handles[fp]

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def _tensor(self, key: str, shape: tuple[int, ...] | None) -> torch.Tensor:
        if key not in self._where:
            raise CheckpointError(f"{self.path}: tensor '{key}' not found in the checkpoint")
        h = self._open(self._safe_open, os.path.join(self.path, self._where[key]))
        t = h.get_tensor(key)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor '{key}' has shape {tuple(t.shape)}, config.json implies {tuple(shape)}"
            )
        self.keys_read.append(key)
        return t

    def get_fp8(self, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(float8_e4m3fn [N, K], weight_scale_inv fp32 [ceil(N / bn), ceil(K / bk)]) of a tensor stored FP8
        with its block scales; None for one stored in full precision (a module the config leaves out)."""
        t = self._tensor(key, shape)
        if t.dtype != FP8:
            return None
        if self.fp8 is None:
            raise CheckpointError(
                f"{self.path}: tensor '{key}' is float8_e4m3fn but config.json has no quantization_config"
            )
        skey = key.removesuffix("weight") + "weight_scale_inv"
        (bn, bk), (N, K) = self.fp8.block, shape
        blocks = (-(-N // bn), -(-K // bk))
        if skey not in self._where:
            raise CheckpointError(f"{self.path}: FP8 tensor '{key}' has no '{skey}' (its block scales)")
        scale = self._tensor(skey, None)
        if tuple(scale.shape) != blocks:
            raise CheckpointError(
                f"{self.path}: '{skey}' has shape {tuple(scale.shape)}; weight_block_size {[bn, bk]} on "
                f"{tuple(shape)} implies {blocks}"
            )
        return t, scale.float()

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor in its stored dtype, or in fp32 if it is stored FP8 (dequantized by its block scales)."""
        t = self._tensor(key, shape)
        if t.dtype != FP8:
            return t
        self.keys_read.pop()
        q, scale_inv = self.get_fp8(key, shape)  # type: ignore[misc]  # FP8: never None
        assert self.fp8 is not None
        return dequantize(q, expand_block_scale(scale_inv, shape[0], self.fp8.block[0]), self.fp8.block[1])

    @property
    def total_bytes(self) -> int:
        return sum(
            os.path.getsize(os.path.join(self.path, f))
            for f in set(self._where.values())
            if os.path.isfile(os.path.join(self.path, f))
        )


class DummyReader:
    """Seeded random weights, any config: norms are ones, everything else N(0, std)."""

    def __init__(self, seed: int = 0, std: float = 0.02):
        self.seed, self.std = seed, std
        self.keys_read: list[str] = []

    def __contains__(self, key: str) -> bool:
        return True

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        self.keys_read.append(key)
        if key.endswith("norm.weight"):
            return torch.ones(shape)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
        std = 1e-3 if key.endswith("e_score_correction_bias") else self.std
        return torch.randn(shape, generator=g) * std

    def get_fp8(self, key: str, shape: tuple[int, ...]) -> None:
        return None  # full precision: quantized at load

    total_bytes = 0


Reader = SafetensorsReader | DummyReader


def open_reader(path: str, dummy: bool = False, seed: int = 0) -> Reader:
    """The checkpoint at `path` (through its family's reader where its released layout has names of its own),
    or with `dummy`, seeded random weights (path then only gives config)."""
    if dummy:
        return DummyReader(seed)
    from afd.model.registry import checkpoint_reader  # the registry imports the families' modules lazily

    return checkpoint_reader(path, SafetensorsReader(path))


@dataclass(frozen=True)
class Weight:
    """One destination tensor of a half and the checkpoint tensors it is made from (a family's name map
    yields these): `combine` turns the sources, in order, into the destination's layout."""

    dest: torch.Tensor
    sources: tuple[tuple[str, tuple[int, ...]], ...]
    """(checkpoint key, shape config.json implies) of each source tensor."""
    combine: Callable[..., torch.Tensor] | None = None
    scale: torch.Tensor | None = None
    """A quantized destination's per-row scales (afd.model.quant_load); None: dest is in full precision."""


def hub_named_weights(model: AttentionHalf) -> Iterator[Weight]:
    """Each parameter of a half from the hub key of the same name under `model.` (the layout every
    family's attention half keeps); lm_head from the embeddings when the config ties them."""
    tied = model.cfg.tie_word_embeddings
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        else:
            name = f"model.{name}"
        yield Weight(p, ((name, tuple(p.shape)),))


def _gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0).t()


def _rows(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def per_expert_weights(experts: Experts, prefix: str, hidden: int, inter: int) -> Iterator[Weight]:
    """Stacked experts `held` (afd.model.experts.Experts) from the hub's per-expert keys
    `{prefix}.{e}.{gate,up,down}_proj.weight`: w13[g] = [gate; up]^T, w2[g] = down^T of expert held[g]
    (quantized: [gate; up] and down, with their scales, in the checkpoint's orientation)."""
    H, I = hidden, inter
    q = experts.quant is not None
    for g, e in enumerate(experts.held):
        x = f"{prefix}.{e}"
        gate_up = ((f"{x}.gate_proj.weight", (I, H)), (f"{x}.up_proj.weight", (I, H)))
        down = ((f"{x}.down_proj.weight", (H, I)),)
        if q:
            yield Weight(experts.w13[g], gate_up, _rows, experts.w13_scale[g])
            yield Weight(experts.w2[g], down, None, experts.w2_scale[g])
        else:
            yield Weight(experts.w13[g], gate_up, _gate_up)
            yield Weight(experts.w2[g], down, torch.t)


def _load(weights: list[Weight], reader: Reader, desc: str, quant: QuantSpec | None) -> None:
    from afd.model.quant_load import load_quantized

    with Progress(len(weights), desc, "tensors", enabled=reader.total_bytes >= _PROGRESS_MIN_BYTES, every_s=5.0) as bar:
        for w in weights:
            if w.scale is not None:
                assert quant is not None
                load_quantized(w.dest, w.scale, w.sources, w.combine, reader, quant)
                bar.update()
                continue
            srcs = [reader.get(key, shape) for key, shape in w.sources]
            src = w.combine(*srcs) if w.combine is not None else srcs[0]
            with torch.no_grad():
                w.dest.copy_(src.to(w.dest.dtype))
            bar.update()


def kept_in_fp32(module: LoadedModule, dtype: torch.dtype) -> tuple[str, ...]:
    """Name suffixes of the tensors of a half that stay fp32 when it serves `dtype`: transformers' rule
    (`PreTrainedModel._get_dtype_plan`), whose `_keep_in_fp32_modules` apply to fp16 only (a bf16 model
    holds them in bf16) and `_keep_in_fp32_modules_strict` to fp16 and bf16. A family states its lists
    as `keep_in_fp32` / `keep_in_fp32_strict` on the half, under afd's parameter names."""
    keep: tuple[str, ...] = ()
    if dtype in (torch.float16, torch.bfloat16):
        keep += module.keep_in_fp32_strict
    if dtype == torch.float16:
        keep += module.keep_in_fp32
    return keep


def _cast(module: LoadedModule, dtype: torch.dtype, device: torch.device) -> None:
    """Every floating tensor to `dtype` on `device`, but the kept ones to fp32 from the values as loaded:
    HF reads those from the checkpoint at full precision, so they must not pass through `dtype`."""
    from afd.model.quant_load import is_quantized

    keep = kept_in_fp32(module, dtype)
    kept = {
        name: t.detach() if is_quantized(name, t) else t.detach().clone()
        for name, t in [*module.named_parameters(), *module.named_buffers()]
        if (keep and name.endswith(keep)) or is_quantized(name, t)
    }
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if is_quantized(name, t):  # out of .to()'s way: it would convert float8 (a floating type) in full
            t.data = t.data.new_empty(0)
    module.to(device=device, dtype=dtype)
    tensors = dict([*module.named_parameters(), *module.named_buffers()])
    for name, t in kept.items():
        tensors[name].data = t.to(device)  # 8-bit values and their scales as loaded; the rest fp32


def _build(
    module: M,
    weights: Callable[[M], Iterator[Weight]],
    reader: Reader,
    desc: str,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantSpec | None = None,
) -> M:
    if quant is not None:
        from afd.model.quant_load import quantize_half

        quantize_half(module, quant)  # on meta: the full-precision weights are never allocated
    module = materialize(module)  # fp32: every checkpoint dtype loads into it exactly
    _load(list(weights(module)), reader, desc, quant)
    _cast(module, dtype, device)
    module = module.eval().requires_grad_(False)
    module.quant = quant
    module.post_load()
    if torch.device(device).type == "cpu":
        cpu_layouts(module)
    return module


def cpu_layouts(module: torch.nn.Module) -> None:
    """Each GEMM weight of a CPU module in the layout, and each bf16/fp16 GEMM by the kernel, timed fastest
    (afd.backend.cpu_packed, afd.backend.cpu_kernels): at load, and again after a TP cut."""
    from afd.backend import cpu_packed
    from afd.backend.cpu import column_major_linears
    from afd.backend.cpu_kernels import choose_linears

    column_major_linears(module)
    choose_linears(module)
    cpu_packed.pack_linears(module)
    for ex in module.modules():
        if isinstance(ex, Experts) and ex.quant is None:
            cpu_packed.pack_grouped(ex, ("w13", "w2"))


def serving_quant(path: str, method: str | None, backend) -> QuantSpec | None:
    """The scheme the checkpoint at `path` serves with under model.quantization `method`
    (afd.model.registry.quant_spec), checked against `backend` (Backend.check_quantization: refused,
    naming the setting, where the device cannot run it)."""
    from afd.model.registry import quant_spec

    spec = quant_spec(path, method)
    if spec is not None:
        backend.check_quantization(spec)
    return spec


def build_attention_half(
    cfg: ModelConfig, reader: Reader, dtype: torch.dtype, device: torch.device, quant: QuantSpec | None = None
) -> AttentionHalf:
    """cfg's family's attention half, with its weights from `reader` (and no other tensor read); with
    `quant`, its linears are quantized once cut for TP (afd.model.quant_layers)."""
    fam = family(cfg.model_type)
    with on_meta():
        model = fam.attention_half(cfg)
    return _build(model, fam.name_map.attention_weights, reader, "loading attention weights", dtype, device, quant)


def build_ffn_half(
    cfg: ModelConfig,
    reader: Reader,
    dtype: torch.dtype,
    device: torch.device,
    experts=None,
    serves_zero: bool = True,
    mtp: bool = False,
    quant: QuantSpec | None = None,
) -> FFNHalf:
    """cfg's family's FFN half holding the routed experts `experts` (all by default; none, `()`: the
    routers alone); with `mtp`, also the MTP module's MoE layer when it has one (afd.model.mtp). With
    `quant`, the experts held 8-bit."""
    from afd.model.mtp import mtp_moe_layers

    kw = {"mtp": True} if mtp and mtp_moe_layers(cfg) else {}
    fam = family(cfg.model_type)
    with on_meta():
        model = fam.ffn_half(cfg, experts, serves_zero, **kw)  # `mtp`: MTP families only
    return _build(model, fam.name_map.ffn_weights, reader, "loading expert weights", dtype, device, quant)


def build_mtp_layer(
    cfg: ModelConfig, reader: Reader, dtype: torch.dtype, device: torch.device, quant: QuantSpec | None = None
) -> MTPLayer:
    """cfg's family's MTP module (afd.model.mtp.MTPLayer) on the attention side: everything of it but the
    routed experts, which the FFN half holds (build_ffn_half with `mtp`)."""
    from afd.model.mtp import family_mtp

    mtp = family_mtp(cfg)
    with on_meta():
        model = mtp.build(cfg)
    name_map = family(cfg.model_type).name_map
    return _build(model, name_map.mtp_weights, reader, "loading MTP weights", dtype, device, quant)
