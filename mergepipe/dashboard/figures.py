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

from mergepipe import api
from mergepipe.api import Catalog
from mergepipe.errors import CatalogError


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
        rows.append({"tensor": t["name"], "group": group_of(t["name"]), "blocks": api.block_count(t, block_bytes),
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


TICK_SPAN = 20  # a tick at most every 1/20 of the columns: >= 20 px apart on a 400 px plot, enough for 12 px labels


def group_ticks(columns, min_gap: int | None = None) -> tuple[list[str], list[str]]:
    """(tick values, tick texts) marking where each layer group starts among block columns labelled
    'tensor#block' (or aggregated bins 'tensor#block..tensor#block'). Ticks are at least ``min_gap`` columns
    apart (default: 1/TICK_SPAN of the columns), so that their labels never overlap: a group starting closer
    after the last tick gets none (the hover still names every block), except a named group (embed, other,
    head), whose name joins that tick's ('other, head')."""
    columns = [str(c) for c in columns]
    gap = max(1, math.ceil(len(columns) / TICK_SPAN)) if min_gap is None else min_gap
    vals, texts, prev, last = [], [], None, None
    for i, c in enumerate(columns):
        g = group_of(c.split("#", 1)[0])
        if g != prev:
            if last is None or i - last >= gap:
                vals.append(c)
                texts.append(g)
                last = i
            elif not g.startswith("layer "):
                texts[-1] += f", {g}"
            prev = g
    return vals, texts


# --- readable figures: font sizes, title and legend on their own lines, byte axes in binary units ------------
FONT_PX = 12  # every figure's text (Streamlit's theme draws ticks smaller)
TITLE_PX = 16
TITLE_TOP_PX = 6  # the title's top, from the figure's top
LEGEND_TOP_PX = 34  # the legend's top: under the title's line (TITLE_TOP_PX + a 16 px title's height + a gap)
LEGEND_ROW_PX = 26


def readable(fig: go.Figure, title: str, legend_above: bool = True) -> go.Figure:
    """Fonts of FONT_PX (the title TITLE_PX), the title on the first line and, with ``legend_above``, a horizontal
    legend on its own line under it (above the plot area): the two never overlap, whatever the width. Call after
    the figure's height is set."""
    height = fig.layout.height or 450
    top = LEGEND_TOP_PX + LEGEND_ROW_PX if legend_above else LEGEND_TOP_PX
    margin = fig.layout.margin.to_plotly_json() if fig.layout.margin else {}
    fig.update_layout(font={"size": FONT_PX}, margin={**margin, "t": top},
                      title={"text": title, "font": {"size": TITLE_PX}, "x": 0, "xanchor": "left", "xref": "container",
                             "yref": "container", "y": 1 - TITLE_TOP_PX / height, "yanchor": "top"})
    if legend_above:
        fig.update_layout(legend={"orientation": "h", "yref": "container", "y": 1 - LEGEND_TOP_PX / height,
                                  "yanchor": "top", "xanchor": "right", "x": 1.0, "font": {"size": FONT_PX}})
    fig.update_xaxes(tickfont={"size": FONT_PX}, title_font={"size": FONT_PX})
    fig.update_yaxes(tickfont={"size": FONT_PX}, title_font={"size": FONT_PX})
    return fig


BINARY_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= ``raw``."""
    exp = 10 ** math.floor(math.log10(raw))
    return next(m * exp for m in (1, 2, 2.5, 5, 10) if m * exp >= raw - 1e-12)


def bytes_ticks(max_bytes: float, n: int = 5) -> tuple[list[float], list[str]]:
    """(tick values in bytes, tick texts) for an axis from 0 to ``max_bytes`` in binary units, as every size
    on the dashboard is written: 0, 256 KiB, 512 KiB, ... (about ``n`` ticks, one past the maximum)."""
    max_bytes = float(max_bytes) if max_bytes and max_bytes > 0 else 0.0  # none, NaN or negative: an empty axis
    unit, name = next((u, nm) for u, nm in BINARY_UNITS if max_bytes >= u or u == 1)
    step = _nice_step(max_bytes / unit / n) if max_bytes > 0 else 1.0
    count = math.floor(max_bytes / unit / step + 1e-9) + 1
    vals = [i * step * unit for i in range(count + 1)]
    return vals, ["0"] + [f"{i * step:g} {name}" for i in range(1, count + 1)]


def bytes_axis(fig: go.Figure, axis: str, max_bytes: float) -> go.Figure:
    """Label the ``axis`` ('x' or 'y') of a figure of bytes with bytes_ticks (binary units, not Plotly's 1.2M)."""
    vals, texts = bytes_ticks(max_bytes)
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    update(tickmode="array", tickvals=vals, ticktext=texts, title_text="bytes")
    return fig


def state_figure(matrix: pd.DataFrame, title: str, states: list[tuple[float, str, str]],
                 height: int | None = None, legend_below: bool = False) -> go.Figure:
    """Experts x blocks in a few discrete states (value, legend label, colour): a heatmap without a colour
    bar, a legend with one entry per state, the x axis labelled with the layer groups (ticks where each
    starts; the hover names the tensor and block), the y axis with the full expert names. Aggregated bins
    hold the mean of their blocks and are drawn between the states' colours. The legend sits under the title, or
    with ``legend_below`` (many states: they do not fit on one line) under the plot."""
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
    height = height or max(260, 150 + 28 * len(y))
    fig.update_layout(height=height + (150 if legend_below else 0),
                      margin={"l": 10, "r": 10, "b": 130 if legend_below else 10})
    readable(fig, title, legend_above=not legend_below)
    if legend_below:
        fig.update_layout(legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom",
                                  "xanchor": "left", "x": 0.0, "font": {"size": FONT_PX}})
    fig.update_xaxes(type="category", tickmode="array", tickvals=vals, ticktext=texts, tickangle=-45,
                     title_text="blocks in model order" + (" (binned)" if binned else "") + "; a tick where each "
                     "layer starts", showgrid=False)
    fig.update_yaxes(type="category", autorange="reversed", title_text="expert", automargin=True)
    return fig
