"""Resolve a parsed config against the catalog and plan it.

:func:`prepare` maps each model reference to a catalog model: a registered id is used as is; a path
is matched to a registered model by uri and fingerprint, or else registered under an id derived from
its folder name; ``BASE+ADAPTER`` registers a PEFT LoRA adapter against the base. It only looks;
:func:`plan_from_config` then applies the registrations and plans inside one catalog transaction, so
a config that fails anywhere before the merge starts leaves the catalog unchanged."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import check_unchanged, is_vocab_tensor, model_ids, models_at, register
from mergepipe.config.model import ConfigError, ConfigModel, MERGEKIT_DTYPE, MergekitConfig
from mergepipe.config import soup
from mergepipe.config.parse_values import _exists
from mergepipe.config.templates import CHAT_TEMPLATES
from mergepipe.config.vocab import VocabRefusal, needs_vocab, row_model_order, vocab_setting
from mergepipe.errors import MergePipeError, brief
from mergepipe.ops.core import get_op, resolve_params
from mergepipe.planner.context import Planner
from mergepipe.planner.plan import Plan
from mergepipe.planner.request import MergeRequest
from mergepipe.storage.dtypes import dtype_label, split_dtypes
from mergepipe.storage.registry import canonical_uri, open_checkpoint, scheme_of, tokenizer_folder
from mergepipe.storage.uris import RemoteRoot, remote_model_name
from mergepipe.storage.tokenizer_files import has_tokenizer, read_chat_template, vocabulary

REMOTE_HINT = "(or a remote URI: s3://bucket/prefix, https://..., hf://org/model@revision)"


# --- resolving references against the catalog ---------------------------------------------------------
@dataclass
class Resolved:
    """A config resolved to catalog ids, plus the registrations and analyses it still needs."""

    config: MergekitConfig
    base: str
    experts: list[dict]  # {"model": id, "weight"?: w, "density"?: d}
    to_register: list[dict] = field(default_factory=list)  # register() keyword arguments, in order
    reused: dict[str, str] = field(default_factory=dict)  # reference as written -> registered id it matched
    tokenizer: dict | None = None  # {"source", "source_uri", "chat_template"}: None = the base's tokenizer
    ids: dict[str, str] = field(default_factory=dict)  # reference as written -> catalog id
    layout: dict | None = None  # a `slices:` config's output layout (config/slices.py)
    method_params: dict | None = None  # a `slices:` config's per-tensor t (None: the config's own)
    base_member: dict | None = None  # a model soup: the base averaged in (MergeRequest.base_member)

    @property
    def pending(self) -> bool:
        return bool(self.to_register)

    def request(self) -> MergeRequest:
        """The merge request this config makes (its models as catalog ids)."""
        c = self.config
        method_params = c.method_params if self.method_params is None else self.method_params
        return MergeRequest.build(self.base, self.experts, c.method, budget=c.budget, target_bound=c.target_bound,
                                  lam=c.lam, normalize=c.normalize, rescale=c.rescale, gamma=c.gamma,
                                  epsilon=c.epsilon, seed=c.seed, strategy=c.strategy, compact=c.compact,
                                  tokenizer=self.tokenizer,
                                  layout=self.layout, base_member=self.base_member, **method_params)


PathCheck = Callable[[str], Path]


def _default_check(text: str) -> Path:
    return Path(text).expanduser().absolute()


def _location(uri: str) -> Path | RemoteRoot:
    """A catalog URI as the resolver compares locations: a Path, or a remote URI (never a Path: it would
    fold ``//``)."""
    return RemoteRoot(uri) if scheme_of(uri) is not None else Path(uri)


def _files(location: Path | RemoteRoot) -> Path:
    """A local folder with a location's tokenizer files (a remote folder's are fetched: storage/registry.py)."""
    return tokenizer_folder(location) if isinstance(location, RemoteRoot) else location


def _known(text: str) -> bool:
    """An existing local path, or a remote URI (whether it exists is found when it is opened)."""
    return scheme_of(text) is not None or _exists(text)


class _Resolver:
    def __init__(self, cat: Catalog, cfg: MergekitConfig, register_paths: bool, check_path: PathCheck | None,
                 reserved_ids):
        self.cat, self.cfg, self.register_paths = cat, cfg, register_paths
        self.check = check_path or _default_check
        self.taken = model_ids(cat) | set(reserved_ids or ())
        self.out = Resolved(cfg, "", [])
        self.views: dict[str, dict[int, int]] = {}  # expert id -> its layer map (sources at other layers)
        self.base_path: Path | None = None
        # a model soup without base_model plans against a reference model (config/soup.py)
        self.base_text, self.base_where = (cfg.base, "base_model") if cfg.base is not None else \
            (cfg.models[0].ref, cfg.models[0].where + ".model")

    def fail(self, where: str, message: str):
        raise ConfigError(f"{self.cfg.source}: {where}: {message}")

    def _path(self, text: str, where: str) -> Path | RemoteRoot | None:
        """The absolute path a reference names (a remote URI in canonical form), or None when nothing
        exists there; a remote URI is registered on the fly, as a path is."""
        if scheme_of(text) is not None:
            try:
                return RemoteRoot(canonical_uri(text))
            except MergePipeError as exc:
                self.fail(where, str(exc))
        if not _exists(text):
            return None
        p = self.check(text)
        return Path(p).resolve()

    def _derive_id(self, path: Path | RemoteRoot) -> str:
        if isinstance(path, RemoteRoot):
            name = remote_model_name(path)
        else:
            name = path.name if path.is_dir() else path.stem
        name = name or "model"
        cand, n = name, 2
        while cand in self.taken:
            cand, n = f"{name}-{n}", n + 1
        self.taken.add(cand)
        return cand

    def _rows_at(self, path: Path) -> list[dict]:
        return models_at(self.cat, str(path))

    def _unregistered(self, where: str, text: str):
        self.fail(where, f"{text} is not registered in the catalog; register and analyze it first "
                         f"(Models page, or `mergepipe merge --config` which does it for you)")

    def base(self) -> tuple[str, Path | None]:
        text, where = self.base_text, self.base_where
        if self.cat.has_model(text):
            return text, _location(self.cat.model(text)["uri"])
        path = self._path(text, where)
        if path is None:
            if self.split_lora(text):
                self.fail(where, "a LoRA-patched model (BASE+ADAPTER) cannot be the base; "
                                 "list the adapter under `models:`")
            self.fail(where, f"{brief(text, 200)} is neither a registered model id nor an existing path {REMOTE_HINT}")
        rows = [r for r in self._rows_at(path) if r["kind"] == "full"]
        rows.sort(key=lambda r: r["base_id"] is not None)  # a plain base first
        for row in rows:
            check_unchanged(row)
            self.out.reused[text] = row["id"]
            return row["id"], path
        if not self.register_paths:
            self._unregistered(where, text)
        open_checkpoint(path)  # a clear error now if it is not a checkpoint
        mid = self._derive_id(path)
        self.out.to_register.append({"model_id": mid, "uri": str(path), "base_id": None, "kind": "full"})
        return mid, path

    def split_lora(self, text: str) -> tuple[str, str] | None:
        """``BASE+ADAPTER`` -> (base reference, adapter path) when both sides exist."""
        if self.cat.has_model(text) or _exists(text):
            return None
        for i, ch in enumerate(text):
            if ch == "+":
                left, right = text[:i], text[i + 1:]
                if left and right and (self.cat.has_model(left) or _known(left)) and _known(right):
                    return left, right
        return None

    def expert(self, m: ConfigModel, base_id: str, base_path: Path | None) -> str | None:
        """The catalog id of one model (None: it is the base itself, which mergekit skips)."""
        text, where = m.ref, m.where + ".model"
        if self.cat.has_model(text):
            if text == base_id:
                return None
            return text
        lora = self.split_lora(text)
        kind = "lora" if lora else "full"
        if lora:
            left, right = lora
            same_base = left == base_id or (base_path is not None and not self.cat.has_model(left)
                                            and self._path(left, where) == base_path)
            if not same_base:
                self.fail(where, f"the adapter {right} is applied to {left}, but the merge base is "
                                 f"{self.base_text}: MergePipe merges adapters trained on the merge base")
            path = self._path(right, where)
        else:
            path = self._path(text, where)
            if path is None:
                self.fail(where, f"{brief(text, 200)} is neither a registered model id nor an existing path {REMOTE_HINT}")
            if base_path is not None and path == base_path:
                return None
        rows = [r for r in self._rows_at(path) if r["base_id"] == base_id
                and (r["kind"] == "lora" if lora else r["kind"] != "lora")]
        if rows:
            row = rows[0]
            check_unchanged(row)
            self.out.reused[text] = row["id"]
            mid = row["id"]
        else:
            if not self.register_paths:
                self._unregistered(where, text)
            if not lora:
                open_checkpoint(path)  # a clear error now if it is not a checkpoint
            mid = self._derive_id(path)
            self.out.to_register.append({"model_id": mid, "uri": str(path), "base_id": base_id, "kind": kind})
        return mid


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


def _tokenizer(r: _Resolver, base_id: str, base_path: Path | None) -> dict | None:
    """The output tokenizer a config asks for: None (the base's files, as they are), or the tokenizer
    source's folder, a chat template and/or the re-ordered vocabulary (``vocab``, config/vocab.py).

    mergekit builds the output vocabulary (the base's, a model's, or the union of every model's, plus
    ``tokens``), then re-orders each model's embed_tokens/lm_head rows to it, with ``len(vocabulary)``
    rows (padded to ``pad_to_multiple_of``). When every model has the source's vocabulary and the
    embeddings have that many rows, every re-ordering is the identity: MergePipe then merges as it is
    and copies the source's tokenizer files (a union's is the base's). Otherwise the request carries
    the vocabulary and every model's row sources, and the merge writes mergekit's tokenizer."""
    cfg, cat = r.cfg, r.cat
    vocab_asked = cfg.tokenizer_source is not None or cfg.tokenizer_tokens or cfg.pad_to_multiple_of is not None
    if not vocab_asked and cfg.chat_template is None:
        return None
    base_root = base_path or _location(cat.model(base_id)["uri"])
    uris = {base_id: base_root}
    for kw in r.out.to_register:
        uris[kw["model_id"]] = _location(kw["uri"])
    models = [(base_id, base_root)]
    kinds = {base_id: "full"}
    for e in r.out.experts:
        mid = e["model"]
        row = cat.model(mid) if cat.has_model(mid) else None
        kinds[mid] = row["kind"] if row is not None else next(
            kw["kind"] for kw in r.out.to_register if kw["model_id"] == mid)
        if kinds[mid] == "lora":
            continue  # an adapter has the base's vocabulary (embedding LoRA is refused)
        models.append((mid, uris.get(mid) or _location(row["uri"])))
    out: dict = {}
    where = "tokenizer_source"
    ref = cfg.tokenizer_source
    source_id, source_root = base_id, base_root
    outside = None  # a tokenizer folder that is not one of the models merged (its files are copied)
    if ref not in (None, "union", "base", cfg.base, base_id):
        outside = _outside_source(r, ref, where, models)
        if outside is not None:
            source_id, source_root = ref, outside
        else:
            source_id = _model_ref(r, ref, where, models)
            source_root = dict(models).get(source_id) or _location(cat.model(source_id)["uri"])
    if vocab_asked:
        if not has_tokenizer(_files(source_root)):
            r.fail(where, f"{source_id} has no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.txt, ...)")
        want = vocabulary(_files(source_root))
        with_tokenizer = [(m, p) for m, p in models if has_tokenizer(_files(p))]  # mergekit assumes the base's otherwise
        if needs_vocab(cat, with_tokenizer, want, cfg, base_id, lambda p: vocabulary(_files(p))):
            if outside is not None:
                r.fail(where, f"{ref} is not one of the models merged: re-ordering the embedding rows to its "
                              f"vocabulary needs it among the models (or `base` / `union`)")
            row_order = [m for m in row_model_order(cfg, r.out.ids, base_id) if m in kinds]
            try:
                out["vocab"] = vocab_setting(cat, cfg, base_id, models, "union" if ref == "union" else source_id,
                                             row_order, lambda text, w: _model_ref(r, text, w, models), kinds)
            except VocabRefusal as exc:
                r.fail(*exc.args)
        if source_root != base_root:
            out.update({"source": source_id, "source_uri": str(source_root)})
    if cfg.chat_template is not None:
        if not has_tokenizer(_files(source_root)):
            r.fail("chat_template", f"the tokenizer source ({source_id}) has no tokenizer files to attach it to")
        template = cfg.chat_template
        if template == "auto":  # mergekit: the most common template among the models (none: leave it)
            found = [t.strip() for t in (read_chat_template(_files(root)) for _, root in models) if t]
            template = Counter(found).most_common(1)[0][0] if found else None
        else:
            template = CHAT_TEMPLATES.get(template, template)
        if template is not None:
            out["chat_template"] = template
    return out or None


def _outside_source(r: _Resolver, ref: str, where: str, models: list) -> Path | RemoteRoot | None:
    """The location a tokenizer setting names when it is a folder (local or remote) that is not one of the
    models merged; None for a model."""
    if ref in r.out.ids or r.cat.has_model(ref):
        return None
    path = r._path(ref, where)
    if path is None or any(p == path for _, p in models):
        return None
    return path


def _model_ref(r: _Resolver, ref: str, where: str, models: list[tuple[str, Path]]) -> str:
    """The catalog id of a model a tokenizer setting names (a registered id, a path, ``base``)."""
    cat = r.cat
    if ref == "base" or ref == r.cfg.base:
        return r.out.base
    if ref in r.out.ids:
        return r.out.ids[ref]
    if cat.has_model(ref):
        if cat.model(ref)["kind"] == "lora":
            r.fail(where, f"{brief(ref, 200)}: a LoRA adapter has no tokenizer of its own; name the base or a model")
        return ref
    path = r._path(ref, where)
    if path is None:
        r.fail(where, f"{brief(ref, 200)} is neither `base`, `union`, a registered model id nor an existing path")
    found = next((m for m, p in models if p == path), None)
    if found is None:
        r.fail(where, f"{ref} is not one of the models merged")
    return found


def _check_out_dtype(cat: Catalog, cfg: MergekitConfig, base_id: str, base_path: Path | None) -> None:
    """mergekit writes out_dtype, or else dtype; MergePipe writes each tensor in the base's own dtype.

    The dtypes asked for apply to the float tensors: non-float buffers (a BERT's int64 ``position_ids``)
    are copied from the base as they are, by mergekit as by MergePipe, so ``dtype: float32`` on an fp32
    base with int64 buffers is honoured."""
    want = cfg.out_dtype or cfg.dtype
    if want is None:
        return
    if cat.has_model(base_id):
        codes = [t["dtype"] for t in cat.tensors(base_id)]
    else:
        codes = [t.dtype for t in open_checkpoint(base_path).tensors.values()]
    floats, others = split_dtypes(codes)
    if floats == [want]:
        return
    key = "out_dtype" if cfg.out_dtype else "dtype (which mergekit also uses as the output dtype)"
    label = dtype_label(codes)
    buffers = f"; its {','.join(others)} buffers are copied as they are" if others else ""
    if len(floats) == 1:
        fix = f"set `out_dtype: {MERGEKIT_DTYPE[floats[0]]}`{buffers}"
    elif floats:
        fix = (f"remove `out_dtype` and `dtype` (the base's float tensors mix {', '.join(floats)}, and MergePipe "
               f"keeps each tensor's dtype)")
    else:
        fix = "the base holds no float tensor to merge"
    raise ConfigError(f"{cfg.source}: {key}: {MERGEKIT_DTYPE.get(want, want)} cannot be honoured: MergePipe "
                      f"writes the base's dtype ({label}); {fix}")


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

