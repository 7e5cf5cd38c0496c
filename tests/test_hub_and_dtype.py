"""vLLM's model and memory flags with vLLM's meanings: hub names resolved from a cache laid out as the
hub lays it out (offline), `--dtype auto` as the checkpoint's own dtype, and `--gpu-memory-utilization` sizing
the KV cache from what the device (here the RAM) has left."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from hub_cache import lay_out

from afd.backend.cpu_memory import memory_info
from afd.cluster.local_config import local_config
from afd.cluster.topology import local_model, with_model_defaults
from afd.config.loader import load
from afd.engine.factory import memory_share
from afd.entrypoints.cli import main
from afd.model.config import ConfigError
from afd.model.hub import checkpoint_dir, is_hub_name

GiB = 2**30


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _checkpoint(root: Path, **config) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **config}))
    (root / "tokenizer.json").write_text("{}")
    return root


def test_a_hub_name_resolves_from_the_cache_offline(tmp_path, offline):
    cache = tmp_path / "hub"
    main_snap = lay_out(cache, "afd-tests/tiny", _checkpoint(tmp_path / "a", dtype="bfloat16"))
    v2 = lay_out(cache, "afd-tests/tiny", _checkpoint(tmp_path / "b", dtype="float16"), ref="v2")
    assert checkpoint_dir("afd-tests/tiny", download_dir=str(cache)) == str(main_snap)
    assert checkpoint_dir("afd-tests/tiny", "v2", str(cache)) == str(v2)
    assert json.loads((main_snap / "config.json").read_text())["dtype"] == "bfloat16"  # a link into blobs/


def test_a_hub_name_missing_offline_names_what_was_tried(tmp_path, offline):
    with pytest.raises(ConfigError) as e:
        checkpoint_dir("afd-tests/absent", download_dir=str(tmp_path))
    msg = str(e.value)
    assert "afd-tests/absent" in msg and str(tmp_path) in msg and "HF_HUB_OFFLINE" in msg


def test_paths_are_never_looked_up_on_the_hub(tmp_path):
    for path in ("./ckpt", "/abs/ckpt", "~/ckpt", "a/b/c", "../x"):
        assert not is_hub_name(path)
        assert checkpoint_dir(path) == path  # read_config_json then names what is wrong
    assert is_hub_name("Qwen/Qwen3-30B-A3B") and is_hub_name("gpt2")


@pytest.mark.parametrize(
    "config, want", [({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"), ({}, "float32")]
)
def test_dtype_auto_is_the_checkpoints(tmp_path, config, want):
    path = _checkpoint(tmp_path / "m", **config)
    cfg = local_config(1, 1, {"model": {"path": str(path)}})
    assert cfg.model.dtype == "auto"  # vLLM's default
    assert with_model_defaults(cfg).model.dtype == want
    pinned = local_config(1, 1, {"model": {"path": str(path), "dtype": "float32"}})
    assert with_model_defaults(pinned).model.dtype == "float32"


def test_dtype_auto_refuses_a_dtype_afd_does_not_serve_in(tmp_path):
    path = _checkpoint(tmp_path / "m", dtype="float64")
    with pytest.raises(ConfigError, match="config.json's dtype 'float64'.*--dtype"):
        with_model_defaults(local_config(1, 1, {"model": {"path": str(path)}}))


def test_check_config_reads_a_cached_hub_name_without_downloading(tmp_path, offline, monkeypatch):
    from afd.model.demo_config import DEMO_CONFIG

    cache = tmp_path / "hub"
    ckpt = tmp_path / "demo"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**DEMO_CONFIG, "dtype": "bfloat16"}))
    lay_out(cache, "afd-tests/demo", ckpt)
    cfg = local_config(1, 2, {"model": {"path": "afd-tests/demo", "download_dir": str(cache)}})
    resolved, model_cfg = local_model(cfg)
    assert model_cfg is not None and resolved.model.dtype == "bfloat16"
    absent = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="afd-tests/absent"))
    assert local_model(absent) == (absent, None)


def test_the_done_when_command_line_sets_each_flag(capsys):
    argv = ["serve", "demo", "-tp", "2", "--dtype", "auto", "--enforce-eager", "--max-num-batched-tokens", "256"]
    main([*argv, "--gpu-memory-utilization", "0.5", "--print-config"])
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["layout"]["attention_tp"] == 2 and doc["layout"]["graph_mode"] == "eager"
    assert doc["engine"]["max_num_batched_tokens"] == 256 and doc["engine"]["gpu_memory_utilization"] == 0.5
    assert doc["model"].get("dtype", "auto") == "auto"
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            main(["serve", "demo", "--gpu-memory-utilization", bad])
        assert "--gpu-memory-utilization" in capsys.readouterr().err


class _Device:
    def __init__(self, free: int, total: int):
        self.free, self.total, self.device = free, total, "fake:0"

    def memory_info(self):
        return self.free, self.total


def test_gpu_memory_utilization_takes_what_the_share_leaves():
    eng = load(str(Path(__file__).parent.parent / "deploy" / "local.yaml")).engine
    eng = dataclasses.replace(eng, gpu_memory_utilization=0.5)
    # 80 GiB device with 30 GiB in use after the weights: half of it is 40, so 10 GiB are left for the cache
    assert memory_share(_Device(50 * GiB, 80 * GiB), eng) == 10 * GiB
    with pytest.raises(ConfigError, match="--gpu-memory-utilization 0.5: 50.0 of 80.0 GiB .* in use"):
        memory_share(_Device(30 * GiB, 80 * GiB), eng)


def test_cpu_memory_is_memavailable_within_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    root = tmp_path / "cg"
    root.mkdir()
    assert memory_info(meminfo, root) == (20000000 * 1024, 24000000 * 1024)  # no cgroup files: the host's
    (root / "memory.max").write_text("max\n")
    assert memory_info(meminfo, root) == (20000000 * 1024, 24000000 * 1024)
    (root / "memory.max").write_text(str(8 * GiB))
    (root / "memory.current").write_text(str(6 * GiB))
    assert memory_info(meminfo, root) == (2 * GiB, 8 * GiB)  # a pod's limit, not the host's RAM
