"""Tiny Mixtral and Qwen3-MoE families in the per-expert layout most Hub checkpoints have
(``block_sparse_moe.experts.E.w1.weight``, ``mlp.experts.E.gate_proj.weight``): a base and fine-tuned experts
(the base plus noise), with a config.json that transformers and mergekit 0.1.5 read."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

H, I, E, L, V, HEADS, KV, HD = 32, 48, 4, 2, 64, 4, 2, 8
ARCHS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _config(model_type: str, dtype: str) -> dict:
    common = {"architectures": [ARCHS[model_type]], "model_type": model_type, "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "head_dim": HD, "vocab_size": V, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": dtype}
    if model_type == "mixtral":
        return {**common, "num_local_experts": E, "num_experts_per_tok": 2}
    return {**common, "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": I,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


def _shapes(model_type: str) -> dict[str, tuple]:
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    moe = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    parts = ({"w1": (I, H), "w2": (H, I), "w3": (I, H)} if model_type == "mixtral"
             else {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)})
    for layer in range(L):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (HEADS * HD, H), p + "self_attn.k_proj.weight": (KV * HD, H),
                    p + "self_attn.v_proj.weight": (KV * HD, H), p + "self_attn.o_proj.weight": (H, HEADS * HD),
                    p + f"{moe}.gate.weight": (E, H)})
        if model_type == "qwen3_moe":
            out.update({p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,)})
        for e in range(E):
            out.update({p + f"{moe}.experts.{e}.{w}.weight": s for w, s in parts.items()})
    return out


def make_moe_family(root: Path, model_type: str, experts: int = 2, dtype: str = "bfloat16") -> dict:
    """``root/base`` and ``root/expert_1..K``: their paths."""
    g = torch.Generator().manual_seed(11)
    tdtype = getattr(torch, dtype)
    base = {n: torch.randn(s, generator=g) * 0.1 for n, s in _shapes(model_type).items()}
    paths = {"base": None, "experts": []}
    for k in range(experts + 1):
        d = Path(root) / ("base" if k == 0 else f"expert_{k}")
        d.mkdir(parents=True)
        tensors = {n: (t if k == 0 else t + 0.02 * torch.randn(t.shape, generator=g)).to(tdtype).contiguous()
                   for n, t in base.items()}
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(_config(model_type, dtype), indent=2))
        if k == 0:
            paths["base"] = str(d)
        else:
            paths["experts"].append(str(d))
    return paths


def per_expert_view(fused: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """A fused (transformers v5) state dict split back into per-expert tensors under the base's names."""
    gate, up, down, moe = (("w1", "w3", "w2", "block_sparse_moe") if model_type == "mixtral"
                           else ("gate_proj", "up_proj", "down_proj", "mlp"))
    out = {}
    for name, t in fused.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            pre = name[: -len(".mlp.experts.gate_up_proj")] + f".{moe}.experts"
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.{gate}.weight"], out[f"{pre}.{e}.{up}.weight"] = t[e].chunk(2, dim=0)
        elif name.endswith(".mlp.experts.down_proj"):
            pre = name[: -len(".mlp.experts.down_proj")] + f".{moe}.experts"
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.{down}.weight"] = t[e]
        else:
            out[name.replace(".mlp.gate.", f".{moe}.gate.")] = t
    return out
