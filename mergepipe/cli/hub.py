"""Hugging Face Hub commands: preflight (a merge config checked from headers only, before any weight byte moves).

``mergepipe preflight --config merge.yml`` prints one table (a row per model) and what the merge will meet:
the output's contents, the tokenizer, bytes to read and transfer, peak memory and time; then one
``problem:`` line per problem. Exit 0 when the merge will run, 1 otherwise. `plan --config` and
`merge --config` run the same checks first (:func:`preflight_gate`) and refuse with the same lines.

``mergepipe publish SNAP hf://org/name[@branch]`` commits a snapshot to the Hub (api/publishing.py);
``mergepipe reproduce DIR|hf://org/name[@rev]`` re-runs a published one and compares (api/reproduction.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mergepipe import api
from mergepipe.cli.common import command, emit, progress_bar, table
from mergepipe.errors import MergePipeError

COLUMNS = ["model", "role", "from", "tensors", "params", "dtype", "vocab", "lm_head", "vs base", "bytes", "fetched"]


def _add_preflight(p):
    p.add_argument("--config", required=True, help="a mergekit YAML config (models as catalog ids, paths, remote "
                                                   "URIs or Hugging Face repo ids: org/name[@revision])")
    p.add_argument("--budget", help="expert-read budget to estimate with (default: the config's, else 100%%)")
    p.add_argument("--wide", action="store_true", help="show every column at its full width")


def print_problems(problems: list[str], stream=None) -> None:
    for p in problems:
        print(f"problem: {p}", file=stream or sys.stdout)


@command("preflight", "check a merge config from headers only, before any weight byte moves (exit 1 on problems)",
         arguments=_add_preflight)
def cmd_preflight(args):
    db = Path(args.db)
    result = api.preflight(args.config, db if db.exists() else None, budget=args.budget)
    if args.json:
        emit(args, api.preflight_dict(result))
        return 0 if result.ok else 1
    print(f"preflight of {result.source}: {result.method}")
    table(api.preflight_table(result), COLUMNS, keep=("model",), show_all=args.wide)
    for line in api.preflight_summary(result):
        print(line)
    for note in result.notes:
        print(f"note: {note}")
    print_problems(result.problems)
    print("the merge will run" if result.ok else
          f"{len(result.problems)} problem{'s' if len(result.problems) > 1 else ''}: the merge would not run")
    return 0 if result.ok else 1


def preflight_gate(cfg, db: str | Path) -> None:
    """The preflight at the start of `plan`/`merge --config`: its problem lines on standard error, then the
    refusal (one ``error:`` line) before anything is registered."""
    try:
        api.preflight_gate(cfg, db)
    except MergePipeError as exc:
        print_problems(getattr(exc, "details", None) or (), sys.stderr)
        raise


# --- publish and reproduce ------------------------------------------------------------------------------------
def _add_publish(p):
    p.add_argument("snapshot", help="snapshot id, merged model id or snapshot folder")
    p.add_argument("target", metavar="hf://org/name[@branch]", help="the Hub repository (and branch; default main)")
    p.add_argument("--private", action="store_true", help="create the repository private (when it does not exist)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing to the branch")


def _read_catalog(args):
    """The catalog at --db, read only, or None when there is none."""
    return api.Catalog(args.db, create=False, read_only=True) if Path(args.db).exists() else None


def publish_text(r: dict) -> str:
    where = r["pr_url"] or f"{r['uri']} at commit {r['commit'][:12]}"
    sent = (f"uploaded {len(r['uploaded'])} files ({api.human_bytes(r['uploaded_bytes'])})" if r["created_commit"]
            else "nothing changed, no commit")
    return (f"published {r['snapshot_id']} to {where}: {sent}, {len(r['unchanged'])} unchanged"
            + (f", {len(r['deleted'])} stale weight files deleted" if r["deleted"] else "")
            + f"; {r['verified']} files verified by range reads")


@command("publish", "publish a snapshot to the Hugging Face Hub (changed files only, a model card, verified by "
                    "range reads)", arguments=_add_publish)
def cmd_publish(args):
    cat = _read_catalog(args)
    if cat is None and not Path(args.snapshot).is_dir():
        raise MergePipeError(f"no catalog at {args.db}: name the snapshot by its folder, or give --db")
    prog, cb = progress_bar("publish")
    with prog:
        res = api.publish_to_hub(cat, args.snapshot, args.target, private=args.private, create_pr=args.create_pr,
                                 progress=cb)
    emit(args, res, lambda r: print(publish_text(r)))


def _add_reproduce(p):
    p.add_argument("source", metavar="DIR|hf://org/name[@rev]", help="a snapshot folder or a published repository")
    p.add_argument("--work-dir", help="folder for the reproduction's temporary merge (default: the system's)")


@command("reproduce", "re-run a published snapshot's recipe: reproduced bit for bit, or the first differing "
                      "tensor and why (exit 1)", arguments=_add_reproduce)
def cmd_reproduce(args):
    cat = _read_catalog(args)
    prog, cb = progress_bar("reproduce")
    with prog:
        res = api.reproduce(cat, args.source, progress=cb, work_dir=args.work_dir)
    emit(args, res, lambda r: print("\n".join([r["message"], *(f"  {i['role']} {i['id']}: {i['uri']} ({i['found']})"
                                                                 for i in r["inputs"])])))
    return 0 if res["ok"] else 1


def spelled_config(args):
    """The config `plan`/`merge --base B --experts E ...` spell when a model they name is not a catalog id but a
    Hub repo id, a path or a remote URI (resolved and registered as a config's are); None when every name is
    registered (or some name is none of these: the plan then says it is unknown, as before)."""
    if args.config is not None or not args.base or not args.experts:
        return None
    refs = [args.base, *args.experts]
    if not any(api.names_a_model(r) for r in refs):  # catalog ids only: the catalog is not even opened here
        return None
    db = Path(args.db)
    if db.exists():
        cat = api.Catalog(db, create=False)
        try:
            refs = [r for r in refs if not cat.has_model(r)]
        finally:
            cat.close()
    if not refs or not all(api.names_a_model(r) for r in refs):
        return None
    text = json.dumps({"merge_method": args.op or "linear", "base_model": args.base,
                       "models": [{"model": e} for e in args.experts]})
    return api.parse_config(text, "--base/--experts")
