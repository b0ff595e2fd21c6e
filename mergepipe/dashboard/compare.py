"""The Compare page: two snapshots or plans side by side -- settings diff, bytes, bound, quality scores,
per-tensor access difference, lineage -- from their manifests and plans (no checkpoint is read).

A plan is compared as what it would do: its settings, its estimates, its access set; a snapshot as
what it did. Both are seen through one manifest-shaped view (:func:`side`)."""

from __future__ import annotations

import json

import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.api import Catalog, Manifest, Plan
from mergepipe.dashboard.figures import tensor_sort_key
from mergepipe.dashboard.formatting import fmt_bound, fmt_bytes, fmt_pct

NOT_MERGED = "- (a plan)"


def plan_side(plan: Plan) -> Manifest:
    """A plan seen as a manifest of the merge it describes: its estimates, no realized numbers, its access
    set as the touched blocks, its base and experts as parents."""
    core = {"plan_id": plan.id, "operator": plan.operator, "params": plan.params, "seed": plan.seed,
            "strategy": plan.strategy, "inputs": {"base": plan.base, "experts": plan.experts}, "grid": plan.grid,
            "budget": plan.budget, "estimated": plan.estimated, "realized": None,
            "full_expert_bytes": plan.full_expert_bytes, "error_bound": plan.error_bound, "touched": plan.access,
            "parents": [{"id": plan.base_id}] + [{"id": eid} for eid in plan.expert_ids]}
    return Manifest(core=core, run={"model_id": None, "kind": "plan"})


def side(cat: Catalog, ref: str) -> Manifest:
    """A snapshot's manifest, or a saved plan as :func:`plan_side` (``ref``: a snapshot or plan id)."""
    return plan_side(api.load_plan(cat, ref)) if ref.startswith("plan-") else api.load_manifest(cat, ref)


def choices(cat: Catalog) -> tuple[list[str], dict[str, str]]:
    """(ids: snapshots then saved plans, newest first; id -> caption) for the two pickers."""
    snaps = list(reversed(api.snapshots(cat)))
    plans = api.plan_rows(cat)
    ids, captions = [], {}
    for s in snaps:
        ids.append(s["id"])
        captions[s["id"]] = f"snapshot: model {s['model_id']}, {s['operator']}"
    for r in plans:
        ids.append(r["id"])
        captions[r["id"]] = f"saved plan: {r['operator']} on {r['base_id']}, " \
                            f"would read {fmt_bytes(r['expert_read_bytes'])}"
    return ids, captions


def _experts(core: dict) -> str:
    parts = []
    for e in core["inputs"]["experts"]:
        w = (e.get("settings") or {}).get("weight", e.get("weight"))
        d = (e.get("settings") or {}).get("density", e.get("density"))
        parts.append(e["id"] + (f" w={w:g}" if isinstance(w, (int, float)) else "")
                     + (f" d={d:g}" if isinstance(d, (int, float)) else ""))
    return ", ".join(parts)


def settings_rows(m: Manifest) -> dict[str, str]:
    c = m.core
    return {
        "model": m.run["model_id"] or NOT_MERGED, "plan": c["plan_id"], "operator": c["operator"],
        "params": json.dumps(c["params"], sort_keys=True), "seed": str(c["seed"]), "strategy": c["strategy"],
        "base": c["inputs"]["base"]["id"], "base fingerprint": c["inputs"]["base"]["fingerprint"],
        "experts": _experts(c), "grid": fmt_bytes(c["grid"]["block_bytes"]) + " blocks",
        "budget": f"{c['budget']['spec']} = {fmt_bytes(c['budget']['bytes'])}",
    }


def settings_diff(a: Manifest, b: Manifest, only_different: bool = False) -> pd.DataFrame:
    """field | A | B | same, for the settings of two snapshots."""
    ra, rb = settings_rows(a), settings_rows(b)
    rows = [{"field": k, "A": ra[k], "B": rb[k], "same": "yes" if ra[k] == rb[k] else "no"} for k in ra]
    df = pd.DataFrame(rows, columns=["field", "A", "B", "same"])
    return df[df["same"] == "no"].reset_index(drop=True) if only_different else df


def numbers_df(a: Manifest, b: Manifest) -> pd.DataFrame:
    """Bytes (estimated, realized; a plan has only estimates), the share of the changed expert bytes
    read, and the error bound."""
    def row(m: Manifest) -> dict:
        c = m.core
        full = c["full_expert_bytes"]
        done = c["realized"] or c["estimated"]  # a plan: what it would read and write
        est = "" if c["realized"] else " (estimated)"
        return {
            "expert read (estimated)": fmt_bytes(c["estimated"]["expert_read"]),
            "expert read (realized)": fmt_bytes(c["realized"]["expert_read"]) if c["realized"] else NOT_MERGED,
            "share of changed expert bytes": (fmt_pct(done["expert_read"] / full) + est) if full else "-",
            "changed (delta != 0) expert bytes": fmt_bytes(full),
            "base read": fmt_bytes(done["base_read"]) + est,
            "write": fmt_bytes(done["output_write"]) + est,
            "error bound": fmt_bound(c["error_bound"]) if c.get("error_bound") else
            f"n/a ({c['operator']} is not additive)",
            "seconds": f"{m.run.get('seconds', 0):.2f}" if c["realized"] else NOT_MERGED,
        }
    ra, rb = row(a), row(b)
    return pd.DataFrame([{"quantity": k, "A": ra[k], "B": rb[k]} for k in ra], columns=["quantity", "A", "B"])


def _blocks_by_tensor(core: dict) -> dict[str, set]:
    out: dict[str, set] = {}
    for expert, tensors in core["touched"].items():
        for t, ranges in tensors.items():
            s = out.setdefault(t, set())
            for lo, hi in ranges:
                s.update((expert, i) for i in range(lo, hi))
    return out


def access_diff(a: Manifest, b: Manifest) -> pd.DataFrame:
    """Per tensor: (expert, block) pairs read by A, by B, by both, only by A, only by B; sorted by how
    much they differ."""
    ta, tb = _blocks_by_tensor(a.core), _blocks_by_tensor(b.core)
    rows = []
    for t in sorted(set(ta) | set(tb), key=tensor_sort_key):
        sa, sb = ta.get(t, set()), tb.get(t, set())
        rows.append({"tensor": t, "A": len(sa), "B": len(sb), "both": len(sa & sb), "only A": len(sa - sb),
                     "only B": len(sb - sa)})
    df = pd.DataFrame(rows, columns=["tensor", "A", "B", "both", "only A", "only B"])
    if len(df):
        df = df.assign(_k=df["only A"] + df["only B"]).sort_values(["_k", "tensor"], ascending=[False, True]) \
            .drop(columns="_k").reset_index(drop=True)
    return df


def access_figure(df: pd.DataFrame, top: int = 20) -> go.Figure:
    """Horizontal stacked bars of the ``top`` most different tensors: blocks read by both, only A, only B."""
    d = df.head(top)
    names = d["tensor"].tolist()
    fig = go.Figure()
    for col, colour in (("both", "#9ecae1"), ("only A", "#08519c"), ("only B", "#e6550d")):
        fig.add_trace(go.Bar(y=names, x=d[col], name=col, orientation="h", marker_color=colour,
                             hovertemplate="%{y}<br>" + col + " %{x} blocks<extra></extra>"))
    fig.update_layout(barmode="stack", title="blocks read per tensor (expert blocks): both, only A, only B",
                      xaxis_title="blocks", height=max(220, 90 + 26 * len(names)),
                      margin={"l": 10, "r": 10, "t": 60, "b": 10},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0})
    fig.update_yaxes(autorange="reversed", automargin=True, type="category")
    return fig


def lineage_note(a: Manifest, b: Manifest) -> list[str]:
    """How the two relate: shared inputs, one merged from the other (a plan: from its inputs)."""
    pa = {p["id"] for p in a.core["parents"]}
    pb = {p["id"] for p in b.core["parents"]}
    ma, mb = a.run["model_id"], b.run["model_id"]
    notes = []
    if ma and ma in pb:
        notes.append(f"B ({mb or 'a plan'}) {'was' if mb else 'would be'} merged from A ({ma}).")
    if mb and mb in pa:
        notes.append(f"A ({ma or 'a plan'}) {'was' if ma else 'would be'} merged from B ({mb}).")
    if a.core["plan_id"] == b.core["plan_id"]:
        notes.append(f"Both come from plan {a.core['plan_id']}.")
    shared = sorted(pa & pb)
    notes.append(f"Shared inputs: {', '.join(shared)}." if shared else "No shared inputs.")
    if pa - pb:
        notes.append(f"Only A: {', '.join(sorted(pa - pb))}.")
    if pb - pa:
        notes.append(f"Only B: {', '.join(sorted(pb - pa))}.")
    return notes


def scores_df(cat: Catalog, a: Manifest, b: Manifest) -> pd.DataFrame:
    """metric | data | A | B: the newest stored score of each merged model (perplexity, task accuracy),
    on the data either was scored on; a plan has none, a model not scored on it "-"."""
    ids = [m.run["model_id"] for m in (a, b) if m.run["model_id"]]
    latest: dict[tuple, float] = {}
    for e in api.evaluations(cat, ids):  # newest first
        latest.setdefault((e["model_id"], e["metric"], e["dataset_name"], e["dataset"]), float(e["value"]))
    keys = sorted({(metric, name, digest) for _, metric, name, digest in latest},
                  key=lambda k: (k[0] != "perplexity", k[0] != "accuracy", k[0], k[1]))

    def cell(m: Manifest, k) -> str:
        if not m.run["model_id"]:
            return NOT_MERGED
        v = latest.get((m.run["model_id"], *k))
        return "-" if v is None else f"{v:.4g}"
    rows = [{"metric": k[0], "data": k[1], "A": cell(a, k), "B": cell(b, k)} for k in keys]
    return pd.DataFrame(rows, columns=["metric", "data", "A", "B"])


def realized_deviation(cat: Catalog, a: Manifest, b: Manifest) -> str | None:
    """The stored realized deviation of A's weights from B's (``mergepipe evaluate A --reference B``), and,
    when B is the full-budget merge of A's settings, A's error bound beside it (the bound is on exactly
    that distance: realized <= bound). None until measured (or when either side is a plan)."""
    ma, mb = a.run["model_id"], b.run["model_id"]
    if not ma or not mb or not cat.has_model(mb):
        return None
    ref = cat.model(mb)["fingerprint"]
    got = {e["metric"]: e["value"] for e in api.evaluations(cat, [ma]) if e["dataset"] == ref}
    if "deviation" not in got:
        return None
    text = f"Realized ||A - B|| = {got['deviation']:.6g}" + (
        f" ({got['deviation:relative']:.4g} of ||B||)" if "deviation:relative" in got else "") + "."
    bound = (a.core.get("error_bound") or {}).get("absolute")
    if bound is not None and is_full_budget_of(b, a):
        holds = got["deviation"] <= bound * (1 + 1e-5) + 1e-9
        text += f" B is the full-budget merge of A's settings: A's error bound {bound:.6g} " + (
            "holds." if holds else "is exceeded.")
    return text


def is_full_budget_of(full: Manifest, m: Manifest) -> bool:
    """Whether ``full`` merged the same base, experts, operator and parameters as ``m`` at budget 100%."""
    f, c = full.core, m.core
    return (f["budget"]["spec"] in ("100%", "1.0", "1") and f["operator"] == c["operator"]
            and f["params"] == c["params"] and f["inputs"]["base"]["id"] == c["inputs"]["base"]["id"]
            and _experts(f) == _experts(c))
