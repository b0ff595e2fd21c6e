"""The Plan page with compact deltas in the catalog (issue 27): the access mask's third state (read from the
compact tier, by bits), the blocks and bytes per tier, the compact-tier control, the frontier of the three-way
greedy, and the suggested budget beside the slider. View tests on the DataFrames and figures, AppTest tests of
the page."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from dashboard_helpers import BLOCK_BYTES, open_page
from mergepipe.analyze.runner import analyze
from mergepipe.catalog import compacts
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.dashboard import views
from mergepipe.dashboard import formatting as dash_formatting
from mergepipe.dashboard import plan as dash_plan
from mergepipe.planner.tiers import EXACT, OMIT
from mergepipe.research.family import make_family

E = ["expert_1", "expert_2", "expert_3"]
PLAIN = "expert_4"  # analyzed without compact deltas


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny fp32 family on a 4 KiB grid: expert_1 and expert_2 with progressive compacts (1, 2 and 4 bits),
    expert_3 with sign1 compacts (1 bit), expert_4 with none."""
    root = tmp_path_factory.mktemp("compact_plan")
    make_family(root / "family", experts=4, size="tiny", dtype="fp32")
    db = root / "catalog.sqlite"
    cat = Catalog(db)
    try:
        register(cat, "base", str(root / "family" / "base"))
        for e in [*E, PLAIN]:
            register(cat, e, str(root / "family" / e), base_id="base")
        analyze(cat, E[:2], block_bytes=BLOCK_BYTES, compact="progressive")
        analyze(cat, E[2:], block_bytes=BLOCK_BYTES, compact="sign1")
        analyze(cat, [PLAIN], block_bytes=BLOCK_BYTES)
        assert {r["model_id"]: r["codec"] for r in compacts.compact_rows(cat)} == {
            "expert_1": "progressive", "expert_2": "progressive", "expert_3": "sign1"}
    finally:
        cat.close()
    return root


def copy_with_compacts(root, dest):
    """The catalog file and its compact files (``<stem>.compacts`` beside it), copied under ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / "catalog.sqlite", dest / "catalog.sqlite")
    shutil.copytree(root / "catalog.compacts", dest / "catalog.compacts")
    return dest / "catalog.sqlite"


@pytest.fixture
def cat(built, tmp_path):
    c = Catalog(copy_with_compacts(built, tmp_path / "cat"))
    yield c
    c.close()


def expected_counts(plan) -> dict:
    t = plan["tiers"]
    return {"exact": t["exact"]["blocks"], "omitted": t["omitted"]["blocks"],
            "compact": {b: t["compact"]["by_bits"].get(b, 0) for b in ("1", "2", "4")}}


# --- views --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "progressive", "sign1", "q4", "off"])
def test_mask_has_exactly_the_plans_blocks_in_each_state(cat, mode):
    experts = E if mode not in ("progressive", "q4") else E[:2]  # expert_3's sign1 compacts hold no 4-bit level
    ctx = views.plan_context(cat, "base", experts, "linear", compact=mode)
    assert (ctx.tiers is None) == (mode == "off")
    n_cand = len(ctx.candidates.expert)
    seen_compact = 0
    for pct in (5, 10, 25, 50, 100):
        plan = dash_plan.make_plan(ctx, pct)
        mask = dash_plan.mask_matrix(ctx, plan)
        counts = dash_plan.mask_state_counts(mask)
        want = expected_counts(plan)
        assert {k: counts[k] for k in ("exact", "omitted", "compact")} == want, (mode, pct)
        assert want["exact"] + sum(want["compact"].values()) + want["omitted"] == n_cand
        assert counts["no delta"] == mask.size - n_cand
        # every cell of the plan's compact ranges holds its level's value; every access range reads exactly
        for e, entry in (plan.data.get("compact") or {}).get("experts", {}).items():
            for bits, tensors in entry["bits"].items():
                for t, ranges in tensors.items():
                    for a, b in ranges:
                        assert all(mask.at[e, f"{t}#{i}"] == dash_plan.COMPACT_STATES[int(bits)][0] for i in range(a, b))
        for e, tensors in plan["access"].items():
            for t, ranges in tensors.items():
                assert all(mask.at[e, f"{t}#{i}"] == 1.0 for a, b in ranges for i in range(a, b))
        seen_compact += sum(want["compact"].values())
        # the tier codes the page derives equal the tiers of the plan
        tier = dash_plan.candidate_tiers(ctx, plan)
        assert int((tier == EXACT).sum()) == want["exact"] and int((tier == OMIT).sum()) == want["omitted"]
        if ctx.tiers is not None:  # the compact bytes of those tiers are the plan's estimate
            assert int(ctx.tiers.compact_read(tier).sum()) == plan["estimate"]["compact_read"] \
                == plan["tiers"]["compact"]["bytes"]
    if mode == "off":
        assert seen_compact == 0
    else:
        assert seen_compact > 0
    if mode == "sign1":
        assert dash_plan.mask_levels(ctx) == (1,)


def test_mask_legend_names_the_three_states(cat):
    ctx = views.plan_context(cat, "base", E[:2], "linear")
    plan = dash_plan.make_plan(ctx, 25)
    assert dash_plan.mask_levels(ctx, plan) == (1, 2, 4)
    fig = dash_plan.mask_heatmap(dash_plan.mask_matrix(ctx, plan), dash_plan.mask_levels(ctx, plan))
    legend = [t.name for t in fig.data[1:]]
    assert sorted(legend) == sorted(["no delta (nothing to read)", "omitted (changed, left out by the budget)",
                                     "compact tier, 1 bit per entry", "compact tier, 2 bits per entry",
                                     "compact tier, 4 bits per entry", "read exactly"])
    # the colour scale puts each state's colour at its value: compact states between omitted and exact
    scale = {round(float(v), 6): c for v, c in fig.data[0].colorscale}
    for bits, (value, _, colour) in dash_plan.COMPACT_STATES.items():
        assert scale[round(value, 6)] == colour
    assert float(fig.data[0].zmin) == 0.0 and float(fig.data[0].zmax) == 1.0
    assert "compact tier" in fig.layout.title.text and fig.layout.legend.y == 0.0  # the legend below the plot
    # an exact-or-omitted context keeps today's three states and title
    off = views.plan_context(cat, "base", E, "linear", compact="off")
    assert dash_plan.mask_levels(off) == ()
    fig = dash_plan.mask_heatmap(dash_plan.mask_matrix(off, dash_plan.make_plan(off, 25)), dash_plan.mask_levels(off))
    assert [t.name for t in fig.data[1:]] == [label for _, label, _ in reversed(dash_plan.MASK_STATES)]
    assert fig.layout.title.text == "access mask: which blocks each expert reads"


def test_tier_summary_is_the_plans_tiers(cat):
    ctx = views.plan_context(cat, "base", E[:2], "linear")
    plan = dash_plan.make_plan(ctx, 25)
    t = plan["tiers"]
    df = dash_plan.tiers_df(plan, ctx).set_index("tier")
    assert df.at["exact", "blocks"] == t["exact"]["blocks"] and df.at["exact", "bytes"] == t["exact"]["bytes"]
    assert df.at["compact tier (total)", "blocks"] == t["compact"]["blocks"]
    assert df.at["compact tier (total)", "bytes"] == t["compact"]["bytes"] == plan["estimate"]["compact_read"]
    assert df.at["omitted (not read)", "blocks"] == t["omitted"]["blocks"]
    assert df.at["omitted (not read)", "bytes"] == t["omitted"]["bytes"]
    levels = [f"compact, {b} bit{'s' if b != '1' else ''} per entry" for b in sorted(t["compact"]["by_bits"], key=int)]
    assert [r for r in df.index if r.startswith("compact, ")] == levels
    assert sum(df.at[r, "blocks"] for r in levels) == t["compact"]["blocks"]
    assert sum(df.at[r, "bytes"] for r in levels) == t["compact"]["bytes"]  # bytes per level, from the context
    assert df.at["exact", "estimated"] == views.fmt_bytes(t["exact"]["bytes"])
    assert df.at["exact", "of full"] == dash_formatting.fmt_pct(t["exact"]["bytes"] / plan["full_expert_bytes"])
    # the budget counts exact + compact bytes
    assert t["exact"]["bytes"] + t["compact"]["bytes"] <= plan["budget"]["bytes"]
    shown = dash_plan.tiers_table(plan, ctx)
    assert list(shown.columns) == ["tier", "blocks", "est. bytes", "% of changed"]
    # without the context the per-level bytes are not known: "-", the totals still are
    bare = dash_plan.tiers_df(json.loads(json.dumps(plan.data))).set_index("tier")
    assert all(bare.at[r, "estimated"] == "-" for r in levels)
    assert bare.at["compact tier (total)", "estimated"] == views.fmt_bytes(t["compact"]["bytes"])
    text = dash_plan.tiers_text(plan)
    assert text.startswith(f"exact {t['exact']['blocks']} blocks")
    assert f"omitted {t['omitted']['blocks']} blocks" in text
    assert dash_plan.tiers_df({k: v for k, v in plan.data.items() if k != "tiers"}) is None  # a plan saved before
    s = views.plan_summary(plan)
    assert s["compact_read_bytes"] == t["compact"]["bytes"]
    assert s["budget_read_pct"] == dash_formatting.fmt_pct((t["exact"]["bytes"] + t["compact"]["bytes"])
                                                 / plan["full_expert_bytes"])


def test_compact_options_and_note(cat):
    assert views.compact_options(cat, E[:2]) == ["auto", "off", "sign1", "q2", "q4", "progressive"]
    assert views.compact_options(cat, E) == ["auto", "off", "sign1"]  # expert_3 holds 1 bit only
    assert views.compact_options(cat, [PLAIN]) == [] and views.compact_options(cat, []) == []
    assert views.compacts_version(cat) != ""
    # a strategy without a gain per byte: the plan says why the compacts are not used
    ctx = views.plan_context(cat, "base", E, "linear", strategy="random")
    plan = dash_plan.make_plan(ctx, 25)
    assert ctx.tiers is None and plan.data["compact_note"].startswith("compact tier not used")
    assert expected_counts(plan)["compact"] == {"1": 0, "2": 0, "4": 0}
    # a request flows the page's setting into the merge request
    assert views.plan_request("base", E, "linear", compact="sign1").compact == "sign1"
    assert views.plan_request("base", E, "linear", compact=None).compact == "auto"


def test_frontier_uses_the_three_way_greedy(cat):
    ctx = views.plan_context(cat, "base", E[:2], "linear")
    fr = dash_plan.frontier_df(ctx)
    want = ctx.tiers.frontier(101)
    assert fr["budget_bytes"].tolist() == [b for b, _ in want]
    assert fr["bound_abs"].tolist() == pytest.approx([v for _, v in want])
    norm = ctx.full_norm_estimate()
    assert fr["bound_rel"].tolist() == pytest.approx([v / norm for _, v in want])
    assert (np.diff(fr["bound_abs"]) <= 1e-12).all() and (np.diff(fr["budget_bytes"]) >= 0).all()
    # it differs from the exact-only curve: the compact tier lowers the bound at the same bytes
    off = views.plan_context(cat, "base", E[:2], "linear", compact="off")
    assert dash_plan.frontier_df(off)["budget_bytes"].tolist() == [b for b, _ in off.candidates.frontier(101)]
    plan = dash_plan.make_plan(ctx, 25)
    x, y = dash_plan.current_point(ctx, plan, relative=False)
    full = ctx.candidates.full_bytes
    assert x == pytest.approx(100 * (plan["estimate"]["expert_read"] + plan["estimate"]["compact_read"]) / full)
    bound = plan["error_bound"]
    assert y == pytest.approx(bound.get("additive", bound["absolute"]))  # the curve's (additive) bound
    assert dash_plan.current_point(ctx, plan, relative=True)[1] == pytest.approx(y / norm)
    v = views.plan_view(ctx, budget_pct=25)
    assert v.frontier.data[-1].x[0] == pytest.approx(x) and v.frontier.data[-1].y[0] == pytest.approx(y / norm)
    assert list(v.tiers.columns)[0] == "tier"
    if bound.get("additive") is not None and bound["additive"] != bound["absolute"]:
        assert v.frontier.layout.yaxis.title.text.startswith("relative additive bound")


def test_budget_suggestion(cat):
    for mode in ("auto", "off"):
        ctx = views.plan_context(cat, "base", E, "linear", compact=mode)
        plan = dash_plan.make_plan(ctx, 25)
        s = plan["suggested_budget"]
        sug = dash_plan.budget_suggestion(plan)
        assert sug["pct"] == math.ceil(100 * s["fraction_of_full"] - 1e-9) and 1 <= sug["pct"] <= 100
        assert sug["text"].startswith(f"Suggested: {sug['pct']} % ({views.fmt_bytes(s['bytes'])})")
        assert f"<= {s['bound_fraction']:g} x the update's norm" in sug["text"]
        assert "measured" in sug["text"] and "not a guarantee" in sug["text"]
        # the slider's whole percentage keeps the rule: its plan's budget holds the suggested bytes
        assert dash_plan.make_plan(ctx, sug["pct"])["budget"]["bytes"] >= s["bytes"]
    ties = dash_plan.make_plan(views.plan_context(cat, "base", E, "ties", density=0.3), 25)
    assert (dash_plan.budget_suggestion(ties) is None) == (ties.data.get("suggested_budget") is None)
    assert dash_plan.budget_suggestion({"suggested_budget": None}) is None


def test_bound_parts_label_each_key():
    assert dash_formatting.bound_parts(None) == []
    b = {"absolute": 0.5, "relative": 0.25, "additive": 2.0, "additive_relative": 1.0, "blockwise": 0.5,
         "blockwise_relative": 0.25, "full_delta_norm": 2.0}
    assert dash_formatting.bound_parts(b) == ["absolute (blockwise) 0.5 (relative 0.25)", "additive 2 (relative 1)"]
    assert dash_formatting.bound_parts({**b, "kind": "blockwise"}) == dash_formatting.bound_parts(b)
    assert dash_formatting.bound_parts({**b, "absolute": 2.0, "relative": 1.0, "kind": "additive"}) == [
        "absolute (additive) 2 (relative 1)", "blockwise (disjoint blocks) 0.5 (relative 0.25)"]
    old = {"absolute": 2.0, "relative": 1.0, "blockwise": 0.5, "blockwise_relative": 0.25, "full_delta_norm": 2.0}
    assert dash_formatting.bound_parts(old) == ["absolute 2 (relative 1)", "blockwise (disjoint blocks) 0.5 (relative 0.25)"]


# --- the page (AppTest) -------------------------------------------------------------------------------------
@pytest.fixture
def env(built, tmp_path, monkeypatch):
    db = copy_with_compacts(built, tmp_path / "page")
    monkeypatch.setenv("MERGEPIPE_DB", str(db))
    monkeypatch.setenv("MERGEPIPE_ALLOWED_ROOTS", f"{built}:{tmp_path}")
    return {"db": db}


def chart(at, key: str) -> dict:
    for el in at.get("plotly_chart"):
        if el.proto.id and key in el.proto.id:
            return json.loads(el.proto.spec)
    raise AssertionError(f"no chart {key}")


def z_of(spec) -> np.ndarray:
    import base64
    z = spec["data"][0]["z"]
    if isinstance(z, dict) and "bdata" in z:
        a = np.frombuffer(base64.b64decode(z["bdata"]), dtype=np.dtype(z["dtype"]))
        return a.reshape([int(n) for n in str(z["shape"]).split(",")]).astype(np.float64)
    return np.array(z, dtype=np.float64)


def tier_table(at):
    tables = [d.value for d in at.dataframe if "tier" in d.value.columns]
    assert len(tables) == 1
    return tables[0]


def test_plan_page_shows_the_compact_tier(env):
    at = open_page("plan")
    at.multiselect(key="experts").set_value(E[:2]).run()
    assert not at.exception
    assert at.selectbox(key="compact").options == ["auto (as stored)", "off (exact or omitted)", "sign1", "q2", "q4",
                                                    "progressive"]
    assert at.selectbox(key="compact").value == "auto"
    cat = Catalog(env["db"])
    try:
        ctx = views.plan_context(cat, "base", E[:2], "linear")
        plan = dash_plan.make_plan(ctx, 25)
        want_table = dash_plan.tiers_table(plan, ctx)
    finally:
        cat.close()
    # the mask: a legend naming the third state (by bits), and exactly the plan's blocks in each state
    spec = chart(at, "mask_chart")
    legend = [d.get("name") for d in spec["data"][1:]]
    for bits in (1, 2, 4):
        assert dash_plan.COMPACT_STATES[bits][1] in legend
    assert "read exactly" in legend and "omitted (changed, left out by the budget)" in legend
    z = z_of(spec)
    want = expected_counts(plan)
    assert int((z == 1.0).sum()) == want["exact"] and int((z == 0.5).sum()) == want["omitted"]
    for bits, (value, _, _) in dash_plan.COMPACT_STATES.items():
        assert int(np.isclose(z, value, atol=1e-6).sum()) == want["compact"][str(bits)]
    assert sum(want["compact"].values()) > 0
    # the tier summary
    got = tier_table(at)
    assert got.reset_index(drop=True).astype(str).equals(want_table.reset_index(drop=True).astype(str))
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Compact-tier read"] == views.fmt_bytes(plan["estimate"]["compact_read"])
    # the compact setting flows into the request: off plans exact-or-omitted, the mask has three states
    at.selectbox(key="compact").set_value("off").run()
    assert not at.exception
    spec = chart(at, "mask_chart")
    assert [d.get("name") for d in spec["data"][1:]] == [label for _, label, _ in reversed(dash_plan.MASK_STATES)]
    got = tier_table(at).set_index("tier")
    assert got.at["compact tier (total)", "blocks"] == 0
    cat = Catalog(env["db"])
    try:
        off = dash_plan.make_plan(views.plan_context(cat, "base", E[:2], "linear", compact="off"), 25)
    finally:
        cat.close()
    assert got.at["exact", "blocks"] == off["tiers"]["exact"]["blocks"]
    read = {m.label: m.value for m in at.metric}["Estimated expert read"]
    assert read == views.fmt_bytes(off["estimate"]["expert_read"])


def test_plan_page_compact_note(env):
    at = open_page("plan")
    at.multiselect(key="experts").set_value(E).run()
    at.selectbox(key="strategy").set_value("random").run()
    assert not at.exception
    assert any(i.value.startswith("compact tier not used: the random strategy") for i in at.info)
    assert tier_table(at).set_index("tier").at["compact tier (total)", "blocks"] == 0


def test_plan_page_suggestion_beside_the_slider(env):
    at = open_page("plan")
    at.multiselect(key="experts").set_value(E[:2]).run()
    cat = Catalog(env["db"])
    try:
        sug = dash_plan.budget_suggestion(dash_plan.make_plan(views.plan_context(cat, "base", E[:2], "linear"), 25))
    finally:
        cat.close()
    assert sug is not None
    # in the settings column, with the slider (not only inside EXPLAIN)
    settings = at.columns[0]
    assert settings.slider(key="budget").value == 25
    assert sug["text"] in [c.value for c in settings.caption]
    button = settings.button(key="use_suggested")
    assert button.label == f"Use {sug['pct']} %" and not button.disabled
    button.click().run()
    assert not at.exception
    assert at.slider(key="budget").value == sug["pct"]
    assert at.button(key="use_suggested").disabled  # the slider is there now
    cat = Catalog(env["db"])
    try:
        want = views.plan_summary(dash_plan.make_plan(views.plan_context(cat, "base", E[:2], "linear"), sug["pct"]))
    finally:
        cat.close()
    assert {m.label: m.value for m in at.metric}["Estimated expert read"] == want["expert_read"]
    # a catalog without compacts for the chosen experts: no compact control, no tier table, still a suggestion
    at.multiselect(key="experts").set_value([PLAIN]).run()
    assert not at.exception
    assert not [s for s in at.selectbox if s.key == "compact"]
    assert not [d for d in at.dataframe if "tier" in d.value.columns]
    assert any(c.value.startswith("Suggested: ") for c in at.columns[0].caption)
