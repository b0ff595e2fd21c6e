"""Search trials on a real local Ray cluster: the same seed gives the same trials and scores as local trials."""

from __future__ import annotations

import json

from dashboard_helpers import build_catalog, copy_catalog
from mergepipe import api
from mergepipe.catalog.db import Catalog

from test_search import OBJECTIVE, space_file


def test_search_trials_on_ray_equal_local_trials(tmp_path, monkeypatch):
    built = build_catalog(tmp_path / "b", merged=False)
    (tmp_path / "objective.py").write_text(OBJECTIVE)
    monkeypatch.setenv("SEARCH_REF", str(built.family / "expert_1"))
    results = {}
    for executor in ("local", "ray"):
        cat = Catalog(copy_catalog(built.db, tmp_path / f"{executor}.sqlite"))
        try:
            path = space_file(tmp_path, {"trials": 4, "executor": executor, "fidelities": ["30%", "100%"],
                                         "pruner": "successive_halving"})
            res = api.search(cat, api.load_search(path))
        finally:
            cat.close()
        results[executor] = [(t["number"], json.dumps(t["params"], sort_keys=True), t["status"], t["score"],
                              [(s["budget"], s["score"], s["expert_read"]) for s in t["steps"]])
                             for t in res["trials"]]
    assert results["ray"] == results["local"]
    assert len(results["ray"]) == 4
