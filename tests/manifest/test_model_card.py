"""The model card (README.md) of every published snapshot: Hugging Face front matter, method, inputs by
fingerprint, budget, estimated vs realized bytes, recipe; hashed in the manifest and checked by verify."""

from __future__ import annotations

import hashlib

import pytest
import yaml

from dashboard_helpers import build_catalog
from mergepipe.api import load_manifest, verify
from mergepipe.catalog.db import Catalog
from mergepipe.manifest.card import CARD_NAME, model_card, recipe


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("card"))


def test_every_snapshot_has_a_model_card(built):
    cat = Catalog(built.db)
    try:
        m = load_manifest(cat, built.snapshot_id)
        card = built.merged / CARD_NAME
        data = card.read_bytes()
        assert m.core["outputs"][CARD_NAME] == {"sha256": "sha256:" + hashlib.sha256(data).hexdigest(),
                                                "bytes": len(data)}
        text = data.decode()
        assert text == model_card(m.core)
        _, front, body = text.split("---\n", 2)
        front = yaml.safe_load(front)
        assert front == {"base_model": ["base", *built.experts], "tags": ["merge", "mergepipe", "linear"],
                         "library_name": "transformers"}
        for e in m.core["inputs"]["experts"]:
            assert f"| expert | {e['id']} | `{e['fingerprint']}` |" in body
        assert m.core["inputs"]["base"]["fingerprint"] in body
        assert "budget: 30% = " in body and "changed (delta != 0) expert bytes" in body
        assert "| expert read |" in body and "error bound: " in body
        rec = yaml.safe_load(body.split("```yaml\n", 1)[1].split("```", 1)[0])
        assert rec == recipe(m.core)
        assert rec["merge_method"] == "linear" and rec["mergepipe"]["budget"] == "30%"
        assert rec["mergepipe"]["plan"] == built.plan_id and len(rec["models"]) == len(built.experts)
        assert verify(cat, built.snapshot_id)["ok"]
        card.write_text(text + "tampered\n")
        res = verify(cat, built.snapshot_id)
        assert not res["ok"] and any(p.startswith(f"{CARD_NAME}: sha256") for p in res["problems"])
        card.write_bytes(data)
    finally:
        cat.close()


def test_card_of_a_target_bound_and_non_additive_core(built):
    cat = Catalog(built.db)
    core = dict(load_manifest(cat, built.snapshot_id).core)
    cat.close()
    core["budget"] = dict(core["budget"], spec="target-bound 0.5")
    core["error_bound"] = None
    core["operator"] = "ties"
    text = model_card(core)
    assert "n/a (ties is not additive)" in text and "target_bound: 0.5" in text
