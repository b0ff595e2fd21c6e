"""The Hugging Face Hub side of the API: preflight (what merging a config will meet, from headers only, before
any weight byte moves) and where a bare repo id (``org/name[@revision][/subfolder]``) is read from.

Nothing here imports torch until a call needs it (``mergepipe --help`` stays light)."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.errors import MergePipeError
from mergepipe.units import human_bytes


class PreflightError(MergePipeError):
    """A merge refused by its preflight: ``details`` holds one line per problem (as `mergepipe preflight`
    prints them)."""


def _config(config, source: str | None):
    """A MergekitConfig from one, from YAML text/bytes (with ``source``), or from a YAML file's path."""
    from mergepipe.config.model import MergekitConfig
    from mergepipe.config.parse import load_config, parse_config
    if isinstance(config, MergekitConfig):
        return config
    if isinstance(config, bytes) or source is not None:
        return parse_config(config, source or "the config")
    return load_config(config)


@contextmanager
def _catalog(catalog: Catalog | str | Path | None):
    """The catalog preflight reads: the one given, one at a path (read-only), or an empty one (no catalog:
    every reference is a path, a URI or a repo id)."""
    if isinstance(catalog, Catalog):
        yield catalog
        return
    if catalog is not None and Path(catalog).exists():
        cat = Catalog(catalog, create=False, read_only=True)
        try:
            yield cat
        finally:
            cat.close()
        return
    with tempfile.TemporaryDirectory(prefix="mergepipe-preflight-") as folder:
        cat = Catalog(Path(folder) / "empty.sqlite")
        try:
            yield cat
        finally:
            cat.close()


def preflight(config, catalog: Catalog | str | Path | None = None, source: str | None = None, budget=None,
              check_path=None):
    """What merging ``config`` will meet, from every model's index, headers and config.json only (a
    :class:`mergepipe.config.preflight.Preflight`: ``ok``, ``problems`` one line each, ``inputs``,
    ``output``, ``estimate``, ``transferred``; :func:`preflight_table` gives its rows, :func:`preflight_dict`
    all of it).

    ``config``: a MergekitConfig, YAML text or bytes (name it with ``source``), or a YAML file's path;
    ``catalog``: a Catalog or a catalog path (read only; none: an empty one); ``budget`` replaces the
    config's; ``check_path`` vets a local path before it is read (the dashboard's allowed folders).
    Changes nothing stored."""
    from mergepipe.config.preflight import preflight as run
    cfg = _config(config, source)
    if budget is not None:
        cfg = cfg.with_overrides(budget=budget)
    with _catalog(catalog) as cat:
        return run(cat, cfg, check_path=check_path)


def preflight_table(result) -> list[dict]:
    """The preflight table: one row per model (model, role, from, tensors, params, dtype, vocab, lm_head,
    vs base, bytes, fetched)."""
    from mergepipe.config.preflight_estimate import table_rows
    return table_rows(result)


def preflight_dict(result) -> dict:
    """A preflight's outcome as plain data (what `mergepipe --json preflight` prints)."""
    return {"source": result.source, "method": result.method, "ok": result.ok, "problems": result.problems,
            "notes": result.notes, "models": preflight_table(result), "output": result.output,
            "estimate": result.estimate, "transferred": result.transferred}


def _seconds(s: float) -> str:
    return f"~{s:.3g} s" if s < 100 else f"~{s / 60:.3g} min"


def preflight_summary(result) -> list[str]:
    """What the merge will meet, in lines below the preflight table (the CLI's and the Plan page's): the output,
    the tokenizer, bytes to read and transfer with the time they take, peak memory, and the bytes preflight moved."""
    o, e = result.output, result.estimate
    lines = []
    if o:
        grow = f", +{o['growth']:,} over the base's" if o["growth"] else " (the base's)"
        lines.append(f"output     {o['tensors']} tensors, {o['params']:,} parameters{grow}; head: {o['head']}")
        lines.append(f"tokenizer  {o['tokenizer']}")
    if e:
        full = e["full"]
        lines.append(f"read       full merge {human_bytes(full['read'])} (base {human_bytes(full['read'] - full['expert'])}"
                     f", experts {human_bytes(full['expert'])}), transfer {human_bytes(full['transfer'])}, "
                     f"{_seconds(full['seconds'])}")
        if e.get("budgeted") and e["budgeted"]["expert"] < e["full_expert_bytes"]:
            b = e["budgeted"]
            lines.append(f"budget     {e['budget']}: read <= {human_bytes(b['read'])} (experts "
                         f"{human_bytes(b['expert'])}), transfer <= {human_bytes(b['transfer'])}, "
                         f"{_seconds(b['seconds'])}")
        elif e.get("budget") is None:
            lines.append("budget     a target bound: the bytes it reads depend on the statistics ANALYZE stores")
        lines.append(f"memory     peak ~{human_bytes(e['peak_memory'])} of merge buffers (plus the process)")
    lines.append(f"preflight transferred {result.transferred:,} bytes (indexes, headers and configs only)")
    return lines


def preflight_gate(config, catalog: Catalog | str | Path | None = None) -> None:
    """The preflight at the start of `plan`/`merge --config`: a PreflightError (``details``: one line per
    problem) when the merge would meet a problem. A model that cannot be found or opened is left to the merge
    itself, which reports it as it always has."""
    try:
        result = preflight(config, catalog)
    except MergePipeError:
        return
    if result.ok or not result.resolved:
        return
    n = len(result.problems)
    err = PreflightError(f"preflight found {n} problem{'s' if n > 1 else ''} the merge would meet, nothing was "
                         f"registered or read beyond headers; the first: {result.problems[0]}")
    err.details = list(result.problems)
    raise err


def names_a_model(text: str) -> bool:
    """Whether ``text`` names a model outside the catalog: an existing path, a remote URI or a Hub repo id."""
    from mergepipe.storage.hub_ids import exists_locally, parse_hub_id
    from mergepipe.storage.registry import scheme_of
    return scheme_of(text) is not None or exists_locally(text) or parse_hub_id(text) is not None


def register_references(catalog: Catalog, base: str, experts) -> tuple[str, list[str]]:
    """Catalog ids for a base and experts named by catalog id, path, remote URI or Hub repo id (a sweep's): the
    names not registered yet are resolved as a config's models are (config/references.py: the local Hugging Face
    cache, then ``hf://`` at the revision's commit) and registered. Call inside the catalog transaction that also
    plans, so that a refusal keeps none of them."""
    import json
    names = [base, *experts]
    if all(not isinstance(n, str) or catalog.has_model(n) for n in names):
        return base, list(experts)
    from mergepipe.config.parse import parse_config
    from mergepipe.config.resolve import apply, prepare
    cfg = parse_config(json.dumps({"merge_method": "linear", "base_model": base,
                                   "models": [{"model": e} for e in experts]}), "the base and experts")
    resolved = prepare(catalog, cfg)
    apply(catalog, resolved)
    return resolved.base, [resolved.ids[e] for e in experts]


def hub_location(text: str) -> dict | None:
    """Where a bare Hub repo id is read from: ``{repo, revision, subfolder, uri, commit, cached}``
    (cached: a snapshot in the local Hugging Face cache, read locally; else ``hf://`` range reads); None
    when ``text`` is no repo id. Raises with HF_HUB_OFFLINE set and nothing cached."""
    from mergepipe.storage.hub_ids import locate
    found = locate(text)
    if found is None:
        return None
    return {"repo": found.hub.repo, "revision": found.hub.rev, "subfolder": found.hub.subfolder, "uri": found.uri,
            "commit": found.commit, "cached": found.cached}


def hub_origin(uri: str) -> dict | None:
    """``{repo, revision, subfolder}`` of a registered location that came from the Hub (an ``hf://`` URI or
    a Hugging Face cache snapshot folder, whose revision is its commit); None otherwise."""
    from mergepipe.storage.hub_ids import hub_origin as origin
    found = origin(uri)
    return None if found is None else {"repo": found.repo, "revision": found.rev, "subfolder": found.subfolder}


# --- publishing a snapshot to the Hub, and reproducing one (api/publishing.py, api/reproduction.py) -----------
def publish_to_hub(catalog: Catalog | None, ref: str, target: str, private: bool = False, create_pr: bool = False,
                   progress=None) -> dict:
    """Publish snapshot ``ref`` (snapshot id, model id or folder) to ``hf://org/name[@branch]``: the files that
    differ from the branch's in one commit (or a pull request), a Hub model card as README.md, then every file
    re-hashed by range requests against the manifest. See :func:`mergepipe.api.publishing.publish_to_hub`."""
    from mergepipe.api.publishing import publish_to_hub as publish
    return publish(catalog, ref, target, private=private, create_pr=create_pr, progress=progress)


def hub_card_text(catalog: Catalog | None, ref: str, target: str) -> str:
    """The README.md :func:`publish_to_hub` would publish snapshot ``ref`` to ``target`` with."""
    from mergepipe.api.publishing import hub_card_text as card
    return card(catalog, ref, target)


def reproduce(catalog: Catalog | None, source: str, progress=None, work_dir=None) -> dict:
    """Re-run a published snapshot (a folder or ``hf://org/name[@revision]``) from its card and manifest and
    compare: ``ok`` (bit for bit), else ``first_difference`` names the first differing tensor and why. The
    catalog is only read (inputs found by fingerprint). See :func:`mergepipe.api.reproduction.reproduce`."""
    from mergepipe.api.reproduction import reproduce as run
    return run(catalog, source, progress=progress, work_dir=work_dir)
