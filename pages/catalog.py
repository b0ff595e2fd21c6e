"""Catalog: per-tensor and per-block statistics of each expert's delta, ||delta|| heatmaps, conflict
heatmaps from the sketches, and a drill-down from a layer to its blocks."""

import streamlit as st

from mergepipe.dashboard import views
from pages import _nav, _ui as ui

_nav.through_app()

VIEWS = ["Heatmap", "Tensors", "Blocks", "Conflicts"]
METRICS = {"sign conflict": "conflict", "cosine": "cosine"}

st.title("Catalog")


def drill_down():
    """A click on a layer cell of the heatmap opens that layer's blocks."""
    sel = st.session_state.get("norm_chart")
    points = (sel or {}).get("selection", {}).get("points", []) if isinstance(sel, dict) else \
        getattr(getattr(sel, "selection", None), "points", [])
    for p in points:
        cd = p.get("customdata")
        if cd:
            st.session_state["layer"] = cd[0]
            st.session_state["view"] = "Blocks"
            return


with ui.user_errors(), ui.catalog() as cat:
    version = views.stats_version(cat)
    bases = [b for b in views.bases(cat) if views.analyzed_experts(cat, b)]
    if not bases:
        st.info("No analyzed experts yet: register and analyze a family on the **Models** page.")
        st.stop()
    c1, c2 = st.columns([1, 3])
    base = c1.selectbox("Base", bases, key="base", bind="query-params")
    all_experts = views.analyzed_experts(cat, base)
    experts = c2.multiselect("Experts", all_experts, default=all_experts, key="experts", bind="query-params")
    if not experts:
        st.warning("Choose at least one expert.")
        st.stop()
    ex = tuple(experts)
    db = ui.db()
    layout = ui.layout(db, version, base)
    groups = views.groups(layout)
    first_layer = next((g for g in groups if g.startswith("layer ")), groups[0])
    view = st.radio("View", VIEWS, key="view", horizontal=True, bind="query-params", label_visibility="collapsed")

    if view in ("Heatmap", "Blocks"):
        o1, o2, o3 = st.columns(3)
        scale = o2.radio("Colour scale", list(views.NORM_SCALES), index=1, key="scale", horizontal=True,
                         bind="query-params", help="log: one outlier expert no longer flattens the others")
        mode = o3.radio("Normalise", list(views.NORM_MODES), key="norm", horizontal=True, bind="query-params",
                        help="per expert: each expert's cells divided by its own largest value")
    if view == "Heatmap":
        level = o1.radio("Rows", ["layer", "tensor", "block"], key="rows", horizontal=True, bind="query-params")
        m = ui.norm_matrix(db, version, ex, level)
        if level == "block" and m.index.name == "block" and len(m) and ".." in str(m.index[0]):
            st.caption(f"{len(m)} row bins: the block matrix is aggregated (norms combine as sqrt of sum of "
                       f"squares); choose a layer under **Blocks** for the detail.")
        st.plotly_chart(views.norm_heatmap(m, level, scale, mode), key="norm_chart",
                        on_select=drill_down if level == "layer" else "ignore",
                        selection_mode="points")
        if level == "layer":
            st.caption("Click a layer's cell to drill down to its blocks.")

    elif view == "Tensors":
        df = ui.tensor_stats(db, version, ex)
        st.caption(f"{len(df)} rows: one per (tensor, expert). Click a column header to sort.")
        ui.table(df, hide_index=True, key="tensor_table", height=520,
                 column_config={"density": st.column_config.NumberColumn(format="%.3f"),
                                "delta_l2": st.column_config.NumberColumn(format="%.4g"),
                                "delta_l1": st.column_config.NumberColumn(format="%.4g"),
                                "delta_max_abs": st.column_config.NumberColumn(format="%.4g")})

    elif view == "Blocks":
        if st.session_state.get("layer") not in groups and st.query_params.get("layer") not in groups:
            st.session_state["layer"] = first_layer
        group = st.selectbox("Layer", groups, key="layer", bind="query-params")
        tensors = tuple(views.tensors_in_group(layout, group))
        m = ui.norm_matrix(db, version, ex, "block", tensors)
        bm, label = views.norm_transform(m, scale, mode)
        st.plotly_chart(views.heatmap_figure(bm, f"||delta||_2 per block of {group} ({scale} scale"
                                             + (", per expert" if mode == "per expert" else "") + ")", label,
                                             show_x_labels=True), key="block_chart")
        df = ui.block_stats(db, version, ex, tensors)
        ui.table(df, hide_index=True, key="block_table", height=420)

    else:  # Conflicts
        if len(experts) < 2:
            st.warning("Choose at least two experts to compare.")
            st.stop()
        c1, c2, c3 = st.columns(3)
        metric_label = c1.radio("Metric", list(METRICS), key="metric", horizontal=True, bind="query-params")
        scope = c2.radio("Scope", ["layer", "tensor"], key="scope", horizontal=True, bind="query-params")
        if scope == "layer":
            if st.session_state.get("clayer") not in groups and st.query_params.get("clayer") not in groups:
                st.session_state["clayer"] = first_layer
            item = c3.selectbox("Layer", groups, key="clayer", bind="query-params")
            tensors = tuple(views.tensors_in_group(layout, item))
        else:
            names = [t for t in layout["tensor"]]
            item = c3.selectbox("Tensor", names, key="ctensor", bind="query-params")
            tensors = (item,)
        metric = METRICS[metric_label]
        m = ui.conflict(db, version, ex, tensors, metric)
        st.plotly_chart(views.conflict_heatmap(m, metric, item), key="conflict_chart")
        st.caption("Estimated from the catalog's block sketches (sampled deltas); no checkpoint is read.")
        ui.table(m.round(4), key="conflict_table")
