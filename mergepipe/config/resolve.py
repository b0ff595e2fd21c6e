"""Resolve a parsed config against the catalog and plan it.

:func:`prepare` maps each model reference to a catalog model: a registered id is used as is; a path
is matched to a registered model by uri and fingerprint, or else registered under an id derived from
its folder name; ``BASE+ADAPTER`` registers a PEFT LoRA adapter against the base. It only looks;
:func:`plan_from_config` then applies the registrations and plans inside one catalog transaction, so
a config that fails anywhere before the merge starts leaves the catalog unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import check_unchanged, is_vocab_tensor, register
from mergepipe.config.model import ConfigError, MERGEKIT_DTYPE, MergekitConfig
from mergepipe.config import soup
from mergepipe.config.references import PathCheck, Resolved, _Resolver
from mergepipe.config.resolve_tokenizer import _tokenizer
from mergepipe.ops.core import get_op, resolve_params
from mergepipe.planner.context import Planner
from mergepipe.planner.plan import Plan
from mergepipe.storage.dtypes import dtype_label, split_dtypes
from mergepipe.storage.registry import open_checkpoint, scheme_of


def prepare(cat: Catalog, cfg: MergekitConfig, register_paths: bool = True, check_path: PathCheck | None = None,
            reserved_ids=()) -> Resolved:
    """Resolve every model reference of ``cfg`` against the catalog, changing nothing.

    ``register_paths=False`` refuses paths that are not registered yet (the dashboard's Plan page);
    ``check_path`` vets a path before it is read (the dashboard's allowed folders); ``reserved_ids``
    are ids a derived id must avoid (the merged model's)."""
    op = get_op(cfg.method)
    # a parameter every slice gives (t per slice, no merge-wide t) is checked when the slices expand
    holders = [h for sl in cfg.slices or () for h in (sl, *sl.sources)]
    holders += [h for m in cfg.modules or () for h in (m, *(x for sl in m.slices for x in (sl, *sl.sources)))]
    per_slice = {k: 0.0 for holder in holders for k in holder.params if k not in cfg.method_params and k != "scale"}
    resolve_params(op, normalize=cfg.normalize, rescale=cfg.rescale, lam=cfg.lam,
                            **{k: v for k, v in (("gamma", cfg.gamma), ("epsilon", cfg.epsilon)) if v is not None},
                            **{k: v for k, v in cfg.method_params.items() if not (cfg.slices and k == "scale")},
                            **{k: v for k, v in per_slice.items() if k not in ("weight", "density")})
    if cfg.base is None and not op.base_optional:  # e.g. a soup's config run with --op ties
        raise ConfigError(f"{cfg.source}: `base_model` is required by {op.name}: MergePipe stores experts as deltas "
                          f"against their base")
    r = _Resolver(cat, cfg, register_paths, check_path, reserved_ids)
    base_id, base_path = r.base()
    r.out.base, r.base_path = base_id, base_path
    _check_out_dtype(cat, cfg, base_id, base_path)
    models = cfg.models
    if cfg.base is None:  # a soup: the reference is the first model, averaged in with its own weight
        r.out.base_member = soup.member(models[0], 0, reference=True)
        r.out.ids[models[0].ref] = base_id
        models = models[1:]
    else:
        r.out.ids[cfg.base] = base_id
    for m in models:
        mid = r.expert(m, base_id, base_path)
        r.out.ids[m.ref] = base_id if mid is None else mid
        if mid is None:
            if op.whole_models:  # mergekit's linear averages a base_model listed among the models
                if r.out.base_member is not None:
                    raise ConfigError(f"{cfg.source}: {m.where}: the model {m.ref} is listed twice")
                r.out.base_member = soup.member(m, len(r.out.experts), reference=False)
            continue  # mergekit skips the base model in task-vector methods
        spec = {"model": mid}
        if m.weight is not None:
            spec["weight"] = m.weight
        if m.density is not None:
            spec["density"] = m.density
        spec.update(m.own)  # its own gamma/epsilon (they differ between models)
        r.out.experts.append(spec)
    if cfg.slices is not None or cfg.modules is not None:
        _expand_slices(r, base_id)
    elif not r.out.experts:
        raise ConfigError(f"{cfg.source}: `models:` lists no model other than the base" if cfg.base is not None else
                          f"{cfg.source}: `models:` lists one model: a soup without base_model averages two or more")
    r.out.tokenizer = _tokenizer(r, base_id, base_path)
    if cfg.modules is not None and (r.out.tokenizer or {}).get("vocab"):
        r.fail("tokenizer_source", "re-ordering the embedding rows to one vocabulary is not combined with "
                                   "`modules:` (the models have other vocabularies than the tokenizer source's)")
    if r.views:
        _use_views(r, base_id)
    return r.out


def _expand_slices(r: _Resolver, base_id: str) -> None:
    """A `slices:` config's layout and per-tensor settings (config/slices.py), from the models' tensors."""
    from mergepipe.config.slice_expand import expand, model_layers, read_config
    uris = {kw["model_id"]: kw["uri"] for kw in r.out.to_register}
    tensors, layers, configs = {}, {}, {}
    for mid in set(r.out.ids.values()):
        if r.cat.has_model(mid):
            shapes = {t["name"]: tuple(t["shape"]) for t in r.cat.tensors(mid)}
            config = json.loads(r.cat.model(mid)["config"] or "{}")
        else:
            shapes = {n: tuple(t.shape) for n, t in open_checkpoint(uris[mid]).tensors.items()}
            config = open_checkpoint(uris[mid]).config if scheme_of(uris[mid]) else read_config(Path(uris[mid]))
        tensors[mid], layers[mid], configs[mid] = shapes, model_layers(config, shapes), config
    kinds = {kw["model_id"]: kw["kind"] for kw in r.out.to_register}
    adapters = {mid for mid in tensors if (kinds.get(mid) or r.cat.model(mid)["kind"]) == "lora"}
    if get_op(r.cfg.method).copies and tensors.get(base_id):
        # passthrough over different vocabularies: a copied embedding tensor is re-ordered to the output
        # vocabulary's rows (config/vocab.py), so its row count may be another than the base's
        for shapes in tensors.values():
            for name, shape in list(shapes.items()):
                want = tensors[base_id].get(name)
                if (is_vocab_tensor(name) and want is not None and len(shape) == 2 == len(want)
                        and shape[1] == want[1] and shape[0] != want[0] and r.cfg.tokenizer_source is not None):
                    shapes[name] = want
    if r.cfg.modules is not None:  # a multi-module architecture's modules (config/modules.py), in place
        from mergepipe.config.modules import expand_modules
        ex = expand_modules(r.cfg, r.out.ids, base_id, tensors, configs[base_id])
        sources = r.cfg.modules[0].slices[0].sources
    else:
        ex = expand(r.cfg, r.out.ids, base_id, tensors, layers, adapters)
        sources = r.cfg.slices[0].sources
    r.out.layout, r.out.method_params = ex.layout, ex.method_params
    r.views = ex.views
    if get_op(r.cfg.method).whole_models:  # linear: the base is averaged in at its place among the sources
        first = [r.out.ids[s.ref] for s in sources]
        weight = ex.settings.get(base_id, {}).get("weight")
        r.out.base_member = {"weight": 1.0 if weight is None else weight, "position": first.index(base_id),
                             "reference": r.cfg.slices_reference}
    for spec in r.out.experts:
        spec.pop("weight", None)
        spec.pop("density", None)
        spec.update({k: v for k, v in ex.settings.get(spec["model"], {}).items() if v is not None})
    if not r.out.experts and not get_op(r.cfg.method).copies:
        raise ConfigError(f"{r.cfg.source}: `{'modules' if r.cfg.modules is not None else 'slices'}:` name no model "
                          f"other than the base")


def _use_views(r: _Resolver, base_id: str) -> None:
    """Each expert a `slices:` config merges at other layers than the base's is merged through its layer view
    (storage/views.py): registered against the base (once; reused while its files are unchanged) and analyzed
    like any expert, so the plan's statistics, budget and bound are the view's, per base tensor."""
    from mergepipe.storage.registry import canonical_uri
    from mergepipe.storage.views import map_text, view_uri
    if (r.out.tokenizer or {}).get("vocab"):
        r.fail("tokenizer_source", "re-ordering the embedding rows to one vocabulary is not combined with slice "
                                   "sources at other layers than the base's: give every source the base's "
                                   "layer_range, or drop tokenizer_source")
    pending = {kw["model_id"]: kw for kw in r.out.to_register}
    for spec in r.out.experts:
        mid = spec["model"]
        mapping = r.views.get(mid)
        if mapping is None:
            continue
        row = pending.get(mid) or r.cat.model(mid)
        kind, uri = row["kind"], row["uri"]  # full or delta: expand refuses an adapter at other layers
        uri = canonical_uri(view_uri(uri, mapping))
        rows = [x for x in r._rows_at(uri) if x["base_id"] == base_id and x["kind"] == kind]
        if rows:
            check_unchanged(rows[0])
            vid = rows[0]["id"]
        else:
            name = f"{mid}@" + "_".join(run.replace(":", "=") for run in map_text(mapping).split(","))
            vid, n = name, 2
            while vid in r.taken:
                vid, n = f"{name}-{n}", n + 1
            r.taken.add(vid)
            r.out.to_register.append({"model_id": vid, "uri": uri, "base_id": base_id, "kind": kind})
        spec["model"] = vid


def _check_out_dtype(cat: Catalog, cfg: MergekitConfig, base_id: str, base_path: Path | None) -> None:
    """mergekit writes out_dtype, or else dtype; so does MergePipe (the request's ``out_dtype``: each float
    output block is rounded once from float32 to it, planner/assembly.py records the conversion).

    The dtypes asked for apply to the float tensors: non-float buffers (a BERT's int64 ``position_ids``)
    are copied from the base as they are, by mergekit as by MergePipe; a base without a float tensor is
    refused (there is nothing to merge)."""
    want = cfg.out_dtype or cfg.dtype
    if want is None:
        return
    if cat.has_model(base_id):
        codes = [t["dtype"] for t in cat.tensors(base_id)]
    else:
        codes = [t.dtype for t in open_checkpoint(base_path).tensors.values()]
    floats, _ = split_dtypes(codes)
    if floats:
        return
    key = "out_dtype" if cfg.out_dtype else "dtype (which mergekit also uses as the output dtype)"
    raise ConfigError(f"{cfg.source}: {key}: {MERGEKIT_DTYPE.get(want, want)} cannot be honoured: the base "
                      f"({dtype_label(codes)}) holds no float tensor to merge")


def apply(cat: Catalog, resolved: Resolved) -> None:
    """Register what :func:`prepare` found missing (call inside a catalog transaction). Experts
    without statistics are analyzed by the merge itself, on the way (see inflight.py)."""
    for kw in resolved.to_register:
        register(cat, kw["model_id"], kw["uri"], base_id=kw["base_id"], kind=kw["kind"])


def plan_from_config(cat: Catalog, cfg: MergekitConfig, save: bool = True, reserved_ids=(),
                     register_paths: bool = True, check_path: PathCheck | None = None) -> tuple[Plan, Resolved]:
    """Resolve ``cfg`` (registering paths as needed) and plan it.

    Registration and planning share one catalog transaction: when either fails, no registration is
    kept. Experts without statistics are read in full and analyzed by the merge (the plan says so)."""
    resolved = prepare(cat, cfg, register_paths=register_paths, check_path=check_path, reserved_ids=reserved_ids)
    planner = Planner(cat)
    vocab = (resolved.tokenizer or {}).get("vocab")  # re-ordered rows: its experts are analyzed first
    if not resolved.pending and not get_op(cfg.method).nonlinear and resolved.layout is None and vocab is None:
        return planner.plan(resolved.request(), save=save), resolved
    with cat.transaction():
        apply(cat, resolved)
        plan = _plan_method(cat, planner, resolved, save)
    return plan, resolved


def _plan_method(cat: Catalog, planner: Planner, resolved: Resolved, save: bool) -> Plan:
    """Plan; an interpolation method whose experts lack statistics (not analyzed, or not analyzed together:
    no pairwise dot products) first analyzes its experts together (they need it before planning)."""
    from mergepipe.planner.methods import NeedsAnalysis
    try:
        return planner.plan(resolved.request(), save=save)
    except NeedsAnalysis:
        pass
    from mergepipe.analyze.runner import analyze
    method = resolved.config.method
    op = get_op(method)
    topk = resolved.request().params.get("select_topk", 1.0) if method == "sce" else 1.0
    analyze(cat, [e["model"] for e in resolved.experts], gram=op.nonlinear or resolved.layout is not None,
            arcee=method == "arcee_fusion", sce_topk=(topk,) if 0.0 < topk < 1.0 else ())
    return planner.plan(resolved.request(), save=save)

