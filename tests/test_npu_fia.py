"""npu_fused_infer_attention_score (FIA), MLA's paged decode on Ascend: the fake op (tests/fakes/torch_npu/
ops_attention.py) against the formula and rules of its document, op-plugin 7.1.0, and each rule refused.
NpuBackend and MLA decode on it: tests/test_npu_mla_decode.py."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

FAKES = Path(__file__).resolve().parent / "fakes"


def _load_ops():
    # By path, as tests/fake_ops_helpers.py loads ops.py: tests/fakes stays off sys.path.
    path = FAKES / "torch_npu" / "ops_attention.py"
    spec = importlib.util.spec_from_file_location("afd_tests_fake_npu_attention", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ops = _load_ops()
C, R = 512, 64  # FIA's MLA mode: latent and rope widths (doc)


def _case(B=3, N=32, bs=16, lens=(40, 17, 3), dtype=torch.bfloat16, layout="BSND", seed=0):
    """FIA's arguments for one decode step and the unshaped inputs the reference reads. Blocks are handed
    out shuffled (a busy pool), tables padded with block 0 as afd pads them."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in lens]
    nb = sum(need) + 2
    order = torch.randperm(nb, generator=g).tolist()
    rows, at = [], 0
    for k in need:
        rows.append(order[at : at + k] + [0] * (max(need) - k))
        at += k
    q, qr = torch.randn(B, N, C, generator=g).to(dtype), torch.randn(B, N, R, generator=g).to(dtype)
    key, kr = torch.randn(nb, bs, C, generator=g).to(dtype), torch.randn(nb, bs, R, generator=g).to(dtype)
    shape = {"BSND": (B, 1, N), "BNSD": (B, N, 1), "BSH": (B, 1)}[layout]
    args = dict(
        query=q.reshape(*shape, -1), key=key, value=key, query_rope=qr.reshape(*shape, -1), key_rope=kr,
        block_table=torch.tensor(rows, dtype=torch.int32), actual_seq_lengths_kv=list(lens), num_heads=N,
        num_key_value_heads=1, scale=0.07, input_layout=layout, block_size=bs,
    )  # fmt: skip
    return args, (q, qr, key, kr)


def _reference(q, qr, key, kr, table, lens, scale):
    """The doc's formula in float64: softmax((q k^T + q_rope k_rope^T) * scale) v, v = k (the latents)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs = key.shape[1]
    for b, n in enumerate(lens):
        blocks = table[b, : math.ceil(n / bs)].long()
        k, r = key[blocks].reshape(-1, C)[:n].double(), kr[blocks].reshape(-1, R)[:n].double()
        s = (q[b].double() @ k.T + qr[b].double() @ r.T) * scale
        out[b] = torch.softmax(s, dim=-1) @ k
    return out


def _fia(args: dict, **change):
    a = args | change
    return ops.npu_fused_infer_attention_score(a.pop("query"), a.pop("key"), a.pop("value"), **a)


# The fake accumulates in fp32 and rounds once to the output dtype: within an output ulp of the fp64 reference.
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    "layout,dtype,N,bs",
    [("BSND", torch.bfloat16, 32, 16), ("BNSD", torch.float16, 64, 128), ("BSH", torch.bfloat16, 128, 16)],
)
def test_fake_fia_is_the_documented_formula(layout, dtype, N, bs):
    lens = (2 * bs + 5, bs, 1)  # a partial last block, exactly one block, one key
    args, (q, qr, key, kr) = _case(N=N, bs=bs, lens=lens, dtype=dtype, layout=layout)
    out, lse = _fia(args)
    assert out.shape == args["query"].shape and out.dtype == dtype
    assert lse.shape == (1,) and lse.item() == 0  # source code: a [1] zero without softmax_lse_flag
    ref = _reference(q, qr, key, kr, args["block_table"], lens, 0.07)
    tol = TOL[dtype]
    torch.testing.assert_close(out.reshape(ref.shape).double(), ref, rtol=tol, atol=tol)


def test_one_length_serves_every_batch_and_meta_gives_the_shape():
    args, (q, qr, key, kr) = _case(lens=(17, 17, 17))
    torch.testing.assert_close(_fia(args, actual_seq_lengths_kv=[17])[0], _fia(args)[0])  # doc: length 1
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out, lse = _fia(meta)
    assert out.shape == args["query"].shape and lse.shape == (1,)


def _refusals():
    a, _ = _case()
    wide = torch.randn(a["key"].shape[0], 16, C + R, dtype=torch.bfloat16)  # afd's combined cache
    q16 = a["query"][:, :, :16].contiguous()
    return [
        (dict(query_rope=None), "given together"),
        (dict(key=wide[..., :C], value=wide[..., :C], block_size=16), "contiguous"),
        (dict(query=a["query"].transpose(0, 2).contiguous().transpose(0, 2)), "query must be contiguous"),
        (dict(query=a["query"].float(), query_rope=a["query_rope"].float()), "float16 or bfloat16"),
        (dict(query_rope=a["query_rope"].half()), "dtype must equal"),
        (dict(num_heads=64), "num_heads 64"),
        (dict(query=a["query"][..., :256].contiguous()), "D must be 512"),
        (dict(query=q16, query_rope=a["query_rope"][:, :, :16].contiguous(), num_heads=16), "32, 64 or 128"),
        (dict(query_rope=a["query_rope"][..., :32].contiguous()), "query_rope must be"),
        (dict(softmax_lse_flag=True), "softmax_lse_flag"),
        (dict(kv_padding_size=torch.zeros(3, dtype=torch.int64)), "kv_padding_size"),
        (dict(pse_shift=torch.zeros(1)), "pse_shift"),
        (dict(sparse_mode=3), "sparse_mode 0"),
        (dict(atten_mask=torch.zeros(3, 48, dtype=torch.bool)), "sparse_mode 0"),
        (dict(inner_precise=2), "inner_precise"),
        (dict(block_table=None), "requires page attention"),
        (dict(block_size=64), "block_size 16 or 128"),
        (dict(block_table=a["block_table"].long()), "int32"),
        (dict(block_table=a["block_table"][:2]), "int32 \\[B=3"),
        (dict(key=a["key"][:, :8].contiguous(), value=a["key"][:, :8].contiguous()), "block_size=16"),
        (dict(value=a["key"][:-1].contiguous()), "same shape"),
        (dict(num_key_value_heads=0), "N 1 and D 512"),
        (dict(key_rope=a["key_rope"][:, :, :32].contiguous()), "key_rope must be"),
        (dict(actual_seq_lengths_kv=None), "requires actual_seq_lengths_kv"),
        (dict(actual_seq_lengths_kv=[40, 17]), "1 or >= 3"),
        (dict(actual_seq_lengths_kv=[40, 17, 49]), "columns hold <"),
        (dict(key=a["key"][:4].contiguous(), value=a["key"][:4].contiguous(), key_rope=a["key_rope"][:4].contiguous()),
         "fewer than the batches"),
    ]  # fmt: skip


@pytest.mark.parametrize("i", range(len(_refusals())))
def test_fake_fia_refuses_what_the_doc_rules_out(i):
    change, match = _refusals()[i]
    args, _ = _case()
    with pytest.raises(RuntimeError, match=match):
        _fia(args, **change)


def test_fake_fia_does_not_compute_other_modes():
    """Modes outside MLA paged decode are not modelled: they raise, so no test passes on them by accident."""
    args, _ = _case()
    for change in (
        dict(query_rope=None, key_rope=None),  # GQA
        dict(query=torch.randn(3, 2, 32, C, dtype=torch.bfloat16), query_rope=torch.randn(3, 2, 32, R).bfloat16()),
        dict(input_layout="TND", query=args["query"][:, 0], query_rope=args["query_rope"][:, 0]),
        dict(key=args["key"].to(torch.int8), value=args["key"].to(torch.int8)),
    ):
        with pytest.raises(NotImplementedError):
            _fia(args, **change)
