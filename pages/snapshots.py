"""Snapshots: the published merges, each one's manifest (summary and raw JSON), estimated vs realized
bytes per expert and per tensor, the touched blocks, a verify button, and publishing to the Hugging Face Hub."""

import streamlit as st

from mergepipe.dashboard import snapshots as snaps, views
from mergepipe.api import delete_snapshot, launch_evaluate, publish_to_hub, set_snapshot_labels, verify
from pages import _nav, _ui as ui

_nav.through_app()

st.title("Snapshots")


def pick_row():
    rows = st.session_state["snap_table"].selection.rows
    ids = st.session_state.get("_snap_ids", [])
    if rows and rows[0] < len(ids):
        st.session_state["snapshot"] = ids[rows[0]]


def do_verify(snapshot_id: str):
    res = ui.action(ui.with_catalog, verify, snapshot_id)
    if res is not None:
        ui.flash("success" if res["ok"] else "error", views.verify_text(res))


def do_publish(snapshot_id: str):
    """Publish to the Hub now, with a progress bar; a refusal or failure is one error line."""
    s = st.session_state
    bar = st.progress(0.0, text=f"publishing {snapshot_id}")

    def progress(stage, done, total):
        bar.progress(*snaps.publish_progress(stage, done, total))

    with ui.user_errors():
        target = snaps.hub_target(s.get("hub_repo", ""))
        res = ui.with_catalog(publish_to_hub, snapshot_id, target, private=bool(s.get("hub_private")),
                              create_pr=bool(s.get("hub_pr")), progress=progress)
        bar.progress(1.0, text="published and verified")
        st.success(snaps.publish_summary(res))
        return
    bar.empty()


def do_save_labels(snapshot_id: str):
    s = st.session_state
    tags = views.parse_tags(s.get("snap_tags", ""))
    if ui.action(ui.with_catalog, set_snapshot_labels, snapshot_id, tags, (s.get("snap_note") or "").strip()) is None:
        ui.flash("success", f"Saved the tags and note of {snapshot_id}.")


def do_delete(snapshot_id: str):
    s = st.session_state
    res = ui.action(ui.with_catalog, delete_snapshot, snapshot_id, force=bool(s.get("del_force")))
    if res:
        # show the newest remaining snapshot (and say so in the URL, which still names the deleted one)
        left = ui.with_catalog(views.snapshots_df)["snapshot"].tolist()
        if left:
            s["snapshot"] = left[0]
        else:
            s.pop("snapshot", None)
        s["del_confirm"] = False
        ui.flash("success", f"Deleted {res['snapshot_id']} ({res['model_id']})"
                            + (f" and its folder {res['out']}." if res["removed_files"] else "."))


def do_evaluate(model_ids: list):
    s = st.session_state

    def fn(cat):
        text, tasks = views.evaluation_inputs(s.get("eval_text", ""), s.get("eval_tasks", ""), ui.roots())
        return launch_evaluate(ui.db(), cat, list(model_ids), text, views.log_dir(ui.db()), tasks_path=tasks)

    res = ui.action(ui.with_catalog, fn)
    if res:
        run_id, proc = res
        ui.keep_process(run_id, proc)
        s["eval_watch"] = run_id
        ui.flash("info", f"evaluate run {run_id} started for {', '.join(model_ids)}")


ui.reap()
ui.show_flash()
with ui.user_errors(), ui.catalog() as cat:
    df = views.snapshots_df(cat)
    if df.empty:
        st.info("No snapshots yet: launch a merge on the **Run** page.")
        st.stop()
    ids = df["snapshot"].tolist()
    st.session_state["_snap_ids"] = ids
    ui.table(df, hide_index=True, key="snap_table", on_select=pick_row, selection_mode="single-row")
    models = dict(zip(df["snapshot"], df["model"]))
    # no format_func: a selectbox bound to the URL matches ?snapshot= against the shown labels
    sid = st.selectbox("Snapshot", ids, key="snapshot", bind="query-params")
    st.caption(f"model {models.get(sid, '')}")
    view = ui.snapshot_view(ui.db(), views.stats_version(cat), sid)
    manifest = view.manifest

    left, right = st.columns([3, 2])
    with left:
        st.subheader("Manifest")
        ui.table(view.summary, hide_index=True, key="manifest_summary")
    with right:
        st.subheader("Verify")
        st.caption("Re-hash every output file against the manifest and the catalog.")
        st.button("Verify", on_click=do_verify, args=(sid,), key="verify")
        st.download_button("Download manifest JSON", view.manifest_json, file_name=f"{sid}.json",
                           mime="application/json", key="download")
        if view.recipe_error:
            st.error(view.recipe_error)
        else:
            st.download_button("Download the recipe (mergekit YAML)", view.recipe,
                               file_name=f"{sid}.yml", mime="application/x-yaml", key="download_recipe",
                               help="The same as `mergepipe explain SNAPSHOT --as-mergekit`: merging from it "
                                    "gives the same plan.")

    with st.expander("Publish to the Hub", key="hub_expander"):
        st.caption("Commits the files that differ from the branch's (weights as LFS), with a model card "
                   "(base models, evaluations, the mergekit recipe, the manifest hash), then re-reads each file by "
                   "range requests. The token comes from HF_TOKEN or `hf auth login`.")
        st.text_input("Repository", key="hub_repo", placeholder="org/name or org/name@branch")
        c1, c2 = st.columns(2)
        c1.checkbox("Private (when it is created)", key="hub_private")
        c2.checkbox("Open a pull request", key="hub_pr")
        if st.button("Publish", key="hub_publish"):
            do_publish(sid)

    with st.expander("Tags and note", key="labels_expander"):
        if st.session_state.get("_labels_for") != sid:  # load the stored labels when the snapshot changes
            lab = views.labels_of(cat, sid)
            st.session_state["snap_tags"] = ", ".join(lab["tags"])
            st.session_state["snap_note"] = lab["note"]
            st.session_state["_labels_for"] = sid
        st.text_input("Tags (comma or space separated)", key="snap_tags", placeholder="e.g. best, ties, eval-me")
        st.text_area("Note", key="snap_note", height=80)
        st.button("Save tags and note", key="save_labels", on_click=do_save_labels, args=(sid,))

    card = views.model_card(manifest)
    with st.expander("Model card (README.md)", key="card_expander"):
        if card is None:
            st.caption("No model card: this snapshot was published before model cards, or its folder is gone.")
        else:
            front, body = card
            st.caption("Front matter: " + " · ".join(f"{k}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
                                                     for k, v in front.items()))
            st.markdown(body)

    with st.expander("Evaluate: perplexity on a held-out text, accuracy on a task suite (budget vs quality)",
                     key="eval_expander"):
        evals = views.evaluation_df(cat, manifest)
        line = views.budget_quality(manifest, evals)
        if line:
            st.success(line)
        todo = views.evaluation_models(cat, manifest)
        c1, c2 = st.columns(2)
        c1.text_input("Held-out text file (UTF-8): perplexity", key="eval_text",
                      help="Under an allowed folder: " + ", ".join(map(str, ui.roots())))
        c2.text_input("Task suite (JSONL): accuracy", key="eval_tasks",
                      help='One JSON object per line: {"task", "prompt", "answer"} (exact match of the greedy '
                           'answer) or {"task", "prompt", "choices": [...], "answer": index} (multiple choice, '
                           "the likeliest choice wins). Under an allowed folder.")
        st.button(f"Evaluate {len(todo)} models", key="evaluate", on_click=do_evaluate, args=(todo,),
                  help="The snapshot, its base and its full-checkpoint experts, in a separate process; results "
                       "are stored by model fingerprint and data hash, so a model already scored on this text "
                       "or suite is not scored again.")
        st.caption("Models: " + ", ".join(todo))
        last = views.latest_run(cat, "evaluate")
        running = bool(last) and views.run_progress(last)["running"]

        @st.fragment(run_every=1.0 if running else None)
        def evaluate_progress():
            with ui.user_errors(), ui.catalog() as c2:
                run = views.latest_run(c2, "evaluate")
                if not run:
                    return
                p = views.run_progress(run)
                st.progress(p["fraction"], text=f"evaluate run {p['id']} {p['status']}: {p['text']} "
                                                f"({p['elapsed_text']})")
                if p["status"] == "failed":
                    st.error(f"evaluate run {p['id']} failed: {p['error'] or 'the process died'}")
                if not p["running"] and st.session_state.get("eval_watch") == p["id"]:
                    st.session_state.pop("eval_watch")
                    st.rerun(scope="app")

        evaluate_progress()
        if not evals.empty:
            ui.table(evals, hide_index=True, key="eval_table")

    st.subheader("Estimated vs realized expert bytes")
    st.plotly_chart(view.by_expert, key="bytes_expert")
    by_tensor = view.by_tensor
    c1, c2, c3 = st.columns([2, 1, 1])
    search = c1.text_input("Find tensors", key="tensor_search", placeholder="e.g. layers.3 mlp (all words must match)")
    sort = c2.radio("Top tensors by", list(views.TENSOR_SORTS), key="tensor_sort", horizontal=True)
    n = c3.number_input("How many", min_value=1, max_value=200, value=20, step=5, key="tensor_top")
    top, matching = views.top_tensors(by_tensor, int(n), sort, search)
    if matching == 0:
        st.info(f"No tensor name contains {search!r}.")
    else:
        st.caption(f"{len(top)} of {matching} matching tensors ({len(by_tensor)} in all), largest {sort} first.")
        st.plotly_chart(views.bytes_bars(top, "tensor"), key="bytes_tensor")
        with st.expander("As a table"):
            ui.table(views.bytes_table(top), hide_index=True, key="bytes_tensor_table",
                     column_config={"tensor": st.column_config.TextColumn(width="large")})
    st.plotly_chart(view.touched, key="touched_chart")
    with st.expander("Raw manifest (JSON)"):
        st.json(manifest.to_dict(), expanded=2)

    with st.expander("Delete this snapshot", key="delete_expander"):
        d = views.delete_preview(cat, sid)
        st.write(f"Deletes **{d['snapshot_id']}** (model `{d['model_id']}`): "
                 + (f"its folder `{d['out']}` ({d['files']} files, {views.fmt_bytes(d['bytes'])})"
                    if d["exists"] else f"its catalog rows (the folder `{d['out']}` is already gone)")
                 + ", its manifest, tags, note and lineage edges. Its inputs stay.")
        if d["dependents"]:
            st.warning(f"Needed by {', '.join(d['dependents'])} (lineage): refused unless forced.")
            st.checkbox("Force: delete it anyway", key="del_force")
        confirmed = st.checkbox(f"Yes, delete {d['snapshot_id']} for good", key="del_confirm")
        st.button("Delete", key="delete", type="primary", on_click=do_delete, args=(sid,), disabled=not confirmed)
