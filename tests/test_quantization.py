"""--quantization (afd.quant): which scheme a flag and a checkpoint make, the formats' round trips, the CPU's
int8 GEMM against the reference, quantized experts and linears, their resident bytes, and a served model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from afd.backend.cpu import CpuBackend
from afd.backend.cpu_quant import int8_matmul
from afd.model.checkpoint import CheckpointError, DummyReader, SafetensorsReader, build_ffn_half
from afd.model.config import ConfigError
from afd.model.quant_layers import QuantLinear
from afd.model.registry import config_from_hf, quant_spec
from afd.quant import reference
from afd.quant.formats import (
    FP8,
    FP8_MAX,
    dequantize,
    expand_block_scale,
    quantize_fp8_block,
    quantize_int8_channel,
    quantize_rows_fp8,
    quantize_rows_int8,
)
from afd.quant.scheme import FP8_BLOCK, INT8_CHANNEL, CheckpointQuant, QuantConfigError, resolve

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 8]}


def test_a_flag_and_a_checkpoint_make_the_scheme():
    ckpt = CheckpointQuant.from_config_json({"quantization_config": FP8_CONFIG})
    assert ckpt == CheckpointQuant((16, 8))
    assert resolve(None, None) is None
    default = resolve(None, ckpt)  # a released FP8 checkpoint serves as fp8, its blocks as stored
    assert (default.method, default.weights, default.block, default.checkpoint) == ("fp8", FP8_BLOCK, (16, 8), ckpt)
    w8a16 = resolve("w8a16", ckpt)
    assert (w8a16.weights, w8a16.activations, w8a16.checkpoint) == (FP8_BLOCK, None, ckpt)
    w8a8 = resolve("w8a8", ckpt)  # re-quantized per channel from the dequantized blocks
    assert (w8a8.weights, w8a8.activations, w8a8.checkpoint) == (INT8_CHANNEL, "int8", None)
    assert resolve("fp8", None).block == (128, 128) and resolve("fp8", None).activations == "fp8"
    assert resolve("w8a16", None).weights == INT8_CHANNEL
    with pytest.raises(QuantConfigError, match="model.quantization: expected one of fp8, w8a8, w8a16"):
        resolve("int4", None)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"quant_method": "awq"}, "quant_method: 'awq' is not supported"),
        ({"fmt": "e5m2"}, "fmt: 'e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme: 'static'"),
        ({"weight_block_size": None}, "weight_block_size: expected two positive integers"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ],
)
def test_a_quantization_config_afd_cannot_read_is_refused_naming_the_field(change, needle):
    d = {"quantization_config": {**FP8_CONFIG, **change}}
    with pytest.raises(QuantConfigError, match=needle):
        CheckpointQuant.from_config_json(d)


def test_the_model_config_refuses_an_unreadable_quantization_config(families):
    with open(os.path.join(families.path("deepseek_v3", "grouped"), "config.json")) as f:
        d = json.load(f)
    with pytest.raises(ConfigError, match="quantization_config.quant_method"):
        config_from_hf({**d, "quantization_config": {"quant_method": "gptq"}})


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]  # rows of very different scales
    w[3] = 0.0  # an all-zero row (and block)
    return w


def test_fp8_blocks_round_trip_within_three_mantissa_bits():
    w = _weight(40, 20)
    q, scale_inv = quantize_fp8_block(w, (16, 8))
    assert q.dtype == FP8 and scale_inv.shape == (3, 3)  # partial blocks at both edges
    per_row = expand_block_scale(scale_inv, 40, 16)
    back = dequantize(q, per_row, 8)
    # e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below the smallest normal
    # (2^-6 of the scale) the step is 2^-9 of the scale, so half of it bounds the absolute error
    bound = torch.maximum(w.abs() * 2**-4, per_row.repeat_interleave(8, 1)[:, :20] * 2**-10)
    assert ((back - w).abs() <= bound).all()
    assert (back[3] == 0).all()
    assert q.float().abs().amax() == FP8_MAX  # each block's absmax lands on FP8's largest value
    q2, s2 = quantize_fp8_block(back, (16, 8))  # the dequantized weight re-quantizes to itself
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, scale_inv)


def test_int8_channels_round_within_half_a_step():
    w = _weight(24, 33)
    q, scale = quantize_int8_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (24, 1)
    back = dequantize(q, scale, 33)
    assert ((back - w).abs() <= scale / 2 * 1.0001).all()  # 1.0001: the division's own fp32 rounding


def test_activations_quantize_per_token():
    x = torch.randn(7, 300) * torch.tensor([1e-3, 1, 10, 100, 0, 1, 5])[:, None]
    q, s = quantize_rows_int8(x)
    assert q.dtype == torch.int8 and s.shape == (7, 1) and (q[4] == 0).all()
    assert ((q.float() * s - x).abs() <= s / 2 * 1.0001).all()
    q8, s8 = quantize_rows_fp8(x, 128)
    assert q8.dtype == FP8 and s8.shape == (7, 3)  # one scale per token and 128-wide group
    back = dequantize(q8, s8, 128)
    assert ((back - x).abs() <= x.abs() * 2**-4 + s8.repeat_interleave(128, 1)[:, :300] * 2**-10).all()


def test_the_cpu_int8_gemm_is_the_reference_s_math():
    from afd.backend.cpu_kernels import int8_matmul_fp32
    from afd.backend.cpu_quant import int_mm_exact

    x, w = torch.randn(9, 72), _weight(40, 72, seed=1)
    q, scale = quantize_int8_channel(w)
    spec = resolve("w8a8", None)
    want = reference.quant_matmul(x, q, scale, spec)
    # the same quantized operands: torch._int_mm sums the int8 products exactly in int32, the reference
    # sums their fp32 widening (exact products, fp32 additions): they differ by K additions' rounding
    tol = 72 * torch.finfo(torch.float32).eps * (x.abs().amax() * w.abs().amax() * 72)
    got = CpuBackend().quant_matmul(x, q, scale, spec)
    assert (got - want).abs().max() <= tol
    # either kernel the CPU may choose gives these very numbers: integer sums below 2^24 are exact in fp32 too
    assert got.equal(int8_matmul_fp32(x, q, scale))
    if int_mm_exact():
        assert got.equal(int8_matmul(x, q, scale))


def test_w8a8_leaves_int_mm_out_where_it_saturates(monkeypatch):
    from afd.backend import cpu_quant, kernel_choice
    from afd.backend.cpu_kernels import int8_matmul_fp32

    monkeypatch.setattr(cpu_quant, "int_mm_exact", lambda: False)
    monkeypatch.setattr(kernel_choice, "_PROCESS", kernel_choice.KernelChoice(path=""))
    q, scale = quantize_int8_channel(_weight(24, 40))
    x, spec = torch.randn(5, 40), resolve("w8a8", None)
    assert CpuBackend().quant_matmul(x, q, scale, spec).equal(int8_matmul_fp32(x, q, scale))
    (choice,) = kernel_choice.process_choice().choices().values()
    assert choice.kernel == "fp32" and "saturates on this CPU" in choice.left_out["int_mm"]
    assert "saturates on this CPU" in cpu_quant.cpu_quant_kernel(spec)


def test_the_cpu_int8_grouped_gemm_is_its_per_group_gemm():
    q, scale = zip(*(quantize_int8_channel(_weight(24, 40, seed=g)) for g in range(3)))
    q, scale = torch.stack(q), torch.stack(scale)  # [G, N, K], [G, N, 1]
    x, sizes, spec = torch.randn(9, 40), torch.tensor([4, 0, 3]), resolve("w8a8", None)  # 2 rows past the groups
    be = CpuBackend()
    got = be.quant_grouped_matmul(x, q, scale, sizes, spec)
    # per-token quantization is per row, so quantizing once or per group is the same: bit-equal rows
    assert torch.equal(got[:4], be.quant_matmul(x[:4], q[0], scale[0], spec))
    assert torch.equal(got[4:7], be.quant_matmul(x[4:7], q[2], scale[2], spec))


def _moe_config():
    from afd.model.longcat_flash.config import LongcatFlashConfig

    return LongcatFlashConfig(
        vocab_size=64, hidden_size=128, ffn_hidden_size=64, expert_ffn_hidden_size=96, num_layers=1,
        num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_routed_experts=8, zero_expert_num=2, moe_topk=3,
    )  # fmt: skip


def _tensor_bytes(module: torch.nn.Module, part: str) -> int:
    ts = dict([*module.named_parameters(), *module.named_buffers()])
    return sum(t.numel() * t.element_size() for n, t in ts.items() if part in n)


@pytest.mark.parametrize("method", ["fp8", "w8a8", "w8a16"])
def test_quantized_experts_hold_a_quarter_of_the_bytes_and_compute_the_dequantized_moe(method):
    cfg, be = _moe_config(), CpuBackend()
    spec = resolve(method, None)
    full = build_ffn_half(cfg, DummyReader(3), torch.float32, be.device)
    half = build_ffn_half(cfg, DummyReader(3), torch.float32, be.device, quant=spec)
    ex = half.layer(0).experts
    assert ex.quant == spec and ex.w13.dtype == (FP8 if spec.weights == FP8_BLOCK else torch.int8)
    # 8-bit values plus fp32 scales (per row and 128-wide block, or per row): at most 0.27 of fp32 here
    assert _tensor_bytes(half, "experts") <= 0.27 * _tensor_bytes(full, "experts")
    # the same MoE over the dequantized weights, in the unquantized layout [G, K, N]
    ref = full.layer(0).experts
    bk = lambda q: spec.block[1] if spec.weights == FP8_BLOCK else q.shape[-1]  # noqa: E731
    with torch.no_grad():
        ref.w13.copy_(dequantize(ex.w13, ex.w13_scale, bk(ex.w13)).transpose(1, 2))
        ref.w2.copy_(dequantize(ex.w2, ex.w2_scale, bk(ex.w2)).transpose(1, 2))
    x = torch.randn(11, cfg.hidden_size)
    got, want = half(be, 0, x), full(be, 0, x)
    if method == "w8a16":  # activations in dtype: the dequantized model's numbers but for fp32 reassociation
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # 8-bit activations: each input element within its quantization step, so the output moves little
        assert (got - want).abs().max() <= 0.1 * want.abs().max()


def _fp8_checkpoint(path, with_scale: bool = True, scale_shape=(2, 1)) -> SafetensorsReader:
    os.makedirs(path, exist_ok=True)
    w = torch.randn(20, 8)
    q, s = quantize_fp8_block(w, (16, 8))
    tensors = {"a.weight": q, "b.weight": w}
    if with_scale:
        tensors["a.weight_scale_inv"] = s if scale_shape == (2, 1) else torch.ones(scale_shape)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"quantization_config": FP8_CONFIG}, f)
    return SafetensorsReader(str(path))


def test_the_reader_dequantizes_fp8_tensors_and_hands_their_bytes_as_stored(tmp_path):
    r = _fp8_checkpoint(tmp_path / "ok")
    q, s = r.get_fp8("a.weight", (20, 8))
    assert q.dtype == FP8 and s.shape == (2, 1)
    assert torch.equal(r.get("a.weight", (20, 8)), dequantize(q, expand_block_scale(s, 20, 16), 8))
    assert r.get_fp8("b.weight", (20, 8)) is None and r.get("b.weight", (20, 8)).dtype == torch.float32
    with pytest.raises(CheckpointError, match="FP8 tensor 'a.weight' has no 'a.weight_scale_inv'"):
        _fp8_checkpoint(tmp_path / "noscale", with_scale=False).get("a.weight", (20, 8))
    with pytest.raises(CheckpointError, match=r"'a.weight_scale_inv' has shape \(3, 3\); weight_block_size"):
        _fp8_checkpoint(tmp_path / "badscale", scale_shape=(3, 3)).get("a.weight", (20, 8))


def test_a_local_cluster_s_nodes_get_the_quantization():
    import afd

    llm = afd.LLM("demo", quantization="fp8", ffn_nodes=2, dummy_weights=True)
    assert llm.cluster is not None and llm.cluster.to_dict()["model"]["quantization"] == "fp8"


def test_a_served_model_quantizes_both_halves_and_1a1f_matches_colocated(families, llm_pool):
    import afd

    path = families.path("deepseek_v3", "grouped")
    assert quant_spec(path, None) is None and quant_spec(path, "w8a8").method == "w8a8"
    prompts = [[1, 5, 9, 3], [2, 7, 7, 4, 1]]

    def run(llm) -> tuple[list, list]:
        logits: list = []
        return llm.generate_ids(prompts, 5, logits_out=logits), logits

    plain = run(afd.LLM(path))
    llm = afd.LLM(path, quantization="w8a8")
    colocated = run(llm)
    assert llm.ffn.layer(llm.cfg.moe_layers[0]).experts.w13.dtype == torch.int8
    assert any(isinstance(m, QuantLinear) for m in llm.attn.modules())  # quantized by the engine factory
    assert not isinstance(llm.attn.lm_head, QuantLinear)
    split = run(llm_pool.get(path, quantization="w8a8", ffn_nodes=1))
    # the same kernels on the same CPU on both sides of the exchange: the same tokens; logits within fp32 sums
    # done in other processes (1e-5 of the largest), while w8a8 moves them by far more than that from fp32
    assert split[0] == colocated[0]
    steps = [t for prompt in zip(split[1], colocated[1], plain[1]) for t in zip(*prompt)]
    assert len(steps) == 10
    for a, b, c in steps:
        scale = c.abs().max()
        assert (a - b).abs().max() <= 1e-5 * scale
        assert (b - c).abs().max() >= 1e-3 * scale, "quantized and unquantized logits should differ"


def test_graph_mode_runs_quantized_experts_eager(caplog):
    from afd.model.ffn_graph import wrap

    spec = resolve("w8a8", None)
    half = build_ffn_half(_moe_config(), DummyReader(0), torch.float32, torch.device("cpu"), quant=spec)
    with caplog.at_level("INFO", logger="afd.graph"):
        assert wrap(half, CpuBackend(), "compile", (4,), 1) is half
    assert "runs eager on cpu with quantized experts (w8a8)" in caplog.text


_PEAK = """
import sys, torch
from afd.model.checkpoint import DummyReader, build_ffn_half
from afd.model.longcat_flash.config import LongcatFlashConfig
from afd.quant.scheme import resolve
def build(hidden, expert):
    cfg = LongcatFlashConfig(vocab_size=64, hidden_size=hidden, ffn_hidden_size=64, expert_ffn_hidden_size=expert,
        num_layers=2, num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_routed_experts=16, zero_expert_num=0, moe_topk=2)
    return build_ffn_half(cfg, DummyReader(0), torch.float32, torch.device("cpu"),
        quant=None if method == "none" else resolve(method, None))
def kib(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))
method = sys.argv[1]
build(64, 128)  # the same code once, small: the library pages it runs are resident before the measure
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # the peak RSS (VmHWM) restarts from the current RSS
before = kib("VmRSS")
half = build(512, 1024)
print(kib("VmHWM") - before)
"""


def test_loading_quantized_experts_never_holds_them_in_full_precision():
    """The load's peak memory (VmHWM growth, a process each, once the same load at a small size has made the
    library code it runs resident, as a process forked from a server has not yet): 8-bit experts are never
    allocated in fp32 (quantized on the meta-built half) nor converted to it when the half is cast (float8 is a
    floating type, which module.to() would convert in full). 200 MB of fp32 experts; 8-bit ones are a quarter,
    plus one source tensor (2 MB) at a time."""
    import sys

    import forked_python

    def peak(method: str) -> int:
        r = forked_python.run([sys.executable, "-c", _PEAK, method], timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return int(r.stdout.split()[-1])

    full = peak("none")
    for method in ("fp8", "w8a8"):
        assert peak(method) <= 0.4 * full, method
