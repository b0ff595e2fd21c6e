"""Plan: base, experts (with weights), operator and parameters; a budget slider that re-plans at once
(access mask, estimated I/O, error bound, frontier) or a target bound that finds the smallest budget; the
suggested budget beside the slider; with compact deltas in the catalog, the compact tier's setting, a
three-state access mask and the blocks and bytes per tier. Every setting is bound to the URL, so a plan view
can be shared as a link."""

import streamlit as st

from mergepipe.dashboard import views
from mergepipe.dashboard import preflight as dash_preflight
from mergepipe.api import STRATEGIES, save_plan
from mergepipe.errors import MergePipeError
from pages import _nav, _ui as ui

_nav.through_app()

TRI = {"default": None, "on": True, "off": False}

st.title("Plan")



def mask_rows(plan, view, key: str, budget, target, version: str):
    """With more experts than the mask draws at once: how many (the top by bytes read) and a search box over their
    ids, then the caption of what is drawn; the figure (None when the search matches nothing)."""
    n = len(plan.experts)
    if n <= views.MASK_TOP:
        return view.mask
    if not 1 <= int(st.session_state.get("mask_top", views.MASK_TOP)) <= n:
        st.session_state["mask_top"] = min(views.MASK_TOP, n)  # e.g. fewer experts than at the last draw
    c = st.columns([1, 2])
    top = c[0].slider("Experts in the mask", 1, n, views.MASK_TOP, key="mask_top",
                      help="The experts that read the most bytes, most first")
    search = c[1].text_input("Search experts", key="mask_search", placeholder="e.g. e1 or e1*",
                             help="A part of the expert id, or a pattern with * and ?")
    fig, note = ui.plan_mask(ui.db(), version, key, budget, target, top, search, view)
    st.caption(note)
    return fig

def reset_experts():
    for k in list(st.session_state):
        if k == "experts" or k.startswith("w_"):
            del st.session_state[k]


def load_mergekit():
    """Fill the settings from a mergekit YAML (an upload, else the typed path)."""
    s = st.session_state

    def fn(cat):
        upload = s.get("mk_upload")
        s.pop("_preflight", None)
        data, source = views.read_config_source(upload.getvalue() if upload is not None else None,
                                                s.get("mk_path"), ui.roots(),
                                                upload.name if upload is not None else None)
        # what the merge will meet (headers only), shown whether or not the page can take the settings
        s["_preflight"] = dash_preflight.config_preflight(cat, data, source, ui.roots())
        return source, views.mergekit_plan_settings(cat, data, source, ui.roots())

    res = ui.action(ui.with_catalog, fn)
    if res:
        source, settings = res
        s.update(settings)
        ui.flash("success", f"Loaded {source}: {settings['op']} of {', '.join(settings['experts'])} "
                            f"on {settings['base']}.")


def use_suggested(pct: int):
    """Move the budget slider to the suggested budget (the widgets follow on the next run)."""
    st.session_state["mode"] = "budget"
    st.session_state["budget"] = int(pct)


def start_target():
    """Switching to the target bound starts it at the bound of the plan shown (the plan stays the same)."""
    if st.session_state.get("mode") == "target bound":
        st.session_state["target"] = views.target_default(st.session_state.get("_plan_bound"))


def apply_yaml(key: str):
    """Apply the edited YAML to the settings (the widgets follow on the next run)."""
    s = st.session_state

    def fn(cat):
        return views.check_plan_yaml(cat, s.get(key, ""), ui.roots())

    res = ui.action(ui.with_catalog, fn)
    if res:
        settings, what = res
        for k in [k for k in s if k.startswith("w_")]:
            del s[k]
        s.update(settings)  # the YAML area is drawn again from the settings it now describes
        ui.flash("success", f"Applied the YAML: {what}.")


def show_preflight(pf):
    """The loaded config's preflight: its table, what the merge will meet, one error per problem."""
    if not pf:
        return
    with st.expander(dash_preflight.preflight_verdict(pf), expanded=True, key="preflight_expander"):
        ui.table(dash_preflight.preflight_frame(pf), hide_index=True, key="preflight_table")
        st.code("\n".join(pf["summary"] + [f"note: {n}" for n in pf["notes"]]), language=None)
        for problem in pf["problems"]:
            st.error(problem, icon=":material/block:")


ui.show_flash()
# What the URL asked for when the page loaded: a value the widgets cannot take is replaced (and said so).
if not st.session_state.get("_plan_url_seen"):
    st.session_state["_plan_url_given"] = st.query_params.to_dict()
    st.session_state["_plan_url_seen"] = True
with ui.user_errors(), ui.catalog() as cat:
    # compacts stored for analyzed experts change what a plan reads without changing their statistics
    version = views.stats_version(cat) + views.compacts_version(cat)
    bases = [b for b in views.bases(cat) if views.experts_of(cat, b)]
    if not bases:
        st.info("Nothing to plan yet: register a base and its experts on the **Models** page and analyze them.")
        st.stop()
    models = {m["id"]: m for m in cat.models()}
    show_preflight(st.session_state.get("_preflight"))
    settings, result = st.columns([1, 2], gap="large")
    with settings:
        base = st.selectbox("Base", bases, key="base", bind="query-params", on_change=reset_experts)
        analyzed = views.analyzed_experts(cat, base)
        options = [e for e in views.experts_of(cat, base) if not models[e]["snapshot_id"] or e in analyzed]
        experts = st.multiselect("Experts", options, key="experts", bind="query-params",
                                 format_func=lambda e: e if e in analyzed else f"{e} (not analyzed)",
                                 **ui.default("experts", default=analyzed))
        if experts:  # the chips above cut long names: the full list, wrapped
            st.caption(f"{len(experts)} expert{'s' if len(experts) != 1 else ''}: " + ", ".join(experts))
        op = st.selectbox("Operator", views.operators(), key="op", bind="query-params",
                          **ui.default("op", index=views.operators().index("linear")))
        info = views.op_info(op)
        # The operator's parameters, as it declares them (mergepipe/ops/): the ones only some operators
        # take here, the per-expert weights and the common ones in the expander.
        values = {}

        def widget(p, key=None, label=None):
            if p["kind"] == "bool":
                default = "on" if p["declared_default"] else "off"
                return TRI[st.selectbox(p["label"], list(TRI), key=p["key"], bind="query-params",
                                        help=f"default for {op}: {default}. {p['help']}")]
            key = key or p["key"]
            v = st.number_input(label or p["label"], min_value=p["min"], max_value=p["max"], step=p["step"],
                                format="%.2f" if p["step"] < 0.1 else None, key=key, bind="query-params",
                                help=p["help"], **ui.default(key, value=float(p["default"])))
            return round(v, p["decimals"]) if p["decimals"] is not None else v

        for p in info["params"]:
            if p["place"] == "main":
                values[p["key"]] = widget(p)
        modes = ["budget", "target bound"] if info["additive"] else ["budget"]
        mode = st.radio("Choose by", modes, key="mode", horizontal=True, bind="query-params", on_change=start_target)
        if mode == "budget":
            budget = st.slider("Expert-read budget (% of the changed expert bytes)", min_value=0, max_value=100,
                               step=1, format="%d%%", key="budget", bind="query-params",
                               **ui.default("budget", value=25))
            target = None
        else:
            target = st.number_input("Target relative error bound", min_value=0.0, step=0.01, format="%.3f",
                                     key="target", bind="query-params", help=views.TARGET_HELP,
                                     **ui.default("target", value=views.TARGET_TYPICAL))
            budget = None
        suggestion_slot = st.empty()  # the suggested budget, filled once the plan is made (beside the slider)
        # the compact tier (issue 27): shown only when some chosen expert has compact deltas in the catalog
        compact_modes = views.compact_options(cat, experts)
        compact = None
        if compact_modes:
            if st.session_state.get("compact") not in (None, *compact_modes):
                st.session_state["compact"] = "auto"  # e.g. a YAML's codec these compacts cannot serve
            compact = st.selectbox(
                "Compact tier", compact_modes, key="compact", bind="query-params",
                format_func=lambda m: {"auto": "auto (as stored)", "off": "off (exact or omitted)"}.get(m, m),
                help="Blocks the budget does not read exactly can be taken from the experts' compact deltas "
                     "(stored by `mergepipe analyze --compact`) instead of being left out; their bytes count "
                     "against the budget. " + " ".join(f"{m}: {views.compact_mode_help(m)}." for m in compact_modes))
        with st.expander("Weights and parameters"):
            weight = next((p for p in info["params"] if p["place"] == "weights"), None)  # slerp etc. take none
            weights = tuple(float(widget(weight, key=f"w_{e}", label=f"weight of {e}")) for e in experts) \
                if weight else ()
            for p in info["params"]:
                if p["place"] == "more":
                    values[p["key"]] = widget(p)
            seed = int(st.number_input("seed", step=1, key="seed", bind="query-params", **ui.default("seed", value=0)))
            strategy = st.selectbox("strategy", list(STRATEGIES), key="strategy", bind="query-params",
                                    help="norm: greedy by |c|*||delta|| per byte; conflict: also down-weights "
                                         "blocks whose signs conflict with the other experts")
        with st.expander("Load a mergekit YAML"):
            st.file_uploader("mergekit config", type=["yml", "yaml"], key="mk_upload",
                             help="The models must be registered already (the CLI's `merge --config` registers "
                                  "paths for you; the first merge analyzes them on the way).")
            st.text_input("... or its path", key="mk_path",
                          help="Under an allowed folder: " + ", ".join(map(str, ui.roots())))
            st.button("Load settings", key="mk_load", on_click=load_mergekit)
        ranges = {"budget": (0, 100), **{p["key"]: (p["min"], p["max"]) for p in info["params"]
                                          if p["kind"] == "float" and p["place"] != "weights"}}
        used = {k: st.session_state.get(k) for k in st.session_state.get("_plan_url_given", {})}
        for msg in views.url_replacements(st.session_state.pop("_plan_url_given", {}), used, ranges):
            st.warning(msg, icon=":material/link_off:")

    with result, ui.user_errors():
        request = views.plan_request(base, experts, op, weights=list(weights) or None, seed=seed, strategy=strategy,
                                     compact=compact, **values)
        key = views.request_key(request)
        ctx = ui.plan_context(ui.db(), version, key, request)
        view = ui.plan_view(ui.db(), version, key, budget, target, ctx)
        plan = view.plan
        st.session_state["_plan_bound"] = plan.error_bound  # where a switch to the target bound starts
        size = sum(models[e]["bytes"] or 0 for e in experts if e in models)
        s = views.plan_summary(plan, size)
        sug = view.suggestion
        if sug:
            with suggestion_slot.container():
                st.caption(sug["text"], help=sug["help"])
                at_it = budget is not None and int(budget) == sug["pct"]
                st.button(f"Use {sug['pct']} %", key="use_suggested", on_click=use_suggested, args=(sug["pct"],),
                          disabled=at_it, help="Set the budget slider to the suggested budget"
                          + (" (it is there)" if at_it else ""))
        if s["first_merge"]:
            st.info(s["first_merge"])
        for w in plan.warnings:
            st.warning(w, icon=":material/warning:")
        c = st.columns(2)
        c[0].metric("Estimated expert read", s["expert_read"], help=f"{s['expert_read_pct']} of {s['full_text']}")
        c[1].metric("Error bound", "n/a" if s["bound_abs"] is None else f"{s['bound_abs']:.4g}",
                    help=s["bound_why"] or "; ".join(s["bounds"]) or s["bound"])
        c = st.columns(2)
        c[0].metric("Base read", s["base_read"])
        c[1].metric("Write", s["write"])
        if compact_modes:
            c = st.columns(2)
            c[0].metric("Compact-tier read", s["compact_read"],
                        help="Bytes of the experts' compact deltas this plan reads (counted in the budget)")
            c[1].metric("Budget used (exact + compact)", s["budget_read_pct"], help=f"of {s['full_text']}")
            st.caption(f"Budget {s['budget']} · read {s['expert_read']} exactly + {s['compact_read']} compact = "
                       f"{s['budget_read_pct']} of {s['full_text']} · bounds: "
                       + ("n/a" if s["bound_why"] else "; ".join(s["bounds"]) or s["bound"]))
        else:
            st.caption(f"Budget {s['budget']} · read {s['expert_read']} = {s['expert_read_pct']} of {s['full_text']} "
                       f"· mask: {s['blocks']} · bound {'n/a' if s['bound_why'] else s['bound']}")
        if s["bound_why"]:
            st.caption(f"Error bound n/a: {s['bound_why']}.")
        if target is not None:
            st.success(f"Smallest budget for a relative bound <= {target:g}: {s['budget']}")
        if plan.compact_note:
            st.info(plan.compact_note, icon=":material/info:")
        if compact_modes and view.tiers is not None:
            st.caption("Per tier: blocks and estimated bytes (exact and compact bytes count against the budget; "
                       "omitted bytes are the exact bytes left unread)")
            ui.table(view.tiers, hide_index=True, key="plan_tiers", column_config={
            "est. bytes": st.column_config.TextColumn(help="bytes estimated by the plan"),
            "% of changed": st.column_config.TextColumn(help="share of the changed (delta != 0) expert bytes, "
                                                             "what the budget percentage is a share of")})
        mask_fig = mask_rows(plan, view, key, budget, target, version)
        if mask_fig is not None:
            st.plotly_chart(mask_fig, key="mask_chart")
        st.plotly_chart(view.frontier, key="frontier_chart")
        ui.table(views.plan_experts_table(plan), hide_index=True, key="plan_experts",
                 column_config={"expert": st.column_config.TextColumn(width="large")})
        if st.button("Save plan", type="primary", key="save_plan"):
            save_plan(cat, plan)
            st.success(f"Saved {plan.id}.")
            st.page_link("pages/run.py", label=f"Run {plan.id}", query_params={"plan": plan.id},
                         icon=":material/play_circle:")
        with st.expander("EXPLAIN"):
            st.code(view.explain, language=None)
        with st.expander("Settings as mergekit YAML (edit, apply, download)", key="yaml_expander"):
            generated = views.plan_yaml(cat, plan)
            # keyed by what it shows: an edit lasts while the settings stay; new settings draw a fresh area
            yaml_key = "yaml_" + views.request_key_digest(generated)
            text = st.text_area("mergekit YAML (the `mergepipe:` key holds budget, strategy and seed)",
                                value=generated, key=yaml_key, height=380)
            edited = text != generated
            valid = False
            if not edited:  # no need to resolve the models again on every slider step
                st.caption("The current settings: edit them here (checked on every change), then apply; or "
                           "download them.")
            else:
                try:
                    _, what = views.check_plan_yaml(cat, text, ui.roots())
                except MergePipeError as exc:
                    st.error(f"Not valid: {exc}", icon=":material/error:")
                else:
                    st.success(f"Valid: {what}.")
                    valid = True
            c1, c2 = st.columns(2)
            c1.button("Apply to the settings", key="yaml_apply", on_click=apply_yaml, args=(yaml_key,),
                      disabled=not (valid and edited), type="primary")
            c2.download_button("Download YAML", text, file_name=f"{plan.id}.yml", mime="application/x-yaml",
                               key="yaml_download")
