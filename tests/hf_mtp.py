"""MTP test checkpoints and their reference.

transformers saves no MTP module (LongCat-Flash's model ignores model.mtp.*; DeepSeek-V3's builds none),
so `add_mtp` writes one into a saved checkpoint under the hub's names (see afd/model/*/weights.py). Its
draft is right a controlled share of the time: eh_proj = [I, 0] plus `noise` times random weights, and
the block's output projections (o_proj, the MLP's and experts' down_proj) `noise` times random, so the
draft is mostly lm_head(norm(embed(t_{i+1}))), the main model's argmax after the next token alone, with
every path of the module still in play. `damp` scales the main model's own o_proj and down_proj, so that
its next token depends on the last one more (damp -> 0: drafts nearly always right) or less (damp 1:
rarely). noise = damp = 1 is a fully random module.
The reference (`MTPReference`) runs the module over a whole sequence with transformers' own layers
(DeepSeek-V3's decoder layer num_hidden_layers, LongCat-Flash's MLA and MLP) and no KV cache; `expected`
replays afd's greedy speculative schedule on it to count the drafts and accepted tokens afd must report.
"""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def _mtp_block_keys(tensors: dict, family: str, L: int) -> dict[str, str]:
    """MTP block key -> the decoder key whose shape it takes."""
    if family == "deepseek_v3":
        src = f"model.layers.{L - 1}."
        return {f"model.layers.{L}." + k[len(src) :]: k for k in tensors if k.startswith(src)}
    like = {
        "self_attn.0.": "self_attn.",
        "mlps.0.": "transformer_layer.mlp.",
        "input_layernorm.0.": "input_layernorm.",
        "post_attention_layernorm.0.": "post_attention_layernorm.",
    }
    return {
        f"model.mtp.layers.0.{dst}{k[len(f'model.layers.0.{src}') :]}": k
        for k in tensors
        for src, dst in like.items()
        if k.startswith(f"model.layers.0.{src}")
    }


def _output_projection(key: str) -> bool:
    return key.endswith("o_proj.weight") or key.endswith("down_proj.weight")


def add_mtp(
    src: str, dst: str, family: str, noise: float = 0.1, damp: float = 1.0, seed: int = 0, weight_std: float = 0.2
) -> str:
    """A copy of checkpoint `src` at `dst` with an MTP module (and the main model damped by `damp`), and no
    EOS token: every greedy run spends its whole budget, which the drafts' reference (`expected`) models.
    Whether a tiny random model reaches its EOS within the budget depends on its weights, and those follow
    transformers' parameter layout (5.25 dropped LongCat's identity experts' gate/up rows, so the same seed
    drew other weights, and one prompt stopped early)."""
    if os.path.isfile(os.path.join(dst, "config.json")):
        return dst
    shutil.copytree(src, dst)
    import json

    for name in ("config.json", "generation_config.json"):
        file = os.path.join(dst, name)
        if os.path.isfile(file):
            with open(file) as f:
                conf = json.load(f)
            with open(file, "w") as f:
                json.dump({**conf, "eos_token_id": None}, f, indent=2)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    tensors.update({k: v * damp for k, v in tensors.items() if _output_projection(k)})
    H = tensors["model.embed_tokens.weight"].shape[1]
    g = torch.Generator().manual_seed(seed)
    if family == "deepseek_v3":
        with open(os.path.join(dst, "config.json")) as f:
            L = json.load(f)["num_hidden_layers"]
        pre, norms = f"model.layers.{L}.", (f"model.layers.{L}.enorm", f"model.layers.{L}.hnorm")
        final = f"{pre}shared_head.norm.weight"
        copies = {
            f"{pre}embed_tokens.weight": "model.embed_tokens.weight",  # the hub's copies, which afd skips
            f"{pre}shared_head.head.weight": "lm_head.weight"
            if "lm_head.weight" in tensors
            else "model.embed_tokens.weight",
        }
    else:
        L, pre = None, "model.mtp.layers.0."
        norms, final = (f"{pre}enorm.m", f"{pre}hnorm.m"), "model.mtp.norm.weight"
        copies = {"model.mtp.embed_tokens.weight": "model.embed_tokens.weight"}
    new = {}
    for key, like in _mtp_block_keys(tensors, family, L).items():
        t = torch.randn(tensors[like].shape, generator=g)
        if "norm" in key:
            new[key] = 1.0 + 0.1 * t
        elif key.endswith("e_score_correction_bias"):
            new[key] = 0.05 * t
        else:
            new[key] = weight_std * t * (noise if _output_projection(key) else 1.0)
    eye = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    new[f"{pre}eh_proj.weight"] = (1 - noise) * eye + noise * weight_std * torch.randn(H, 2 * H, generator=g)
    for name in norms:
        new[f"{name}.weight"] = 1.0 + noise * 0.1 * torch.randn(H, generator=g)
    new[final] = tensors["model.norm.weight"] + noise * 0.1 * torch.randn(H, generator=g)
    tensors.update(new)
    tensors.update({k: tensors[v].clone() for k, v in copies.items()})
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


class MTPReference:
    """The checkpoint's main model and MTP module in transformers' layers, over whole sequences."""

    def __init__(self, path: str, family: str):
        from transformers.masking_utils import create_causal_mask

        self.family, self.mask = family, create_causal_mask
        tensors = load_file(os.path.join(path, "model.safetensors"))
        if family == "deepseek_v3":
            from transformers import DeepseekV3ForCausalLM
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm as Norm

            self.main = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
            L = self.main.config.num_hidden_layers
            # the MTP block is decoder layer L: a model one layer deeper loads it from the same keys
            deeper = DeepseekV3ForCausalLM.from_pretrained(
                path, dtype=torch.float32, num_hidden_layers=L + 1, experts_implementation="eager"
            )
            self.block = deeper.model.layers[L].eval()
            pre, final = f"model.layers.{L}.", f"model.layers.{L}.shared_head.norm.weight"
            norms = {"enorm": f"{pre}enorm.weight", "hnorm": f"{pre}hnorm.weight"}
        else:
            from transformers import LongcatFlashForCausalLM
            from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMLA, LongcatFlashMLP
            from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashRMSNorm as Norm

            # the eager expert loop, as DeepSeek's above (LongCat's default is grouped_mm from transformers 5.25)
            self.main = LongcatFlashForCausalLM.from_pretrained(
                path, dtype=torch.float32, experts_implementation="eager"
            )
            cfg, pre = self.main.config, "model.mtp.layers.0."
            self.block = torch.nn.ModuleDict(
                {
                    "self_attn": LongcatFlashMLA(cfg, 0),
                    "mlp": LongcatFlashMLP(cfg),
                    "input_layernorm": Norm(cfg.hidden_size, cfg.rms_norm_eps),
                    "post_attention_layernorm": Norm(cfg.hidden_size, cfg.rms_norm_eps),
                }
            )
            self.block.load_state_dict(
                {
                    k: tensors[pre + ("transformer_layer." if k.startswith("mlp.") else "") + k]
                    for k in self.block.state_dict()
                }
            )
            self.block.eval()
            final, norms = "model.mtp.norm.weight", {"enorm": f"{pre}enorm.m.weight", "hnorm": f"{pre}hnorm.m.weight"}
        cfg = self.main.config
        self.main.eval()
        self.norms = {}
        for name, key in (*norms.items(), ("norm", final)):
            n = Norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            n.weight.data.copy_(tensors[key])
            self.norms[name] = n
        self.eh_proj = tensors[f"{pre}eh_proj.weight"]

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """The main model's final hidden states (what its head reads) [T, H]."""
        return self.main.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def mtp(self, next_ids: list[int], h: torch.Tensor) -> torch.Tensor:
        """The MTP module at positions 0 .. T-1 on (h [T, H], next_ids [T]): its post-norm hidden [T, H]."""
        m = self.main.model
        e = m.embed_tokens(torch.tensor([next_ids]))
        x = torch.cat([self.norms["enorm"](e), self.norms["hnorm"](h[None])], dim=-1) @ self.eh_proj.t()
        pos = torch.arange(len(next_ids))[None]
        pe = m.rotary_emb(x, pos)
        mask = self.mask(config=self.main.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        if self.family == "deepseek_v3":
            x = self.block(x, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        else:
            b = self.block
            a, _ = b["self_attn"](
                hidden_states=b["input_layernorm"](x), attention_mask=mask, position_embeddings=pe, position_ids=pos
            )
            x = x + a
            x = x + b["mlp"](b["post_attention_layernorm"](x))
        return self.norms["norm"](x)[0]

    @torch.no_grad()
    def drafts(self, seq: list[int], H: torch.Tensor, a: int, k: int) -> list[int]:
        """The k drafts afd makes once positions 0 .. a are computed (seq[a + 1] sampled): the MTP module
        on (H[t], seq[t + 1]) for t <= a, then chained on its own hidden state."""
        ids, h, out = list(seq[1 : a + 2]), H[: a + 1], []
        for _ in range(k):
            hm = self.mtp(ids, h)
            out.append(int(self.main.lm_head(hm[-1]).argmax()))
            ids, h = ids + [out[-1]], torch.cat([h, hm[-1:]])
        return out


def expected(ref: MTPReference, prompt: list[int], tokens: list[int], n: int) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) of afd's greedy speculative decoding of `tokens` (the
    greedy continuation of `prompt`, generated to its end) with n drafts per step."""
    seq = prompt + tokens
    H = ref.hidden(seq)
    a, done, drafts, drafted, accepted = len(prompt) - 1, 1, 0, 0, 0
    while done < len(tokens):
        k = min(n, len(tokens) - done - 1)
        d = ref.drafts(seq, H, a, k)
        acc = 0
        while acc < k and d[acc] == seq[a + 2 + acc]:
            acc += 1
        if k:
            drafts, drafted, accepted = drafts + 1, drafted + k, accepted + acc
        done, a = done + acc + 1, a + acc + 1
    return drafts, drafted, accepted
