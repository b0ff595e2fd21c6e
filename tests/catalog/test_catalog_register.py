"""Catalog schema and register: headers only (measured), layout checks against the base, idempotent
re-registration, refusal of changed content without replace, and no change on any error."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (
    dump_catalog,
    fsync_tree,
    read_bytes_now,
    register_family,
)
from mergepipe.catalog.schema import SCHEMA_VERSION
from mergepipe.catalog.db import Catalog
from mergepipe.errors import CatalogError, MergePipeError, StorageError
from mergepipe.storage.local import fingerprint
from mergepipe.catalog.models import layout_mismatches, register
from mergepipe.storage.safetensors import INDEX_NAME, open_checkpoint
from mergepipe.storage.local import evict


# --- catalog ----------------------------------------------------------------------------------------
def test_catalog_schema_and_wal(tmp_path):
    path = tmp_path / "c.sqlite"
    cat = Catalog(path)
    tables = {r["name"] for r in cat.query("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables >= {"meta", "models", "tensors", "grids", "analyses", "blocks", "tensor_stats", "plans",
                      "snapshots", "manifests", "lineage", "runs"}
    assert cat.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert cat.query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"] == str(SCHEMA_VERSION)
    cols = {r["name"] for r in cat.query("PRAGMA table_info(blocks)")}
    assert cols >= {"tensor", "block", "row_start", "row_end", "offset", "nbytes", "delta_l2", "delta_l1",
                    "delta_max_abs", "delta_nnz", "sketch"}
    cat.close()


def test_reopening_a_catalog_changes_nothing(tmp_path, fam_fp32):
    path = tmp_path / "c.sqlite"
    cat = Catalog(path)
    register_family(cat, fam_fp32)
    counter = cat.change_counter()
    before = dump_catalog(cat)
    cat.close()
    for _ in range(2):
        again = Catalog(path, create=False)
        assert dump_catalog(again) == before
        assert again.change_counter() == counter
        again.close()


def test_missing_or_foreign_catalog(tmp_path):
    with pytest.raises(CatalogError, match="no catalog here"):
        Catalog(tmp_path / "absent.sqlite", create=False)
    assert not (tmp_path / "absent.sqlite").exists()
    with pytest.raises(CatalogError, match="directory does not exist"):
        Catalog(tmp_path / "no" / "such" / "dir.sqlite")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(CatalogError, match="not a MergePipe catalog"):
        Catalog(junk)
    assert junk.read_bytes() == b"this is not sqlite" * 100


def test_newer_schema_refused(tmp_path):
    path = tmp_path / "c.sqlite"
    cat = Catalog(path)
    cat.conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(SCHEMA_VERSION + 1)])
    cat.close()
    with pytest.raises(CatalogError, match="newer"):
        Catalog(path)


def test_change_counter_bumps_on_writes(catalog, fam_fp32):
    c0 = catalog.change_counter()
    register(catalog, "base", str(fam_fp32.base))
    assert catalog.change_counter() == c0 + 1
    register(catalog, "base", str(fam_fp32.base))  # unchanged: no write
    assert catalog.change_counter() == c0 + 1


# --- register ---------------------------------------------------------------------------------------
def test_register_records_models_and_tensors(catalog, family):
    res = register(catalog, "base", str(family.base))
    assert res["status"] == "registered"
    assert register(catalog, "e1", str(family.experts[0]), base_id="base")["status"] == "registered"
    ck = open_checkpoint(family.base)
    m = catalog.model("base")
    cfg = json.loads((family.base / "config.json").read_text())
    assert m["uri"] == str(family.base.resolve())
    assert (m["kind"], m["base_id"], m["architecture"]) == ("full", None, "LlamaForCausalLM")
    assert m["dtype"] == {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}[family.dtype]
    assert m["params"] == sum(math.prod(t.shape) for t in ck.tensors.values()) == 106816
    assert m["bytes"] == ck.nbytes == m["params"] * (4 if family.dtype == "fp32" else 2)
    assert m["n_tensors"] == len(ck.tensors) == res["n_tensors"]
    assert json.loads(m["config"]) == cfg
    assert m["fingerprint"] == res["fingerprint"] == fingerprint(ck)
    assert m["fingerprint"].startswith("sha256:") and m["content_hash"] is None
    assert m["registered_at"]
    e = catalog.model("e1")
    assert e["base_id"] == "base" and e["fingerprint"] != m["fingerprint"]
    assert catalog.experts_of("base") == ["e1"]
    rows = catalog.tensors("base")
    assert {r["name"] for r in rows} == set(ck.tensors)
    assert [r["idx"] for r in rows] == list(range(len(rows)))
    for r in rows:
        info = ck.tensors[r["name"]]
        assert (r["shape"], r["dtype"], r["file"], r["offset"], r["nbytes"]) == (
            info.shape, info.dtype, info.file, info.offset, info.nbytes)
    # rows are in file order (file, offset), so that a scan in idx order reads each file sequentially
    assert [(r["file"], r["offset"]) for r in rows] == sorted((r["file"], r["offset"]) for r in rows)
    assert {m["id"] for m in catalog.models()} == {"base", "e1"}
    assert catalog.totals()["models"] == 2


def test_register_single_file_uri(catalog, families):
    f = families["fp16-single"].base / "model.safetensors"
    res = register(catalog, "solo", str(f))
    assert res["status"] == "registered"
    m = catalog.model("solo")
    assert m["uri"] == str(f.resolve()) and m["architecture"] is None and m["dtype"] == "F16"


def test_register_reads_no_tensor_bytes(tmp_path, fam_fp32):
    """Measured on a cold cache: only header pages (plus config/index json) come off the disk."""
    fsync_tree(fam_fp32.base, *fam_fp32.experts)
    cat = Catalog(tmp_path / "c.sqlite")
    dirs = fam_fp32.all_dirs()
    tensor_bytes = sum(open_checkpoint(d).nbytes for d in dirs)
    # a generous page-granular allowance: the pages holding each header (plus one), and the json files
    allowance = 0
    for d in dirs:
        for f in d.glob("*.safetensors"):
            header_len = int.from_bytes(f.read_bytes()[:8], "little")
            allowance += ((8 + header_len + 4095) // 4096 + 1) * 4096
        for j in ("config.json", INDEX_NAME):
            allowance += ((d / j).stat().st_size + 4095) // 4096 * 4096
    evict(dirs)
    before = read_bytes_now()
    register_family(cat, fam_fp32)
    delta = read_bytes_now() - before
    print(f"\nregister of {len(dirs)} models: read_bytes {delta} B, tensor bytes {tensor_bytes} B, "
          f"allowance {allowance} B")
    assert delta <= allowance
    assert delta < tensor_bytes / 5
    assert len(cat.models()) == len(dirs)
    cat.close()


def test_register_content_hash(catalog, fam_bf16):
    res = register(catalog, "base", str(fam_bf16.base), with_content_hash=True)
    h = hashlib.sha256()
    for f in sorted(fam_bf16.base.glob("*.safetensors")):
        h.update(f.read_bytes())
    assert catalog.model("base")["content_hash"] == "sha256:" + h.hexdigest()
    assert res["status"] == "registered"


def test_reregister_same_content_is_noop(catalog, fam_fp32):
    register_family(catalog, fam_fp32)
    before = dump_catalog(catalog)
    assert register(catalog, "base", str(fam_fp32.base))["status"] == "unchanged"
    res = register(catalog, "expert_1", str(fam_fp32.experts[0]), base_id="base")
    assert res["status"] == "unchanged"
    # also through a different spelling of the same path
    relative_spelling = str(fam_fp32.experts[0]) + "/../" + fam_fp32.experts[0].name
    assert register(catalog, "expert_1", relative_spelling, base_id="base")["status"] == "unchanged"
    assert dump_catalog(catalog) == before


def test_different_content_refused_unless_replace(catalog, fam_fp32):
    register_family(catalog, fam_fp32)
    before = dump_catalog(catalog)
    # same id, other files
    with pytest.raises(CatalogError) as ei:
        register(catalog, "expert_1", str(fam_fp32.experts[1]), base_id="base")
    assert "expert_1" in str(ei.value) and "--replace" in str(ei.value)
    # same files, other settings
    with pytest.raises(CatalogError, match="already registered"):
        register(catalog, "expert_1", str(fam_fp32.experts[0]), base_id="base", kind="delta")
    with pytest.raises(CatalogError, match="already registered"):
        register(catalog, "expert_1", str(fam_fp32.experts[0]))
    assert dump_catalog(catalog) == before

    res = register(catalog, "expert_1", str(fam_fp32.experts[1]), base_id="base", replace=True)
    assert res["status"] == "replaced"
    m = catalog.model("expert_1")
    assert m["uri"] == str(fam_fp32.experts[1].resolve())
    assert m["fingerprint"] == catalog.model("expert_2")["fingerprint"]
    assert len(catalog.tensors("expert_1")) == len(catalog.tensors("expert_2"))
    assert catalog.query("SELECT COUNT(*) AS n FROM models")[0]["n"] == 3


def test_replace_drops_stale_statistics(catalog, fam_fp32):
    from mergepipe.analyze.runner import analyze
    register_family(catalog, fam_fp32)
    analyze(catalog, ["expert_1"], block_bytes=1 << 20, densities=(0.5,))
    assert catalog.blocks("expert_1") and catalog.analysis("expert_1")
    register(catalog, "expert_1", str(fam_fp32.experts[1]), base_id="base", replace=True)
    assert catalog.blocks("expert_1") == [] and catalog.analysis("expert_1") is None
    assert catalog.tensor_stats("expert_1") == {}


# --- mismatches against the base ------------------------------------------------------------------
def _variant(tmp_path, fam, name, edit) -> str:
    """A single-file copy of the fp32 base with ``edit`` applied to its tensor dict."""
    tensors = {}
    for f in sorted(fam.base.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    edit(tensors)
    out = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(out))
    return str(out)


Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"
NORM = "model.norm.weight"


@pytest.mark.parametrize("edit, needles", [
    pytest.param(lambda t: t.__setitem__(Q, torch.zeros(32, 64)), [Q, "shape [32, 64] != base [64, 64]"],
                 id="shape"),
    pytest.param(lambda t: t.pop(UP), ["missing tensor " + UP], id="missing"),
    pytest.param(lambda t: t.__setitem__(NORM, t[NORM].to(torch.bfloat16)), [NORM, "dtype BF16 != base F32"],
                 id="dtype"),
    pytest.param(lambda t: t.__setitem__("extra.weight", torch.zeros(3)), ["extra tensor extra.weight"],
                 id="extra"),
    pytest.param(lambda t: (t.pop(UP), t.__setitem__(Q, torch.zeros(64, 32)),
                            t.__setitem__(NORM, t[NORM].half())),
                 ["missing tensor " + UP, Q + ": shape [64, 32]", NORM + ": dtype F16"], id="all-three"),
])
def test_expert_layout_mismatch_is_one_error_and_changes_nothing(tmp_path, catalog, fam_fp32, edit, needles):
    register_family(catalog, fam_fp32)
    before = dump_catalog(catalog)
    uri = _variant(tmp_path, fam_fp32, "bad", edit)
    with pytest.raises(CatalogError) as ei:
        register(catalog, "bad", uri, base_id="base")
    msg = str(ei.value)
    assert msg.startswith("bad does not match base base: ")
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    assert dump_catalog(catalog) == before
    # replacing an existing expert with a mismatched checkpoint is refused the same way
    with pytest.raises(CatalogError, match="does not match base"):
        register(catalog, "expert_1", uri, base_id="base", replace=True)
    assert dump_catalog(catalog) == before


def test_layout_mismatches_lists_and_caps():
    from mergepipe.storage.safetensors import Checkpoint, TensorInfo
    from pathlib import Path

    def ck(tensors):
        return Checkpoint(Path("."), [], {t.name: t for t in tensors}, {})
    base = ck([TensorInfo(f"t{i}", "F32", (2,), "f", 0, 8) for i in range(30)])
    assert layout_mismatches(base, base) == []
    expert = ck([TensorInfo(f"u{i}", "F32", (2,), "f", 0, 8) for i in range(30)])
    problems = layout_mismatches(base, expert, limit=5)
    assert problems[:5] == [f"missing tensor t{i}" for i in sorted(range(30), key=str)][:5]
    assert problems[-1] == "... and 55 more"


@pytest.mark.parametrize("case", ["truncated", "header-beyond-file", "overlap", "unknown-dtype",
                                  "not-safetensors", "empty-dir", "missing-path"])
def test_corrupt_inputs_leave_catalog_unchanged(tmp_path, catalog, fam_fp32, case):
    register_family(catalog, fam_fp32)
    before = dump_catalog(catalog)
    d = tmp_path / "ckpt"
    d.mkdir()
    f = d / "model.safetensors"
    if case == "truncated":
        src = fam_fp32.experts[0] / "model-00002-of-00008.safetensors"
        f.write_bytes(src.read_bytes()[:-64])
    elif case == "header-beyond-file":
        f.write_bytes((1 << 20).to_bytes(8, "little") + b"{}")
    elif case in ("overlap", "unknown-dtype"):
        hdr = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
               "b": {"dtype": "F32" if case == "overlap" else "Q4", "shape": [4],
                     "data_offsets": [8, 24] if case == "overlap" else [16, 32]}}
        raw = json.dumps(hdr).encode()
        f.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(32))
    elif case == "not-safetensors":
        f.write_text("<html>404 not found</html>\n")
    elif case == "empty-dir":
        f = d
    elif case == "missing-path":
        f = d / "gone"
    with pytest.raises(StorageError) as ei:
        register(catalog, "broken", str(f if case != "empty-dir" else d), base_id="base")
    assert isinstance(ei.value, MergePipeError)
    assert str(f) in str(ei.value) or str(d) in str(ei.value)
    assert dump_catalog(catalog) == before


def test_register_argument_errors(catalog, fam_fp32):
    register(catalog, "base", str(fam_fp32.base))
    before = dump_catalog(catalog)
    with pytest.raises(CatalogError, match="unknown model id 'nobase'"):
        register(catalog, "e", str(fam_fp32.experts[0]), base_id="nobase")
    with pytest.raises(CatalogError, match="own base"):
        register(catalog, "base", str(fam_fp32.base), base_id="base")
    with pytest.raises(CatalogError, match="unsupported kind 'qlora'"):
        register(catalog, "e", str(fam_fp32.experts[0]), base_id="base", kind="qlora")
    with pytest.raises(CatalogError, match="not a PEFT adapter directory"):
        register(catalog, "e", str(fam_fp32.experts[0]), base_id="base", kind="lora")
    with pytest.raises(CatalogError, match="needs --base"):
        register(catalog, "e", str(fam_fp32.experts[0]), kind="lora")
    with pytest.raises(CatalogError, match="needs --base"):
        register(catalog, "e", str(fam_fp32.experts[0]), kind="delta")
    with pytest.raises(CatalogError, match="must not be empty"):
        register(catalog, "  ", str(fam_fp32.experts[0]))
    assert dump_catalog(catalog) == before


def test_model_lookup_error_names_known_ids(catalog, fam_fp32):
    with pytest.raises(CatalogError, match=r"unknown model id 'x' \(registered: none\)"):
        catalog.model("x")
    register_family(catalog, fam_fp32)
    with pytest.raises(CatalogError, match=r"registered: base, expert_1, expert_2"):
        catalog.model("x")
    assert catalog.has_model("base") and not catalog.has_model("x")


def test_v1_catalog_is_migrated_in_place(tmp_path, fam_fp32):
    """A catalog written by schema v1 (no models.file_stats, no tensor_stats.fixed_bytes) opens,
    migrates and keeps its rows."""
    db = tmp_path / "old.sqlite"
    cat = Catalog(db)
    register(cat, "base", str(fam_fp32.base))
    cat.conn.execute("ALTER TABLE models DROP COLUMN file_stats")
    cat.conn.execute("ALTER TABLE tensor_stats DROP COLUMN fixed_bytes")
    for table in ("blocks", "tensor_stats"):  # v4: non-finite counts
        for col in ("nonfinite", "base_nonfinite"):
            cat.conn.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    cat.conn.execute("ALTER TABLE tensor_stats DROP COLUMN topk")  # v5: exact top-k statistics
    cat.conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    cat.close()
    cat = Catalog(db)
    assert cat.query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"] == str(SCHEMA_VERSION)
    row = cat.model("base")
    assert row["file_stats"] is None and row["fingerprint"].startswith("sha256:")
    assert "fixed_bytes" in {c[1] for c in cat.conn.execute("PRAGMA table_info(tensor_stats)")}
    from mergepipe.catalog.models import check_unchanged
    check_unchanged(row)  # no stored stats: falls back to re-parsing the headers
