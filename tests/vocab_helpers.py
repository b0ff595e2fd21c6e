"""The tiny fp32 family whose experts add tokens, shared by the tests of merges over different vocabularies
(tests/engine/test_vocab_merge.py, tests/engine/test_vocab_interp.py): expert_1 adds ``<tool>``,
``<think>``; expert_2 ``<tool>``, ``<im>``; expert_3 none; their embed_tokens/lm_head grown by those rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mergepipe.research.family import make_family

ADDED = {1: ["<tool>", "<think>"], 2: ["<tool>", "<im>"], 3: []}
ADDED_TOKENS = {"<tool>", "<think>", "<im>", "<new>"}
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def add_tokens(d: Path, tokens: list[str], seed: int) -> None:
    """Append added (special) tokens to a model's tokenizer and their rows to its embeddings."""
    if not tokens:
        return
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    for t in tokens:
        vocab[t] = len(vocab)
        tj["added_tokens"].append({"id": vocab[t], "content": t, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})
    (d / "tokenizer.json").write_text(json.dumps(tj))
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = len(vocab)
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for n in VOCAB_TENSORS:
        rows = torch.randn(len(tokens), tensors[n].shape[1], generator=g).to(tensors[n].dtype)
        tensors[n] = torch.cat([tensors[n], rows])
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


SPREAD_TENSORS = (*VOCAB_TENSORS, "model.layers.0.self_attn.q_proj.weight")  # one tensor whose statistics are
# the catalog's, to compare with the composed ones


def spread_rows(d: Path, scale: float, seed: int, fraction: float = 1.0) -> None:
    """Move a model's embedding rows (and one attention matrix) away from the base's: noise of ``scale``
    times their std added to every entry, so that the whole-tensor angles the interpolation methods take
    are far from 0 (the family's own deltas are tiny: slerp would take its linear branch). ``fraction`` < 1:
    to that fraction of the entries only, drawn at random (experts then share some changed entries and
    not others: ramplus_tl's shared/unique counts matter)."""
    tensors = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for n in SPREAD_TENSORS:
        t = tensors[n]
        noise = scale * float(t.float().std()) * torch.randn(t.shape, generator=g)
        if fraction < 1.0:
            noise = noise * (torch.rand(t.shape, generator=g) < fraction)
        tensors[n] = (t + noise).to(t.dtype)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def added_tokens_family(root: Path, spread: float = 0.0, dtype: str = "fp32",
                        fraction: float = 1.0) -> tuple[Path, list[Path]]:
    """(base, experts) of the family, the base's tokenizer with a chat template (``spread``: the experts'
    embedding rows moved by that much, on ``fraction`` of their entries, spread_rows; ``dtype``: fp32 or
    bf16)."""
    paths = make_family(root / "fam", experts=3, size="tiny", dtype=dtype, shard_bytes=1 << 30, seed=11)
    base, experts = Path(paths["base"]), [Path(p) for p in paths["experts"]]
    tc = json.loads((base / "tokenizer_config.json").read_text())
    tc["chat_template"] = TEMPLATE
    (base / "tokenizer_config.json").write_text(json.dumps(tc))
    for i, e in enumerate(experts, start=1):
        if spread:
            spread_rows(e, spread, 200 + i, fraction)
        add_tokens(e, ADDED[i], 100 + i)
    return base, experts


def same_vocabulary(ours, theirs) -> tuple[dict, dict]:
    """Assert two tokenizers hold the same tokens with the same ids, the added ones possibly in another
    order (mergekit iterates a set of its models); their vocabularies (token -> id)."""
    a, b = ours.get_vocab(), theirs.get_vocab()
    assert set(a) == set(b) and {t: i for t, i in a.items() if t not in ADDED_TOKENS} == {
        t: i for t, i in b.items() if t not in ADDED_TOKENS}
    assert sorted(a[t] for t in ADDED_TOKENS & set(a)) == sorted(b[t] for t in ADDED_TOKENS & set(b))
    return a, b


def mergepipe_merge(tmp: Path, text: str):
    """Plan and run a YAML merge config in a fresh catalog under ``tmp``: (catalog, plan, manifest, tensors)."""
    from mergepipe.catalog.db import Catalog
    from mergepipe.config.parse import parse_config
    from mergepipe.config.resolve import plan_from_config
    from mergepipe.engine.engine import Engine
    cat = Catalog(tmp / "c.sqlite")
    plan, _ = plan_from_config(cat, parse_config(text, "merge.yml"))
    _, manifest = Engine(cat).execute(plan, out=tmp / "mp")
    return cat, plan, manifest, load_file(str(tmp / "mp" / "model.safetensors"))
