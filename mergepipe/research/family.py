"""Synthetic checkpoint families: a base plus K experts whose deltas look like real fine-tunes.

Deltas are small relative to the weights, concentrated in some layers and some experts, vary from row
to row (so blocks of one tensor differ), partly shared between experts (so sign conflicts and cosines
vary), and some tensors are frozen (exactly zero delta). Everything is seeded and reproducible.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from mergepipe.errors import MergePipeError
from mergepipe.storage.safetensors import INDEX_NAME

SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=256, tie=False,
                 arch="LlamaForCausalLM", model_type="llama", qk_norm=False),
    "small": dict(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, inter=688, vocab=4096, tie=False,
                  arch="LlamaForCausalLM", model_type="llama", qk_norm=False),
    "medium": dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, inter=1376, vocab=16384, tie=False,
                   arch="LlamaForCausalLM", model_type="llama", qk_norm=False),
    "qwen3-0.6b": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151936,
                       tie=True, arch="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True),
    # Llama-3.2-3B's dimensions (3.21B parameters, 6.4 GB in bf16): the scale benchmark's family
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, inter=8192, vocab=128256,
                         tie=True, arch="LlamaForCausalLM", model_type="llama", qk_norm=False),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def tensor_shapes(size: str) -> dict[str, tuple[int, ...]]:
    c = SIZES[size]
    h, q, kv, i = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["inter"]
    shapes = {"model.embed_tokens.weight": (c["vocab"], h)}
    for layer in range(c["layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if c["qk_norm"]:
            shapes[p + "self_attn.q_norm.weight"] = (c["head_dim"],)
            shapes[p + "self_attn.k_norm.weight"] = (c["head_dim"],)
    shapes["model.norm.weight"] = (h,)
    if not c["tie"]:
        shapes["lm_head.weight"] = (c["vocab"], h)
    return shapes


def _gen(seed: int, *parts) -> torch.Generator:
    key = zlib.crc32(json.dumps([seed, *parts]).encode())
    return torch.Generator().manual_seed(key)


def _layer_of(name: str) -> int | None:
    bits = name.split(".")
    return int(bits[2]) if len(bits) > 2 and bits[1] == "layers" else None


def base_tensor(name: str, shape, seed: int) -> torch.Tensor:
    g = _gen(seed, "base", name)
    if len(shape) == 1:
        return 1.0 + 0.05 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) * (0.6 / math.sqrt(shape[-1]))


def delta_tensor(name: str, shape, seed: int, expert: int, n_layers: int) -> torch.Tensor | None:
    """An expert's delta for one tensor, or None when the expert froze it."""
    g = _gen(seed, "expert", expert, name)
    layer = _layer_of(name)
    # Which tensors this expert froze (embeddings and norms often; a few others at random).
    frozen_p = 0.7 if ("embed" in name or "norm" in name or "lm_head" in name) else 0.12
    if torch.rand((), generator=g).item() < frozen_p:
        return None
    # Each expert concentrates its update on a band of layers.
    focus = (expert * 0.37 % 1.0) * max(1, n_layers - 1)
    dist = abs((layer if layer is not None else n_layers) - focus) / max(1, n_layers)
    scale = 0.02 * math.exp(-6.0 * dist) * (0.5 + torch.rand((), generator=g).item()) * (0.6 / math.sqrt(shape[-1]))
    # Part shared across experts (varying by tensor), part expert-specific: cosines and conflicts vary.
    shared_g = _gen(seed, "shared", name)
    rho = float(torch.rand((), generator=_gen(seed, "rho", name, expert % 3)).item()) * 1.2 - 0.3
    shared = torch.randn(shape, generator=shared_g)
    own = torch.randn(shape, generator=g)
    delta = rho * shared + math.sqrt(max(0.0, 1 - rho * rho)) * own
    if len(shape) >= 2:  # rows differ in how much they moved
        rows = torch.exp(torch.randn(shape[0], 1, generator=g) * 1.0)
        delta = delta * rows
    return delta * scale


def write_checkpoint(out: Path, tensors, config: dict, shard_bytes: int) -> None:
    """Write ``tensors`` (a dict, or an iterable of (name, tensor) made one at a time) as safetensors
    shards of at most ``shard_bytes``: each shard is written as soon as it is full, so a model larger
    than memory can be generated. Shards are named ``model-0000i-of-0000n``'s way once their count is
    known (a single shard is ``model.safetensors``)."""
    out.mkdir(parents=True, exist_ok=True)
    items = tensors.items() if isinstance(tensors, dict) else tensors
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    for name, t in items:
        nb = t.numel() * t.element_size()
        if shard and size + nb > shard_bytes:
            written.append(_write_shard(out, len(written), shard))
            shard, size = {}, 0
        shard[name] = t
        size += nb
        total += nb
    written.append(_write_shard(out, len(written), shard))
    weight_map = _name_shards(out, written)
    if len(written) > 1:
        (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(out, config["vocab_size"])
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))


def _write_shard(out: Path, i: int, shard: dict) -> tuple[Path, list[str]]:
    path = out / f".shard-{i + 1:05d}.safetensors"
    save_file(shard, str(path), metadata={"format": "pt"})
    return path, list(shard)


def _name_shards(out: Path, written: list[tuple[Path, list[str]]]) -> dict[str, str]:
    """Rename the shards to their final names; the weight map (tensor name -> file name)."""
    n = len(written)
    weight_map = {}
    for i, (path, names) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        path.rename(out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    return weight_map


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for c, i in list(vocab.items())[:3]],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 2048}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def hf_config(size: str, dtype: str) -> dict:
    c = SIZES[size]
    cfg = {
        "architectures": [c["arch"]], "model_type": c["model_type"], "hidden_size": c["hidden"],
        "intermediate_size": c["inter"], "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"], "vocab_size": c["vocab"],
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": c["tie"], "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[dtype],
    }
    return cfg


def make_family(out: str | Path, experts: int = 4, size: str = "small", dtype: str = "bf16",
                shard_bytes: int = 256 << 20, seed: int = 0, progress=None) -> dict:
    """Write ``out/base`` and ``out/expert_1..K``; returns their paths."""
    if size not in SIZES:
        raise MergePipeError(f"unknown size {size!r} (choose from {', '.join(SIZES)})")
    if dtype not in DTYPES:
        raise MergePipeError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if experts < 1:
        raise MergePipeError("--experts must be at least 1")
    out = Path(out)
    tdtype = DTYPES[dtype]
    shapes = tensor_shapes(size)
    config = hf_config(size, dtype)
    n_layers = SIZES[size]["layers"]
    base = {n: base_tensor(n, s, seed).to(tdtype) for n, s in shapes.items()}
    write_checkpoint(out / "base", base, config, shard_bytes)
    paths = {"base": str(out / "base"), "experts": []}
    for e in range(1, experts + 1):
        write_checkpoint(out / f"expert_{e}", expert_tensors(base, shapes, seed, e, n_layers, tdtype), config,
                         shard_bytes)
        paths["experts"].append(str(out / f"expert_{e}"))
        if progress:
            progress(e, experts)
    return paths


def expert_tensors(base: dict, shapes: dict, seed: int, e: int, n_layers: int, tdtype):
    """Expert ``e`` of a family: the base plus its seeded deltas, (name, tensor) made one at a time."""
    for n, s in shapes.items():
        d = delta_tensor(n, s, seed, e, n_layers)
        yield n, base[n] if d is None else (base[n].float() + d).to(tdtype)


def add_expert(out: str | Path, e: int, size: str = "small", dtype: str = "bf16", shard_bytes: int = 256 << 20,
               seed: int = 0) -> str:
    """Write ``out/expert_{e}`` of the family ``make_family(out, size=size, dtype=dtype, seed=seed)`` (the same
    base, the deltas of expert ``e``): one more expert for a family already on disk."""
    if size not in SIZES or dtype not in DTYPES:
        raise MergePipeError(f"unknown size {size!r} or dtype {dtype!r}")
    shapes = tensor_shapes(size)
    base = {n: base_tensor(n, s, seed).to(DTYPES[dtype]) for n, s in shapes.items()}
    path = Path(out) / f"expert_{e}"
    write_checkpoint(path, expert_tensors(base, shapes, seed, e, SIZES[size]["layers"], DTYPES[dtype]),
                     hf_config(size, dtype), shard_bytes)
    return str(path)
