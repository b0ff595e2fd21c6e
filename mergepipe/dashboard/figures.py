"""Shared figures: tensor groups and the block layout, aggregation of big matrices, heatmaps.

Big matrices (blocks x experts) are aggregated above ``MAX_CELLS`` cells so that a page stays
responsive on large catalogs; the drill-down views show the detail of one layer or tensor.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from mergepipe.catalog.db import Catalog
from mergepipe.errors import CatalogError
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import TensorInfo


MAX_CELLS = 100_000
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
    z = matrix.to_numpy(dtype=np.float32)  # display only: half the bytes sent to the browser
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


def group_ticks(columns, min_gap: int | None = None) -> tuple[list[str], list[str]]:
    """(tick values, tick texts) marking where each layer group starts among block columns labelled
    'tensor#block' (or aggregated bins 'tensor#block..tensor#block'). A group starting less than
    ``min_gap`` columns after the last ticked one gets no tick (its labels would overlap; the hover still
    names every block); default: 1/40 of the columns."""
    columns = [str(c) for c in columns]
    gap = max(1, len(columns) // 40) if min_gap is None else min_gap
    vals, texts, prev, last = [], [], None, None
    for i, c in enumerate(columns):
        g = group_of(c.split("#", 1)[0])
        if g != prev:
            if last is None or i - last >= gap:
                vals.append(c)
                texts.append(g)
                last = i
            prev = g
    return vals, texts


def state_figure(matrix: pd.DataFrame, title: str, states: list[tuple[float, str, str]],
                 height: int | None = None) -> go.Figure:
    """Experts x blocks in a few discrete states (value, legend label, colour): a heatmap without a colour
    bar, a legend with one entry per state, the x axis labelled with the layer groups (ticks where each
    starts; the hover names the tensor and block), the y axis with the full expert names. Aggregated bins
    hold the mean of their blocks and are drawn between the states' colours."""
    states = sorted(states)
    lo, hi = states[0][0], states[-1][0]
    span = (hi - lo) or 1.0
    scale = [[(v - lo) / span, colour] for v, _, colour in states]
    x = [str(c) for c in matrix.columns]
    y = [str(i) for i in matrix.index]
    z = matrix.to_numpy(dtype=np.float32)  # display only: half the bytes sent to the browser
    names = "; ".join(f"{v:g} = {label}" for v, label, _ in states)
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale=scale, zmin=lo, zmax=hi, showscale=False,
                               hovertemplate="%{y}<br>%{x}<br>%{z:.2f} (" + names + ")<extra></extra>"))
    for _, label, colour in reversed(states):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label, showlegend=True,
                                 marker={"symbol": "square", "size": 12, "color": colour,
                                         "line": {"color": "#888", "width": 1}}))
    vals, texts = group_ticks(x)
    binned = any(".." in c for c in x[:1])
    fig.update_layout(title=title, height=height or max(240, 120 + 28 * len(y)),
                      margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0})
    fig.update_xaxes(type="category", tickmode="array", tickvals=vals, ticktext=texts, tickangle=-45,
                     title_text="blocks of each tensor in model order (tensor#block" + (", binned" if binned else "")
                     + "); ticks: where each layer starts", showgrid=False)
    fig.update_yaxes(type="category", autorange="reversed", title_text="expert", automargin=True)
    return fig
