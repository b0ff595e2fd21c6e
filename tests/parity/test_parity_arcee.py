"""arcee_fusion on tensors above mergekit's 1,000,000-entry quantile sample (issue 15, item 2).

mergekit estimates a large tensor's importance quantiles from 1,000,000 entries drawn at random with
replacement (torch's generator); ANALYZE draws its 1,000,000 from a fixed-seed stream. The thresholds are
then estimates of the same quantiles: statistically equal, not bit-equal. On the small family (bf16, the
embedding and the head hold 4096 x 256 = 1,048,576 entries) this asserts, per large tensor: the threshold
within 1 % of the exact one (all entries sorted), the entries kept within 2 % of mergekit's count, and
the outputs equal wherever both keep or both drop the change; every smaller tensor is bit-equal.
Tensors at or below 1,000,000 entries use every entry (bit-equal: tests/parity/test_parity_methods.py).
"""

from __future__ import annotations

import torch
import yaml

from mergepipe.api import merge_config
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.gram import load_arcee_thresholds
from mergepipe.config.parse import parse_config
from mergepipe.ops.arcee_fusion import QUANTILE_SAMPLE_SIZE, importance, threshold
from mergepipe.research.family import make_family

from merge_helpers import load_dir
from mergekit_runner import mergekit_merge


def _perturb(folder, name: str) -> None:
    """Change every entry of one tensor of a one-file checkpoint by a small random amount (rewritten in place)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(17)
    t = tensors[name]
    tensors[name] = (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_large_tensors_sample_the_quantiles_like_mergekit(tmp_path):
    paths = make_family(tmp_path / "fam", experts=1, size="small", dtype="bf16", shard_bytes=1 << 30, seed=3)
    _perturb(paths["experts"][0], "model.embed_tokens.weight")  # the family leaves this expert's embedding as is
    cfg = {"merge_method": "arcee_fusion", "base_model": paths["base"], "dtype": "float32", "out_dtype": "bfloat16",
           "models": [{"model": paths["base"]}, {"model": paths["experts"][0]}]}
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        plan, _, _ = merge_config(cat, parse_config(yaml.safe_dump(cfg)), tmp_path / "mp", model_id="fused")
        stored = load_arcee_thresholds(cat, plan["base"]["id"], plan["experts"][0]["id"])
    finally:
        cat.close()
    ours, theirs = load_dir(tmp_path / "mp"), mergekit_merge(cfg, tmp_path / "mk", seed=1)
    base, expert = load_dir(paths["base"]), load_dir(paths["experts"][0])
    changed = 0
    large = [n for n, t in base.items() if t.numel() > QUANTILE_SAMPLE_SIZE]
    assert sorted(large) == ["lm_head.weight", "model.embed_tokens.weight"]
    for name in base:
        if name not in large:
            assert torch.equal(ours[name], theirs[name]), name
            continue
        b, x = base[name].float(), expert[name].float()
        exact = threshold(importance(x, b))
        assert abs(stored[name] - exact) <= 0.01 * abs(exact), (name, stored[name], exact)
        kept_ours, kept_theirs = ours[name] != base[name], theirs[name] != base[name]
        n_o, n_t = int(kept_ours.sum()), int(kept_theirs.sum())
        assert abs(n_o - n_t) <= 0.02 * n_t, (name, n_o, n_t)  # (a tensor the expert did not change: 0 and 0)
        changed += n_t
        same = kept_ours == kept_theirs
        assert torch.equal(ours[name][same], theirs[name][same]), name
        print(name, "threshold", stored[name], "exact", exact, "kept", n_o, "mergekit", n_t)
    assert changed > 1000  # a large tensor where the mask matters
