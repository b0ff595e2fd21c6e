"""mergekit's ``slices:``: output layers stacked from layer ranges of the input models.

A config lists output slices; each has ``sources`` (``model``, ``layer_range: [start, end)``, optional
``parameters``) and optional ``parameters``. mergekit (plan.py) writes the output layers in order: layer
``start + i`` of every source of a slice, merged, becomes the next output layer, renumbered; gradients
are interpolated over the slice (t = i / (n - 1), 1 for a one-layer slice); the tensors outside the
layers take the first slice's models (embeddings, t = 0) and the last slice's (final norm, lm_head, t = 0);
config.json's ``num_hidden_layers`` is the number of output layers. Parameters resolve with mergekit's
precedence: a source's own (for per-input parameters: weight, density, scale), then the slice's, then the
merge-wide ``parameters``; per-input filters match the input tensor's name, merge-wide ones (t) the
output's.

This module reads ``slices:`` (:func:`read_slices`, at parse time) and expands it against the models'
tensors (:func:`expand`, at resolve time) into data the planner and engine already understand:

* a **layout** (the plan's ``layout``): per output tensor, the model and input tensor it is made of (and
  passthrough's scale); the engine reads, merges and writes by it;
* per-tensor settings for the merge (each expert's weight and density, slerp's t) as exact-name
  conditions: the operators merge each input tensor as they always do.

``linear`` over slices averages every source, the base among them: it is planned as a soup (config/soup.py)
whose base member is the base (or, without ``base_model``, the first source of the first slice, the
reference) at its place among the first slice's sources, with its weight resolved per tensor like any source's.

Sources at different layers (layer i of the base with layer j of an expert; mergekit pairs layer
``start + i`` of every source of a slice) are merged through **layer views** (storage/views.py). ANALYZE's
statistics, the plan's candidates, budget and error bound are all per (expert, same-named base tensor), and
the base's tensor of an output layer is the one at the base source's layer: so each expert merged at other
layers than the base's is given a view, its tensor ``layers.{j}.X`` read under the base's name
``layers.{i}.X`` (same files, same byte ranges), registered in the catalog against the base (id
``EXPERT@I-J=K-L``, URI ``EXPERT_URI::layers=I-J:K-L``, reused while the expert's files are unchanged) and
analyzed like any expert (a config merge does it on the way; `mergepipe analyze VIEW_ID` otherwise). The
layout and the rest of the planner and engine are unchanged: budgets, the bound and byte-range reads are the
view's. Per-input parameters (weight, density) match their filters on each input's own tensor name (the
expert's layer j), as mergekit's do; t matches the output's. Export writes a view back as its expert with its
own layer_range.

What MergePipe cannot do exactly is refused: a LoRA adapter at other layers than the base's (its delta is
trained on its base's own layers), an expert whose tensor at the paired layer has another shape than the base's,
and re-ordered embedding rows (``tokenizer_source`` with different vocabularies) combined with views; every
slice lists the same models with the base among them, and each base layer is merged at most once (repeat
layers with passthrough): the plan merges each base tensor once.
"""

from __future__ import annotations

import json
import re

from mergepipe.ops.core import get_op
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.config.model import ConfigError, ConfigModel, GRADIENT_PARAMS, PER_TENSOR
from mergepipe.errors import brief
from mergepipe.ops.setting import LAYER, PRE_LAYER_NAMES, Setting

SLICE_KEYS = ("sources",)
SOURCE_KEYS = ("model", "layer_range", "parameters")
# the parameters a slice or a source may give: the per-input ones and the merge-wide gradients (t, scale)
SLICE_PARAMS = tuple(dict.fromkeys(PER_TENSOR + GRADIENT_PARAMS))


@dataclass(frozen=True)
class SliceSource:
    ref: str
    start: int
    end: int
    params: dict
    where: str


@dataclass(frozen=True)
class OutputSlice:
    sources: tuple[SliceSource, ...]
    params: dict
    where: str

    @property
    def length(self) -> int:
        return self.sources[0].end - self.sources[0].start


# --- parse time -----------------------------------------------------------------------------------------
def read_slices(doc: dict, method: str, globals_: dict, ref_of) -> tuple[str, list[ConfigModel], tuple]:
    """(base reference, the other models, the slices) of a ``slices:`` config. ``ref_of(value, where)``
    checks a model reference (parse.py's); the models carry the merge-wide weight and density."""
    if "models" in doc:
        raise ConfigError("give either `models:` or `slices:`, not both (mergekit takes exactly one)")
    raw = doc["slices"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError("`slices:` must be a non-empty list of `- sources: [...]` entries")
    slices = tuple(_slice(item, f"slices[{i}]", ref_of) for i, item in enumerate(raw))
    base = doc.get("base_model")
    if base is None:
        if method != "passthrough" and not get_op(method).whole_models:
            raise ConfigError(f"`base_model` is required for {method} over slices (it must be a source of every slice)")
        # mergekit's passthrough has no base, linear ignores it: the first source is the reference (config/soup.py)
        base = slices[0].sources[0].ref
    base = ref_of(base, "base_model")
    _check_models(slices, method, base)
    refs = list(dict.fromkeys(s.ref for sl in slices for s in sl.sources if s.ref != base))
    models = [ConfigModel(ref, globals_.get("weight"), globals_.get("density"), f"slices (model {ref})")
              for ref in refs]
    return base, models, slices


def _slice(item, where: str, ref_of) -> OutputSlice:
    if not isinstance(item, dict) or "sources" not in item:
        raise ConfigError(f"{where} must be a mapping with `sources` (a list of model and layer_range)")
    for key in item:
        if key not in ("sources", "parameters"):
            raise ConfigError(f"unsupported key `{key}` in {where} (MergePipe reads sources and parameters)")
    raw = item["sources"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}.sources must be a non-empty list of `- model: ..., layer_range: [start, end]`")
    sources = tuple(_source(s, f"{where}.sources[{j}]", ref_of) for j, s in enumerate(raw))
    lengths = {s.end - s.start for s in sources}
    if len(lengths) > 1:
        ranges = ", ".join(f"{s.ref} [{s.start}, {s.end}]" for s in sources)
        raise ConfigError(f"{where}: the sources cover different numbers of layers ({ranges}); every source of a "
                          f"slice must cover the same number of layers")
    return OutputSlice(sources, _params(item.get("parameters"), f"{where}.parameters"), where)


def _source(item, where: str, ref_of) -> SliceSource:
    if not isinstance(item, dict):
        raise ConfigError(f"{where} must be a mapping with `model` and `layer_range`")
    for key in item:
        if key not in SOURCE_KEYS:
            raise ConfigError(f"unsupported key `{key}` in {where} (a source has {', '.join(SOURCE_KEYS)})")
    if "model" not in item or "layer_range" not in item:
        raise ConfigError(f"{where} needs `model` and `layer_range`")
    ref = ref_of(item["model"], f"{where}.model")
    rng = item["layer_range"]
    if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                             for v in rng) and 0 <= rng[0] < rng[1]):
        raise ConfigError(f"{where}.layer_range must be [start, end] with 0 <= start < end (integers), not {brief(rng)}")
    return SliceSource(ref, rng[0], rng[1], _params(item.get("parameters"), f"{where}.parameters"), where)


def _params(raw, where: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of parameter names to values")
    out = {}
    for k, v in raw.items():
        if k not in SLICE_PARAMS:
            raise ConfigError(f"unsupported parameter `{k}` in {where} (a slice or source may give "
                              f"{', '.join(SLICE_PARAMS)}; give the others once under the top-level `parameters:`)")
        if isinstance(v, dict) and set(v) <= {"value", "filter"} and "value" in v and v.get("filter") in (None, "*"):
            v = v["value"]
        out[k] = Setting.parse(v, f"{where}.{k}", ConfigError).json
    return out


def _check_models(slices, method: str, base: str) -> None:
    """What MergePipe merges exactly (see the module docstring)."""
    if method == "passthrough":
        for sl in slices:
            if len(sl.sources) != 1:
                raise ConfigError(f"{sl.where}: passthrough copies one source per slice ({len(sl.sources)} given)")
        return
    models = None
    merged: dict[int, str] = {}
    for sl in slices:
        refs = [s.ref for s in sl.sources]
        if base not in refs:
            raise ConfigError(f"{sl.where}: the base model {base} is not among the sources; {method} over slices "
                              f"merges the other models into the base's layers")
        if len(set(refs)) != len(refs):
            raise ConfigError(f"{sl.where}: a model is listed twice among the sources")
        if models is not None and set(refs) != models:
            raise ConfigError(f"{sl.where}: the sources are not the models of {slices[0].where} "
                              f"({', '.join(sorted(models))}); MergePipe merges the same models in every slice")
        models = set(refs)
        base_src = next(s for s in sl.sources if s.ref == base)
        for layer in range(base_src.start, base_src.end):
            if layer in merged:
                raise ConfigError(f"{sl.where}: layer {layer} of the base is merged again (also in {merged[layer]}); "
                                  f"MergePipe merges each base layer once (repeat layers with "
                                  f"`merge_method: passthrough`)")
            merged[layer] = sl.where


# --- resolve time ---------------------------------------------------------------------------------------
@dataclass
class Expansion:
    """What a ``slices:`` config asks of the planner: the layout, each expert's weight and density settings,
    and the merge-wide gradient parameters (t) per tensor."""

    layout: dict | None
    settings: dict  # expert id -> {"weight": setting, "density": setting}
    method_params: dict
    # expert id -> {base layer: the expert's layer merged with it}, for the experts merged at other layers than
    # the base's (merged through a layer view, storage/views.py)
    views: dict = field(default_factory=dict)


def expand(cfg, ids: dict[str, str], base_id: str, tensors: dict[str, dict[str, tuple]],
           layers: dict[str, int], adapters=frozenset()) -> Expansion:
    """``ids``: reference as written -> catalog id; ``tensors``: model id -> {name: shape};
    ``layers``: model id -> its number of layers; ``adapters``: the ids of LoRA adapters (no layer view)."""
    slices, copies = cfg.slices, cfg.method == "passthrough"
    for sl in slices:
        for s in sl.sources:
            n = layers[ids[s.ref]]
            if s.end > n:
                raise ConfigError(f"{cfg.source}: {s.where}.layer_range [{s.start}, {s.end}] is out of range: "
                                  f"{s.ref} has {n} layers (0-{n - 1})")
    base_names = list(tensors[base_id])
    by_layer: dict[int, list[str]] = {}
    outside = []
    for name in base_names:
        m = LAYER.search(name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(name)
        else:
            outside.append(name)
    if not by_layer:
        raise ConfigError(f"{cfg.source}: slices: the base has no tensors named like `...layers.N...`, `...h.N...`, "
                          f"`...layer.N...` or `...blocks.N...`; MergePipe slices layers named that way (Llama, "
                          f"Mistral, Qwen, Gemma, GPT-2, BERT, ...)")
    pre = [n for n in outside if any(p in n for p in PRE_LAYER_NAMES)]
    post = [n for n in outside if n not in pre]
    entries = []  # (out name, slice, the base's input name, t, layer offset in the slice or None)
    for name in pre:
        entries.append((name, slices[0], name, 0.0, None))
    out_layers = []
    j = 0
    base_ref = None if copies else next(ref for ref, mid in ids.items() if mid == base_id
                                        and any(s.ref == ref for s in slices[0].sources))
    for sl in slices:
        # the base's layer is the base source's (mergekit pairs layer start + i of every source)
        first = sl.sources[0] if copies else next(s for s in sl.sources if s.ref == base_ref)
        for i in range(sl.length):
            t = i / (sl.length - 1) if sl.length > 1 else 1.0
            src_layer = first.start + i
            for name in by_layer.get(src_layer, ()):
                entries.append((_renumber(name, j), sl, name, t, i))
            out_layers.append([ids[first.ref] if copies else base_id, src_layer])
            j += 1
    for name in post:
        entries.append((name, slices[-1], name, 0.0, None))
    layout = {"tensors": [], "layers": out_layers}
    if copies:
        for out, sl, name, t, _ in entries:
            src = sl.sources[0]
            mid = ids[src.ref]
            if name not in tensors[mid] or tensors[mid][name] != tensors[base_id][name]:
                raise ConfigError(f"{cfg.source}: {src.where}: {src.ref} has no tensor {name} of the base's shape")
            scale = _resolve([src.params.get("scale"), sl.params.get("scale"), cfg.method_params.get("scale")],
                             name, t)
            layout["tensors"].append([out, mid, name, None if scale == 1.0 else scale])  # x * 1.0 is x
        return Expansion(layout, {}, {})
    layout["tensors"] = [[out, base_id, name, None] for out, _, name, _, _ in entries]
    if all(out == name for out, _, name, _, _ in entries) and len(entries) == len(base_names):
        layout = None  # the base's own tensors, in place: a plain merge
    settings = {}
    views = {}
    whole = get_op(cfg.method).whole_models
    for ref, mid in ids.items():
        if mid == base_id and not whole:  # linear: the base is averaged in, weighted like any source
            continue
        settings[mid] = {}
        for p in ("weight", "density"):
            per = {}
            for out, sl, name, t, i in entries:
                src = next(s for s in sl.sources if s.ref == ref)
                # mergekit matches a per-input parameter's filters on that input's own tensor name
                own = name if i is None else _renumber(name, src.start + i)
                per[name] = _resolve([src.params.get(p), sl.params.get(p), _global(cfg, ref, p)], own, t)
            settings[mid][p] = _exact(per, 1.0)
        if mid != base_id:
            mapping = _layer_map(cfg, slices, ref, base_ref, tensors[mid], tensors[base_id], by_layer,
                                 mid in adapters)
            if any(a != b for a, b in mapping.items()):
                views[mid] = mapping
    method_params = dict(cfg.method_params)
    for p in GRADIENT_PARAMS:
        if p == "scale":
            method_params.pop(p, None)
            continue
        per = {name: _resolve([sl.params.get(p), cfg.method_params.get(p)], out, t) for out, sl, name, t, _ in entries}
        value = _exact(per, None)
        if value is not None:
            method_params[p] = value
    return Expansion(layout, settings, method_params, views)


def _layer_map(cfg, slices, ref: str, base_ref: str, shapes: dict, base_shapes: dict, by_layer,
               adapter: bool) -> dict[int, int]:
    """Base layer -> the layer of ``ref`` merged with it (mergekit: layer start + i of every source of a slice),
    each of its tensors checked against the base's."""
    mapping = {}
    for sl in slices:
        src = next(s for s in sl.sources if s.ref == ref)
        base_src = next(s for s in sl.sources if s.ref == base_ref)
        for i in range(sl.length):
            b, e = base_src.start + i, src.start + i
            mapping[b] = e
            if b == e:
                continue
            if adapter:
                raise ConfigError(f"{cfg.source}: {src.where}: {ref} is a LoRA adapter, whose delta is trained on "
                                  f"its base's own layers: give it the base's layer_range [{base_src.start}, "
                                  f"{base_src.end}], or merge the adapter into a model first")
            for name in by_layer.get(b, ()):
                own = _renumber(name, e)
                if shapes.get(own) != base_shapes[name]:
                    raise ConfigError(f"{cfg.source}: {src.where}: {ref} has no tensor {own} of the shape of the "
                                      f"base's {name} ({list(base_shapes[name])}), which it is merged with")
    return mapping


def _global(cfg, ref: str, p: str):
    """The merge-wide value of a per-input parameter (parse keeps it on every model)."""
    # every model carries the merge-wide value (read_slices); the base is not among them (linear averages it too)
    m = next((m for m in cfg.models if m.ref == ref), cfg.models[0] if cfg.models else None)
    return getattr(m, p, None) if m is not None else None


def _renumber(name: str, layer: int) -> str:
    m = LAYER.search(name)
    return name[:m.start(1)] + str(layer) + name[m.end(1):]


def _resolve(settings, tensor: str, t: float):
    for s in settings:
        if s is not None:
            v = Setting.from_json(s).at(tensor, t)
            if v is not None:
                return float(v)
    return None


def _exact(per: dict[str, float | None], default: float | None):
    """One value per tensor as a setting: a number when they agree, else one exact-name condition per
    tensor (longest names first: a name that is a substring of another must not match it first). A tensor
    without a value takes ``default`` (None: the parameter is required)."""
    values = set(per.values())
    if values == {None}:
        return None
    if None in values:
        if default is None:
            missing = sorted(n for n, v in per.items() if v is None)[0]
            raise ConfigError(f"a per-slice parameter is given for some slices only, and not for {missing}; give it "
                              f"for every slice or under the top-level `parameters:`")
        per = {n: default if v is None else v for n, v in per.items()}
        values = set(per.values())
    if len(values) == 1:
        return values.pop()
    return [{"filter": n, "value": v} for n, v in sorted(per.items(), key=lambda kv: (-len(kv[0]), kv[0]))]


def model_layers(config: dict, names) -> int:
    n = config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
    if isinstance(n, int) and n > 0:
        return n
    found = [int(m.group(1)) for name in names if (m := LAYER.search(name))]
    return max(found) + 1 if found else 0


def read_config(root: Path) -> dict:
    try:
        return json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


# --- export ---------------------------------------------------------------------------------------------
def export_slices(layout: dict, base: dict, experts: list[dict], params: dict, copies: bool) -> tuple[list, dict]:
    """(``slices:``, merge-wide ``parameters`` changes) that plan back to ``layout`` and its per-tensor
    settings: one slice per run of consecutive input layers of one model (and of each layer view's expert,
    storage/views.py: an expert merged at other layers is written with its own layer_range); per-tensor values
    as exact-name conditions (per-input ones on each input's own names, per source; t on the output names)."""
    from mergepipe.storage.views import renumber, split_view
    uris = {base["id"]: base["uri"], **{e["id"]: e["uri"] for e in experts}}
    views = {}  # expert id -> (its checkpoint's uri, base layer -> its layer)
    for e in experts:
        own, mapping = split_view(e["uri"])
        if mapping is not None:
            views[e["id"]] = (own, mapping)
    runs: list[list] = []  # [model, first input layer, last input layer, [layout entries]]
    for model, i in layout["layers"]:
        if runs and runs[-1][0] == model and runs[-1][2] + 1 == i and all(
                m.get(i) is not None and m.get(i) == m.get(i - 1, -2) + 1 for _, m in views.values()):
            runs[-1][2] = i
        else:
            runs.append([model, i, i, []])
    first_out = {}
    j = 0
    for k, run in enumerate(runs):
        for _ in range(run[1], run[2] + 1):
            first_out[j] = k
            j += 1
    seen_layer = False
    for entry in layout["tensors"]:
        m = LAYER.search(entry[0])
        seen_layer = seen_layer or bool(m)
        runs[first_out[int(m.group(1))] if m else (-1 if seen_layer else 0)][3].append(entry)
    slices = []
    for model, lo, hi, entries in runs:
        rng = [lo, hi + 1]
        if copies:
            source = {"model": uris[model], "layer_range": rng}
            scale = _exact({e[2]: e[3] for e in entries}, 1.0)
            if scale is not None:
                source["parameters"] = {"scale": scale}
            slices.append({"sources": [source]})
            continue
        sources = [{"model": base["uri"], "layer_range": rng}]
        for e in experts:
            if e["id"] in views:
                own_uri, mapping = views[e["id"]]
                source = {"model": own_uri, "layer_range": [mapping[lo], mapping[hi] + 1]}
                name_of = lambda n, mapping=mapping: (renumber(n, mapping[int(LAYER.search(n).group(1))])
                                                      if LAYER.search(n) else n)
            else:
                source = {"model": uris[e["id"]], "layer_range": rng}
                name_of = lambda n: n
            own = {}
            for i, key in ((0, "weight"), (1, "density")):
                per = {name_of(t[2]): (e["tensors"][t[2]][i] if e.get("tensors") and t[2] in e["tensors"]
                                       else e.get(key)) for t in entries}
                value = _exact(per, 1.0)
                if value is not None and not (key == "density" and value == 1.0):
                    own[key] = value
            if own:
                source["parameters"] = own
            sources.append(source)
        slices.append({"sources": sources})
    changes = {"scale": None} if copies else {}  # passthrough's scale is per tensor, in the slices
    out_of = {t[2]: t[0] for t in layout["tensors"]}
    for key, value in params.items():
        if isinstance(value, list):  # t per input tensor -> per output tensor (mergekit matches t on outputs)
            changes[key] = _exact({out_of[c["filter"]]: c["value"] for c in value if c["filter"] in out_of}, None)
    return slices, changes


# --- modules ---------------------------------------------------------------------------------------------
MODULE_KEYS = ("slices", "models", "parameters")


def lift_modules(doc: dict, fallback) -> dict:
    """mergekit's ``modules:`` for a single-module model (its module is named ``default``) as the
    equivalent top-level config (other module names are a multi-module architecture's: config/modules.py): the module's ``slices`` or ``models``, its ``parameters`` taking
    precedence over the merge-wide ones (a module condition list falls back to the merge-wide value, as
    mergekit resolves them: ``fallback(own, merge_wide)``)."""
    if "modules" not in doc:
        return doc
    modules = doc["modules"]
    if "models" in doc or "slices" in doc:
        raise ConfigError("give one of `models:`, `slices:` or `modules:` (mergekit takes exactly one)")
    if not isinstance(modules, dict) or not modules:
        raise ConfigError("`modules:` must map a module name to its `slices:` or `models:`")
    names = list(modules)
    if names != ["default"]:
        return doc  # a multi-module architecture's modules (config/modules.py)
    module = modules["default"]
    if not isinstance(module, dict):
        raise ConfigError("modules.default must be a mapping with `slices:` or `models:` and optional `parameters`")
    for key in module:
        if key not in MODULE_KEYS:
            raise ConfigError(f"unsupported key `{key}` in modules.default (a module has {', '.join(MODULE_KEYS)})")
    if ("slices" in module) == ("models" in module):
        raise ConfigError("modules.default needs exactly one of `slices:` or `models:`")
    out = {k: v for k, v in doc.items() if k != "modules"}
    body = "slices" if "slices" in module else "models"
    out[body] = module[body]
    own = module.get("parameters") or {}
    if not isinstance(own, dict):
        raise ConfigError("modules.default.parameters must be a mapping of parameter names to values")
    merged = dict(doc.get("parameters") or {})
    for name, value in own.items():
        merged[name] = fallback(value, merged.get(name)) if name in merged else value
    if merged:
        out["parameters"] = merged
    return out
