"""What the dashboard shows, computed without Streamlit: DataFrames, Plotly figures, DOT source, path
checks and the formatting of estimates. The pages in ``pages/`` only render what these functions
return; every function here is unit-tested without a browser (tests/test_views.py).

Big matrices (blocks x experts) are aggregated above ``MAX_CELLS`` cells so that a page stays
responsive on large catalogs; the drill-down views show the detail of one layer or tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.errors import CatalogError, MergePipeError, PlanError
from mergepipe.storage.grid import tensor_grid
from mergepipe.manifest.build import Manifest
from mergepipe.ops.core import OPERATORS, get_op
from mergepipe.planner.plan import Plan, PlanContext, load_plan
from mergepipe.catalog.sketch import decode
from mergepipe.storage.safetensors import TensorInfo
from mergepipe.engine.txn import pid_alive

MAX_CELLS = 100_000
ACTIVE = ("queued", "running")


# --- formatting ------------------------------------------------------------------------------------
def fmt_bytes(n) -> str:
    """1536 -> '1.50 KiB'; None -> '-'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def fmt_pct(x) -> str:
    """0.253 -> '25.3%'."""
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_bound(bound: dict | None) -> str:
    """The planner's error bound as one line (or why there is none)."""
    if not bound:
        return "n/a (not an additive operator)"
    return f"{bound['absolute']:.4g} (relative {bound['relative']:.3g})"


def fmt_seconds(s) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def short_fp(fp: str | None) -> str:
    """'sha256:abcdef0123...' -> 'abcdef012345'."""
    if not fp:
        return "-"
    return fp.split(":", 1)[-1][:12]


# --- paths -----------------------------------------------------------------------------------------
def db_path(env=None) -> Path:
    """The catalog the dashboard shows: $MERGEPIPE_DB (default ./mergepipe.sqlite), made absolute."""
    env = os.environ if env is None else env
    return Path(env.get("MERGEPIPE_DB") or "mergepipe.sqlite").expanduser().absolute()


def allowed_roots(db, env=None, cwd=None) -> list[Path]:
    """Folders the dashboard may read checkpoints from and write outputs into.

    ``$MERGEPIPE_ALLOWED_ROOTS`` (os.pathsep-separated) when set, else the working directory and the
    catalog's directory. Returned resolved (symlinks followed) and without duplicates.
    """
    env = os.environ if env is None else env
    raw = env.get("MERGEPIPE_ALLOWED_ROOTS")
    if raw:
        items = [p for p in raw.split(os.pathsep) if p.strip()]
    else:
        items = [str(cwd or os.getcwd()), str(Path(db).expanduser().absolute().parent)]
    out: list[Path] = []
    for p in items:
        r = Path(p).expanduser().resolve()
        if r not in out:
            out.append(r)
    return out


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def _roots_text(roots: list[Path]) -> str:
    return ", ".join(str(r) for r in roots) or "none"


def check_path(path: str, roots: list[Path], must_exist: bool = True) -> Path:
    """A user-typed checkpoint path, resolved, refused unless it lies under an allowed root."""
    text = (path or "").strip()
    if not text:
        raise MergePipeError("enter a path")
    if "\x00" in text:
        raise MergePipeError("the path contains a NUL character")
    p = Path(text).expanduser()
    if not p.is_absolute():
        p = Path(os.getcwd()) / p
    resolved = p.resolve()
    if not _inside(resolved, roots):
        raise MergePipeError(f"{resolved} is outside the allowed folders ({_roots_text(roots)}); "
                             f"set MERGEPIPE_ALLOWED_ROOTS to allow it")
    if must_exist and not resolved.exists():
        raise MergePipeError(f"{resolved} does not exist")
    return resolved


def check_out_path(path: str, roots: list[Path]) -> Path:
    """A user-typed output directory: under an allowed root, not existing yet, parent creatable."""
    p = check_path(path, roots, must_exist=False)
    if p.exists() or p.is_symlink():
        raise MergePipeError(f"{p} already exists; published snapshots are never overwritten")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise MergePipeError(f"{parent} is not a directory")
    return p


def log_dir(db) -> Path:
    """Where the dashboard's runs write their logs: next to the catalog."""
    p = Path(db).expanduser().absolute()
    return p.parent / f"{p.stem}-logs"


def default_out(db, plan_id: str, n: int) -> Path:
    p = Path(db).expanduser().absolute()
    short = plan_id.removeprefix("plan-")[:8]
    return p.parent / "merged" / f"merge-{short}-{n}"


# --- models ----------------------------------------------------------------------------------------
def role_of(model: dict) -> str:
    if model.get("snapshot_id"):
        return "snapshot"
    return "expert" if model.get("base_id") else "base"


def models_df(cat: Catalog) -> pd.DataFrame:
    """Registered models: id, role, kind, base, fingerprint, size, analyzed state."""
    rows = []
    for m in cat.models():
        role = role_of(m)
        analyzed = cat.is_analyzed(m["id"]) if m["base_id"] else None
        rows.append({
            "id": m["id"], "role": role, "kind": m["kind"], "base": m["base_id"] or "",
            "architecture": m["architecture"] or "", "dtype": m["dtype"], "params": m["params"],
            "bytes": m["bytes"], "size": fmt_bytes(m["bytes"]), "tensors": m["n_tensors"],
            "fingerprint": short_fp(m["fingerprint"]),
            "analyzed": "-" if analyzed is None else ("yes" if analyzed else ("stale" if m["analyzed_at"] else "no")),
            "registered": m["registered_at"], "uri": m["uri"],
        })
    cols = ["id", "role", "kind", "base", "architecture", "dtype", "params", "bytes", "size", "tensors",
            "fingerprint", "analyzed", "registered", "uri"]
    return pd.DataFrame(rows, columns=cols)


def model_details(cat: Catalog, model_id: str) -> dict:
    """One model: its row (without config), config, analysis and lineage parents/children."""
    m = dict(cat.model(model_id))
    config = json.loads(m.pop("config") or "{}")
    a = cat.analysis(model_id)
    parents = cat.query("SELECT parent_id, role, weight FROM lineage WHERE child_id = ? ORDER BY role, parent_id",
                        [model_id])
    children = [r["child_id"] for r in cat.query(
        "SELECT DISTINCT child_id FROM lineage WHERE parent_id = ? ORDER BY child_id", [model_id])]
    return {
        "model": m, "role": role_of(m), "config": config, "analysis": a,
        "analyzed": cat.is_analyzed(model_id) if m["base_id"] else None,
        "parents": parents, "children": children,
        "summary": pd.DataFrame([
            ("id", m["id"]), ("role", role_of(m)), ("kind", m["kind"]), ("base", m["base_id"] or "-"),
            ("uri", m["uri"]), ("architecture", m["architecture"] or "-"), ("dtype", m["dtype"]),
            ("params", f"{m['params']:,}"), ("size", fmt_bytes(m["bytes"])), ("tensors", str(m["n_tensors"])),
            ("fingerprint", m["fingerprint"]), ("registered", m["registered_at"]),
            ("snapshot", m["snapshot_id"] or "-"),
            ("analyzed", "-" if not m["base_id"] else
             (f"yes ({a['n_blocks']} blocks of {fmt_bytes(a['block_bytes'])}, {a['analyzed_at']})"
              if cat.is_analyzed(model_id) else ("stale" if a else "no"))),
        ], columns=["field", "value"]),
    }


REGISTER_KINDS = ("full", "delta", "lora")
KIND_HELP = {"full": "a whole checkpoint (a base, or an expert fine-tuned from the base)",
             "delta": "a checkpoint holding expert - base directly (needs its base)",
             "lora": "a PEFT LoRA adapter directory: adapter_config.json + adapter_model.safetensors (needs its base)"}


def registration_base(kind: str, base: str | None) -> str | None:
    """The base a registration form's choice amounts to; delta checkpoints and LoRA adapters need one."""
    if kind not in REGISTER_KINDS:
        raise MergePipeError(f"unknown kind {kind!r} (choose from {', '.join(REGISTER_KINDS)})")
    if kind == "delta" and not base:
        raise MergePipeError("a delta checkpoint needs a base: choose the model its deltas are taken against")
    if kind == "lora" and not base:
        raise MergePipeError("a LoRA adapter needs a base: choose the model it was trained on")
    return base or None


def bases(cat: Catalog) -> list[str]:
    """Models that are bases (registered without a base)."""
    return [m["id"] for m in cat.models() if not m["base_id"]]


def experts_of(cat: Catalog, base_id: str) -> list[str]:
    return cat.experts_of(base_id)


def analyzed_experts(cat: Catalog, base_id: str) -> list[str]:
    return [e for e in cat.experts_of(base_id) if cat.is_analyzed(e)]


def unanalyzed_experts(cat: Catalog) -> list[str]:
    """Experts (not published snapshots) whose statistics are missing or stale."""
    return [m["id"] for m in cat.models() if m["base_id"] and not m["snapshot_id"] and not cat.is_analyzed(m["id"])]


def stats_version(cat: Catalog) -> str:
    """Changes when models, analyses or grids change (not on run progress): a cache key for statistics."""
    row = cat.conn.execute(
        """SELECT (SELECT group_concat(id || ':' || fingerprint, ',') FROM (SELECT * FROM models ORDER BY id)),
                  (SELECT group_concat(model_id || ':' || analyzed_at || ':' || block_bytes, ',')
                     FROM (SELECT * FROM analyses ORDER BY model_id)),
                  (SELECT group_concat(base_id || ':' || block_bytes, ',') FROM (SELECT * FROM grids ORDER BY base_id)),
                  (SELECT COUNT(*) FROM plans), (SELECT COUNT(*) FROM snapshots)""").fetchone()
    return hashlib.sha256(repr(tuple(row)).encode()).hexdigest()[:16]


def totals(cat: Catalog) -> dict:
    """Catalog totals with human-readable sizes (for the home page metrics)."""
    t = cat.totals()
    t["model_size"] = fmt_bytes(t["model_bytes"])
    return t


# --- runs ------------------------------------------------------------------------------------------
def _parse_ts(ts: str | None) -> float | None:
    if not ts:
        return None
    try:
        return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def effective_status(run: dict) -> str:
    """The run's status, with a queued/running run whose process is gone reported as failed."""
    if run["status"] in ACTIVE and run["pid"] and not pid_alive(run["pid"]):
        return "failed"
    return run["status"]


def run_progress(run: dict, now_ts: float | None = None) -> dict:
    """Progress of a run row for display: fraction, text, elapsed, running."""
    status = effective_status(run)
    done, total = int(run["blocks_done"] or 0), int(run["blocks_total"] or 0)
    if status == "succeeded":
        frac = 1.0
    else:
        frac = min(1.0, done / total) if total else 0.0
    start = _parse_ts(run["started_at"])
    end = _parse_ts(run["finished_at"]) if status not in ACTIVE else None
    if end is None:
        end = now_ts if now_ts is not None else time.time()
    elapsed = max(0.0, end - start) if start is not None else None
    if run.get("kind") == "analyze":
        n = len([m for m in (run["model_id"] or "").split(",") if m])
        text = f"analyze {run['model_id']}: {frac:.0%} ({n} model{'s' if n != 1 else ''})"
        detail = f"{fmt_bytes(run['expert_bytes_done'])} of the current model read"
    else:
        text = f"{done}/{total} blocks" if total else ("starting..." if status in ACTIVE else "-")
        detail = (f"expert read {fmt_bytes(run['expert_bytes_done'])} of {fmt_bytes(run['expert_bytes_planned'])} "
                  f"planned")
    return {"id": run["id"], "kind": run.get("kind") or "merge", "status": status, "fraction": frac,
            "text": text, "detail": detail, "elapsed": elapsed, "elapsed_text": fmt_seconds(elapsed),
            "running": status in ACTIVE, "snapshot_id": run.get("snapshot_id"), "error": run.get("error"),
            "blocks_done": done, "blocks_total": total,
            "bytes_done": int(run["expert_bytes_done"] or 0), "bytes_planned": int(run["expert_bytes_planned"] or 0)}


def runs(cat: Catalog, kind: str | None = None, limit: int = 50) -> list[dict]:
    sql = "SELECT * FROM runs"
    params: list = []
    if kind:
        sql += " WHERE kind = ?"
        params.append(kind)
    sql += " ORDER BY id DESC LIMIT ?"
    params.append(int(limit))
    return cat.query(sql, params)


def runs_df(cat: Catalog, kind: str | None = None, limit: int = 50) -> pd.DataFrame:
    rows = []
    for r in runs(cat, kind, limit):
        p = run_progress(r)
        rows.append({"run": r["id"], "kind": p["kind"], "status": p["status"], "progress": round(100 * p["fraction"], 1),
                     "model": r["model_id"], "plan": r["plan_id"] or "", "out": r["out"] or "",
                     "snapshot": r["snapshot_id"] or "", "started": r["started_at"], "elapsed": p["elapsed_text"],
                     "error": r["error"] or ""})
    cols = ["run", "kind", "status", "progress", "model", "plan", "out", "snapshot", "started", "elapsed", "error"]
    return pd.DataFrame(rows, columns=cols)


def latest_run(cat: Catalog, kind: str) -> dict | None:
    rows = runs(cat, kind, 1)
    return rows[0] if rows else None


# --- tensors, layers, block layout ---------------------------------------------------------------------
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def group_of(name: str) -> str:
    """'model.layers.3.mlp.up_proj.weight' -> 'layer 3'; embeddings, final norm and head by name."""
    n = layer_of(name)
    if n is not None:
        return f"layer {n}"
    if "embed" in name:
        return "embed"
    if "lm_head" in name:
        return "head"
    return "other"


def _group_key(group: str):
    if group == "embed":
        return (0, 0)
    if group.startswith("layer "):
        return (1, int(group.split()[1]))
    return (2 if group == "other" else 3, 0)


def tensor_sort_key(name: str):
    """Natural order: embeddings, layers by number, final norm, head."""
    return (_group_key(group_of(name)), name)


def layout_of(tensor_rows: list[dict], block_bytes: int) -> pd.DataFrame:
    """Tensors in display order with their block counts and first global block column."""
    rows = []
    for t in sorted(tensor_rows, key=lambda t: tensor_sort_key(t["name"])):
        info = TensorInfo(t["name"], t["dtype"], tuple(t["shape"]), t["file"], t["offset"], t["nbytes"])
        rows.append({"tensor": t["name"], "group": group_of(t["name"]), "blocks": len(tensor_grid(info, block_bytes)),
                     "nbytes": t["nbytes"]})
    df = pd.DataFrame(rows, columns=["tensor", "group", "blocks", "nbytes"])
    df["first"] = np.concatenate([[0], np.cumsum(df["blocks"].to_numpy())[:-1]]).astype(int) if len(df) else []
    return df


def block_layout(cat: Catalog, base_id: str, block_bytes: int | None = None) -> pd.DataFrame:
    """The base's tensors in display order with their block counts on its grid (or ``block_bytes``)."""
    block_bytes = block_bytes or cat.grid_block_bytes(base_id)
    if not block_bytes:
        raise CatalogError(f"{base_id!r} has no block grid yet (analyze one of its experts)")
    return layout_of(cat.tensors(base_id), block_bytes)


def groups(layout: pd.DataFrame) -> list[str]:
    """Layer groups in display order."""
    return sorted(layout["group"].unique().tolist(), key=_group_key)


def tensors_in_group(layout: pd.DataFrame, group: str) -> list[str]:
    return layout.loc[layout["group"] == group, "tensor"].tolist()


# --- aggregation and heatmaps ----------------------------------------------------------------------------
def aggregate(matrix: pd.DataFrame, max_cells: int = MAX_CELLS, axis: int = 1, how: str = "mean") -> pd.DataFrame:
    """Bin consecutive columns (axis=1) or rows (axis=0) so that the matrix has at most max_cells cells.

    ``how``: 'mean', 'max', 'sum' or 'l2' (sqrt of the sum of squares: norms of merged blocks).
    Bins are labelled '<first>..<last>' of the labels they cover. A small enough matrix is returned as is.
    """
    rows, cols = matrix.shape
    if rows * cols <= max_cells or rows * cols == 0:
        return matrix
    m = matrix if axis == 1 else matrix.T
    keep = m.shape[0]
    n_bins = max(1, max_cells // max(keep, 1))
    size = math.ceil(m.shape[1] / n_bins)
    values = m.to_numpy(dtype=np.float64)
    labels = [str(c) for c in m.columns]
    out_cols, out_labels = [], []
    for start in range(0, m.shape[1], size):
        chunk = values[:, start:start + size]
        if how == "mean":
            v = chunk.mean(axis=1)
        elif how == "max":
            v = chunk.max(axis=1)
        elif how == "sum":
            v = chunk.sum(axis=1)
        elif how == "l2":
            v = np.sqrt((chunk ** 2).sum(axis=1))
        else:
            raise ValueError(f"unknown aggregation {how!r}")
        out_cols.append(v)
        last = min(start + size, m.shape[1]) - 1
        out_labels.append(labels[start] if last == start else f"{labels[start]}..{labels[last]}")
    res = pd.DataFrame(np.column_stack(out_cols), index=m.index, columns=out_labels)
    return res if axis == 1 else res.T


def heatmap_figure(matrix: pd.DataFrame, title: str, colorbar: str, colorscale="Viridis", zmin=None, zmax=None,
                   clickable: bool = False, show_x_labels: bool | None = None, height: int | None = None) -> go.Figure:
    """A heatmap of ``matrix`` (rows on y, columns on x). With ``clickable`` an invisible scatter over
    the cells carries [row, column] as customdata, so that a click selects a cell (a plain go.Heatmap
    returns an empty selection)."""
    x = [str(c) for c in matrix.columns]
    y = [str(i) for i in matrix.index]
    z = matrix.to_numpy(dtype=np.float64)
    clickable = clickable and z.size > 0
    hover = "%{y}<br>%{x}<br>" + colorbar + " %{z:.4g}<extra></extra>"
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale=colorscale, zmin=zmin, zmax=zmax,
                               colorbar={"title": colorbar}, hoverongaps=False,
                               hoverinfo="skip" if clickable else None, hovertemplate=None if clickable else hover))
    if clickable:
        # the overlay carries the hover label too: a trace with hoverinfo 'skip' gets no click events
        xx, yy = np.meshgrid(np.arange(len(x)), np.arange(len(y)))
        fig.add_trace(go.Scatter(
            x=[x[i] for i in xx.ravel()], y=[y[j] for j in yy.ravel()], mode="markers",
            marker={"opacity": 0, "size": 14},
            customdata=[[y[j], x[i], float(z[j, i])] for i, j in zip(xx.ravel(), yy.ravel())],
            hovertemplate="%{customdata[0]}<br>%{customdata[1]}<br>" + colorbar + " %{customdata[2]:.4g}<extra></extra>",
            showlegend=False))
    fig.update_layout(title=title, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      height=height or max(260, min(900, 60 + 18 * len(y))))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", showticklabels=(len(x) <= 60) if show_x_labels is None else show_x_labels)
    return fig


# --- catalog statistics ------------------------------------------------------------------------------
def _in(seq) -> str:
    return ",".join("?" * len(seq))


def tensor_stats_df(cat: Catalog, experts: list[str]) -> pd.DataFrame:
    """Per (expert, tensor): ||delta||_2, L1, max |delta|, non-zeros, density, in natural tensor order."""
    cols = ["expert", "tensor", "group", "numel", "delta_l2", "delta_l1", "delta_max_abs", "delta_nnz", "density"]
    if not experts:
        return pd.DataFrame(columns=cols)
    rows = cat.query(f"SELECT model_id, tensor, numel, delta_l2, delta_l1, delta_max_abs, delta_nnz FROM tensor_stats "
                     f"WHERE model_id IN ({_in(experts)})", list(experts))
    df = pd.DataFrame(rows, columns=["model_id", "tensor", "numel", "delta_l2", "delta_l1", "delta_max_abs",
                                     "delta_nnz"]).rename(columns={"model_id": "expert"})
    df["group"] = df["tensor"].map(group_of)
    df["density"] = np.where(df["numel"] > 0, df["delta_nnz"] / df["numel"].clip(lower=1), 0.0)
    order = {e: i for i, e in enumerate(experts)}
    df["_e"] = df["expert"].map(order)
    df["_t"] = df["tensor"].map(tensor_sort_key)
    df = df.sort_values(["_t", "_e"]).drop(columns=["_e", "_t"]).reset_index(drop=True)
    return df[cols]


def block_stats_df(cat: Catalog, experts: list[str], tensors: list[str] | None = None) -> pd.DataFrame:
    """Per (expert, tensor, block) statistics, optionally only for some tensors."""
    cols = ["expert", "tensor", "group", "block", "row_start", "row_end", "nbytes", "delta_l2", "delta_l1",
            "delta_max_abs", "delta_nnz"]
    if not experts or (tensors is not None and not tensors):
        return pd.DataFrame(columns=cols)
    sql = (f"SELECT model_id, tensor, block, row_start, row_end, nbytes, delta_l2, delta_l1, delta_max_abs, delta_nnz "
           f"FROM blocks WHERE model_id IN ({_in(experts)})")
    params = list(experts)
    if tensors is not None:
        sql += f" AND tensor IN ({_in(tensors)})"
        params += list(tensors)
    df = pd.DataFrame(cat.query(sql, params), columns=["model_id", "tensor", "block", "row_start", "row_end", "nbytes",
                                                       "delta_l2", "delta_l1", "delta_max_abs", "delta_nnz"])
    df = df.rename(columns={"model_id": "expert"})
    df["group"] = df["tensor"].map(group_of)
    order = {e: i for i, e in enumerate(experts)}
    df["_e"] = df["expert"].map(order)
    tkeys = {t: tensor_sort_key(t) for t in df["tensor"].unique()}
    df["_t"] = df["tensor"].map(tkeys)
    df = df.sort_values(["_t", "block", "_e"]).drop(columns=["_e", "_t"]).reset_index(drop=True)
    return df[cols]


def norm_matrix(df: pd.DataFrame, level: str, experts: list[str], max_cells: int = MAX_CELLS) -> pd.DataFrame:
    """||delta||_2 as rows x experts, rows = 'layer' groups, 'tensor's or 'block's (tensor#block).

    From a block_stats_df (any level) or a tensor_stats_df (layer/tensor). Norms combine as
    sqrt(sum of squares); a block-level matrix over ``max_cells`` is aggregated into row bins.
    """
    if df.empty:
        return pd.DataFrame(columns=experts, dtype=float)
    d = df.copy()
    d["sq"] = d["delta_l2"].astype(float) ** 2
    if level == "layer":
        d["row"] = d["group"]
        order = sorted(d["row"].unique(), key=_group_key)
    elif level == "tensor":
        d["row"] = d["tensor"]
        order = sorted(d["row"].unique(), key=tensor_sort_key)
    elif level == "block":
        if "block" not in d:
            raise ValueError("a block-level matrix needs block statistics")
        d["row"] = d["tensor"] + "#" + d["block"].astype(str)
        keys = d.drop_duplicates("row").set_index("row")[["tensor", "block"]]
        order = sorted(keys.index, key=lambda r: (tensor_sort_key(keys.at[r, "tensor"]), int(keys.at[r, "block"])))
    else:
        raise ValueError(f"unknown level {level!r}")
    m = d.pivot_table(index="row", columns="expert", values="sq", aggfunc="sum", fill_value=0.0)
    m = np.sqrt(m.reindex(index=order, columns=experts, fill_value=0.0))
    m.index.name = level
    return aggregate(m, max_cells, axis=0, how="l2")


def norm_heatmap(matrix: pd.DataFrame, level: str) -> go.Figure:
    return heatmap_figure(matrix, f"||delta||_2 per {level} and expert", "||delta||", clickable=(level == "layer"),
                          show_x_labels=True)


def sketch_matrix(cat: Catalog, experts: list[str], tensors: list[str]) -> np.ndarray:
    """[K, N]: each expert's block sketches of ``tensors`` in delta units (sketch * max |delta|),
    concatenated in (tensor, block) order; a block an expert left unchanged contributes zeros."""
    if not experts or not tensors:
        return np.zeros((len(experts), 0), dtype=np.float32)
    rows = cat.query(f"SELECT model_id, tensor, block, delta_max_abs, sketch FROM blocks "
                     f"WHERE model_id IN ({_in(experts)}) AND tensor IN ({_in(tensors)})", [*experts, *tensors])
    tindex = {t: i for i, t in enumerate(tensors)}
    eindex = {e: i for i, e in enumerate(experts)}
    size = max((len(r["sketch"] or b"") // 2 for r in rows), default=0)
    keys = sorted({(tindex[r["tensor"]], r["block"]) for r in rows})
    kindex = {k: i for i, k in enumerate(keys)}
    mat = np.zeros((len(experts), len(keys), size), dtype=np.float32)
    for r in rows:
        v = decode(r["sketch"])
        if len(v):
            mat[eindex[r["model_id"]], kindex[(tindex[r["tensor"]], r["block"])], :len(v)] = v * float(r["delta_max_abs"])
    return mat.reshape(len(experts), -1)


def pairwise(mat: np.ndarray, metric: str) -> np.ndarray:
    """K x K sign-conflict rates ('conflict') or cosines ('cosine') between the rows of ``mat``,
    vectorised (equal to mergepipe.sketch.conflict_rate / cosine on every pair)."""
    if metric == "conflict":
        pos = (mat > 0).astype(np.float64)
        neg = (mat < 0).astype(np.float64)
        nz = pos + neg
        both = nz @ nz.T
        differ = pos @ neg.T + neg @ pos.T
        return np.divide(differ, both, out=np.zeros_like(both), where=both > 0)
    if metric == "cosine":
        m = mat.astype(np.float64)
        gram = m @ m.T
        norms = np.sqrt(np.diag(gram))
        denom = np.outer(norms, norms)
        return np.divide(gram, denom, out=np.zeros_like(gram), where=denom > 0)
    raise ValueError(f"unknown metric {metric!r} (conflict or cosine)")


def conflict_matrix(cat: Catalog, experts: list[str], tensors: list[str], metric: str = "conflict") -> pd.DataFrame:
    """Expert x expert sign-conflict rate or cosine over the given tensors, from the catalog's sketches."""
    values = pairwise(sketch_matrix(cat, experts, tensors), metric)
    return pd.DataFrame(values, index=list(experts), columns=list(experts))


def conflict_heatmap(matrix: pd.DataFrame, metric: str, scope: str) -> go.Figure:
    if metric == "conflict":
        return heatmap_figure(matrix, f"sign-conflict rate ({scope})", "conflict", colorscale="Reds", zmin=0, zmax=1,
                              show_x_labels=True)
    return heatmap_figure(matrix, f"cosine ({scope})", "cosine", colorscale="RdBu", zmin=-1, zmax=1, show_x_labels=True)


# --- plans ---------------------------------------------------------------------------------------------
def operators() -> list[str]:
    return list(OPERATORS)


def op_info(name: str) -> dict:
    """What the Plan page needs to know about an operator's parameters."""
    spec = get_op(name)
    return {"name": spec.name, "uses_density": spec.uses_density, "additive": spec.additive,
            "normalize": spec.normalize, "rescale": spec.rescale, "random": spec.random,
            "extra": dict(spec.params)}


def plan_context(cat: Catalog, base: str, experts: list[str], operator: str = "linear", weights=None, density=None,
                 lam=None, normalize=None, rescale=None, seed: int = 0, strategy: str = "norm", gamma=None,
                 epsilon=None) -> PlanContext:
    """A PlanContext ready for fast re-planning (the sketch-based norm estimate is computed now, so
    that moving the budget touches no catalog row)."""
    if not experts:
        raise PlanError("choose at least one expert")
    ctx = PlanContext(cat, base, list(experts), operator, weights=list(weights) if weights is not None else None,
                      density=density, lam=lam, normalize=normalize, rescale=rescale, seed=seed, strategy=strategy,
                      gamma=gamma, epsilon=epsilon)
    if ctx.op.additive:
        ctx.full_norm_estimate()
    ctx.layout = layout_of(ctx.tensors, ctx.block_bytes)
    return ctx


def make_plan(ctx: PlanContext, budget_pct: float | None = None, target_rel: float | None = None) -> Plan:
    """The plan at a budget in percent of the full expert read, or the smallest one meeting a relative bound."""
    if target_rel is not None:
        return ctx.plan(target_bound=float(target_rel))
    if budget_pct is None:
        raise PlanError("give a budget")
    if not budget_pct > 0:
        raise PlanError("the budget must be positive: move the slider above 0%")
    return ctx.plan(budget=f"{float(budget_pct):g}%")


PLAN_PAGE_TRI = {None: "default", True: "on", False: "off"}


def read_config_source(upload: bytes | None, path: str | None, roots: list[Path],
                       upload_name: str | None = None) -> tuple[bytes, str]:
    """The bytes of a mergekit YAML from an upload, else from a typed path under an allowed folder."""
    from mergepipe.config.mergekit import MAX_CONFIG_BYTES
    if upload is not None:
        return upload, upload_name or "uploaded config"
    p = check_path(path or "", roots)
    if not p.is_file():
        raise MergePipeError(f"{p} is not a file")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise MergePipeError(f"{p}: {p.stat().st_size} bytes is too large for a merge config")
    return p.read_bytes(), p.name


def mergekit_plan_settings(cat: Catalog, text: str | bytes, source: str, roots: list[Path]) -> dict:
    """Plan-page settings (widget key -> value) equivalent to a mergekit YAML config.

    Only looks at the catalog: the config's models must be registered already (a path is matched by
    uri and fingerprint; paths must lie under an allowed folder). Refuses what the page cannot show
    (per-model densities that differ, a budget that is not a whole percentage)."""
    from mergepipe.config.mergekit import parse_config, prepare
    cfg = parse_config(text, source)
    r = prepare(cat, cfg, register_paths=False, check_path=lambda t: check_path(t, roots))
    spec = get_op(cfg.method)
    experts = [e["model"] for e in r.experts]
    for e in experts:
        if cat.model(e)["base_id"] != r.base:
            raise PlanError(f"expert {e!r} is registered with base {cat.model(e)['base_id']!r}, not {r.base!r}")
    settings: dict = {"base": r.base, "experts": experts, "op": spec.name, "lam": 1.0 if cfg.lam is None else cfg.lam,
                      "normalize": PLAN_PAGE_TRI[cfg.normalize], "rescale": PLAN_PAGE_TRI[cfg.rescale],
                      "seed": 0 if cfg.seed is None else cfg.seed, "strategy": cfg.strategy or "norm"}
    for e in r.experts:
        for key in ("weight", "density"):
            if isinstance(e.get(key), list):
                raise PlanError(f"{source}: the {key} of {e['model']} varies per tensor (a filter or gradient), "
                                f"which the Plan page cannot show; use `mergepipe merge --config`")
        settings[f"w_{e['model']}"] = float(e.get("weight", 1.0))
    if spec.uses_density:
        densities = sorted({float(e.get("density", 1.0)) for e in r.experts})
        if len(densities) > 1:
            raise PlanError(f"{source}: the models' densities differ ({', '.join(f'{d:g}' for d in densities)}); "
                            f"the Plan page uses one density for all (use `mergepipe merge --config`)")
        d = densities[0]
        if not (0.01 <= d <= 1.0 and abs(round(d, 2) - d) < 1e-9):
            raise PlanError(f"{source}: density {d:g} is not one the Plan page offers (0.01 to 1 in steps of 0.01)")
        settings["density"] = round(d, 2)
    for name, value in (("gamma", cfg.gamma), ("epsilon", cfg.epsilon)):
        if name in spec.params:
            value = spec.params[name] if value is None else value
            if not 0 <= value <= 0.5:
                raise PlanError(f"{source}: {name} {value:g} is outside the Plan page's range (0 to 0.5)")
            settings[name] = float(value)
    if cfg.target_bound is not None:
        if not spec.additive:
            raise PlanError(f"{source}: a target bound needs an additive operator (linear, task_arithmetic)")
        settings.update({"mode": "target bound", "target": float(cfg.target_bound)})
    elif cfg.budget is not None:
        settings.update({"mode": "budget", "budget": _whole_percent(cfg.budget, source)})
    return settings


def _whole_percent(spec: str, source: str) -> int:
    text = spec.strip()
    try:
        pct = float(text[:-1]) if text.endswith("%") else float(text) * 100
    except ValueError:
        pct = None
    if pct is None or not 0 <= pct <= 100 or abs(pct - round(pct)) > 1e-9:
        raise PlanError(f"{source}: budget {spec} is not a whole percentage, which the Plan page's slider needs "
                        f"(use `mergepipe merge --config` for other budgets)")
    return round(pct)


def plan_summary(plan: Plan | dict) -> dict:
    """Formatted estimates of a plan (strings) plus the raw numbers they come from."""
    p = plan.data if isinstance(plan, Plan) else plan
    full = p["full_expert_bytes"]
    est = p["estimate"]
    selected = sum(p["blocks_selected"].values())
    candidates = sum(p["blocks_candidate"].values())
    return {
        "plan_id": p["id"], "operator": p["operator"],
        "budget": f"{fmt_bytes(p['budget']['bytes'])} ({p['budget']['spec']})",
        "budget_bytes": p["budget"]["bytes"],
        "expert_read": fmt_bytes(est["expert_read"]), "expert_read_bytes": est["expert_read"],
        "expert_read_pct": fmt_pct(est["expert_read"] / full) if full else "-",
        "base_read": fmt_bytes(est["base_read"]), "write": fmt_bytes(est["output_write"]),
        "full_expert": fmt_bytes(full),
        "bound": fmt_bound(p["error_bound"]),
        "bound_abs": p["error_bound"]["absolute"] if p["error_bound"] else None,
        "bound_rel": p["error_bound"]["relative"] if p["error_bound"] else None,
        "blocks": f"{selected} of {candidates} candidate blocks ({p['blocks_total']} per model)",
        "blocks_selected": selected, "blocks_candidate": candidates, "blocks_total": p["blocks_total"],
        "first_merge": first_merge_note(p),
    }


def first_merge_note(p: dict) -> str | None:
    """What a first merge does, when some experts have no current statistics (None otherwise)."""
    pending = [f"{e['id']} ({e['analyze']})" for e in p["experts"] if e.get("analyze")]
    if not pending:
        return None
    return (f"First merge: {', '.join(pending)}. This merge reads every expert in full and analyzes "
            f"{'it' if len(pending) == 1 else 'them'} on the way (no separate analyze needed); the "
            f"{p['budget']['spec']} budget applies from the next merge.")


def plan_experts_df(plan: Plan | dict) -> pd.DataFrame:
    p = plan.data if isinstance(plan, Plan) else plan
    rows = []
    for e in p["experts"]:
        eid = e["id"]
        rows.append({"expert": eid, "weight": e["weight"], "density": e.get("density"),
                     "blocks": p["blocks_selected"][eid], "candidates": p["blocks_candidate"][eid],
                     "read": p["expert_read_by_expert"][eid], "read_text": fmt_bytes(p["expert_read_by_expert"][eid])})
    return pd.DataFrame(rows, columns=["expert", "weight", "density", "blocks", "candidates", "read", "read_text"])


def _mask_array(layout: pd.DataFrame, experts: list[str], access: dict) -> np.ndarray:
    first = dict(zip(layout["tensor"], layout["first"]))
    total = int(layout["blocks"].sum()) if len(layout) else 0
    m = np.zeros((len(experts), total), dtype=np.float64)
    for ei, e in enumerate(experts):
        for t, ranges in (access.get(e) or {}).items():
            f = first.get(t)
            if f is None:
                continue
            for a, b in ranges:
                m[ei, f + a:f + b] = 1.0
    return m


def block_labels(layout: pd.DataFrame) -> list[str]:
    return [f"{t}#{b}" for t, n in zip(layout["tensor"], layout["blocks"]) for b in range(int(n))]


def mask_matrix(ctx: PlanContext, plan: Plan | dict, max_cells: int = MAX_CELLS) -> pd.DataFrame:
    """Experts x blocks (all tensors, display order): 1 = selected, 0.5 = candidate left out, 0 = no delta
    (or not useful to the operator). Aggregated to the mean over column bins above ``max_cells``."""
    p = plan.data if isinstance(plan, Plan) else plan
    layout = ctx.layout
    experts = [e["id"] for e in ctx.experts]
    sel = _mask_array(layout, experts, p["access"])
    first = np.zeros(len(ctx.tensors), dtype=np.int64)
    pos = dict(zip(layout["tensor"], layout["first"]))
    for i, t in enumerate(ctx.tensors):
        first[i] = pos[t["name"]]
    c = ctx.candidates
    cand = np.zeros_like(sel)
    if len(c.expert):
        cand[c.expert, first[c.tensor] + c.block] = 0.5
    m = np.maximum(sel, cand)
    df = pd.DataFrame(m, index=experts, columns=block_labels(layout))
    return aggregate(df, max_cells, axis=1, how="mean")


def mask_heatmap(mask: pd.DataFrame) -> go.Figure:
    fig = heatmap_figure(mask, "access mask: blocks read per expert (1 = read, 0.5 = left out, 0 = no delta)",
                         "read", colorscale=[[0, "#f0f0f0"], [0.5, "#9ecae1"], [1, "#08519c"]], zmin=0, zmax=1,
                         height=max(200, 80 + 28 * len(mask.index)))
    return fig


def omitted_term(ctx: PlanContext, plan: Plan | dict) -> float:
    """Sum over the candidates the plan leaves out of |c_i| * ||delta|| (the bound for additive operators)."""
    p = plan.data if isinstance(plan, Plan) else plan
    experts = [e["id"] for e in ctx.experts]
    sel = _mask_array(ctx.layout, experts, p["access"])
    pos = dict(zip(ctx.layout["tensor"], ctx.layout["first"]))
    first = np.array([pos[t["name"]] for t in ctx.tensors], dtype=np.int64)
    c = ctx.candidates
    if not len(c.expert):
        return 0.0
    chosen = sel[c.expert, first[c.tensor] + c.block] > 0
    return float(c.bound_term[~chosen].sum())


def frontier_df(ctx: PlanContext, points: int = 101) -> pd.DataFrame:
    """The budget-bound curve of the greedy order: budget (bytes, %) vs omitted bound (absolute, relative)."""
    full = ctx.candidates.full_bytes
    norm = ctx.full_norm_estimate() if ctx.op.additive else None
    rows = []
    for b, bound in ctx.candidates.frontier(points):
        rows.append({"budget_bytes": b, "budget_pct": 100.0 * b / full if full else 0.0, "bound_abs": bound,
                     "bound_rel": bound / norm if norm else None})
    return pd.DataFrame(rows, columns=["budget_bytes", "budget_pct", "bound_abs", "bound_rel"])


def frontier_figure(frontier: pd.DataFrame, current_pct: float, current_bound: float, relative: bool,
                    operator: str) -> go.Figure:
    y = "bound_rel" if relative and frontier["bound_rel"].notna().all() else "bound_abs"
    yt = ("relative error bound" if y == "bound_rel" else
          ("error bound ||M_full - M_A||" if op_info(operator)["additive"] else
           f"omitted sum |c|*||delta|| (not a bound for {operator})"))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=frontier["budget_pct"], y=frontier[y], mode="lines", name="frontier",
                             hovertemplate="budget %{x:.1f}%<br>%{y:.4g}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[current_pct], y=[current_bound], mode="markers", name="this plan",
                             marker={"size": 12, "color": "crimson", "symbol": "x"}))
    fig.update_layout(title="budget vs bound", xaxis_title="expert-read budget (% of full)", yaxis_title=yt,
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=320, showlegend=False)
    return fig


def current_point(ctx: PlanContext, plan: Plan | dict, relative: bool) -> tuple[float, float]:
    """(expert read in % of full, bound) of a plan, for the frontier chart."""
    p = plan.data if isinstance(plan, Plan) else plan
    full = ctx.candidates.full_bytes
    x = 100.0 * p["estimate"]["expert_read"] / full if full else 0.0
    omitted = omitted_term(ctx, p)
    if relative and ctx.op.additive:
        norm = ctx.full_norm_estimate()
        return x, (omitted / norm if norm else 0.0)
    return x, omitted


def plans_df(cat: Catalog) -> pd.DataFrame:
    rows = []
    for r in cat.query("SELECT id, created_at, base_id, operator, budget_bytes, full_expert_bytes, expert_read_bytes, "
                       "error_bound, json FROM plans ORDER BY created_at DESC, id"):
        p = json.loads(r["json"])
        rows.append({"plan": r["id"], "created": r["created_at"], "base": r["base_id"], "operator": r["operator"],
                     "experts": ", ".join(e["id"] for e in p["experts"]), "budget": p["budget"]["spec"],
                     "expert_read": fmt_bytes(r["expert_read_bytes"]),
                     "of_full": fmt_pct(r["expert_read_bytes"] / r["full_expert_bytes"]) if r["full_expert_bytes"] else "-",
                     "bound": "-" if r["error_bound"] is None else f"{r['error_bound']:.4g}"})
    cols = ["plan", "created", "base", "operator", "experts", "budget", "expert_read", "of_full", "bound"]
    return pd.DataFrame(rows, columns=cols)


# --- snapshots -----------------------------------------------------------------------------------------
def snapshots_df(cat: Catalog) -> pd.DataFrame:
    rows = []
    for s in reversed(api.snapshots(cat)):
        rows.append({"snapshot": s["id"], "model": s["model_id"], "operator": s["operator"], "plan": s["plan_id"],
                     "expert_read": fmt_bytes(s["expert_read_bytes"]),
                     "of_full": fmt_pct(s["expert_read_bytes"] / s["full_expert_bytes"])
                     if s["full_expert_bytes"] else "-",
                     "created": s["created_at"], "out": s["out"], "manifest": short_fp(s["manifest_hash"])})
    cols = ["snapshot", "model", "operator", "plan", "expert_read", "of_full", "created", "out", "manifest"]
    return pd.DataFrame(rows, columns=cols)


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
                        f"/ {fmt_bytes(c['full_expert_bytes'])} full"),
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
        est = (plan.data if isinstance(plan, Plan) else plan).get("expert_read_by_tensor", {})
    names = sorted(set(c["realized_by_tensor"]) | set(est), key=tensor_sort_key)
    rows = [{"tensor": t, "estimated": int(est.get(t, 0)) if plan is not None else None,
             "realized": int(c["realized_by_tensor"].get(t, 0))} for t in names]
    return pd.DataFrame(rows, columns=["tensor", "estimated", "realized"])


def manifest_plan(cat: Catalog, manifest: Manifest) -> Plan | None:
    try:
        return load_plan(cat, manifest.core["plan_id"])
    except MergePipeError:
        return None


def bytes_figure(df: pd.DataFrame, by: str) -> go.Figure:
    fig = go.Figure()
    if "estimated" in df and df["estimated"].notna().any():
        fig.add_trace(go.Bar(x=df[by], y=df["estimated"], name="estimated"))
    fig.add_trace(go.Bar(x=df[by], y=df["realized"], name="realized"))
    fig.update_layout(barmode="group", title=f"expert bytes per {by}: estimated vs realized", yaxis_title="bytes",
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=340)
    if by == "tensor":
        fig.update_xaxes(showticklabels=len(df) <= 40)
    return fig


def touched_matrix(cat: Catalog, manifest: Manifest, max_cells: int = MAX_CELLS) -> pd.DataFrame:
    """Experts x blocks of the base grid: 1 where the merge read the expert's block."""
    c = manifest.core
    layout = block_layout(cat, c["inputs"]["base"]["id"], c["grid"]["block_bytes"])
    experts = [e["id"] for e in c["inputs"]["experts"]]
    m = _mask_array(layout, experts, c["touched"])
    df = pd.DataFrame(m, index=experts, columns=block_labels(layout))
    return aggregate(df, max_cells, axis=1, how="mean")


def touched_heatmap(matrix: pd.DataFrame) -> go.Figure:
    return heatmap_figure(matrix, "touched blocks per expert (1 = read)", "read",
                          colorscale=[[0, "#f0f0f0"], [1, "#238b45"]], zmin=0, zmax=1,
                          height=max(200, 80 + 28 * len(matrix.index)))


def verify_text(result: dict) -> str:
    head = f"{'OK' if result['ok'] else 'MISMATCH'}: {result['snapshot_id']}, {result['files_checked']} files checked"
    return head + "".join(f"\n- {p}" for p in result["problems"])


# --- lineage -------------------------------------------------------------------------------------------
def lineage_dot(cat: Catalog, model_id: str | None = None) -> str:
    return api.lineage_dot(api.lineage(cat, model_id))


def lineage_nodes_df(cat: Catalog) -> pd.DataFrame:
    g = api.lineage(cat)
    parents: dict[str, list[str]] = {}
    for e in g["edges"]:
        w = f" w={e['weight']:g}" if e["weight"] is not None else ""
        parents.setdefault(e["child_id"], []).append(f"{e['parent_id']} ({e['role']}{w})")
    rows = [{"node": n["id"], "kind": n["kind"], "snapshot": n["snapshot_id"] or "", "base": n["base_id"] or "",
             "parents": ", ".join(parents.get(n["id"], []))} for n in g["nodes"]]
    return pd.DataFrame(rows, columns=["node", "kind", "snapshot", "base", "parents"])


def node_target(cat: Catalog, node_id: str) -> tuple[str, str]:
    """Where a lineage node opens: ('snapshot', snapshot id) or ('model', model id)."""
    m = cat.model(node_id)
    if m["snapshot_id"]:
        return "snapshot", m["snapshot_id"]
    return "model", m["id"]
