"""Models: register checkpoints, see what is registered, run ANALYZE with live progress."""

import streamlit as st

from mergepipe.dashboard import views
from mergepipe.errors import MergePipeError
from mergepipe.api import launch_analyze, register
from pages import _nav, _ui as ui

_nav.through_app()

NO_BASE = "(none: this is a base model)"

st.title("Models")


def do_register():
    s = st.session_state

    def fn():
        path = views.check_path(s.get("reg_path", ""), ui.roots())
        model_id = (s.get("reg_id") or "").strip() or path.name
        base = s.get("reg_base")
        kind = s.get("reg_kind", "full")
        base = views.registration_base(kind, None if base in (None, NO_BASE) else base)
        res = ui.with_catalog(register, model_id, str(path), base_id=base, kind=kind)
        return res

    res = ui.action(fn)
    if res:
        ui.flash("success", f"{res['status']}: {res['model_id']} ({views.short_fp(res['fingerprint'])})")
        st.session_state["reg_id"] = ""


def do_analyze():
    s = st.session_state
    ids = list(s.get("an_models") or [])
    if not ids:
        ui.flash("error", "choose at least one expert to analyze")
        return

    def fn(cat):
        kib = int(s.get("an_kib") or 1024)
        if kib <= 0:
            raise MergePipeError("the block size must be positive")
        return launch_analyze(ui.db(), cat, ids, views.log_dir(ui.db()), block_bytes=kib * 1024)

    res = ui.action(ui.with_catalog, fn)
    if res:
        run_id, proc = res
        ui.keep_process(run_id, proc)
        s["analyze_watch"] = run_id
        ui.flash("info", f"analyze run {run_id} started for {', '.join(ids)}")


def open_model():
    rows = st.session_state["models_table"].selection.rows
    ids = st.session_state.get("_model_ids", [])
    if rows and rows[0] < len(ids):
        st.session_state["model"] = ids[rows[0]]


ui.reap()
ui.show_flash()
with ui.user_errors(), ui.catalog() as cat:
    df = views.models_df(cat)
    st.session_state["_model_ids"] = df["id"].tolist()

    left, right = st.columns(2)
    with left:
        st.subheader("Register a checkpoint")
        with st.form("register_form"):
            st.text_input("Checkpoint path (directory or .safetensors file)", key="reg_path",
                          help="For a LoRA adapter, its directory. Refused unless under an allowed folder: "
                               + ", ".join(map(str, ui.roots())))
            st.text_input("Model id (default: the folder's name)", key="reg_id")
            st.selectbox("Base", [NO_BASE, *views.bases(cat)], key="reg_base",
                         help="Required for experts, delta checkpoints and LoRA adapters.")
            st.selectbox("Kind", list(views.REGISTER_KINDS), key="reg_kind",
                         help="; ".join(f"{k}: {v}" for k, v in views.KIND_HELP.items()))
            st.form_submit_button("Register", on_click=do_register, type="primary")
    with right:
        st.subheader("Analyze")
        experts = [m for m in df.loc[df["role"] == "expert", "id"]]
        todo = views.unanalyzed_experts(cat)
        if "an_models" not in st.session_state or st.session_state["an_models"] == st.session_state.get("_an_todo"):
            st.session_state["an_models"] = todo  # follow the not-analyzed list until the user edits it
        st.session_state["_an_todo"] = todo
        st.session_state["an_models"] = [m for m in st.session_state["an_models"] if m in experts]
        st.multiselect("Experts to analyze", experts, key="an_models")
        if "an_kib" not in st.session_state:
            grids = [cat.grid_block_bytes(b) for b in views.bases(cat)]
            grid = next((g for g in grids if g), 1 << 20)
            st.session_state["an_kib"] = max(1, grid // 1024)
        st.number_input("Block size (KiB)", min_value=1, step=1, key="an_kib",
                        help="The block grid of the base: statistics, plans and reads use blocks of this size.")
        st.button("Analyze", on_click=do_analyze, key="analyze_btn", disabled=not experts)
        if todo:
            st.caption("Not analyzed yet: " + ", ".join(todo))

        last = views.latest_run(cat, "analyze")
        running = bool(last) and views.run_progress(last)["running"]

        @st.fragment(run_every=1.0 if running else None)
        def analyze_progress():
            with ui.user_errors(), ui.catalog() as c2:
                run = views.latest_run(c2, "analyze")
                if not run:
                    return
                p = views.run_progress(run)
                st.progress(p["fraction"], text=f"run {p['id']} {p['status']}: {p['text']} ({p['elapsed_text']})")
                if p["status"] == "failed":
                    st.error(f"analyze run {p['id']} failed: {p['error'] or 'the process died'}")
                if not p["running"] and st.session_state.get("analyze_watch") == p["id"]:
                    st.session_state.pop("analyze_watch")
                    st.rerun(scope="app")
                if p["running"] and st.session_state.get("analyze_watch") != p["id"]:
                    st.session_state["analyze_watch"] = p["id"]

        analyze_progress()

    for w in views.expert_warnings(cat):
        st.warning(w, icon=":material/warning:")
    st.subheader("Registered models")
    if df.empty:
        st.caption("No models registered yet.")
    else:
        ui.table(df.drop(columns=["bytes"]), hide_index=True, key="models_table", on_select=open_model,
                 selection_mode="single-row", column_config={"id": st.column_config.TextColumn(width="medium")})

    st.subheader("Details")
    model = st.selectbox("Model", df["id"].tolist(), index=None, key="model", bind="query-params",
                         placeholder="choose a model (or select a row above)")
    if model:
        d = views.model_details(cat, model)
        ui.table(d["summary"], hide_index=True, key="model_summary")
        if d["parents"]:
            st.write("Parents: " + ", ".join(f"{p['parent_id']} ({p['role']})" for p in d["parents"]))
        if d["children"]:
            st.write("Used by: " + ", ".join(d["children"]))
        if d["model"]["snapshot_id"]:
            st.page_link("pages/snapshots.py", label=f"Open the manifest of {d['model']['snapshot_id']}",
                         query_params={"snapshot": d["model"]["snapshot_id"]}, icon=":material/description:")
        with st.expander("config.json"):
            st.json(d["config"], expanded=False)
