"""What a new user found on the dashboard (issue 28), without a browser: the target bound starts at the plan's
bound with a help text; Home counts merges made from the command line; tables show '-' for a missing value,
never `None`; the figures' title and legend have their own lines, tick labels do not crowd, byte axes are binary
(KiB, MiB) and text is at least 11 px. (tests/dashboard/test_demo_dashboard.py checks the same in a browser.)"""

from __future__ import annotations

import math

import pandas as pd

from dashboard_helpers import EXPERTS, open_page
from mergepipe.catalog.db import Catalog
from mergepipe.dashboard import views
from mergepipe.dashboard import figures as dash_figures
from mergepipe.dashboard import formatting as dash_formatting
from mergepipe.dashboard import home as dash_home
from mergepipe.dashboard import plan as dash_plan
from mergepipe.dashboard import snapshots as dash_snapshots
from mergepipe.dashboard.figures import FONT_PX, LEGEND_ROW_PX, TITLE_PX, TICK_SPAN

E = list(EXPERTS)


def texts(elements) -> list[str]:
    return [e.value for e in elements]


def table_with(at, column: str) -> pd.DataFrame:
    return next(d.value for d in at.dataframe if column in d.value.columns)


# --- 3: the target bound's default and help -----------------------------------------------------------------------
def test_target_bound_starts_at_the_plans_bound(env):
    at = open_page("plan")
    cat = Catalog(env["db"])
    at25 = dash_plan.make_plan(views.plan_context(cat, "base", E, "linear"), 25)
    rel = at25["error_bound"]["relative"]
    at.radio(key="mode").set_value("target bound").run()
    assert not at.exception
    target = at.number_input(key="target")
    assert target.value == views.target_default(at25["error_bound"]) == math.ceil(rel * 1000 - 1e-9) / 1000
    assert 0 < target.value < 1 and target.value != 1.0
    assert target.help == views.TARGET_HELP and "Typical: 0.05 to 0.2" in target.help
    assert "relative to the full merge's change from the base" in target.help
    # the plan stays (about) the same: the smallest budget meeting the bound reads no more than 25 %
    plan = dash_plan.make_plan(views.plan_context(cat, "base", E, "linear"), target_rel=target.value)
    cat.close()
    want = views.plan_summary(plan)
    assert texts(at.success)[-1] == f"Smallest budget for a relative bound <= {target.value:g}: {want['budget']}"
    read, read25 = plan["estimate"]["expert_read"], at25["estimate"]["expert_read"]
    assert 0.95 * read25 <= read <= read25


def test_target_bound_from_a_link_starts_at_a_typical_value(env):
    at = open_page("plan", {"mode": "target bound"})
    assert at.number_input(key="target").value == views.TARGET_TYPICAL == 0.1
    assert views.target_default(None) == 0.1 and views.target_default({"relative": 0.11401}) == 0.115


# --- 4: Home counts merges made from the command line ----------------------------------------------------------------
def test_home_counts_a_merge_without_a_run(env, built):
    cat = Catalog(env["db"])
    assert cat.totals()["runs"] == 0  # the merge (api.merge, as the CLI and the demo) recorded no run
    assert [s["id"] for s in dash_home.merges_without_run(cat)] == [built.snapshot_id]
    assert views.totals(cat)["runs"] == 1
    cat.close()
    at = open_page("home")
    assert {m.label: m.value for m in at.metric}["Runs"] == "1"
    assert "No runs yet." not in texts(at.caption)
    assert any(c.startswith("A merge made from the command line has no run number") for c in texts(at.caption))
    runs = table_with(at, "run")
    assert runs[["run", "kind", "status", "snapshot", "model"]].values.tolist() == [
        ["-", "merge", "succeeded", built.snapshot_id, "merged-1"]]


def test_activity_lists_runs_and_foreground_merges_newest_first(env, built):
    from mergepipe.engine.runs import create_run
    cat = Catalog(env["db"])
    run_id = create_run(cat, built.plan_id, str(env["tmp"] / "out2"), "merged-2", 1, None)
    df = views.activity_df(cat, limit=10)
    assert views.totals(cat)["runs"] == 2
    cat.close()
    assert df["run"].tolist()[0] == run_id and pd.isna(df["run"].tolist()[1])
    assert df["snapshot"].tolist() == ["", built.snapshot_id]


# --- 5: tables show '-' for a missing value ----------------------------------------------------------------------
def test_table_formats_missing_values_in_one_place():
    df = pd.DataFrame({"name": ["a", None], "score": [5.296523, None], "n": [1, 2], "count": [3.0, float("nan")]})
    out = views.table(df)
    assert out.to_dict("list") == {"name": ["a", "-"], "score": ["5.2965", "-"], "n": [1, 2], "count": ["3", "-"]}
    assert out["n"].dtype.kind == "i"  # a column with no missing value keeps its type (numeric sorting)
    assert df["name"].isna().tolist() == [False, True]  # the data is not changed
    assert views.table(df[["n"]]) is not None and views.table(df[["n"]])["n"].tolist() == [1, 2]
    assert dash_formatting.fmt_cell(None) == dash_formatting.fmt_cell(float("nan")) == dash_formatting.fmt_cell(pd.NaT) == dash_formatting.MISSING == "-"


def test_pages_show_no_none_in_tables(env):
    at = open_page("home")
    snaps = table_with(at, "perplexity")
    assert snaps.loc[0, "perplexity"] == "-" and snaps.loc[0, "accuracy"] == "-"
    at.switch_page("pages/plan.py").run()
    experts = table_with(at, "density")  # linear takes no density
    assert set(experts["density"]) == {"-"}
    for page in ("snapshots", "models", "lineage", "run"):
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception, page
        for d in at.dataframe:
            assert not d.value.isna().any().any(), (page, d.value.columns.tolist())


# --- 6: figures --------------------------------------------------------------------------------------------------
def demo_like_mask() -> pd.DataFrame:
    """A mask with the demo's shape: embed, 4 layers of 14 blocks, the final norm (1 block), the head."""
    cols = ([f"model.embed_tokens.weight#{i}" for i in range(6)]
            + [f"model.layers.{n}.mlp.up_proj.weight#{i}" for n in range(4) for i in range(14)]
            + ["model.norm.weight#0", "lm_head.weight#0", "lm_head.weight#1"])
    return pd.DataFrame(1.0, index=E, columns=cols)


def title_and_legend_px(fig) -> tuple[float, float, float]:
    """(the title's bottom, the legend's top, the plot area's top) in pixels from the figure's top."""
    h = fig.layout.height
    assert fig.layout.title.yref == "container" and fig.layout.title.yanchor == "top"
    assert fig.layout.legend.yref == "container" and fig.layout.legend.yanchor == "top"
    title_bottom = (1 - fig.layout.title.y) * h + TITLE_PX * 1.4
    return title_bottom, (1 - fig.layout.legend.y) * h, fig.layout.margin.t


def assert_fonts(fig):
    assert fig.layout.font.size >= 11 and fig.layout.title.font.size >= 11
    assert fig.layout.xaxis.tickfont.size >= 11 and fig.layout.yaxis.tickfont.size >= 11


def test_state_figure_title_legend_and_ticks():
    mask = demo_like_mask()
    fig = dash_plan.mask_heatmap(mask)
    title_bottom, legend_top, plot_top = title_and_legend_px(fig)
    assert title_bottom <= legend_top and legend_top + LEGEND_ROW_PX <= plot_top  # own lines, above the plot
    assert_fonts(fig) and fig.layout.legend.font.size >= 11
    texts_, vals = list(fig.layout.xaxis.ticktext), list(fig.layout.xaxis.tickvals)
    assert texts_ == ["embed", "layer 0", "layer 1", "layer 2", "layer 3", "other, head"]
    pos = [list(mask.columns).index(v) for v in vals]
    assert min(b - a for a, b in zip(pos, pos[1:])) >= math.ceil(len(mask.columns) / TICK_SPAN)
    with_tiers = dash_plan.mask_heatmap(mask, levels=(4,))  # six states: the legend under the plot
    assert with_tiers.layout.legend.y == 0.0 and with_tiers.layout.margin.b >= 130
    assert with_tiers.layout.margin.t < with_tiers.layout.height * (1 - with_tiers.layout.title.y) + 40
    assert_fonts(with_tiers)


def test_group_ticks_join_named_groups_and_keep_their_distance():
    cols = [f"model.layers.0.x#{i}" for i in range(80)] + ["model.norm.weight#0", "lm_head.weight#0"]
    assert dash_figures.group_ticks(cols) == (["model.layers.0.x#0", "model.norm.weight#0"], ["layer 0", "other, head"])
    crowded = [f"model.layers.{n}.x#0" for n in range(40)]  # 40 one-block layers: every other one ticked
    vals, texts_ = dash_figures.group_ticks(crowded)
    assert texts_ == [f"layer {n}" for n in range(0, 40, 2)]


def test_bytes_ticks_are_binary():
    vals, texts_ = dash_figures.bytes_ticks(1.19 * 2 ** 20)
    assert texts_ == ["0", "0.25 MiB", "0.5 MiB", "0.75 MiB", "1 MiB", "1.25 MiB"]
    assert vals == [i * 2 ** 18 for i in range(6)]
    assert dash_figures.bytes_ticks(350_000)[1] == ["0", "100 KiB", "200 KiB", "300 KiB", "400 KiB"]
    assert dash_figures.bytes_ticks(float("nan")) == ([0.0, 1.0], ["0", "1 B"])


def test_snapshot_bytes_charts_in_mib_with_readable_labels():
    df = pd.DataFrame({"expert": E, "estimated": [1.19 * 2 ** 20, 400_000, 300_000],
                       "realized": [1.19 * 2 ** 20, 450_000, 300_000]})
    bars = views.bytes_bars(df, "expert")
    assert list(bars.layout.xaxis.ticktext) == ["0", "0.25 MiB", "0.5 MiB", "0.75 MiB", "1 MiB", "1.25 MiB"]
    assert bars.layout.xaxis.tickmode == "array" and bars.layout.xaxis.title.text == "bytes"
    realized = bars.data[-1]
    assert realized.constraintext == "none" and realized.textfont.size >= 11  # not shrunk to the bar's height
    title_bottom, legend_top, plot_top = title_and_legend_px(bars)
    assert title_bottom <= legend_top and legend_top + LEGEND_ROW_PX <= plot_top
    assert_fonts(bars)
    fig = dash_snapshots.bytes_figure(df, "expert")
    assert list(fig.layout.yaxis.ticktext)[-1].endswith("MiB") and fig.layout.font.size == FONT_PX
