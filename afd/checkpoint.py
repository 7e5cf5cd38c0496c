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
from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from afd.config import ModelConfig
from afd.model.attention_half import AttentionHalf
from afd.model.ffn_half import FFNHalf

_PROGRESS_MIN_BYTES = 512 << 20


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
        self._handles = {}
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

    def _open(self, safe_open, fp: str):
        if fp not in self._handles:
            if not os.path.isfile(fp):
                raise CheckpointError(f"checkpoint shard missing: {fp}")
            self._handles[fp] = safe_open(fp, framework="pt")
        return self._handles[fp]

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in self._where:
            raise CheckpointError(f"{self.path}: tensor '{key}' not found in the checkpoint")
        h = self._open(self._safe_open, os.path.join(self.path, self._where[key]))
        t = h.get_tensor(key)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor '{key}' has shape {tuple(t.shape)}, "
                                  f"config.json implies {tuple(shape)}")
        self.keys_read.append(key)
        return t

    @property
    def total_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, f)) for f in set(self._where.values())
                   if os.path.isfile(os.path.join(self.path, f)))


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

    total_bytes = 0


Reader = SafetensorsReader | DummyReader


def open_reader(path: str, dummy: bool = False, seed: int = 0) -> Reader:
    """The checkpoint at `path`, or with `dummy`, seeded random weights (path then only gives config)."""
    return DummyReader(seed) if dummy else SafetensorsReader(path)


def attention_keys(model: AttentionHalf) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, destination) for every tensor the attention half holds."""
    tied = model.cfg.tie_word_embeddings
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            yield ("model.embed_tokens.weight" if tied else "lm_head.weight"), p
        else:
            yield f"model.{name}", p


def _load_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dest.copy_(src.to(dest.dtype))


def _progress(reader: Reader, total: int, desc: str):
    """A bar over tensors, shown only for checkpoints big enough to make a user wait."""
    return tqdm(total=total, desc=desc, unit="tensor", disable=reader.total_bytes < _PROGRESS_MIN_BYTES)


def load_attention_half(model: AttentionHalf, reader: Reader) -> None:
    items = list(attention_keys(model))
    with _progress(reader, len(items), "loading attention weights") as bar:
        for key, p in items:
            _load_into(p, reader.get(key, tuple(p.shape)))
            bar.update()


def load_ffn_half(model: FFNHalf, reader: Reader) -> None:
    cfg = model.cfg
    lo, hi = model.expert_range
    H, I = cfg.hidden_size, cfg.expert_ffn_hidden_size
    E = cfg.num_experts_total
    with _progress(reader, cfg.num_layers * (hi - lo), "loading expert weights") as bar:
        for i, layer in enumerate(model.layers):
            pre = f"model.layers.{i}.mlp"
            router = layer.router
            _load_into(router.classifier.weight, reader.get(f"{pre}.router.classifier.weight", (E, H)))
            if router.classifier.bias is not None:
                _load_into(router.classifier.bias, reader.get(f"{pre}.router.classifier.bias", (E,)))
            _load_into(router.e_score_correction_bias, reader.get(f"{pre}.router.e_score_correction_bias", (E,)))
            ex = layer.experts
            for g, e in enumerate(range(lo, hi)):
                gate = reader.get(f"{pre}.experts.{e}.gate_proj.weight", (I, H))
                up = reader.get(f"{pre}.experts.{e}.up_proj.weight", (I, H))
                down = reader.get(f"{pre}.experts.{e}.down_proj.weight", (H, I))
                _load_into(ex.w13[g], torch.cat([gate, up], dim=0).t())
                _load_into(ex.w2[g], down.t())
                bar.update()


def _materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_attention_half(cfg: ModelConfig, reader: Reader, dtype: torch.dtype,
                         device: torch.device) -> AttentionHalf:
    with torch.device("meta"):
        model = AttentionHalf(cfg)
    model = model.to_empty(device="cpu")
    load_attention_half(model, reader)
    return _materialize(model, dtype, device)


def build_ffn_half(cfg: ModelConfig, reader: Reader, dtype: torch.dtype, device: torch.device,
                   lo: int = 0, hi: int | None = None, serves_zero: bool = True) -> FFNHalf:
    with torch.device("meta"):
        model = FFNHalf(cfg, lo, hi, serves_zero)
    model = model.to_empty(device="cpu")
    load_ffn_half(model, reader)
    model = _materialize(model, dtype, device)
    for layer in model.layers:  # the router stays fp32, as HF keeps classifier.weight
        layer.router.float()
    return model
