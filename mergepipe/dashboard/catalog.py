"""The Catalog page: per-tensor and per-block delta statistics, norm and conflict heatmaps."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.api import Catalog
from mergepipe.dashboard.figures import (
    MAX_CELLS, _group_key, aggregate, group_of, heatmap_figure, tensor_sort_key,
)


# --- catalog statistics ------------------------------------------------------------------------------
def tensor_stats_df(cat: Catalog, experts: list[str]) -> pd.DataFrame:
    """Per (expert, tensor): ||delta||_2, L1, max |delta|, non-zeros, density, in natural tensor order."""
    cols = ["expert", "tensor", "group", "numel", "delta_l2", "delta_l1", "delta_max_abs", "delta_nnz", "density"]
    if not experts:
        return pd.DataFrame(columns=cols)
    rows = api.tensor_stats_rows(cat, experts)
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
    df = pd.DataFrame(api.block_stats_rows(cat, experts, tensors), columns=["model_id", "tensor", "block", "row_start", "row_end", "nbytes",
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


NORM_SCALES = ("log", "linear")
NORM_MODES = ("absolute", "per expert")


def norm_transform(matrix: pd.DataFrame, scale: str = "log", mode: str = "absolute") -> tuple[pd.DataFrame, str]:
    """(matrix, colour-bar label) as drawn: ``mode`` 'per expert' divides each expert's column by its
    largest value (so an outlier expert no longer flattens the others); ``scale`` 'log' takes log10
    (zeros, i.e. unchanged rows, stay blank)."""
    if scale not in NORM_SCALES:
        raise ValueError(f"unknown scale {scale!r}")
    if mode not in NORM_MODES:
        raise ValueError(f"unknown normalisation {mode!r}")
    m = matrix.astype(float)
    label = "||delta||"
    if mode == "per expert":
        peak = m.max(axis=0).replace(0.0, np.nan)
        m = m.div(peak, axis=1).fillna(0.0)
        label = "||delta|| / expert max"
    if scale == "log":
        m = np.log10(m.where(m > 0))
        label = f"log10 {label}"
    return m, label


def norm_heatmap(matrix: pd.DataFrame, level: str, scale: str = "linear", mode: str = "absolute") -> go.Figure:
    m, label = norm_transform(matrix, scale, mode)
    what = "||delta||_2" + (" / each expert's max" if mode == "per expert" else "")
    return heatmap_figure(m, f"{what} per {level} and expert ({scale} scale)", label, clickable=(level == "layer"),
                          show_x_labels=True)


def sketch_matrix(cat: Catalog, experts: list[str], tensors: list[str]) -> np.ndarray:
    """[K, N]: each expert's block sketches of ``tensors`` in delta units (sketch * max |delta|),
    concatenated in (tensor, block) order; a block an expert left unchanged contributes zeros."""
    if not experts or not tensors:
        return np.zeros((len(experts), 0), dtype=np.float32)
    rows = api.sketch_rows(cat, experts, tensors)
    tindex = {t: i for i, t in enumerate(tensors)}
    eindex = {e: i for i, e in enumerate(experts)}
    size = max((len(r["sketch"] or b"") // 2 for r in rows), default=0)
    keys = sorted({(tindex[r["tensor"]], r["block"]) for r in rows})
    kindex = {k: i for i, k in enumerate(keys)}
    mat = np.zeros((len(experts), len(keys), size), dtype=np.float32)
    for r in rows:
        v = api.decode_sketch(r["sketch"])
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
