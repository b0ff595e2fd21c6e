"""mergekit YAML configs: a config merges exactly like the equivalent flags / API call, paths are
registered and analyzed on the fly (and reused), refusals are one clear line with the catalog unchanged,
and `explain --as-mergekit` round-trips to the same plan digest and bytes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from merge_helpers import (
    copy_catalog,
    dir_hashes,
    dump_db,
    manifest_of,
    rows,
    run_cli,
    shared_family,
)

from mergepipe.catalog.db import Catalog
from mergepipe.errors import MergePipeError
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import parse_config
from mergepipe.config.resolve import prepare


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


@pytest.fixture
def db(fam, tmp_path) -> Path:
    return copy_catalog(fam, tmp_path / "c.sqlite")


def write(tmp_path: Path, text: str, name: str = "merge.yml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def cfg_text(fam, method: str, models: list[tuple[int, dict]], params: dict | None = None, extra: str = "") -> str:
    """A mergekit config over the family's paths: models are (expert index, per-model parameters)."""
    doc = {"merge_method": method, "base_model": str(fam.base),
           "models": [{"model": str(fam.experts[i]), **({"parameters": p} if p else {})} for i, p in models]}
    if params:
        doc["parameters"] = params
    return yaml.safe_dump(doc, sort_keys=False) + textwrap.dedent(extra)


def assert_one_line_error(res, *words):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def merge_json(db, *args) -> dict:
    res = run_cli(["--db", db, "--json", "merge", *args])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def model_ids(db) -> list[str]:
    return sorted(r["id"] for r in rows(db, "SELECT id FROM models"))


# --- a config merges exactly like the equivalent flags -------------------------------------------------
CASES = {
    "task_arithmetic": (
        [(0, {"weight": 0.5}), (1, {"weight": 1.0}), (2, {"weight": -0.25})], {"lambda": 0.8},
        "mergepipe:\n  budget: 30%\n",
        ["--op", "task_arithmetic", "--weights", "0.5", "1", "-0.25", "--lambda", "0.8", "--budget", "30%"]),
    "ties": (
        [(0, {"weight": 0.7, "density": 0.3}), (1, {"weight": 0.3, "density": 0.3})], {"normalize": True},
        "dtype: float32\nout_dtype: float32\ntokenizer_source: base\nmergepipe: {budget: 40%, strategy: kept}\n",
        ["--op", "ties", "--weights", "0.7", "0.3", "--density", "0.3", "--normalize", "--budget", "40%",
         "--strategy", "kept"]),
    "dare_ties": (
        [(0, {}), (1, {}), (2, {})], {"weight": 1.0, "density": 0.5, "rescale": True},
        "mergepipe: {seed: 7, budget: '0.5'}\n",
        ["--op", "dare_ties", "--density", "0.5", "--rescale", "--seed", "7", "--budget", "0.5"]),
    "breadcrumbs": (
        [(0, {"weight": 1.0, "density": 0.3, "gamma": 0.01}), (2, {"weight": 2.0, "density": 0.3, "gamma": 0.01})],
        None, "",
        ["--op", "breadcrumbs", "--weights", "1", "2", "--density", "0.3", "--gamma", "0.01"]),
}


@pytest.mark.parametrize("method", list(CASES))
def test_config_equals_cli_flags(fam, db, tmp_path, method):
    models, params, extra, flags = CASES[method]
    cfg = write(tmp_path, cfg_text(fam, method, models, params, extra))
    before = model_ids(db)
    a = merge_json(db, "--config", cfg, "--out", tmp_path / "from-yaml")
    experts = [f"e{i + 1}" for i, _ in models]
    b = merge_json(db, "--base", "base", "--experts", *experts, *flags, "--out", tmp_path / "from-flags")
    assert a["plan_id"] == b["plan_id"] and a["manifest_hash"] == b["manifest_hash"]
    assert dir_hashes(tmp_path / "from-yaml") == dir_hashes(tmp_path / "from-flags")
    assert manifest_of(tmp_path / "from-yaml")["core"]["plan_digest"] == manifest_of(tmp_path / "from-flags")["core"][
        "plan_digest"]
    # The paths were the registered e1..e3: reused, nothing registered besides the two outputs.
    assert model_ids(db) == sorted(before + ["from-yaml", "from-flags"])


def test_config_equals_python_api(fam, db, tmp_path):
    from mergepipe.api import merge, merge_config, plan_config
    cfg = write(tmp_path, cfg_text(fam, "ties", [(0, {"weight": 2.0}), (1, {"weight": 1.0})],
                                   {"density": 0.5}, "mergepipe: {budget: 25%}\n"))
    cat = Catalog(db)
    try:
        p1, _, m1 = merge_config(cat, cfg, tmp_path / "a")
        p2, _, m2 = merge(cat, "base", [{"model": "e1", "weight": 2.0, "density": 0.5},
                                        {"model": "e2", "weight": 1.0, "density": 0.5}],
                          tmp_path / "b", operator="ties", budget="25%")
        assert p1.digest == p2.digest and m1.manifest_hash == m2.manifest_hash
        assert dir_hashes(tmp_path / "a") == dir_hashes(tmp_path / "b")
        # Overrides apply over the file; a stored plan comes back with save=True.
        p3 = plan_config(cat, cfg, budget="10%", seed=3)
        assert p3["budget"]["spec"] == "10%" and p3["seed"] == 3
        assert cat.query("SELECT 1 FROM plans WHERE id = ?", [p3.id])
    finally:
        cat.close()


def test_command_line_flags_override_the_config(fam, db, tmp_path):
    cfg = write(tmp_path, cfg_text(fam, "ties", [(0, {"weight": 1.0}), (1, {"weight": 1.0})], {"density": 0.5},
                                   "mergepipe: {budget: 50%, strategy: conflict, seed: 3}\n"))
    res = run_cli(["--db", db, "--json", "plan", "--config", cfg, "--budget", "20%", "--density", "0.3",
                   "--weights", "2", "1"])
    assert res.returncode == 0, res.stderr
    plan = json.loads(run_cli(["--db", db, "explain", "--json", json.loads(res.stdout)["plan_id"]]).stdout)
    assert plan["budget"]["spec"] == "20%" and plan["strategy"] == "conflict" and plan["seed"] == 3
    assert [(e["weight"], e["density"]) for e in plan["experts"]] == [(2.0, 0.3), (1.0, 0.3)]
    flags = run_cli(["--db", db, "--json", "plan", "--base", "base", "--experts", "e1", "e2", "--op", "ties",
                     "--density", "0.3", "--weights", "2", "1", "--budget", "20%", "--strategy", "conflict",
                     "--seed", "3"])
    assert json.loads(flags.stdout)["plan_id"] == plan["id"]
    # --target-bound replaces the config's budget; the weights must match the models.
    res = run_cli(["--db", db, "--json", "plan", "--config", cfg, "--op", "linear", "--target-bound", "0.2"])
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["error_bound"]["relative"] <= 0.2
    assert_one_line_error(run_cli(["--db", db, "plan", "--config", cfg, "--weights", "1"]), "1 weights", "2 models")
    assert_one_line_error(run_cli(["--db", db, "plan", "--config", cfg, "--base", "base"]), "cannot be combined")


# --- paths are registered and analyzed on the fly, then reused -------------------------------------------
def test_paths_registered_analyzed_then_reused(fam, tmp_path):
    db = tmp_path / "fresh.sqlite"  # no catalog yet: --config creates it
    cfg = write(tmp_path, cfg_text(fam, "ties", [(0, {"weight": 1.0}), (1, {"weight": 0.5})], {"density": 0.37},
                                   "mergepipe: {budget: 60%}\n"))
    first = merge_json(db, "--config", cfg, "--out", tmp_path / "m1")
    assert model_ids(db) == ["base", "expert_1", "expert_2", "m1"]
    m = {r["id"]: r for r in rows(db, "SELECT * FROM models")}
    assert m["expert_1"]["base_id"] == m["expert_2"]["base_id"] == "base" and m["base"]["base_id"] is None
    assert m["expert_1"]["uri"] == str(fam.experts[0].resolve()) and m["expert_1"]["kind"] == "full"
    densities = json.loads(rows(db, "SELECT densities FROM analyses WHERE model_id='expert_1'")[0]["densities"])
    assert 0.37 in densities and 0.5 in densities  # the config's density and the defaults
    # The first merge read the new experts in full and analyzed them on the way.
    assert first["budget_bytes"] == first["full_expert_bytes"] == first["realized"]["expert_read"]
    stats = {t: dump_db(db)[t] for t in ("models", "analyses", "blocks", "tensor_stats", "grids")}
    # Second run: everything is reused (same rows, no re-analysis), the budget applies, only the new
    # snapshot is added; a third run repeats the second exactly.
    second = merge_json(db, "--config", cfg, "--out", tmp_path / "m2")
    assert second["budget_bytes"] < second["full_expert_bytes"]
    third = merge_json(db, "--config", cfg, "--out", tmp_path / "m3")
    assert third["plan_id"] == second["plan_id"] and third["manifest_hash"] == second["manifest_hash"]
    after = dump_db(db)
    for t in ("analyses", "blocks", "tensor_stats", "grids"):
        assert after[t] == stats[t], t
    assert model_ids(db) == ["base", "expert_1", "expert_2", "m1", "m2", "m3"]
    # The same merge through ids gives the same plan.
    res = run_cli(["--db", db, "--json", "plan", "--base", "base", "--experts", "expert_1", "expert_2", "--op",
                   "ties", "--weights", "1", "0.5", "--density", "0.37", "--budget", "60%"])
    assert json.loads(res.stdout)["plan_id"] == second["plan_id"]


def test_new_path_gets_a_free_id_and_reused_models_keep_theirs(fam, db, tmp_path):
    cat = Catalog(db)
    from mergepipe.catalog.models import register
    register(cat, "expert_4", str(fam.experts[2]), base_id="base")  # the folder name of experts[3] is taken
    cat.close()
    cfg = write(tmp_path, cfg_text(fam, "linear", [(0, {"weight": 1.0}), (3, {"weight": 1.0})]))
    s = merge_json(db, "--config", cfg, "--out", tmp_path / "out", "--model-id", "lin")
    new = set(model_ids(db)) - {"base", "e1", "e2", "e3", "expert_4", "lin"}
    assert new == {"expert_4-2"}
    plan = json.loads(run_cli(["--db", db, "explain", "--json", s["plan_id"]]).stdout)
    assert [e["id"] for e in plan["experts"]] == ["e1", "expert_4-2"]
    assert rows(db, "SELECT uri FROM models WHERE id='expert_4-2'")[0]["uri"] == str(fam.experts[3].resolve())


def test_ids_and_base_listed_among_models(fam, db, tmp_path):
    # Catalog ids work as references; the base listed among the models is skipped (as mergekit does).
    cfg = write(tmp_path, """\
        merge_method: ties
        base_model: base
        models:
          - model: base
          - model: e1
            parameters: {weight: 1, density: 0.5}
          - model: e2
            parameters: {weight: 1, density: 0.5}
        """)
    res = run_cli(["--db", db, "--json", "plan", "--config", cfg])
    assert res.returncode == 0, res.stderr
    plan = json.loads(run_cli(["--db", db, "explain", "--json", json.loads(res.stdout)["plan_id"]]).stdout)
    assert [e["id"] for e in plan["experts"]] == ["e1", "e2"]


def test_lora_reference_registers_an_adapter_against_the_base(fam, db, tmp_path):
    """`BASE+ADAPTER` resolves to a LoRA registration (kind lora, base_id = the merge base)."""
    adapter = tmp_path / "my_adapter"
    adapter.mkdir()
    cfg = parse_config(f"merge_method: task_arithmetic\nbase_model: {fam.base}\n"
                       f"models:\n  - model: {fam.base}+{adapter}\n    parameters: {{weight: 0.5}}\n"
                       f"  - model: e1\n    parameters: {{weight: 1.0}}\n")
    cat = Catalog(db)
    try:
        r = prepare(cat, cfg)
        assert r.base == "base"
        assert r.to_register == [{"model_id": "my_adapter", "uri": str(adapter.resolve()), "base_id": "base",
                                  "kind": "lora"}]
        assert r.experts == [{"model": "my_adapter", "weight": 0.5}, {"model": "e1", "weight": 1.0}]
        # An adapter on another model than the merge base is refused.
        other = parse_config(f"merge_method: task_arithmetic\nbase_model: base\n"
                             f"models:\n  - model: {fam.experts[0]}+{adapter}\n")
        with pytest.raises(ConfigError, match="merge base"):
            prepare(cat, other)
        as_base = parse_config(f"merge_method: linear\nbase_model: {fam.base}+{adapter}\nmodels: [e1]\n")
        with pytest.raises(ConfigError, match="cannot be the base"):
            prepare(cat, as_base)
    finally:
        cat.close()


def make_peft_adapter(base_dir: Path, out: Path, seed: int = 0) -> Path:
    """A PEFT LoRA adapter (q_proj, v_proj; r=4) for a generated family's base, saved by PEFT itself."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    peft_model.save_pretrained(str(out))
    return out


def test_lora_adapter_merges_from_yaml(fam, db, tmp_path):
    """End to end with a real PEFT adapter (needs the LoRA kind in the catalog)."""
    adapter = make_peft_adapter(fam.base, tmp_path / "lora_a")
    cfg = write(tmp_path, f"""\
        merge_method: task_arithmetic
        base_model: {fam.base}
        models:
          - model: {fam.base}+{adapter}
            parameters: {{weight: 1.0}}
          - model: {fam.experts[0]}
            parameters: {{weight: 0.5}}
        """)
    s = merge_json(db, "--config", cfg, "--out", tmp_path / "out")
    row = rows(db, "SELECT * FROM models WHERE id = 'lora_a'")[0]
    assert row["kind"] == "lora" and row["base_id"] == "base" and row["uri"] == str(adapter.resolve())
    exported = run_cli(["--db", db, "explain", s["snapshot_id"], "--as-mergekit"]).stdout
    assert f"{fam.base.resolve()}+{adapter.resolve()}" in exported
    again = write(tmp_path, exported, "again.yml")
    before = model_ids(db)
    s2 = merge_json(db, "--config", again, "--out", tmp_path / "out2")
    assert model_ids(db) == sorted(before + ["out2"])
    # The first merge analyzed its experts on the way (a full read); from the export, the same full-budget
    # merge is planned from the statistics: other plan, same bytes out. Exported again, the plan repeats.
    assert s["budget_bytes"] == s["full_expert_bytes"] and s2["plan_id"] != s["plan_id"]
    assert [f.read_bytes() for f in sorted((tmp_path / "out").glob("*.safetensors"))] == \
        [f.read_bytes() for f in sorted((tmp_path / "out2").glob("*.safetensors"))]
    third = write(tmp_path, run_cli(["--db", db, "explain", s2["snapshot_id"], "--as-mergekit"]).stdout, "third.yml")
    assert merge_json(db, "--config", third, "--out", tmp_path / "out3")["plan_id"] == s2["plan_id"]


# --- refusals: one line, exit 2, catalog unchanged ------------------------------------------------------
def _bad(fam):
    base, e1, e2 = fam.base, fam.experts[0], fam.experts[1]
    ok_models = f"models:\n  - model: {e1}\n    parameters: {{weight: 1.0}}\n"
    return [
        ("bad yaml", "models: [\n  - model: x\n", ["not valid YAML", "line"]),
        ("not a mapping", "- just\n- a list\n", ["mapping of keys"]),
        ("empty", "\n", ["empty"]),
        ("missing models", f"merge_method: linear\nbase_model: {base}\n", ["`models:` is required"]),
        ("empty models", f"merge_method: linear\nbase_model: {base}\nmodels: []\n", ["non-empty list"]),
        ("missing method", f"base_model: {base}\n{ok_models}", ["merge_method` is required"]),
        ("unknown method task_adapter", f"merge_method: task_adapter\nbase_model: {base}\n{ok_models}",
         ["merge_method `task_adapter` is not supported", "ties"]),
        ("model_stock with one model", f"merge_method: model_stock\nbase_model: {base}\n{ok_models}",
         ["model_stock"]),
        ("unknown method", f"merge_method: frobnicate\nbase_model: {base}\n{ok_models}",
         ["unknown merge_method `frobnicate`"]),
        ("missing base", f"merge_method: ties\n{ok_models}", ["`base_model` is required by ties"]),
        ("soup of one model", f"merge_method: linear\n{ok_models}", ["lists one model"]),
        ("slices", (f"merge_method: linear\nbase_model: {base}\nslices:\n  - sources:\n"
                   f"      - model: {e1}\n        layer_range: [0, 2]\n"), ["slices"]),
        ("int8_mask filter", (f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters:\n"
                             f"  int8_mask:\n    - filter: mlp\n      value: true\n"),
         ["parameters.int8_mask", "per-tensor filters", "not supported for int8_mask"]),
        ("normalize list", f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters: {{normalize: [true]}}\n",
         ["parameters.normalize"]),
        ("nested filter", (f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters:\n  density:\n"
                          f"    - filter: mlp\n      value: [{{value: 0.5}}]\n"), ["parameters.density[0].value", "nested"]),
        ("mixed list", (f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters:\n"
                       f"  density: [0.5, {{value: 0.3}}]\n"), ["parameters.density[0]", "mixes"]),
        ("filter not a string", (f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters:\n"
                                f"  density: [{{filter: 3, value: 0.3}}]\n"), ["parameters.density[0].filter"]),
        ("condition keys", (f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters:\n"
                           f"  density: [{{filter: mlp, val: 0.3}}]\n"), ["filter and value"]),
        ("empty gradient", f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters: {{density: []}}\n",
         ["parameters.density is an empty list"]),
        ("gradient not numbers", (f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters:\n"
                                 f"  density: [0.5, high]\n"), ["parameters.density[1] must be a number"]),
        ("gradient density out of range", (f"merge_method: ties\nbase_model: {base}\nmodels:\n"
                                          f"  - model: {fam.experts[3]}\n    parameters: {{density: [0.5, 1.2]}}\n"),
         ["density 1.2 of expert_4 on", "outside (0, 1]"]),
        ("weight not a number", (f"merge_method: linear\nbase_model: {base}\nmodels:\n  - model: {e1}\n"
                                f"    parameters: {{weight: abc}}\n"), ["models[0].parameters.weight", "number"]),
        ("weight nan", (f"merge_method: linear\nbase_model: {base}\nmodels:\n  - model: {e1}\n"
                       f"    parameters: {{weight: .nan}}\n"), ["finite"]),
        ("unknown parameter", f"merge_method: ties\nbase_model: {base}\n{ok_models}parameters: {{frobnicity: 0.5}}\n",
         ["unsupported parameter `frobnicity`"]),
        ("unknown key", f"merge_method: linear\nbase_model: {base}\n{ok_models}name: x\n", ["unsupported key `name`"]),
        ("unknown model key", f"merge_method: linear\nbase_model: {base}\nmodels:\n  - model: {e1}\n    lora: x\n",
         ["unsupported key `lora` in models[0]"]),
        ("duplicate key", f"merge_method: linear\nmerge_method: ties\nbase_model: {base}\n{ok_models}",
         ["duplicate key 'merge_method'"]),
        ("unknown dtype", f"merge_method: linear\nbase_model: {base}\n{ok_models}dtype: int4\n",
         ["unknown dtype 'int4'"]),
        ("tokenizer union", (f"merge_method: linear\nbase_model: {base}\n{ok_models}"
                             f"tokenizer: {{source: union, tokens: {{'<new>': {{source: base}}}}}}\n"),
         ["tokenizer.tokens", "'<new>': base has no such token"]),
        ("tokenizer config", (f"merge_method: linear\nbase_model: {base}\n{ok_models}"
                              f"tokenizer: {{source: base, tokens: {{'<new>': {{force: true}}}}}}\n"),
         ["tokenizer.tokens", "'<new>' has no source"]),
        ("per-model gamma out of range", (f"merge_method: breadcrumbs\nbase_model: {base}\nmodels:\n"
                                         f"  - model: {e1}\n    parameters: {{weight: 1, gamma: 0.01}}\n"
                                         f"  - model: {e2}\n    parameters: {{weight: 1, gamma: 1.5}}\n"),
         ["gamma", "1.5", "outside the range"]),
        ("nonexistent path", f"merge_method: linear\nbase_model: {base}\nmodels:\n  - model: {base}/../nope\n",
         ["models[0].model", "nope", "neither a registered model id nor an existing path"]),
        ("nonexistent base", f"merge_method: linear\nbase_model: /no/such/base\n{ok_models}", ["base_model"]),
        ("linear with base twice", f"merge_method: linear\nbase_model: {base}\n{ok_models}  - model: {base}\n"
         f"  - model: {base}\n", ["models[2]", "is listed twice"]),
        ("mapping reference", f"merge_method: linear\nbase_model: {base}\nmodels:\n  - model: {{path: {e1}}}\n",
         ["mapping form"]),
        ("bad extension", f"merge_method: linear\nbase_model: {base}\n{ok_models}mergepipe: {{budgets: 5%}}\n",
         ["unsupported key `budgets` in mergepipe"]),
        ("bad budget", f"merge_method: linear\nbase_model: {base}\n{ok_models}mergepipe: {{budget: lots}}\n",
         ["bad budget 'lots'"]),
        # Found only once the new expert is registered and analyzed: rolled back, catalog unchanged.
        ("density out of range", (f"merge_method: ties\nbase_model: {base}\nmodels:\n"
                                 f"  - model: {fam.experts[3]}\n    parameters: {{weight: 1, density: 1.5}}\n"),
         ["density 1.5", "outside (0, 1]"]),
        ("not a checkpoint", (f"merge_method: linear\nbase_model: {base}\nmodels:\n  - model: {fam.experts[3]}\n"
                             f"  - model: {fam.root}\n"), ["no .safetensors files"]),
    ]


BAD_NAMES = [b[0] for b in _bad(type("F", (), {"base": Path("/b"), "experts": [Path("/e")] * 4,
                                                  "root": Path("/r")})())]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("cmd", ["merge", "plan"])
def test_bad_config_exit_2_catalog_unchanged(fam, db, tmp_path, name, cmd):
    text, words = next((t, w) for n, t, w in _bad(fam) if n == name)
    cfg = write(tmp_path, text)
    before = dump_db(db)
    out = tmp_path / "out"
    res = run_cli(["--db", db, cmd, "--config", cfg] + (["--out", out] if cmd == "merge" else []))
    assert_one_line_error(res, *words)
    assert "Traceback" not in res.stderr
    assert dump_db(db) == before
    assert not out.exists()


# --- per-tensor weights and densities: mergekit's filters and gradients ------------------------------------
ATTN_LOW = [{"filter": "self_attn", "value": 0.3}, {"value": 0.7}]


def test_filters_and_gradients_equal_the_api(fam, db, tmp_path):
    from mergepipe.api import merge
    cfg = write(tmp_path, f"""\
        merge_method: ties
        base_model: {fam.base}
        models:
          - model: {fam.experts[0]}
            parameters:
              weight:
                - filter: self_attn
                  value: 0.3
                - value: 0.7
          - model: {fam.experts[1]}
            parameters: {{density: 0.5}}
        parameters:
          density: [0.3, 0.5]
        mergepipe: {{budget: 60%}}
        """)
    s = merge_json(db, "--config", cfg, "--out", tmp_path / "yaml")
    cat = Catalog(db)
    try:
        plan, _, manifest = merge(cat, "base", [{"model": "e1", "weight": ATTN_LOW, "density": [0.3, 0.5]},
                                                {"model": "e2", "density": 0.5}],
                                  tmp_path / "api", operator="ties", budget="60%")
    finally:
        cat.close()
    assert s["plan_id"] == plan.id and s["manifest_hash"] == manifest.manifest_hash
    assert dir_hashes(tmp_path / "yaml") == dir_hashes(tmp_path / "api")
    e1 = plan["experts"][0]
    assert e1["settings"]["weight"] == [{"filter": "self_attn", "value": 0.3}, {"filter": None, "value": 0.7}]
    # explain --as-mergekit writes the settings back; merging from it gives the same plan.
    exported = run_cli(["--db", db, "explain", s["snapshot_id"], "--as-mergekit"]).stdout
    doc = yaml.safe_load(exported)
    assert doc["models"][0]["parameters"] == {"weight": e1["settings"]["weight"], "density": [0.3, 0.5]}
    again = merge_json(db, "--config", write(tmp_path, exported, "again.yml"), "--out", tmp_path / "again")
    assert again["plan_id"] == s["plan_id"] and again["manifest_hash"] == s["manifest_hash"]


def test_model_filters_fall_back_to_the_global_value(fam, db, tmp_path):
    """mergekit: a model's conditions that match no tensor fall back to the global parameter."""
    from mergepipe.api import merge
    cfg = write(tmp_path, """\
        merge_method: task_arithmetic
        base_model: base
        models:
          - model: e1
            parameters:
              weight: [{filter: mlp, value: 0.25}]
          - model: e2
        parameters: {weight: [0.5, 1.5]}
        """)
    merge_json(db, "--config", cfg, "--out", tmp_path / "yaml")
    cat = Catalog(db)
    try:  # the planner's own two-level resolution: the model's setting, then the merge-wide one
        merge(cat, "base", [{"model": "e1", "weight": [{"filter": "mlp", "value": 0.25}]}, "e2"],
              tmp_path / "api", operator="task_arithmetic", weight=[0.5, 1.5])
    finally:
        cat.close()
    assert dir_hashes(tmp_path / "yaml", "*.safetensors") == dir_hashes(tmp_path / "api", "*.safetensors")


def test_gradient_densities_are_analyzed_on_the_way(fam, db, tmp_path):
    """A gradient can ask for densities the catalog has no thresholds for: the plan reads those experts
    in full and the merge stores thresholds for them, so the next plan is budgeted."""
    cfg = write(tmp_path, cfg_text(fam, "ties", [(0, {"weight": 1.0}), (1, {"weight": 1.0})],
                                   {"density": [0.305, 0.5]}))
    assert 0.305 not in json.loads(rows(db, "SELECT densities FROM analyses WHERE model_id='e1'")[0]["densities"])
    res = run_cli(["--db", db, "--json", "plan", "--config", cfg])
    assert res.returncode == 0, res.stderr
    plan = json.loads(run_cli(["--db", db, "explain", "--json", json.loads(res.stdout)["plan_id"]]).stdout)
    assert [e["analyze"] for e in plan["experts"]] == ["no magnitude threshold for top-0.305"] * 2
    res = run_cli(["--db", db, "merge", "--config", cfg, "--out", tmp_path / "m"])
    assert res.returncode == 0, res.stderr
    for e in ("e1", "e2"):
        assert 0.305 in json.loads(rows(db, "SELECT densities FROM analyses WHERE model_id=?", [e])[0]["densities"])
    res = run_cli(["--db", db, "--json", "plan", "--config", cfg, "--budget", "10%"])
    assert res.returncode == 0, res.stderr
    again = json.loads(res.stdout)
    assert again["budget_bytes"] < again["full_expert_bytes"]


def test_bad_config_file_and_flags(fam, db, tmp_path):
    before = dump_db(db)
    assert_one_line_error(run_cli(["--db", db, "merge", "--config", tmp_path / "none.yml", "--out", tmp_path / "o"]),
                          "no such config file")
    binary = tmp_path / "bin.yml"
    binary.write_bytes(b"\xff\xfe\x00merge")
    assert_one_line_error(run_cli(["--db", db, "plan", "--config", binary]), "UTF-8")
    cfg = write(tmp_path, cfg_text(fam, "linear", [(0, {"weight": 1.0})]))
    assert_one_line_error(run_cli(["--db", db, "merge", "--config", cfg, "--experts", "e1", "--out", tmp_path / "o"]),
                          "cannot be combined with --config")
    taken = tmp_path / "taken"
    taken.mkdir()
    assert_one_line_error(run_cli(["--db", db, "merge", "--config", cfg, "--out", taken]), "already exists")
    assert_one_line_error(run_cli(["--db", db, "merge", "--config", cfg, "--out", tmp_path / "x", "--model-id", "e2"]),
                          "already registered")
    assert_one_line_error(run_cli(["--db", db, "plan"]), "--base and --experts are required")
    assert dump_db(db) == before
    # A missing catalog is not created for a config that cannot be read.
    res = run_cli(["--db", tmp_path / "new.sqlite", "plan", "--config", tmp_path / "none.yml"])
    assert res.returncode == 2 and not (tmp_path / "new.sqlite").exists()


def test_dtypes_honoured_on_a_bf16_base(tmp_path):
    from mergepipe.research.family import make_family
    paths = make_family(tmp_path / "f", experts=1, size="tiny", dtype="bf16")
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        def cfg(extra):
            return parse_config(f"merge_method: linear\nbase_model: {paths['base']}\n"
                                f"models:\n  - model: {paths['experts'][0]}\n{extra}")
        # the usual mergekit config for a bf16 family: computed in float32 here, written as bf16; any other
        # float output dtype is written too (mergekit's out_dtype, else dtype: issue 32)
        for ok, out in (("", None), ("dtype: float32\nout_dtype: bfloat16\n", "BF16"), ("out_dtype: bf16\n", "BF16"),
                        ("dtype: bfloat16\n", "BF16"), ("dtype: float32\n", "F32"), ("out_dtype: float16\n", "F16"),
                        ("dtype: float16\n", "F16")):
            r = prepare(cat, cfg(ok))
            assert [k["model_id"] for k in r.to_register] == ["base", "expert_1"]
            assert r.request().out_dtype == out
        assert cat.query("SELECT COUNT(*) AS n FROM models")[0]["n"] == 0  # prepare only looks
    finally:
        cat.close()


def test_parse_config_fields():
    cfg = parse_config("""\
        merge_method: della
        base_model: base
        models:
          - model: a
            parameters: {weight: 0.5, density: {value: 0.6}, epsilon: 0.05}
          - model: b
            parameters: {density: 0.4}
        parameters: {weight: 2, normalize: false, rescale: 1, lambda: 1.5, int8_mask: true, epsilon: 0.05}
        dtype: fp32
        tokenizer_source: base
        mergepipe: {budget: 0.25, strategy: random, seed: 9, plan: plan-0123}
        """.replace("        ", ""), source="x.yml")
    assert cfg.method == "della" and cfg.base == "base"
    assert [(m.ref, m.weight, m.density) for m in cfg.models] == [("a", 0.5, 0.6), ("b", 2.0, 0.4)]
    assert (cfg.normalize, cfg.rescale, cfg.lam, cfg.epsilon, cfg.gamma) == (False, True, 1.5, 0.05, None)
    assert (cfg.dtype, cfg.budget, cfg.strategy, cfg.seed, cfg.plan_id) == ("F32", "0.25", "random", 9, "plan-0123")
    with pytest.raises(MergePipeError, match=r"^x\.yml: "):
        parse_config("merge_method: arcee_fusion\n", source="x.yml")


# --- export: explain --as-mergekit round-trips ----------------------------------------------------------
@pytest.mark.parametrize("flags", [
    ["--op", "ties", "--weights", "0.7", "0.2", "0.5", "--density", "0.3", "--budget", "35%", "--strategy", "kept"],
    ["--op", "dare_linear", "--density", "0.5", "--seed", "5", "--io-budget-mb", "0.25", "--no-rescale"],
    ["--op", "task_arithmetic", "--lambda", "0.6", "--target-bound", "0.2"],
])
def test_explain_as_mergekit_round_trips(fam, db, tmp_path, flags):
    s = merge_json(db, "--base", "base", "--experts", "e1", "e2", "e3", *flags, "--out", tmp_path / "orig")
    out_yml = tmp_path / "exported.yml"
    res = run_cli(["--db", db, "explain", s["snapshot_id"], "--as-mergekit", "--out", out_yml])
    assert res.returncode == 0, res.stderr
    text = out_yml.read_text()
    doc = yaml.safe_load(text)
    assert doc["base_model"] == str(fam.base.resolve()) and doc["dtype"] == "float32"
    assert doc["out_dtype"] == "float32" and doc["tokenizer_source"] == "base"
    assert [m["model"] for m in doc["models"]] == [str(p.resolve()) for p in fam.experts[:3]]
    assert doc["mergepipe"]["plan"] == s["plan_id"] and s["plan_id"] in text.splitlines()[0]
    # stdout and the snapshot directory give the same text (the directory needs no catalog).
    assert run_cli(["--db", db, "explain", "orig", "--as-mergekit"]).stdout == text
    assert run_cli(["--db", tmp_path / "none.sqlite", "explain", tmp_path / "orig", "--as-mergekit"]).stdout == text
    before = model_ids(db)
    again = merge_json(db, "--config", out_yml, "--out", tmp_path / "again")
    assert again["plan_id"] == s["plan_id"] and again["manifest_hash"] == s["manifest_hash"]
    assert dir_hashes(tmp_path / "again") == dir_hashes(tmp_path / "orig")
    assert model_ids(db) == sorted(before + ["again"])
    # A plan id exports too.
    plan_yml = run_cli(["--db", db, "explain", s["plan_id"], "--as-mergekit"]).stdout
    assert yaml.safe_load(plan_yml) == doc


def test_explain_as_mergekit_errors(db, tmp_path):
    assert_one_line_error(run_cli(["--db", db, "explain", "nope", "--as-mergekit"]), "unknown plan or snapshot")
    assert_one_line_error(run_cli(["--db", db, "explain", "nope", "--out", tmp_path / "x.yml"]), "--as-mergekit")
