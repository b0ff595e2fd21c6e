"""The Snapshots page: manifests, bytes read by expert and tensor, touched blocks, verification."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.api import Catalog, Manifest, Plan
from mergepipe.dashboard.figures import (
    FONT_PX, MAX_CELLS, aggregate, block_layout, bytes_axis, readable, state_figure, tensor_sort_key,
)
from mergepipe.dashboard.paths import check_path
from mergepipe.dashboard.formatting import fmt_bound, fmt_bytes, fmt_pct, short_fp
from mergepipe.dashboard.plan_masks import _mask_array, block_labels
from mergepipe.errors import MergePipeError


# --- snapshots -----------------------------------------------------------------------------------------
def snapshots_df(cat: Catalog) -> pd.DataFrame:
    rows = []
    labels = api.snapshot_labels(cat)
    ppl, acc = latest_scores(cat, "perplexity"), latest_scores(cat, "accuracy")
    bounds = api.plan_bounds(cat)
    for s in reversed(api.snapshots(cat)):
        lab = labels.get(s["id"], {})
        rows.append({"snapshot": s["id"], "model": s["model_id"], "operator": s["operator"], "plan": s["plan_id"],
                     "expert_read": fmt_bytes(s["expert_read_bytes"]),
                     "of_full": fmt_pct(s["expert_read_bytes"] / s["full_expert_bytes"])
                     if s["full_expert_bytes"] else "-",
                     "error_bound": bounds.get(s["plan_id"]),
                     "perplexity": ppl.get(s["model_id"]), "accuracy": acc.get(s["model_id"]),
                     "created": s["created_at"], "tags": ", ".join(lab.get("tags", [])), "note": lab.get("note", ""),
                     "out": s["out"], "manifest": short_fp(s["manifest_hash"])})
    cols = ["snapshot", "model", "operator", "plan", "expert_read", "of_full", "error_bound", "perplexity", "accuracy",
            "created", "tags", "note", "out", "manifest"]
    return pd.DataFrame(rows, columns=cols)


def latest_scores(cat: Catalog, metric: str) -> dict[str, float]:
    """model id -> its newest stored result of ``metric`` ('perplexity', or 'accuracy': a task suite's mean)."""
    out: dict[str, float] = {}
    for e in api.evaluations(cat):  # newest first
        if e["metric"] == metric:
            out.setdefault(e["model_id"], float(e["value"]))
    return out


def load_manifest(cat: Catalog, ref: str) -> Manifest:
    return api.load_manifest(cat, ref)


def manifest_summary(manifest: Manifest) -> pd.DataFrame:
    c, r = manifest.core, manifest.run
    est, real = c["estimated"], c["realized"]
    rows = [
        ("snapshot", r["snapshot_id"]), ("model", r["model_id"]), ("output", r["out"]),
        ("created", r.get("created_at", "-")), ("manifest hash", manifest.manifest_hash),
        ("plan", c["plan_id"]), ("operator", c["operator"]), ("params", json.dumps(c["params"], sort_keys=True)),
        ("seed", str(c["seed"])), ("base", c["inputs"]["base"]["id"]),
        ("experts", ", ".join(f"{e['id']} (w={e['weight']:g})" for e in c["inputs"]["experts"])),
        ("grid", fmt_bytes(c["grid"]["block_bytes"]) + " blocks"),
        ("budget", f"{fmt_bytes(c['budget']['bytes'])} ({c['budget']['spec']})"),
        ("expert read", f"{fmt_bytes(real['expert_read'])} realized / {fmt_bytes(est['expert_read'])} estimated "
                        f"/ {fmt_bytes(c['full_expert_bytes'])} changed (delta != 0)"),
        ("base read", f"{fmt_bytes(real['base_read'])} realized / {fmt_bytes(est['base_read'])} estimated"),
        ("write", f"{fmt_bytes(real['output_write'])} realized / {fmt_bytes(est['output_write'])} estimated"),
        ("error bound", fmt_bound(c["error_bound"])),
        ("output files", str(len(c["outputs"]))),
        ("seconds", f"{r.get('seconds', 0):.2f}"),
    ]
    return pd.DataFrame(rows, columns=["field", "value"])


def bytes_by_expert_df(manifest: Manifest) -> pd.DataFrame:
    c = manifest.core
    experts = [e["id"] for e in c["inputs"]["experts"]]
    rows = [{"expert": e, "estimated": int(c["estimated_by_expert"].get(e, 0)),
             "realized": int(c["realized_by_expert"].get(e, 0))} for e in experts]
    return pd.DataFrame(rows, columns=["expert", "estimated", "realized"])


def bytes_by_tensor_df(manifest: Manifest, plan: Plan | dict | None = None) -> pd.DataFrame:
    """Realized expert bytes per tensor, with the plan's estimate when the plan is known."""
    c = manifest.core
    est = {}
    if plan is not None:
        est = api.as_plan(plan).estimated_by_tensor
    names = sorted(set(c["realized_by_tensor"]) | set(est), key=tensor_sort_key)
    rows = [{"tensor": t, "estimated": int(est.get(t, 0)) if plan is not None else None,
             "realized": int(c["realized_by_tensor"].get(t, 0))} for t in names]
    return pd.DataFrame(rows, columns=["tensor", "estimated", "realized"])


def manifest_plan(cat: Catalog, manifest: Manifest) -> Plan | None:
    try:
        return api.load_plan(cat, manifest.core["plan_id"])
    except MergePipeError:
        return None


def _largest(df: pd.DataFrame, *columns: str) -> float:
    """The largest number in ``columns`` of ``df`` (missing ones and values skipped; 0 when there is none)."""
    values = [pd.to_numeric(df[c], errors="coerce") for c in columns if c in df]
    top = pd.concat(values).max() if values else 0.0
    return 0.0 if pd.isna(top) else float(top)


def bytes_figure(df: pd.DataFrame, by: str) -> go.Figure:
    fig = go.Figure()
    if "estimated" in df and df["estimated"].notna().any():
        fig.add_trace(go.Bar(x=df[by], y=df["estimated"], name="estimated"))
    fig.add_trace(go.Bar(x=df[by], y=df["realized"], name="realized"))
    fig.update_layout(barmode="group", margin={"l": 10, "r": 10, "b": 10}, height=340)
    readable(fig, f"expert bytes per {by}: estimated vs realized")
    bytes_axis(fig, "y", _largest(df, "estimated", "realized"))
    if by == "tensor":
        fig.update_xaxes(showticklabels=len(df) <= 40)
    return fig


TENSOR_SORTS = ("bytes", "|difference|")


def signed_bytes(n) -> str:
    """+1536 -> '+1.50 KiB'; 0 -> '0 B'."""
    if n is None:
        return "-"
    return ("+" if n > 0 else "-" if n < 0 else "") + fmt_bytes(abs(n))


def with_difference(df: pd.DataFrame) -> pd.DataFrame:
    """Adds realized - estimated ('difference', bytes) and realized / estimated ('ratio'; NaN without an
    estimate or when nothing was estimated)."""
    d = df.copy()
    est = pd.to_numeric(d["estimated"], errors="coerce")
    d["difference"] = d["realized"] - est
    d["ratio"] = (d["realized"] / est.where(est > 0)).astype(float)
    return d


def top_tensors(df: pd.DataFrame, n: int = 20, sort: str = "bytes", search: str = "") -> tuple[pd.DataFrame, int]:
    """(the ``n`` tensors to chart, how many match) from a bytes_by_tensor_df: those whose name contains
    ``search`` (case-insensitive; several words must all match), ranked by bytes (the larger of estimated
    and realized) or by |realized - estimated|, largest first."""
    if sort not in TENSOR_SORTS:
        raise ValueError(f"unknown sort {sort!r} ({', '.join(TENSOR_SORTS)})")
    d = with_difference(df)
    for word in (search or "").lower().split():
        d = d[d["tensor"].str.lower().str.contains(word, regex=False)]
    if sort == "bytes":
        key = pd.concat([pd.to_numeric(d["estimated"], errors="coerce").fillna(0), d["realized"]], axis=1).max(axis=1)
    else:
        key = d["difference"].abs().fillna(d["realized"])
    d = d.assign(_k=key).sort_values(["_k", "tensor"], ascending=[False, True]).drop(columns="_k")
    return d.head(max(1, int(n))).reset_index(drop=True), len(d)


def bytes_table(df: pd.DataFrame) -> pd.DataFrame:
    """Estimated vs realized bytes for display: binary units, the difference as bytes and as a ratio."""
    d = with_difference(df) if "difference" not in df else df
    by = "tensor" if "tensor" in d else "expert"
    return pd.DataFrame({
        by: d[by], "estimated": d["estimated"].map(lambda v: "-" if pd.isna(v) else fmt_bytes(v)),
        "realized": d["realized"].map(fmt_bytes),
        "difference": d["difference"].map(lambda v: "-" if pd.isna(v) else signed_bytes(v)),
        "ratio": d["ratio"].map(lambda v: "-" if pd.isna(v) else f"{v:.3f}x"),
    })


def bytes_bars(df: pd.DataFrame, by: str, title: str | None = None) -> go.Figure:
    """Horizontal bars, one row per ``by`` (names readable on the y axis), estimated and realized side by
    side; each row's label at the right gives the difference as bytes and as a ratio."""
    d = with_difference(df) if "difference" not in df else df
    names = d[by].astype(str).tolist()
    fig = go.Figure()
    has_est = d["estimated"].notna().any()
    if has_est:
        fig.add_trace(go.Bar(y=names, x=d["estimated"], name="estimated", orientation="h", marker_color="#9ecae1",
                             hovertemplate="%{y}<br>estimated %{x:,} B<extra></extra>"))
    text = [("" if pd.isna(diff) else f"{signed_bytes(diff)}" + ("" if pd.isna(r) else f" ({r:.2f}x)"))
            for diff, r in zip(d["difference"], d["ratio"])]
    fig.add_trace(go.Bar(y=names, x=d["realized"], name="realized", orientation="h", marker_color="#08519c",
                         text=text, textposition="outside", cliponaxis=False, constraintext="none",
                         textfont={"size": FONT_PX},
                         hovertemplate="%{y}<br>realized %{x:,} B<br>%{text}<extra></extra>"))
    fig.update_layout(barmode="group", margin={"l": 10, "r": 120, "b": 10}, height=max(240, 110 + 34 * len(names)))
    readable(fig, title or f"expert bytes per {by}: estimated vs realized (label: realized - estimated, "
             "realized / estimated)")
    bytes_axis(fig, "x", _largest(d, "estimated", "realized"))
    fig.update_yaxes(autorange="reversed", automargin=True, type="category")
    return fig


def touched_matrix(cat: Catalog, manifest: Manifest, max_cells: int = MAX_CELLS) -> pd.DataFrame:
    """Experts x blocks of the base grid: 1 where the merge read the expert's block."""
    c = manifest.core
    layout = block_layout(cat, c["inputs"]["base"]["id"], c["grid"]["block_bytes"])
    experts = [e["id"] for e in c["inputs"]["experts"]]
    m = _mask_array(layout, experts, c["touched"])
    df = pd.DataFrame(m, index=experts, columns=block_labels(layout))
    return aggregate(df, max_cells, axis=1, how="mean")


TOUCHED_STATES = [(0.0, "not read", "#f0f0f0"), (1.0, "read", "#238b45")]


def touched_heatmap(matrix: pd.DataFrame) -> go.Figure:
    return state_figure(matrix, "touched blocks: what the merge read of each expert", TOUCHED_STATES)


def verify_text(result: dict) -> str:
    head = f"{'OK' if result['ok'] else 'MISMATCH'}: {result['snapshot_id']}, {result['files_checked']} files checked"
    return head + "".join(f"\n- {p}" for p in result["problems"])


# --- model card and recipe -------------------------------------------------------------------------------
def model_card(manifest: Manifest) -> tuple[dict, str] | None:
    """(front matter, markdown body) of the snapshot's README.md, or None when it has none (published
    before model cards) or its folder is gone."""
    path = Path(manifest.run["out"]) / api.CARD_NAME
    if api.CARD_NAME not in manifest.core["outputs"] or not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.startswith("---\n") and "\n---\n" in text[4:]:
        head, body = text[4:].split("\n---\n", 1)
        try:
            front = api.load_yaml(head) or {}  # bounded: a tampered card cannot hang the page
        except MergePipeError:
            front = {}
        return (front if isinstance(front, dict) else {}), body.lstrip("\n")
    return {}, text


def snapshot_recipe(cat: Catalog, snapshot_id: str) -> str:
    """The snapshot's recipe as mergekit YAML (the same as ``mergepipe explain SNAP --as-mergekit``)."""
    return api.export_mergekit(cat, snapshot_id)


# --- tags, note, deletion ----------------------------------------------------------------------------------
def parse_tags(text: str) -> list[str]:
    """'merge, ties  best,ties' -> ['merge', 'ties', 'best'] (commas or spaces; duplicates dropped)."""
    import re
    out = []
    for t in re.split(r"[,\s]+", text or ""):
        if t and t not in out:
            out.append(t)
    return out


def labels_of(cat: Catalog, snapshot_id: str) -> dict:
    return api.snapshot_labels(cat).get(snapshot_id, {"tags": [], "note": ""})


def delete_preview(cat: Catalog, snapshot_id: str) -> dict:
    """What deleting a snapshot removes, and who still needs it (deletion is refused unless forced)."""
    row = api.snapshot_row(cat, snapshot_id)
    if row is None:
        raise MergePipeError(f"unknown snapshot {snapshot_id!r}")
    out = Path(row["out"])
    files = sorted(p for p in out.iterdir() if p.is_file()) if out.is_dir() else []
    return {"snapshot_id": row["id"], "model_id": row["model_id"], "out": str(out), "exists": out.is_dir(),
            "files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "dependents": api.snapshot_dependents(cat, row["model_id"])}


# --- evaluation -------------------------------------------------------------------------------------------
def evaluation_models(cat: Catalog, manifest: Manifest) -> list[str]:
    """What Evaluate scores for a snapshot: the merged model, its base and its full-checkpoint experts."""
    c = manifest.core
    ids = [manifest.run["model_id"], c["inputs"]["base"]["id"]] + [e["id"] for e in c["inputs"]["experts"]]
    return [i for i in dict.fromkeys(ids) if cat.has_model(i) and cat.model(i)["kind"] == "full"]


def evaluation_inputs(text: str, tasks: str, roots: list) -> tuple[Path | None, Path | None]:
    """The held-out text and the task suite a user typed (either may be empty, not both), each under an
    allowed folder; the suite is parsed now, so a bad one is refused before any run starts."""
    if not (text or "").strip() and not (tasks or "").strip():
        raise MergePipeError("give a held-out text file or a task suite (or both)")
    text_path = check_path(text, roots) if (text or "").strip() else None
    tasks_path = check_path(tasks, roots) if (tasks or "").strip() else None
    for p in (text_path, tasks_path):
        if p is not None and not p.is_file():
            raise MergePipeError(f"{p} is not a file")
    if tasks_path is not None:
        api.read_task_suite(tasks_path)
    return text_path, tasks_path


def evaluation_df(cat: Catalog, manifest: Manifest) -> pd.DataFrame:
    """Stored scores (perplexity; task-suite accuracy, the mean and per task) of the snapshot, its base and experts (current fingerprints only), with the
    snapshot's expert read and error bound beside them: budget vs quality."""
    c = manifest.core
    roles = {manifest.run["model_id"]: "snapshot", c["inputs"]["base"]["id"]: "base",
             **{e["id"]: "expert" for e in c["inputs"]["experts"]}}
    rows = []
    for e in api.evaluations(cat, list(roles)):
        rows.append({"model": e["model_id"], "role": roles[e["model_id"]], "metric": e["metric"],
                     "value": round(float(e["value"]), 4), "tokens or examples": e["tokens"], "data": e["dataset_name"],
                     "data sha256": short_fp(e["dataset"]), "evaluated": e["evaluated_at"]})
    order = {"snapshot": 0, "base": 1, "expert": 2}
    df = pd.DataFrame(rows, columns=["model", "role", "metric", "value", "tokens or examples", "data", "data sha256",
                                     "evaluated"])
    return df.sort_values(["data", "metric", "role", "model"], key=lambda s: s.map(order) if s.name == "role" else s) \
        .reset_index(drop=True)


def budget_quality(manifest: Manifest, evals: pd.DataFrame) -> str | None:
    """One line: what the snapshot read, then each of its scores (perplexity on a text, mean accuracy on a
    task suite) next to its base's and experts' on the same data."""
    snap = evals[(evals["role"] == "snapshot") & evals["metric"].isin(["perplexity", "accuracy"])]
    if snap.empty:
        return None
    c = manifest.core
    full = c["full_expert_bytes"]
    parts = [f"read {fmt_bytes(c['realized']['expert_read'])}"
             + (f" ({fmt_pct(c['realized']['expert_read'] / full)} of the changed expert bytes)" if full else "")]
    for metric in ("perplexity", "accuracy"):
        mine = snap[snap["metric"] == metric]
        if mine.empty:
            continue
        row = mine.iloc[0]
        same = evals[(evals["data sha256"] == row["data sha256"]) & (evals["metric"] == metric)]
        part = f"{metric} {row['value']:.4g}"
        base = same[same["role"] == "base"]
        ex = same[same["role"] == "expert"]
        others = ([f"base {base.iloc[0]['value']:.4g}"] if len(base) else []) + \
                 ([f"experts {ex['value'].min():.4g} to {ex['value'].max():.4g}"] if len(ex) else [])
        parts.append(part + (f" ({', '.join(others)})" if others else "") + f" on {row['data']}")
    return " · ".join(parts)


# --- one snapshot's view, built once -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SnapshotView:
    """What the Snapshots page draws for one snapshot that does not change while the snapshot exists
    (a manifest is immutable): built once and then reused as is (the page caches it)."""
    manifest: Manifest
    plan: Plan | None
    summary: pd.DataFrame
    manifest_json: str
    recipe: str | None
    recipe_error: str | None
    by_expert: go.Figure
    by_tensor: pd.DataFrame
    touched: go.Figure


def snapshot_view(cat: Catalog, snapshot_id: str) -> SnapshotView:
    manifest = load_manifest(cat, snapshot_id)
    plan = manifest_plan(cat, manifest)
    try:
        recipe, recipe_error = snapshot_recipe(cat, snapshot_id), None
    except MergePipeError as exc:
        recipe, recipe_error = None, str(exc)
    return SnapshotView(manifest=manifest, plan=plan, summary=manifest_summary(manifest),
                        manifest_json=manifest.to_json(), recipe=recipe, recipe_error=recipe_error,
                        by_expert=bytes_bars(bytes_by_expert_df(manifest), "expert"),
                        by_tensor=bytes_by_tensor_df(manifest, plan), touched=touched_heatmap(touched_matrix(cat, manifest)))


# --- publishing to the Hub ---------------------------------------------------------------------------------
# stage -> (progress at its start, at its end, what the bar says)
PUBLISH_STAGES = {"check": (0.0, 0.1, "checking the files against the manifest"),
                  "compare": (0.1, 0.15, "comparing with the repository"), "upload": (0.15, 0.7, "uploading"),
                  "verify": (0.7, 1.0, "re-reading the committed files by range requests")}


def hub_target(repo: str) -> str:
    """The hf:// URI of a repository typed as ``org/name[@branch]`` (or as the URI itself)."""
    text = (repo or "").strip()
    if not text:
        raise MergePipeError("name the Hub repository to publish to: org/name or org/name@branch")
    return text if text.lower().startswith("hf://") else f"hf://{text}"


def publish_progress(stage: str, done: int, total: int) -> tuple[float, str]:
    lo, hi, text = PUBLISH_STAGES.get(stage, (0.0, 1.0, stage))
    return min(1.0, lo + (hi - lo) * (done / total if total else 1.0)), f"{text} ({done} of {total})"


def publish_summary(r: dict) -> str:
    where = r["pr_url"] or f"{r['uri']} (commit {r['commit'][:12]})"
    sent = (f"{len(r['uploaded'])} files uploaded ({fmt_bytes(r['uploaded_bytes'])})" if r["created_commit"]
            else "nothing changed, no commit")
    return f"Published {r['snapshot_id']} to {where}: {sent}, {len(r['unchanged'])} unchanged, " \
           f"{r['verified']} verified by range reads."
