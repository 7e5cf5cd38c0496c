"""Released FP8 block-quantized checkpoints: afd reads them as HF transformers does.

The fixtures are tiny DeepSeek-V3 and LongCat-Flash checkpoints rewritten into the released layout
(tests/fp8_checkpoint.py), the oracle HF transformers' load with FineGrainedFP8Config(dequantize=True).
Every FP8 dimension is a multiple of the block there: HF 5.24 takes a tensor's block as its shape over
its scale grid (Fp8Dequantize._dequantize_one), so an edge block (N % bn != 0) is refused or, when the
division happens to be exact, silently read with the wrong block; edge blocks are checked against the
format's definition instead (test_edge_blocks_read_as_the_format_defines).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from fp8_checkpoint import FP8, block_values, hf_dequantized_model, is_fp8_key, write_fp8_checkpoint
from hf_deepseek import make_deepseek_checkpoint
from hf_reference import TINY_CONFIGS, make_hf_checkpoint

from afd.backend import get_backend
from afd.model.checkpoint import SafetensorsReader, build_ffn_half, open_reader
from afd.model.config import read_config_json
from afd.model.registry import checkpoint_quant, load_config
from afd.quant.formats import dequantize, expand_block_scale
from afd.quant.scheme import resolve

BLOCK = (16, 8)
"""(bn, bk): unequal, so that a swapped block shows; every FP8 dimension of the fixtures is a multiple."""

# Sizes that are multiples of 16 (rows) and 8 (columns) in every linear: kv_a = kv_lora + rope = 16,
# q_b and kv_b = heads * 16 = 64, o = heads * v = 32, experts 16, dense MLPs 48.
DIMS = dict(hidden_size=32, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
FAMILIES = {
    "deepseek_v3": lambda p: make_deepseek_checkpoint(
        p, seed=10, **DIMS, intermediate_size=48, moe_intermediate_size=16
    ),
    "longcat_flash": lambda p: make_hf_checkpoint(
        p, seed=0, **DIMS, head_dim=8, ffn_hidden_size=48, expert_ffn_hidden_size=16
    ),
}


class Fp8Family:
    """One family's FP8 fixture: the checkpoint, HF's dequantized model of it (loaded once: the slow part)."""

    def __init__(self, root, family: str):
        self.family = family
        src = FAMILIES[family](str(root / "src"))
        self.path = write_fp8_checkpoint(src, str(root / "fp8"), BLOCK)
        self.hf = hf_dequantized_model(self.path)
        self.hf_state = self.hf.state_dict()
        self.cfg = load_config(self.path)

    def hf_weight(self, key: str) -> torch.Tensor:
        """HF's tensor for checkpoint key `key`: routed experts are fused there (gate_up_proj [E, 2I, H] with
        gate rows first, down_proj [E, H, I])."""
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", key)
        if m is None:
            return self.hf_state[key]
        prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
        if which == "down":
            return self.hf_state[f"{prefix}.down_proj"][e]
        gate_up = self.hf_state[f"{prefix}.gate_up_proj"][e]
        rows = gate_up.shape[0] // 2
        return gate_up[:rows] if which == "gate" else gate_up[rows:]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fp8(request, tmp_path_factory) -> Fp8Family:
    return Fp8Family(tmp_path_factory.mktemp(f"fp8-{request.param}"), request.param)


def _stored(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_fixture_is_in_the_released_layout(fp8):
    stored = _stored(fp8.path)
    with open(os.path.join(fp8.path, "config.json")) as f:
        q = json.load(f)["quantization_config"]
    assert q == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [16, 8]}
    weights = [k for k in stored if not k.endswith("weight_scale_inv")]
    fp8_keys = [k for k in weights if stored[k].dtype == FP8]
    assert fp8_keys == [k for k in weights if is_fp8_key(k)]
    for k in fp8_keys:
        N, K = stored[k].shape
        s = stored[k.removesuffix("weight") + "weight_scale_inv"]
        assert s.dtype == torch.float32 and tuple(s.shape) == (-(-N // 16), -(-K // 8))
        assert N % 16 == 0 and K % 8 == 0  # whole blocks: HF's dequantization reads them right
    assert len([k for k in stored if k.endswith("weight_scale_inv")]) == len(fp8_keys)
    kinds = {re.sub(r"\.\d+\.", ".N.", k) for k in fp8_keys}
    routed = "model.layers.N.mlp.experts.N.gate_proj.weight"
    dense = (
        "model.layers.N.mlp.up_proj.weight" if fp8.family == "deepseek_v3" else "model.layers.N.mlps.N.up_proj.weight"
    )
    assert {routed, dense} <= kinds
    assert any(".kv_a_proj_with_mqa." in k for k in fp8_keys)
    if fp8.family == "deepseek_v3":
        assert "model.layers.N.mlp.shared_experts.down_proj.weight" in kinds
    full = [k for k in weights if k not in fp8_keys]
    router = r"\.mlp\.(gate|router\.classifier)\.weight$"
    assert all(stored[k].dtype == torch.float32 for k in full)
    for pattern in (r"^model\.embed_tokens\.weight$", r"^lm_head\.weight$", r"norm", router, r"e_score_correction"):
        assert any(re.search(pattern, k) for k in full), pattern
        assert not any(re.search(pattern, k) for k in fp8_keys), pattern


def test_hf_holds_the_afd_dequantized_weights(fp8):
    """Every FP8 tensor HF dequantized equals afd.quant.formats.dequantize of its stored blocks bit for bit
    (both widen to fp32 and multiply once), and the format's definition q[n, k] * s[n // bn, k // bk]."""
    stored = _stored(fp8.path)
    keys = [k for k in stored if stored[k].dtype == FP8]
    for k in keys:
        q, s = stored[k], stored[k.removesuffix("weight") + "weight_scale_inv"]
        ours = dequantize(q, expand_block_scale(s, q.shape[0], BLOCK[0]), BLOCK[1])
        hf = fp8.hf_weight(k)
        assert hf.dtype == torch.float32 and torch.equal(hf, ours), k
        assert torch.equal(ours, block_values(q, s, BLOCK)), k
    for k in (k for k in stored if k.endswith(".bias") or "norm" in k):
        assert torch.equal(fp8.hf_state[k], stored[k]), k


def test_reader_gives_hf_values_and_stored_bytes(fp8):
    reader = SafetensorsReader(fp8.path)
    stored = _stored(fp8.path)
    assert reader.fp8 is not None and reader.fp8.block == BLOCK and reader.fp8.not_converted == ()
    layer = fp8.cfg.moe_layers[0] if fp8.family == "deepseek_v3" else 1
    keys = [
        f"model.layers.{layer}.mlp.experts.3.gate_proj.weight",
        f"model.layers.{layer}.mlp.experts.5.down_proj.weight",
        next(k for k in stored if k.endswith("kv_a_proj_with_mqa.weight")),
        next(k for k in stored if re.search(r"mlps?(\.\d+)?\.up_proj\.weight$", k)),
    ]
    for k in keys:
        shape = tuple(stored[k].shape)
        got = reader.get(k, shape)
        assert got.dtype == torch.float32 and torch.equal(got, fp8.hf_weight(k)), k
        q, s = reader.get_fp8(k, shape)
        assert q.dtype == FP8 and torch.equal(q.view(torch.uint8), stored[k].view(torch.uint8)), k
        assert torch.equal(s, stored[k.removesuffix("weight") + "weight_scale_inv"]), k
    router = next(k for k in stored if re.search(r"\.mlp\.(gate|router\.classifier)\.weight$", k))
    assert reader.get_fp8(router, tuple(stored[router].shape)) is None
    assert torch.equal(reader.get(router, tuple(stored[router].shape)), fp8.hf_state[router])


def _hf_routed(fp8: Fp8Family, i: int, x: torch.Tensor) -> torch.Tensor:
    """HF's routed-expert output of decoder layer i on x [T, H]: DeepSeek's MoE less its shared experts
    (afd runs those on the attention side), LongCat's whole MoE (its identity experts included)."""
    mlp = fp8.hf.model.layers[i].mlp
    if fp8.family == "deepseek_v3":
        _, weights, ids = mlp.gate(x)
        return mlp.experts(x, ids, weights)
    return mlp(x)


def test_ffn_half_matches_hf_moe(fp8):
    """afd's FFN half on the checkpoint's FP8 blocks as stored (w8a16: weights widened, activations in
    fp32) against HF's dequantized MoE, every MoE layer, on random hidden states.

    Both sides multiply the bit-equal fp32 weights (test_hf_holds_the_afd_dequantized_weights) and route
    alike (the same router weights in fp32), so they differ only in the order of fp32 sums: afd's grouped
    GEMM and its index_add over the top-k against HF's per-expert F.linear. Each output is a sum of
    K (hidden or expert inner, <= 32) products then top-k weighted terms; reassociating n fp32 terms moves
    the result by at most ~n * 2^-24 of the sum of their magnitudes, which here stays under 1e-5 of the
    output's largest value (measured: a few 1e-7)."""
    with torch.no_grad():
        quant = resolve("w8a16", checkpoint_quant(read_config_json(fp8.path)))
        assert quant is not None and quant.checkpoint is not None and quant.block == BLOCK
        half = build_ffn_half(fp8.cfg, open_reader(fp8.path), torch.float32, torch.device("cpu"), quant=quant)
        backend = get_backend("cpu")
        layers = fp8.cfg.moe_layers if fp8.family == "deepseek_v3" else range(fp8.cfg.num_layers)
        g = torch.Generator().manual_seed(0)
        for i in layers:
            x = torch.randn(37, fp8.cfg.hidden_size, generator=g)
            ours = half(backend, i, x)
            ref = _hf_routed(fp8, i, x)
            scale = ref.abs().max().item()
            assert scale > 0.1
            assert (ours - ref).abs().max().item() <= 1e-5 * scale, i


def test_edge_blocks_read_as_the_format_defines(tmp_path):
    """Dimensions that are not multiples of the block (the releases' kv_a_proj_with_mqa: 576 rows in
    blocks of 128): the reader gives q[n, k] * s[n // bn, k // bk], the last block cut short. HF 5.24
    cannot be the oracle here (see the module docstring), the format's definition is."""
    src = make_hf_checkpoint(str(tmp_path / "src"), **TINY_CONFIGS["odd_sizes"])  # hidden 36, experts 9
    path = write_fp8_checkpoint(src, str(tmp_path / "fp8"), (8, 16))
    stored = _stored(path)
    reader = SafetensorsReader(path)
    edge = [k for k in stored if stored[k].dtype == FP8 and (stored[k].shape[0] % 8 or stored[k].shape[1] % 16)]
    assert any(".experts." in k for k in edge) and any("kv_a_proj" in k for k in edge)
    for k in edge:
        s = stored[k.removesuffix("weight") + "weight_scale_inv"]
        assert torch.equal(reader.get(k, tuple(stored[k].shape)), block_values(stored[k], s, (8, 16))), k


def _llm_w8a16(path: str):
    """afd.LLM on an FP8 checkpoint serving w8a16: the experts hold the stored FP8 bytes, widened in the GEMM."""
    import afd

    llm = afd.LLM(path, dtype="float32", block_size=4, quantization="w8a16")
    assert llm.ffn.layer(llm.cfg.moe_layers[0]).experts.w13.dtype == FP8
    return llm


def test_greedy_tokens_and_logits_match_hf_dequantized(fp8):
    """The whole model (attention half's FP8 projections too) against HF's dequantized model: the same
    greedy tokens and logits within test_families' LOGITS_REL_TOL (fp32 both sides, other kernel orders)."""
    from hf_reference import PROMPTS, greedy_with_logits, max_rel_err

    ref = greedy_with_logits(fp8.hf, PROMPTS, 8)
    logits: list = []
    ours = _llm_w8a16(fp8.path).generate_ids(PROMPTS, 8, logits_out=logits)
    for i, (ref_ids, ref_logits) in enumerate(ref):
        assert ours[i] == ref_ids, f"prompt {i}"
        assert max_rel_err(logits[i], ref_logits) <= 1e-4, f"prompt {i}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("topology", [["--colocated"], ["--ffn-nodes", "2"]], ids=lambda t: "".join(t))
def test_afd_serve_serves_the_fp8_checkpoint_with_hfs_tokens(fp8, topology, tmp_path):
    """`afd serve` on the released layout as it is, colocated and at 1A2F (the experts split across two FFN
    nodes, each holding its share's FP8 blocks), --quantization w8a16: HF's greedy tokens. (1A1F is the 1A2F
    case with one share: its node processes would cost a third of the module's time and test nothing more.)"""
    from cluster_helpers import post
    from hf_reference import PROMPTS, greedy_with_logits
    from serve_helpers import Served, free_port_run

    want = [ids for ids, _ in greedy_with_logits(fp8.hf, PROMPTS[:2], 6)]
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    argv = [fp8.path, "--port", str(port), "--quantization", "w8a16", "--block-size", "4", *topology]
    s = Served(argv, tmp_path / "serve.log", [url])
    try:
        s.wait_ready()
        body = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
        for prompt, ids in zip(PROMPTS[:2], want):
            code, got = post(url, "/v1/completions", {**body, "prompt": prompt})
            assert code == 200 and got["choices"][0]["token_ids"] == ids, got
    finally:
        assert s.stop() == 0
    assert "quantization w8a16: weights FP8 per 16x8 block, the checkpoint's FP8 as stored" in s.log.read_text()


def test_afd_generate_takes_the_flag(fp8, tmp_path, capsys):
    """`afd generate --quantization w8a16` on the FP8 checkpoint: HF's greedy tokens, colocated in this process
    (the flag reaching node processes is the serve case above's)."""
    from hf_reference import PROMPTS, greedy_with_logits

    from afd.entrypoints.cli import main

    want = [ids for ids, _ in greedy_with_logits(fp8.hf, PROMPTS[:2], 4)]
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS[:2]))
    argv = ["generate", "--model", fp8.path, "--prompt-ids", str(prompts), "--max-tokens", "4", "--colocated"]
    assert main([*argv, "--quantization", "w8a16", "--block-size", "4"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == want
    with pytest.raises(SystemExit) as refused:  # argparse refuses it, naming the choices
        main([*argv, "--quantization", "int4"])
    assert refused.value.code == 2
    assert "--quantization: invalid choice: 'int4'" in capsys.readouterr().err
