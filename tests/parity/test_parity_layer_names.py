"""Layer names beyond ``layers.N`` (issue 15): GPT-2's ``transformer.h.N`` and BERT's ``encoder.layer.N`` for
gradients, ``slices:`` and frankenmerges, against mergekit 0.1.5 on tiny real transformers checkpoints (built
here with transformers' GPT2LMHeadModel and BertForSequenceClassification, saved as safetensors, fp32 and bf16).

Asserted: a gradient over the layers (slerp's t, a task_arithmetic weight) interpolates by the layer index of
``h.N`` / ``layer.N`` tensors exactly as mergekit does (fp32 within 8 float32 ulps of the tensor's largest value,
bf16 bit-equal or a rare entry one bf16 ulp off); a passthrough frankenmerge renumbers ``h.N`` layers and
writes GPT-2's ``n_layer`` (bit-equal, same names); slices over BERT layers take the embeddings from the first
slice and the pooler from the last, as mergekit's pre/post weights. Measured: fp32 GPT-2 gradient slerp 1.2 ulp, BERT weight-gradient
task_arithmetic bit-equal, BERT slices slerp 1.6 ulp; bf16 bit-equal in all three. (BERT is
BertForSequenceClassification: mergekit 0.1.5 fails on BertModel's optional position_ids alias.)
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.config.parse import parse_config

from merge_helpers import load_dir
from mergekit_runner import mergekit_merge

EPS32 = 2.0 ** -23


def _family(root, arch: str, dtype: str, experts: int = 2):
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    else:
        model = BertForSequenceClassification(BertConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64, max_position_embeddings=16))
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    paths = []
    for i in range(experts + 1):
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(base_state[name] + (0.0 if i == 0 else 0.02 * torch.randn(p.shape, generator=g)))
        path = root / ("base" if i == 0 else f"expert_{i}")
        model.to(tdtype).save_pretrained(path, safe_serialization=True)
        model.to(torch.float32)
        paths.append(path)
    return paths[0], paths[1:]


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def fams(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"names-{request.param}")
    out = {"dtype": request.param, "root": root}
    for arch in ("gpt2", "bert"):
        (root / arch).mkdir()
        out[arch] = _family(root / arch, arch, request.param)
    return out


def _run(fams, cfg, tag):
    cfg = dict(cfg, dtype="float32", **({"out_dtype": "bfloat16"} if fams["dtype"] == "bf16" else {}))
    out = fams["root"] / tag
    out.mkdir()
    cat = Catalog(fams["root"] / f"{tag}.sqlite")
    try:
        plan, _, _ = api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), out / "mp", model_id=tag)
    finally:
        cat.close()
    return plan, load_dir(out / "mp"), mergekit_merge(cfg, out / "mk"), out


def _close(fams, got, ref, ulps=8):
    assert sorted(got) == sorted(ref)
    for name, b in ref.items():
        a = got[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if fams["dtype"] == "bf16":
            differ = float((a != b).float().mean())
            assert differ <= 0.01, (name, differ)
            if differ:
                assert float((a.float() - b.float()).abs().max()) <= 2 ** -8 * float(b.float().abs().max()), name
        else:
            assert float((a - b).abs().max()) <= ulps * EPS32 * float(b.abs().max()), name


def test_gpt2_gradient_slerp_follows_h_layers(fams):
    base, experts = fams["gpt2"]
    cfg = {"merge_method": "slerp", "base_model": str(base),
           "models": [{"model": str(base)}, {"model": str(experts[0])}],
           "parameters": {"t": [{"filter": "attn", "value": [0.0, 1.0]}, {"value": [0.9, 0.1, 0.5]}]}}
    plan, got, ref, _ = _run(fams, cfg, "gpt2-slerp")
    _close(fams, got, ref)
    # t per tensor: layer 1 of 3 is halfway along a gradient; the embeddings are at t = 0
    from mergepipe.planner.settings import layer_t
    assert layer_t("transformer.h.1.attn.c_attn.weight", 3) == 0.5 and layer_t("h.2.mlp.c_fc.bias", 3) == 1.0
    assert layer_t("transformer.wte.weight", 3) == 0.0


def test_bert_weight_gradient_follows_encoder_layers(fams):
    base, experts = fams["bert"]
    cfg = {"merge_method": "task_arithmetic", "base_model": str(base),
           "models": [{"model": str(experts[0]), "parameters": {"weight": [0.2, 1.0]}},
                      {"model": str(experts[1]), "parameters": {"weight": [{"filter": "attention", "value": [1, 0]},
                                                                           {"value": 0.5}]}}]}
    _, got, ref, _ = _run(fams, cfg, "bert-ta")
    _close(fams, got, ref)


def test_gpt2_passthrough_frankenmerge_renumbers_h_layers(fams):
    base, experts = fams["gpt2"]
    cfg = {"merge_method": "passthrough",
           "slices": [{"sources": [{"model": str(base), "layer_range": [0, 2]}]},
                      {"sources": [{"model": str(experts[0]), "layer_range": [1, 3]}]}]}
    plan, got, ref, out = _run(fams, cfg, "gpt2-franken")
    assert sorted(got) == sorted(ref) and "transformer.h.3.mlp.c_fc.weight" in got
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert json.loads((out / "mp" / "config.json").read_text())["n_layer"] == 4
    assert json.loads((out / "mk" / "config.json").read_text())["n_layer"] == 4


def test_bert_slices_take_embeddings_first_and_pooler_last(fams):
    base, experts = fams["bert"]

    def sl(start, end, t):
        return {"sources": [{"model": str(base), "layer_range": [start, end]},
                            {"model": str(experts[0]), "layer_range": [start, end]}], "parameters": {"t": t}}
    cfg = {"merge_method": "slerp", "base_model": str(base), "slices": [sl(0, 1, 0.2), sl(1, 3, [0.6, 0.9])]}
    plan, got, ref, _ = _run(fams, cfg, "bert-slices")
    _close(fams, got, ref)
    t = {c["filter"]: c["value"] for c in plan["params"]["t"]}
    assert t["bert.embeddings.word_embeddings.weight"] == 0.2  # the first slice's, at its t = 0 value
    assert t["bert.pooler.dense.weight"] == pytest.approx(0.6)  # the last slice's, at its t = 0 value
    assert t["classifier.weight"] == pytest.approx(0.6)
    assert t["bert.encoder.layer.2.output.dense.weight"] == pytest.approx(0.9)
