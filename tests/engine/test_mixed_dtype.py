"""Checkpoints holding non-float tensors (a pretrained BERT: fp32 weights plus an int64 position_ids
buffer): the buffers are copied from the base bit for bit and never read for an expert, the model's
dtype is shown as ``F32 (+I64 buffers)``, and ``dtype: float32`` in a config applies to the float
tensors (it used to be refused as "mixed:F32,I64", with a wrong fix)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.config.export import export_mergekit
from mergepipe.config.parse import parse_config
from mergepipe.config.resolve import plan_from_config
from mergepipe.engine.engine import Engine
from mergepipe.storage.dtypes import dtype_label, label_float_dtype

H, V, P = 32, 50, 16


def bert_tensors(seed: int, positions=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "bert.embeddings.word_embeddings.weight": torch.randn(V, H, generator=g),
        "bert.embeddings.position_embeddings.weight": torch.randn(P, H, generator=g),
        "bert.embeddings.LayerNorm.weight": torch.randn(H, generator=g),
        "bert.encoder.layer.0.attention.self.query.weight": torch.randn(H, H, generator=g),
        "bert.encoder.layer.0.attention.self.query.bias": torch.randn(H, generator=g),
        "bert.encoder.layer.0.output.dense.weight": torch.randn(H, H, generator=g),
    }
    t["bert.embeddings.position_ids"] = torch.arange(P, dtype=torch.int64)[None] if positions is None else positions
    t["bert.embeddings.token_type_ids"] = torch.zeros(1, P, dtype=torch.int64)
    return t


def write(d: Path, tensors: dict) -> Path:
    d.mkdir(parents=True)
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    return d


@pytest.fixture
def family(tmp_path):
    base = bert_tensors(0)
    write(tmp_path / "base", base)
    experts = []
    for e in (1, 2):
        t = {n: (v + 0.01 * e * torch.randn_like(v)) if v.is_floating_point() else v for n, v in base.items()}
        # an expert's buffers differ from the base's: proof that the output's come from the base
        t["bert.embeddings.position_ids"] = torch.full((1, P), 7 * e, dtype=torch.int64)
        experts.append(write(tmp_path / f"expert_{e}", t))
    return tmp_path, base, experts


def test_dtype_labels():
    assert dtype_label(["F32", "I64", "F32"]) == "F32 (+I64 buffers)"
    assert dtype_label(["BF16"]) == "BF16"
    assert dtype_label(["BF16", "F32", "I64", "BOOL"]) == "mixed:BF16,F32 (+BOOL,I64 buffers)"
    assert label_float_dtype("F32 (+I64 buffers)") == "F32"
    assert label_float_dtype("mixed:F32,I64") == "F32"  # a label stored by an older version
    assert label_float_dtype("mixed:BF16,F32") is None


def test_buffers_copied_from_base_never_read_for_experts(family):
    root, base, experts = family
    cat = Catalog(root / "c.sqlite")
    register(cat, "base", str(root / "base"))
    assert cat.model("base")["dtype"] == "F32 (+I64 buffers)"
    for i, e in enumerate(experts):
        register(cat, f"e{i}", str(e), base_id="base")
    plan, _, manifest = api.run(cat, api.merge_request("base", ["e0", "e1"], "ties", density=0.5,
                                                       out=str(root / "out")))
    out = load_file(str(root / "out" / "model.safetensors"))
    for name in ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids"):
        assert out[name].dtype == torch.int64 and torch.equal(out[name], base[name])
        for e in ("e0", "e1"):
            assert name not in plan["access"][e]
            assert name not in manifest.core["realized_by_tensor"]
    # expert bytes read are exactly the float tensors' planned blocks (the buffers are never read)
    float_bytes = sum(v.numel() * 4 for v in base.values() if v.is_floating_point())
    assert plan["full_expert_bytes"] == 2 * float_bytes
    assert manifest.core["realized"]["expert_read"] == plan["estimate"]["expert_read"]
    assert not torch.equal(out["bert.embeddings.word_embeddings.weight"], base["bert.embeddings.word_embeddings.weight"])


def config(root, experts, extra: str) -> str:
    return textwrap.dedent(f"""\
        merge_method: linear
        base_model: {root / 'base'}
        models:
          - model: {experts[0]}
            parameters: {{weight: 0.5}}
          - model: {experts[1]}
            parameters: {{weight: 0.5}}
        """) + extra


def test_config_dtype_float32_applies_to_float_tensors(family):
    root, base, experts = family
    cat = Catalog(root / "c.sqlite")
    cfg = parse_config(config(root, experts, "dtype: float32\nout_dtype: float32\n"), "bert.yml")
    plan, _ = plan_from_config(cat, cfg)
    Engine(cat).execute(plan, out=root / "out")
    out = load_file(str(root / "out" / "model.safetensors"))
    assert torch.equal(out["bert.embeddings.position_ids"], base["bert.embeddings.position_ids"])
    assert out["bert.encoder.layer.0.output.dense.weight"].dtype == torch.float32
    assert "out_dtype: float32" in export_mergekit(cat, plan.id)  # the float dtype, buffers aside


def test_config_other_dtype_converts_the_float_tensors_only(family):
    """``out_dtype: bfloat16`` on an fp32 base with int64 buffers (issue 32): the float tensors are written in
    bf16 (the float32 merge rounded once), the buffers copied as they are."""
    root, base, experts = family
    cat = Catalog(root / "c.sqlite")
    cfg = parse_config(config(root, experts, "out_dtype: bfloat16\n"), "bert.yml")
    plan, _ = plan_from_config(cat, cfg)
    assert plan.out_dtype == "BF16"
    Engine(cat).execute(plan, out=root / "out")
    out = load_file(str(root / "out" / "model.safetensors"))
    assert torch.equal(out["bert.embeddings.position_ids"], base["bert.embeddings.position_ids"])
    assert {v.dtype for n, v in out.items() if "_ids" not in n} == {torch.bfloat16}
    assert "out_dtype: bfloat16" in export_mergekit(cat, plan.id)


def test_pretrained_bert_as_people_have_it_merges_from_a_config(tmp_path):
    """The case of the issue, end to end through the command line: a BERT saved with torch.save
    (pytorch_model.bin: fp32 weights + an int64 position_ids buffer, vocab.txt next to it), experts
    likewise, merged by a mergekit config that says `dtype: float32`."""
    from merge_helpers import run_cli

    base = bert_tensors(0)
    dirs = []
    for i in range(3):
        d = tmp_path / ("base" if i == 0 else f"ft{i}")
        d.mkdir()
        t = base if i == 0 else {n: v + 0.01 * i if v.is_floating_point() else v for n, v in base.items()}
        torch.save(t, d / "pytorch_model.bin")
        (d / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
        (d / "vocab.txt").write_text("[PAD]\n[UNK]\nhello\n")
        (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
        dirs.append(d)
    (tmp_path / "m.yml").write_text(config(tmp_path, dirs[1:], "dtype: float32\ntokenizer_source: base\n"))
    res = run_cli(["--db", tmp_path / "c.sqlite", "merge", "--config", tmp_path / "m.yml", "--out", tmp_path / "out"])
    assert res.returncode == 0, res.stderr
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["bert.embeddings.position_ids"], base["bert.embeddings.position_ids"])
    name = "bert.encoder.layer.0.output.dense.weight"
    assert torch.allclose(out[name], base[name] + 0.015, atol=1e-6)
    assert (tmp_path / "out" / "vocab.txt").read_text() == "[PAD]\n[UNK]\nhello\n"
    res = run_cli(["--db", tmp_path / "c.sqlite", "--json", "models"])
    assert '"F32 (+I64 buffers)"' in res.stdout
