"""What changed between two snapshots, from their manifests alone: experts added, removed, reweighted and
re-trained (same id, other files: a different fingerprint), the operator and parameters, bytes read and
written, the error bound, and the quality scores stored for either (evaluations)."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.evaluations import evaluations
from mergepipe.manifest.verify import load_manifest


def _experts(core: dict) -> dict[str, dict]:
    return {e["id"]: e for e in core["inputs"]["experts"]}


def _side(catalog: Catalog, manifest) -> dict:
    core = manifest.core
    bound = core.get("error_bound") or {}
    model_id = manifest.run["model_id"]
    return {"snapshot_id": manifest.snapshot_id, "model_id": model_id, "created_at": manifest.run["created_at"],
            "operator": core["operator"], "params": core["params"], "base": core["inputs"]["base"]["id"],
            "experts": len(core["inputs"]["experts"]),
            "read_bytes": sum(v for k, v in core["realized"].items() if k.endswith("_read")),
            "expert_read": core["realized"]["expert_read"], "output_write": core["realized"]["output_write"],
            "bound": bound.get("absolute"), "extends": (core.get("extends") or {}).get("snapshot_id"),
            "scores": {f"{r['dataset_name']}:{r['metric']}": r["value"] for r in evaluations(catalog, [model_id])}}


def diff_snapshots(catalog: Catalog, ref_a: str, ref_b: str) -> dict:
    """``{"a", "b", "added", "removed", "reweighted", "retrained", "settings", "scores"}`` from A to B."""
    ma, mb = load_manifest(catalog, ref_a), load_manifest(catalog, ref_b)
    ea, eb = _experts(ma.core), _experts(mb.core)
    added = [{"id": i, "weight": eb[i].get("weight")} for i in eb if i not in ea]
    removed = [{"id": i, "weight": ea[i].get("weight")} for i in ea if i not in eb]
    common = [i for i in ea if i in eb]
    reweighted = [{"id": i, "from": ea[i].get("weight"), "to": eb[i].get("weight")} for i in common
                  if ea[i].get("weight") != eb[i].get("weight")]
    retrained = [{"id": i, "from": ea[i]["fingerprint"], "to": eb[i]["fingerprint"]} for i in common
                 if ea[i]["fingerprint"] != eb[i]["fingerprint"]]
    a, b = _side(catalog, ma), _side(catalog, mb)
    settings = {k: {"from": a[k], "to": b[k]} for k in ("operator", "params", "base") if a[k] != b[k]}
    scores = {k: {"from": a["scores"].get(k), "to": b["scores"].get(k)}
              for k in sorted(set(a["scores"]) | set(b["scores"]))}
    return {"a": a, "b": b, "added": added, "removed": removed, "reweighted": reweighted, "retrained": retrained,
            "settings": settings, "scores": scores}


def diff_text(d: dict, human_bytes) -> str:
    """The diff as lines for the terminal."""
    a, b = d["a"], d["b"]
    lines = [f"DIFF {a['snapshot_id']} ({a['model_id']}) -> {b['snapshot_id']} ({b['model_id']})"
             + ("  [B extends A]" if b["extends"] == a["snapshot_id"] else "")]
    lines += [f"  + {e['id']} (weight {e['weight']})" for e in d["added"]]
    lines += [f"  - {e['id']} (weight {e['weight']})" for e in d["removed"]]
    lines += [f"  ~ {e['id']} weight {e['from']} -> {e['to']}" for e in d["reweighted"]]
    lines += [f"  ! {e['id']} re-trained: {e['from'][:19]} -> {e['to'][:19]}" for e in d["retrained"]]
    if not (d["added"] or d["removed"] or d["reweighted"] or d["retrained"]):
        lines.append("  same experts and weights")
    lines += [f"  {k}: {v['from']} -> {v['to']}" for k, v in d["settings"].items()]
    lines.append(f"  read       {human_bytes(a['read_bytes'])} -> {human_bytes(b['read_bytes'])} "
                 f"(experts {human_bytes(a['expert_read'])} -> {human_bytes(b['expert_read'])})")
    lines.append(f"  written    {human_bytes(a['output_write'])} -> {human_bytes(b['output_write'])}")
    fmt = lambda x: "n/a" if x is None else f"{x:.6g}"  # noqa: E731
    lines.append(f"  bound      {fmt(a['bound'])} -> {fmt(b['bound'])}")
    lines += [f"  score {k}: {fmt(v['from'])} -> {fmt(v['to'])}" for k, v in d["scores"].items()]
    return "\n".join(lines)
