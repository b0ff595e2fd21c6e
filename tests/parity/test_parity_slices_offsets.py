"""``slices:`` whose sources start at different layers (layer i of the base merged with layer j of an
expert), against mergekit 0.1.5 at full budget, and under a budget.

MergePipe merges such an expert through a layer view (storage/views.py): the expert's tensors read under
the base's layer names, registered against the base and analyzed like any expert, so the plan's budget,
bound and byte ranges are the view's.

Tolerances, as in test_parity_slices.py: merged tensors within 8 float32 ulps of the tensor's largest value
(the slerp angle and task-arithmetic sums come from the catalog's float64 statistics); most are bit-equal
(the measured numbers are in the README's slices paragraph).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from mergepipe import api
from mergepipe.config.parse import parse_config
from mergepipe.storage.views import LAYER, renumber

from merge_helpers import assert_config_refused, load_dir, open_copy, run_cli, shared_family, slice_source as _src
from mergekit_runner import config_merge_both, mergekit_merge

EPS32 = 2.0 ** -23
ULPS = 8


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    fam = shared_family(tmp_path_factory, "small-fp32")  # 4 layers, 2 experts
    work = tmp_path_factory.mktemp("slices-offsets")
    cat = open_copy(fam, work / "cat.sqlite")
    yield fam, cat, work
    cat.close()


def _merge_both(cat, work, cfg, name):
    return config_merge_both(cat, work, dict(cfg, dtype="float32"), name)


def _ulps(got, ref, tied=None) -> tuple[float, int]:
    """(the largest difference in ulps of the tensor's largest value, how many tensors are bit-equal); ``tied``:
    per tensor, entries left out of the difference (TIES' tied cut-off magnitudes)."""
    assert sorted(got) == sorted(ref)
    worst, equal = 0.0, 0
    for name in ref:
        a, b = got[name], ref[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        d = (a.double() - b.double()).abs()
        diff = float(d[~tied[name]].max()) if tied is not None and (~tied[name]).any() else float(d.max())
        worst = max(worst, diff / (EPS32 * float(b.abs().max())))
        equal += bool(torch.equal(a, b))
    return worst, equal


def _inputs(cfg, out_name: str) -> list[tuple[str, str, float]]:
    """(model path, input tensor name, density) of every source of the output tensor ``out_name``, as mergekit
    pairs them (layer start + i of every source of a slice; outside the layers, the same name)."""
    m = LAYER.search(out_name)
    if m is None:
        sl, i = cfg["slices"][0], None
    else:
        j = int(m.group(1))
        for sl in cfg["slices"]:
            n = sl["sources"][0]["layer_range"][1] - sl["sources"][0]["layer_range"][0]
            if j < n:
                i = j
                break
            j -= n
    return [(s["model"], out_name if i is None else renumber(out_name, s["layer_range"][0] + i),
             (s.get("parameters") or {}).get("density", 1.0)) for s in sl["sources"]]


def _tied(cfg, got) -> dict[str, torch.Tensor]:
    """Per output tensor, the entries where some expert's |delta| (its input tensor minus the base's) equals its
    TIES cut-off magnitude (the k-th largest): there mergekit's unstable sort keeps an arbitrary subset of the
    tied entries, MergePipe the first in flat order (as in test_parity_existing.py)."""
    loaded = {}
    out = {}
    for name in got:
        srcs = _inputs(cfg, name)
        base_model, base_name, _ = next(x for x in srcs if x[0] == cfg["base_model"])
        load = lambda path: loaded.setdefault(path, load_dir(path))
        base = load(base_model)[base_name].float()
        tied = torch.zeros(base.shape, dtype=torch.bool)
        for model, inp, density in srcs:
            if model == cfg["base_model"]:
                continue
            a = (load(model)[inp].float() - base).abs()
            cut = torch.sort(a.reshape(-1), descending=True).values[max(1, int(density * a.numel())) - 1]
            tied |= a == cut
        out[name] = tied
    return out


def _layers(path):
    return json.loads((path / "config.json").read_text())["num_hidden_layers"]


def _offsets(fam, **params):
    """Output layers 0-1: base layers 0-1 with e1's layers 2-3 (the brief's example)."""
    return [{"sources": [_src(fam.base, 0, 2), _src(fam.experts[0], 2, 4, **params)]}]


CASES = {
    "slerp": lambda f: {"slices": _offsets(f), "merge_method": "slerp", "base_model": str(f.base),
                        "parameters": {"t": 0.5}},
    "slerp-gradient": lambda f: {
        "slices": [{"sources": [_src(f.base, 0, 2), _src(f.experts[0], 2, 4)]},
                   {"sources": [_src(f.base, 2, 4), _src(f.experts[0], 0, 2)], "parameters": {"t": 0.3}}],
        "merge_method": "slerp", "base_model": str(f.base),
        "parameters": {"t": [{"filter": "mlp", "value": [0.9, 0.1]}, {"value": 0.6}]}},
    "task_arithmetic": lambda f: {
        "slices": [{"sources": [_src(f.base, 1, 3), _src(f.experts[0], 2, 4, weight=0.7),
                                _src(f.experts[1], 0, 2, weight=[1.2, 0.4])]}],
        "merge_method": "task_arithmetic", "base_model": str(f.base)},
    # the base's layers in place (no layout), the expert's swapped: a plain merge of the view, analyzed on the way
    "task_arithmetic-swapped": lambda f: {
        "slices": [{"sources": [_src(f.base, 0, 2), _src(f.experts[1], 2, 4, weight=0.6)]},
                   {"sources": [_src(f.base, 2, 4), _src(f.experts[1], 0, 2, weight=0.9)]}],
        "merge_method": "task_arithmetic", "base_model": str(f.base)},
    "ties": lambda f: {
        "slices": [{"sources": [_src(f.base, 0, 2), _src(f.experts[0], 2, 4, weight=0.8, density=0.5),
                                _src(f.experts[1], 1, 3, weight=0.6, density=0.7)]},
                   {"sources": [_src(f.base, 3, 4), _src(f.experts[0], 0, 1, weight=0.5, density=0.5),
                                _src(f.experts[1], 3, 4, weight=0.6, density=0.7)]}],
        "merge_method": "ties", "base_model": str(f.base), "parameters": {"normalize": True}},
    "linear": lambda f: {
        "slices": [{"sources": [_src(f.base, 0, 2, weight=0.5), _src(f.experts[0], 2, 4),
                                _src(f.experts[1], 1, 3, weight=0.25)]}],
        "merge_method": "linear", "base_model": str(f.base), "parameters": {"weight": 1.0}},
}
MEASURED: dict[str, tuple[float, int, int]] = {}


@pytest.mark.parametrize("case", list(CASES))
def test_sources_at_other_layers_equal_mergekit(small, case):
    fam, cat, work = small
    cfg = CASES[case](fam)
    plan, manifest, got, ref = _merge_both(cat, work, cfg, case)
    tied = _tied(cfg, got) if case == "ties" else None
    worst, equal = _ulps(got, ref, tied)
    MEASURED[case] = (worst, equal, len(ref))
    at_ties = sum(int(((got[n] != ref[n]) & tied[n]).sum()) for n in ref) if tied else 0
    print(f"{case}: {worst:.2f} ulp, {equal}/{len(ref)} tensors bit-equal, {at_ties} entries differ at tied "
          f"magnitudes")
    assert worst <= ULPS, case
    n_out = sum(sl["sources"][0]["layer_range"][1] - sl["sources"][0]["layer_range"][0] for sl in cfg["slices"])
    assert _layers(work / f"mp-{case}") == n_out
    # every shifted expert is merged through its layer view, analyzed against the base
    views = [e for e in plan["experts"] if "::layers=" in e["uri"]]
    assert views and all(cat.is_analyzed(e["id"]) for e in views)
    assert manifest.core["realized"]["expert_read"] == plan["estimate"]["expert_read"]
    assert manifest.core["realized_by_expert"] == plan["expert_read_by_expert"]


def test_budgeted_task_arithmetic_at_other_layers_reads_the_plan_and_equals_its_access_set(small):
    """task_arithmetic with both experts at other layers than the base's, at 50 %: the bytes read are the
    plan's (per expert, within the budget), the error bound holds against the full merge, and the output equals
    an independent reference made from the plan's access set: base + sum of weight * (the expert's own input
    rows - the base's) over the blocks read, read from the checkpoints' own layer tensors."""
    fam, cat, work = small
    from mergepipe.planner.plan import expand_ranges
    from mergepipe.storage.grid import tensor_grid
    from mergepipe.storage.registry import open_checkpoint
    cfg = dict(CASES["task_arithmetic"](fam), dtype="float32")
    half_cfg = dict(cfg, mergepipe={"budget": "50%"})
    full, _, _ = api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), work / "ta-full", model_id="ta-full")
    half, _, m = api.merge_config(cat, parse_config(yaml.safe_dump(half_cfg)), work / "ta-half", model_id="ta-half")
    core = m.core
    assert 0 < half["estimate"]["expert_read"] <= half["budget"]["bytes"] < half["full_expert_bytes"]
    assert core["realized"]["expert_read"] == half["estimate"]["expert_read"]
    assert core["realized_by_expert"] == half["expert_read_by_expert"]
    assert sorted(core["realized_by_expert"]) == sorted(e["id"] for e in half["experts"])
    got, got_full = load_dir(work / "ta-half"), load_dir(work / "ta-full")
    dist = sum(float((got[n].double() - got_full[n].double()).square().sum()) for n in got) ** 0.5
    assert 0 < dist <= half["error_bound"]["absolute"] * (1 + 1e-6)
    # the independent reference: the plan's access set applied to the input checkpoints' own tensors
    infos = open_checkpoint(fam.base).tensors
    layout = {out: name for out, _, name, _ in half["layout"]["tensors"]}
    weight = {e["id"]: e for e in half["experts"]}
    sources = {e["id"]: s for e, s in zip(half["experts"], cfg["slices"][0]["sources"][1:])}
    base_t = load_dir(fam.base)
    shifted = 0
    for out, name in layout.items():
        ref = base_t[name].clone()
        for eid, tensors in half["access"].items():
            if name not in tensors:
                continue
            src = sources[eid]
            own = next(inp for model, inp, _ in _inputs(cfg, out) if model == src["model"])
            shifted += own != name
            x = load_dir(src["model"])[own]
            e = weight[eid]
            w = e["tensors"][name][0] if e.get("tensors") else e["weight"]
            for span in tensor_grid(infos[name], half["grid"]["block_bytes"]):
                if span.index in set(expand_ranges(tensors[name])):
                    rows = slice(span.row_start, span.row_end)
                    ref[rows] += w * (x[rows] - base_t[name][rows])
        assert float((got[out] - ref).abs().max()) <= ULPS * EPS32 * float(ref.abs().max()), out
    assert shifted > 0


def test_offsets_plan_exports_as_slices_and_round_trips(small):
    """``explain --as-mergekit`` writes each expert with its own layer_range (the layer view's expert) and
    per-input conditions on its own tensor names: MergePipe plans it to the same digest, mergekit merges it
    to the same result."""
    fam, cat, work = small
    from mergepipe.config.export import export_mergekit
    from mergepipe.config.resolve import plan_from_config
    for name in ("slerp-gradient", "task_arithmetic", "ties"):
        plan_id = cat.conn.execute("SELECT plan_id FROM snapshots WHERE model_id = ?", (f"mp-{name}",)).fetchone()[0]
        text = export_mergekit(cat, plan_id)
        assert "::layers=" not in text and "slices:" in text, name
        again, _ = plan_from_config(cat, parse_config(text), save=False)
        assert again.id == plan_id, name
        if name == "task_arithmetic":
            cfg = yaml.safe_load(text)
            cfg.pop("mergepipe")
            ranges = [[s["layer_range"] for s in sl["sources"]] for sl in cfg["slices"]]
            assert ranges == [[[1, 3], [2, 4], [0, 2]]]
            ref = mergekit_merge(cfg, work / "mk-export-ta")
            got = load_dir(work / "mp-task_arithmetic")
            assert _ulps(got, ref)[0] <= ULPS


def test_views_are_reused_and_analyzable_by_id(small):
    """A second merge with the same pairing reuses the registered view (no new model, no new analysis); the
    view is a catalog model that `mergepipe analyze` names like any expert."""
    fam, cat, work = small
    views = [r[0] for r in cat.conn.execute("SELECT id FROM models WHERE uri LIKE '%::layers=%'")]
    assert "e1@0-1=2-3" in views
    before = len(cat.conn.execute("SELECT id FROM models").fetchall())
    cfg = dict(CASES["slerp"](fam), dtype="float32", parameters={"t": 0.25})
    plan, _, _ = api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), work / "again", model_id="again")
    assert [e["id"] for e in plan["experts"]] == ["e1@0-1=2-3"]
    assert len(cat.conn.execute("SELECT id FROM models").fetchall()) == before + 1  # the merged model only
    r = run_cli(["--db", work / "cat.sqlite", "analyze", "e1@0-1=2-3"])
    assert r.returncode == 0, r.stderr


REFUSALS = [
    (lambda f, tmp: {"slices": [{"sources": [_src(f.base, 0, 2), _src(f.experts[0], 2, 4)]},
                                {"sources": [_src(f.base, 1, 2), _src(f.experts[0], 0, 1)]}],
                     "merge_method": "slerp", "base_model": str(f.base), "parameters": {"t": 0.5}},
     "slices[1]: layer 1 of the base is merged again (also in slices[0]); MergePipe merges each base layer once "
     "(repeat layers with `merge_method: passthrough`)"),
    (lambda f, tmp: {"slices": [{"sources": [_src(f.base, 0, 2), _src(_short(f, tmp), 1, 3)]}],
                     "merge_method": "task_arithmetic", "base_model": str(f.base)},
     "slices[0].sources[1]: {short} has no tensor model.layers.1.mlp.down_proj.weight of the shape of the base's "
     "model.layers.0.mlp.down_proj.weight ([{rows}, {cols}]), which it is merged with"),
    (lambda f, tmp: {"slices": [{"sources": [_src(f.base, 0, 2), _src(_adapter(f, tmp), 2, 4, weight=0.5)]}],
                     "merge_method": "task_arithmetic", "base_model": str(f.base)},
     "slices[0].sources[1]: {lora} is a LoRA adapter, whose delta is trained on its base's own layers: give it "
     "the base's layer_range [0, 2], or merge the adapter into a model first"),
]


def _adapter(fam, tmp):
    """``BASE+ADAPTER``: a PEFT LoRA adapter (q_proj, v_proj; r=4) on the base, saved by PEFT itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    out = tmp / "lora"
    if not out.exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(fam.base), torch_dtype=torch.float32)
        get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                         init_lora_weights=False)).save_pretrained(str(out))
    return f"{fam.base}+{out}"


def _short(fam, tmp):
    """expert_1 with layer 1's down_proj cut to half its rows (a checkpoint MergePipe registers: every
    tensor of the base's layer 0 is the base's shape)."""
    from safetensors.torch import save_file
    import shutil
    out = tmp / "short"
    if not out.exists():
        shutil.copytree(fam.experts[0], out)
        for f in out.glob("*.safetensors"):
            f.unlink()
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
        t = load_dir(fam.experts[0])
        name = "model.layers.1.mlp.down_proj.weight"
        t[name] = t[name][: t[name].shape[0] // 2].contiguous()
        save_file(t, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("case", range(len(REFUSALS)))
def test_what_cannot_be_merged_at_other_layers_is_refused_and_changes_nothing(small, tmp_path, case):
    fam, cat, work = small
    make, message = REFUSALS[case]
    cfg = make(fam, tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    db = work / "cat.sqlite"
    shape = load_dir(fam.base)["model.layers.0.mlp.down_proj.weight"].shape
    filled = message.format(short=tmp_path / "short", rows=shape[0], cols=shape[1], lora=f"{fam.base}+{tmp_path}/lora")
    expected = f"bad.yaml: {filled}"
    assert_config_refused(cat, db, path, tmp_path, expected)


def test_a_view_without_statistics_names_the_analyze_command(small, tmp_path):
    """A layer view registered but not analyzed (`mergepipe register` takes its URI like any checkpoint's): a
    plan that needs its statistics says which `mergepipe analyze` stores them; after it, the plan is made."""
    fam, _, _ = small
    from mergepipe.catalog.models import register
    from mergepipe.planner.context import Planner
    from mergepipe.planner.methods import NeedsAnalysis
    from mergepipe.storage.views import view_uri
    cat = open_copy(fam, tmp_path / "c.sqlite")
    try:
        r = run_cli(["--db", tmp_path / "c.sqlite", "register", "--model-id", "v", "--base", "base",
                     "--uri", view_uri(str(fam.experts[0]), {0: 2, 1: 3})])
        assert r.returncode == 0, r.stderr
        names = [t["name"] for t in cat.tensors("base") if ".layers.0." in t["name"] or ".layers.1." in t["name"]]
        layout = {"tensors": [[n, "base", n, None] for n in names], "layers": [["base", 0], ["base", 1]]}
        with pytest.raises(NeedsAnalysis) as exc:
            Planner(cat).plan("base", ["v"], "task_arithmetic", layout=layout, save=False)
        assert "`mergepipe analyze v`" in str(exc.value)
        r = run_cli(["--db", tmp_path / "c.sqlite", "analyze", "v"])
        assert r.returncode == 0, r.stderr
        plan = Planner(cat).plan("base", ["v"], "task_arithmetic", layout=layout, save=False)
        assert plan["full_expert_bytes"] == sum(t["nbytes"] for t in cat.tensors("v") if t["name"] in names)
    finally:
        cat.close()
