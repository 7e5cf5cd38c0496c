"""State kinds (afd.model.state_spec) in the engine's paged cache (afd.engine.kv_cache): DeepSeek-V4's window and
compressed entries, each layer at its own width in one page pool; the window's pages given back as a sequence
advances; the memory per token against DeepSeek-V3's; the one-kind families' layout unchanged; KVP refused."""

from __future__ import annotations

import math

import pytest
import torch
from hf_deepseek_v4 import BASE

from afd.engine.kv_cache import KVCache
from afd.model.config import ConfigError
from afd.model.deepseek_v4.state import layer_planes
from afd.model.registry import config_from_hf
from afd.model.state_spec import NULL_BLOCK, StateLayout, state_bytes_per_token, window_bytes_per_sequence

CPU = torch.device("cpu")


def _tiny():
    """layers: sliding, CSA (rate 4), HCA (rate 16), CSA; sliding_window 8, head_dim 16, index_head_dim 8."""
    return config_from_hf({"model_type": "deepseek_v4", **BASE})


def test_v4_kinds_hold_each_layer_at_its_own_width():
    cfg = _tiny()
    D, c = cfg.head_dim, cfg.index_head_dim
    window, csa, hca = cfg.state_kinds()  # compressed kinds in the order of their first layer
    assert window.widths == (D, 5 * D + 4 * c, 3 * D, 5 * D + 4 * c) and window.rate == 1
    assert window.lookback == 15  # HCA's open window (rate 16) reaches furthest back: sliding 8 - 1, CSA 2*4 - 1
    assert (csa.rate, csa.widths, csa.lookback) == (4, (0, D + c, 0, D + c), None)
    assert (hca.rate, hca.widths, hca.lookback) == (16, (0, 0, D, 0), None)
    layout = StateLayout(cfg.state_kinds(), 8)
    assert layout.page_values == 8 * window.width
    assert [layout.slots(k) for k in range(3)] == [8, layout.page_values // (2 * D + 2 * c), layout.page_values // D]


def test_layer_views_write_their_own_columns_of_a_page():
    cfg = _tiny()
    kv = KVCache(cfg, 4, 8, torch.float32, CPU)
    p1 = layer_planes(cfg, 1)
    tokens, entries = kv.layer(1).view("window"), kv.layer(1).view("compressed_sparse_attention")
    assert tokens.shape[1:] == (8, p1.token_width) and entries.shape[2] == p1.entry_width
    tokens[3, 1, p1.kv] = 1.0
    entries[2, 5, p1.ientry] = 2.0
    pool = kv.data[0]
    assert pool[3].sum() == cfg.head_dim and pool[2].sum() == 2 * cfg.index_head_dim
    assert kv.layer(0).view("window")[3].sum() == 0  # layer 0's columns of the same page: untouched


def test_window_pages_go_back_as_a_long_sequence_advances():
    """One token a step, 400 tokens: the sequence holds its window's pages (lookback 15 + the block being
    written, blocks of 4) and its compressed entries' pages, and the rest go back to the allocator."""
    cfg, bs = _tiny(), 4
    kv = KVCache(cfg, 32, bs, torch.float32, CPU)
    a, total = kv.allocator, kv.allocator.num_free
    table, held = kv.new_table(), []
    for n in range(1, 401):
        kv.grow(table, n)
        kv.release_window(table, n)
        held.append(total - a.num_free)
    window = [g for g in table if g != NULL_BLOCK]
    assert len(table) == 100 and len(window) == 4 and all(g == NULL_BLOCK for g in table[:-5])
    entries = sum(len(t) for t in table.kinds.values())
    assert (
        entries == kv.layout.blocks_for(1, 400) + kv.layout.blocks_for(2, 400) == 5 + 1
    )  # 100 CSA entries, 24 a page; 25 HCA, 72 a page
    assert held[-1] == len(window) + entries
    assert max(held) <= 5 + entries  # without the window's release: 100 + entries pages
    kv.free(table)
    assert a.num_free == total


def test_trim_gives_back_every_kinds_pages_past_the_tokens():
    cfg = _tiny()
    kv = KVCache(cfg, 64, 4, torch.float32, CPU)
    total = kv.allocator.num_free
    table = kv.new_table()
    kv.grow(table, 200)
    csa = table.kinds["compressed_sparse_attention"]
    assert len(table) == 50 and len(csa) == -(-50 // kv.layout.slots(1)) == 3  # 50 CSA entries, 24 a page
    kv.trim(table, 3)  # no CSA window complete yet
    assert len(table) == 1 and csa == [] and kv.allocator.num_free == total - 1


def test_v4_memory_per_token_against_deepseek_v3_at_hf_defaults():
    """HF's default V4 (43 layers: 20 CSA at rate 4, 23 HCA at rate 128) keeps per token its compressed entries
    only: 20 * (512 + 128) / 4 + 23 * 512 / 128 = 3,292 values, against DeepSeek-V3's 61 * 576 = 35,136;
    plus a fixed window of 128 positions of every layer's per-token planes per sequence."""
    v4, v3 = config_from_hf({"model_type": "deepseek_v4"}), config_from_hf({"model_type": "deepseek_v3"})
    assert state_bytes_per_token(v4, 2) == 2 * 3292
    assert state_bytes_per_token(v3, 2) == 2 * math.prod(v3.kv_cache_shape(1, 1)) == 2 * 35136
    assert window_bytes_per_sequence(v3, 2) == 0
    window_values = 20 * (512 * 5 + 4 * 128) + 23 * 3 * 512
    assert window_values == v4.state_kinds()[0].width == 96768
    assert window_bytes_per_sequence(v4, 2) == 2 * 128 * window_values


@pytest.mark.parametrize("model_type", ["deepseek_v3", "longcat_flash", "qwen3_moe"])
def test_one_kind_families_keep_their_layout(model_type):
    cfg = config_from_hf({"model_type": model_type})
    (kind,) = cfg.state_kinds()
    assert kind.lookback is None and kind.rate == 1
    assert kind.width == math.prod(cfg.kv_cache_shape(1, 1))
    kv = KVCache(cfg, 4, 2, torch.float32, CPU)
    assert not kv.paged and kv.data.shape == cfg.kv_cache_shape(4, 2) and kv.new_table() == []
    assert kv.layer(0).shape == cfg.kv_cache_shape(4, 2)[1:]
    assert kv.max_tokens(4, 512, 10_000) == 8 and kv.max_tokens(4, 512, 5) == 5  # pages in full, or the limit


def test_max_tokens_of_a_window_family_is_its_peak_not_its_history():
    """The longest sequence a pool holds: the window's lookback and one chunk, and every compressed entry."""
    cfg = _tiny()
    kv = KVCache(cfg, 16, 8, torch.float32, CPU)
    pages = kv.allocator.num_free
    n = kv.max_tokens(pages, 32, 100_000)
    assert n > pages * 8 and kv.layout.peak_pages(n, 32) <= pages < kv.layout.peak_pages(n + 1, 32)
    assert kv.max_tokens(pages, 32, 100) == 100
    assert kv.layout.peak_pages(10, 32) == 3  # short: its own 10 tokens (2 blocks) and a CSA page (2 entries)


def test_kvp_is_refused_for_several_kinds():
    with pytest.raises(ConfigError, match="kvp 1"):
        KVCache(_tiny(), 8, 4, torch.float32, CPU, kvp=2)
