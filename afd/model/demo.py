"""A small LongCat-Flash-shaped checkpoint with seeded weights, written in the hub's layout.

`make run` serves it so that a newcomer needs no download; it is made once into a cache folder.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

from afd.cache_dir import cache_dir
from afd.model.demo_config import DEMO_CONFIG  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    import torch

    from afd.model.config import ModelConfig

# Written by hand for the demo tokenizer's merges: a byte-level BPE needs some text to learn from,
# and an embedded one keeps the build offline and the ids identical on every machine.
DEMO_TEXT = """\
Attention lets every token look back at the tokens before it. Each head compares a query with the
keys of earlier positions, turns the scores into weights, and mixes the values with those weights.
Multi-head latent attention compresses the keys and values into a small latent vector, so the cache
that holds them for a long conversation stays small, and the heads expand it again when they read.

A mixture of experts replaces one large feed-forward network with many smaller experts. A router
scores the experts for every token and sends the token to the best few; the others do no work for
it. Zero experts return their input unchanged, which lets easy tokens spend less computation while
hard tokens still reach several real experts. The shortcut connection runs the dense part of the
next layer while the experts of this layer are still computing.

When attention and experts run on separate machines, the attention side keeps the cache and the
expert side keeps the weights. Tokens travel from one side to the other and back in every layer,
so the two sides must overlap their work: while one micro-batch is in the experts, the other is in
attention. A good schedule hides the network time behind the computation on both sides.

The server reads a prompt, turns the text into token ids, and generates new tokens one at a time.
It streams the answer back as text, stops at the end-of-sequence token or a stop string, and
reports how many tokens the prompt and the answer used. Tests check that the text survives the
round trip through the tokenizer, including accents like café and naïve, and other scripts too.
"""
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
# 256 byte symbols plus the special tokens: below this a byte-level tokenizer cannot exist.
MIN_TOKENIZER_VOCAB = 256 + len(SPECIAL_TOKENS)
# The rendered prompt carries BOS itself, so it is encoded with add_special_tokens=False (as in HF).
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ m['role'] ~ '; expected system, user or assistant') }}{% endif %}"
    "{{ '<|' ~ m['role'] ~ '|>\\n' ~ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def write_tokenizer(path: str, vocab_size: int) -> None:
    """Trains a byte-level BPE on DEMO_TEXT and writes tokenizer.json, tokenizer_config.json and
    generation_config.json to `path`, with exactly `vocab_size` tokens (ids 0-5 are SPECIAL_TOKENS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_TOKENIZER_VOCAB:
        raise ValueError(
            f"a byte-level tokenizer needs a vocab_size of at least {MIN_TOKENIZER_VOCAB}, got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    # No prefix space: decode(encode(text)) must give back exactly `text`.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DEMO_TEXT.split("\n\n"), trainer)
    # A larger vocab than the text has merges for is filled with reserved specials, so the ids still
    # cover the model's whole embedding table.
    missing = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    # The post-processor adds BOS so that HF's fast tokenizer, which reads only tokenizer.json, agrees.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    for name, content in (
        ("tokenizer_config.json", config),
        ("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2}),
    ):
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)


DEMO_STAMP = ".afd-demo-v2"
"""Bumped whenever what the demo checkpoint holds changes, so that old caches are made again."""


def default_cache_dir() -> str:
    return os.path.join(cache_dir(), "demo-longcat-flash")


def checkpoint_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of a hub-layout checkpoint for `cfg`, from the same generator as dummy weights."""
    # here, not at the top: `afd serve demo` finds the checkpoint made without importing torch
    import torch

    from afd.model.checkpoint import DummyReader
    from afd.model.meta import on_meta
    from afd.model.registry import family

    reader = DummyReader(seed)
    fam = family(cfg.model_type)
    with on_meta():
        attn, ffn = fam.attention_half(cfg), fam.ffn_half(cfg)
    halves = [(attn, fam.name_map.attention_weights), (ffn, fam.name_map.ffn_weights)]
    out = {key: reader.get(key, shape) for half, name_map in halves for w in name_map(half) for key, shape in w.sources}
    for key, shape in ffn.extra_checkpoint_keys():
        out[key] = torch.zeros(shape)
    return out


def write_checkpoint(path: str, hf_config: dict, seed: int = 0) -> str:
    """Writes config.json, model.safetensors and (when the vocabulary can hold one) the demo tokenizer
    to `path` (atomically: a half-written one never stays)."""
    from safetensors.torch import save_file

    from afd.model.registry import config_from_hf

    cfg = config_from_hf(hf_config)
    tmp = f"{path}.tmp-{os.getpid()}"  # per process: two nodes may make the demo at once
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    tensors = {k: v.contiguous() for k, v in checkpoint_tensors(cfg, seed).items()}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    if cfg.vocab_size >= MIN_TOKENIZER_VOCAB:
        write_tokenizer(tmp, cfg.vocab_size)
    try:
        os.replace(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same checkpoint first
    return path


def ensure_demo_checkpoint(path: str | None = None) -> str:
    path = path or default_cache_dir()
    stamp = os.path.join(path, DEMO_STAMP)
    if not all(os.path.isfile(os.path.join(path, f)) for f in (DEMO_STAMP, "model.safetensors", "tokenizer.json")):
        # A cache made by an older afd is made again; os.replace needs the old one gone.
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_checkpoint(path, DEMO_CONFIG)
        with open(stamp, "w") as f:
            f.write("the contents of this demo checkpoint are current\n")
    return path
