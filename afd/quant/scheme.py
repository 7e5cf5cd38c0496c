"""Which quantization a model serves with: `--quantization` (model.quantization) against what the checkpoint
holds (config.json's quantization_config).

A released FP8 checkpoint (DeepSeek-V3, LongCat-Flash) says

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

and stores each quantized linear's weight [N, K] as float8_e4m3fn beside `weight_scale_inv` fp32
[ceil(N / 128), ceil(K / 128)]: the value of element (n, k) is weight[n, k] * weight_scale_inv[n // 128,
k // 128] (DeepSeek's `weight_dequant`, transformers' FineGrainedFP8). Everything else (embeddings,
norms, routers, lm_head) is in the checkpoint's dtype.

The methods (vLLM's flag names where they exist):
- fp8: FP8 e4m3 weights per 128 x 128 block, FP8 activations per token (one scale per 128-wide group of
  the row, as DeepSeek's act_quant), both dynamic.
- w8a8: int8 weights per output channel, int8 activations per token, dynamic.
- w8a16: 8-bit weights (the checkpoint's FP8 blocks, else int8 per output channel) widened inside the GEMM;
  activations stay in the model dtype, so the result is the unquantized model's on the dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass


class QuantConfigError(ValueError):
    """--quantization or a checkpoint's quantization_config is not one afd serves."""


METHODS = ("fp8", "w8a8", "w8a16")
"""--quantization's values (model.quantization)."""
FP8_BLOCK = "fp8_block"
INT8_CHANNEL = "int8_channel"


@dataclass(frozen=True)
class CheckpointQuant:
    """What config.json's quantization_config says of the stored weights (FP8, block-scaled: the one form
    afd reads)."""

    block: tuple[int, int]
    """weight_block_size: (rows N, columns K) of one scale's block."""
    not_converted: tuple[str, ...] = ()
    """modules_to_not_convert / ignored_layers: name fragments of modules stored unquantized."""

    @classmethod
    def from_config_json(cls, d: dict) -> CheckpointQuant | None:
        q = d.get("quantization_config")
        if q is None:
            return None
        where = "config.json: quantization_config"
        if not isinstance(q, dict):
            raise QuantConfigError(f"{where}: expected an object, got {type(q).__name__}")
        method = q.get("quant_method")
        if method != "fp8":
            raise QuantConfigError(
                f"{where}.quant_method: {method!r} is not supported; afd reads FP8 block-quantized checkpoints "
                "(quant_method 'fp8') and quantizes bf16/fp32 ones at load (--quantization)"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantConfigError(f"{where}.fmt: {fmt!r} is not supported (float8_e4m3fn only)")
        act = q.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise QuantConfigError(f"{where}.activation_scheme: {act!r} is not supported (dynamic only)")
        block = q.get("weight_block_size")
        if (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise QuantConfigError(
                f"{where}.weight_block_size: expected two positive integers, got {block!r} "
                "(per-tensor FP8 checkpoints are not supported)"
            )
        skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
            raise QuantConfigError(f"{where}.modules_to_not_convert: expected a list of names, got {skip!r}")
        return cls((block[0], block[1]), tuple(skip))


@dataclass(frozen=True)
class QuantSpec:
    """How a half's quantized linears and experts hold their weights and run their GEMMs."""

    method: str
    """fp8, w8a8 or w8a16."""
    weights: str
    """fp8_block (float8_e4m3fn, a scale per block) or int8_channel (int8, a scale per output channel)."""
    block: tuple[int, int]
    """fp8_block's (N, K) block; int8_channel: unused."""
    checkpoint: CheckpointQuant | None = None
    """The checkpoint's FP8 blocks, when they are read as they are (no re-quantization)."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise QuantConfigError(f"model.quantization: expected one of {', '.join(METHODS)}, got {self.method!r}")
        if self.weights not in (FP8_BLOCK, INT8_CHANNEL):
            raise ValueError(f"unknown weight format {self.weights!r}")

    @property
    def activations(self) -> str | None:
        """How the GEMMs' inputs are quantized, per token and dynamically: fp8, int8, or None (the model dtype)."""
        return {"fp8": "fp8", "w8a8": "int8", "w8a16": None}[self.method]

    def describe(self) -> str:
        w = f"FP8 per {self.block[0]}x{self.block[1]} block" if self.weights == FP8_BLOCK else "int8 per channel"
        a = {"fp8": "FP8 per token", "int8": "int8 per token", None: "in the model dtype"}[self.activations]
        src = ", the checkpoint's FP8 as stored" if self.checkpoint is not None else ", quantized at load"
        return f"{self.method}: weights {w}{src}; activations {a}"


DEFAULT_BLOCK = (128, 128)


def resolve(method: str | None, checkpoint: CheckpointQuant | None) -> QuantSpec | None:
    """The scheme of `--quantization method` on a checkpoint holding `checkpoint` (None: unquantized). An FP8
    checkpoint serves as fp8 by default and keeps its blocks under fp8 and w8a16; w8a8 re-quantizes its
    dequantized weights per channel. Without a flag, an unquantized checkpoint serves unquantized."""
    if method is None:
        method = "fp8" if checkpoint is not None else None
    if method is None:
        return None
    if method not in METHODS:
        raise QuantConfigError(f"model.quantization: expected one of {', '.join(METHODS)}, got {method!r}")
    if method == "w8a8":
        return QuantSpec(method, INT8_CHANNEL, DEFAULT_BLOCK)
    if checkpoint is not None:
        return QuantSpec(method, FP8_BLOCK, checkpoint.block, checkpoint)
    return QuantSpec(method, FP8_BLOCK if method == "fp8" else INT8_CHANNEL, DEFAULT_BLOCK)
