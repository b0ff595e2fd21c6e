"""mergekit's ``modules:`` for multi-module (modular) architectures: a vision tower, a projector and a text
decoder, each merged with its own models' parameters.

mergekit 0.1.5 (plan.py, architecture/json_definitions.py) defines a modular architecture as named modules,
each with a tensor-name prefix, its own layer count (a config key such as ``text_config.num_hidden_layers``
or ``vision_config.depth``, or a fixed number) and its own pre-layer, per-layer and post-layer tensor names
(config/architectures.py holds them). A config may then give ``modules: {NAME: {models: [...] | slices:
[...], parameters: {...}}}``; ``merge_method`` and ``base_model`` are merge-wide. mergekit plans the modules
in the config's order, each like a single-module model: ``models:`` becomes one slice over the module's
layers (the base appended when not listed); the tensors before the layers take the first slice's sources at
t = 0, the layers t = i / (n - 1) over their slice, the tensors after them the last slice's at t = 0; the
layer numbering restarts in every module. Parameters resolve a model's own, then the slice's, then the
module's, then the merge-wide ones. Only the modules the config lists are written, and only the tensors the
definitions list. A tensor planned twice (the projector's layers of Qwen2-VL, whose names do not depend on
the layer index, at t = 0 and t = 1) is written twice under one name, and which one mergekit keeps depends
on its task order: MergePipe requires the plannings to agree (a gradient there is refused).

This module reads ``modules:`` (:func:`read_modules`, parse time) and expands it against the base's tensors
and config.json (:func:`expand_modules`, resolve time) into what the planner already runs: one exact-name
setting per tensor for each expert's weight and density and for the merge-wide gradients (t), as
config/slices.py does for ``slices:``. The tensors stay in place (no layout): the plan, its budget and bound
are those of a ``models:`` merge with per-tensor settings.

Refused (one ``ConfigError``): a module the architecture lacks (or a multi-module config over an
architecture mergekit defines as one module), a module of the architecture the config omits or a base
tensor in no module (mergekit would write a checkpoint without them), modules or slices that merge other
models or the same models in another order (MergePipe merges one set of experts), slices that do not keep a
module's layers in place (every source the same ``layer_range``, the slices covering the module's layers in
order), ``passthrough``, and parameters other than weight, density and the gradient ones (t) per module,
slice or model.

A single-module model's ``modules: {default: ...}`` is the equivalent top-level config (:func:`lift_modules`).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from mergepipe.config.architectures import MERGEKIT_VERSION, MODULAR
from mergepipe.config.model import ConfigError, ConfigModel, GRADIENT_PARAMS
from mergepipe.config.per_tensor import _exact, _resolve
from mergepipe.config.slice_expand import Expansion
from mergepipe.config.slices import OutputSlice, _params, _slice
from mergepipe.errors import brief
from mergepipe.ops.core import get_op


@dataclass(frozen=True)
class Source:
    ref: str
    params: dict
    where: str


@dataclass(frozen=True)
class ModuleSlice:
    """One output slice of a module, in place: layers [start, end) of every source (None: all the module's
    layers, the ``models:`` form)."""

    sources: tuple[Source, ...]
    params: dict
    where: str
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class Module:
    name: str
    slices: tuple[ModuleSlice, ...]
    params: dict
    where: str


# --- parse time -----------------------------------------------------------------------------------------
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


def read_modules(doc: dict, method: str, globals_: dict, ref_of) -> tuple[str, list[ConfigModel], tuple, bool]:
    """(base reference, the other models, the modules, whether the base is a reference chosen among the
    models: linear without ``base_model``) of a multi-module ``modules:`` config."""
    if get_op(method).copies:
        raise ConfigError("modules: passthrough over the modules of a multi-module model is not supported "
                          "(MergePipe copies layers through `slices:` of a single-module model)")
    raw = doc["modules"]
    base = doc.get("base_model")
    if base is not None:
        base = ref_of(base, "base_model")
    modules = []
    for name, body in raw.items():
        where = f"modules.{name}"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"modules: a module name must be a name, not {brief(name)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{where} must be a mapping with `models:` or `slices:` and optional `parameters`")
        for key in body:
            if key not in MODULE_KEYS:
                raise ConfigError(f"unsupported key `{key}` in {where} (a module has {', '.join(MODULE_KEYS)})")
        if ("slices" in body) == ("models" in body):
            raise ConfigError(f"{where} needs exactly one of `slices:` or `models:`")
        if "models" in body:
            slices = (_models_slice(body["models"], where, ref_of),)
        else:
            slices = _in_place_slices(body["slices"], where, ref_of)
        modules.append(Module(name, slices, _params(body.get("parameters"), f"{where}.parameters"), where))
    reference = base is None
    if reference:
        if not get_op(method).whole_models:
            raise ConfigError(f"`base_model` is required by {method}: MergePipe stores experts as deltas against "
                              f"their base")
        base = modules[0].slices[0].sources[0].ref  # linear without a base: the first model is the reference
    modules = tuple(_with_base(m, base, reference) for m in modules)
    refs = _check_models(modules, method, base)
    models = [ConfigModel(ref, globals_.get("weight"), globals_.get("density"), f"modules (model {ref})")
              for ref in refs]
    return base, models, modules, reference


def _models_slice(raw, where: str, ref_of) -> ModuleSlice:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}.models must be a non-empty list of `- model: PATH_OR_ID` entries")
    sources = []
    for i, item in enumerate(raw):
        w = f"{where}.models[{i}]"
        if isinstance(item, str):
            item = {"model": item}
        if not isinstance(item, dict) or "model" not in item:
            raise ConfigError(f"{w} must be a mapping with a `model` key")
        for key in item:
            if key not in ("model", "parameters"):
                raise ConfigError(f"unsupported key `{key}` in {w} (a model entry has model and parameters)")
        sources.append(Source(ref_of(item["model"], f"{w}.model"), _params(item.get("parameters"),
                                                                          f"{w}.parameters"), w))
    return ModuleSlice(tuple(sources), {}, f"{where}.models")


def _in_place_slices(raw, where: str, ref_of) -> tuple[ModuleSlice, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}.slices must be a non-empty list of `- sources: [...]` entries")
    out = []
    end = 0
    for i, item in enumerate(raw):
        sl: OutputSlice = _slice(item, f"{where}.slices[{i}]", ref_of)
        ranges = {(s.start, s.end) for s in sl.sources}
        start = sl.sources[0].start
        if len(ranges) > 1 or start != end:
            raise ConfigError(f"{sl.where}: MergePipe merges a module's slices in place (every source with the "
                              f"same layer_range, the slices covering the module's layers from 0 in order: this "
                              f"one would start at layer {end}); re-ordered, repeated or offset layers are "
                              f"merged through `slices:` of a single-module model")
        end = sl.sources[0].end
        out.append(ModuleSlice(tuple(Source(s.ref, s.params, s.where) for s in sl.sources), sl.params, sl.where,
                               (start, end)))
    return tuple(out)


def _with_base(m: Module, base: str, reference: bool) -> Module:
    """mergekit appends the base to a module's ``models:`` when they do not list it."""
    sl = m.slices[0]
    if reference or sl.layers is not None or any(s.ref == base for s in sl.sources):
        return m
    sl = ModuleSlice(sl.sources + (Source(base, {}, f"{m.where} (base_model, added)"),), sl.params, sl.where)
    return Module(m.name, (sl,), m.params, m.where)


def _check_models(modules: tuple[Module, ...], method: str, base: str) -> list[str]:
    """The models other than the base, in order; every slice of every module must merge the same ones in the
    same order (linear: the base at the same place too) with the base among them."""
    whole = get_op(method).whole_models
    first = None
    for m in modules:
        for sl in m.slices:
            refs = [s.ref for s in sl.sources]
            if len(set(refs)) != len(refs):
                raise ConfigError(f"{sl.where}: a model is listed twice")
            if base not in refs:
                raise ConfigError(f"{sl.where}: the base model {base} is not among the sources; {method} merges "
                                  f"the other models into the base's tensors")
            order = refs if whole else [r for r in refs if r != base]
            if first is None:
                first = (order, sl.where)
                continue
            if order != first[0]:
                extra = [r for r in order if r not in first[0]] or [r for r in first[0] if r not in order]
                what = (f"merges {extra[0]}, which {first[1]} does not" if extra and extra[0] in order else
                        f"does not merge {extra[0]}, which {first[1]} does" if extra else
                        f"lists the models of {first[1]} in another order")
                raise ConfigError(f"{sl.where} {what}: MergePipe merges the same models, in the same order, in "
                                  f"every module (give a model weight 0 where it should not count)")
    return [r for r in first[0] if r != base]


# --- resolve time ---------------------------------------------------------------------------------------
class _Template(string.Template):
    idpattern = r"(?a:[_a-z][_a-z0-9]*([+-]1)?)"  # mergekit's ${layer_index+1}


def _name(template: str, n: int, i: int | None) -> str:
    if "{" not in template:
        return template
    subs = {"num_layers": n, "num_layers+1": n + 1, "num_layers-1": n - 1}
    if i is not None:
        subs.update({"layer_index": i, "layer_index+1": i + 1, "layer_index-1": i - 1})
    return _Template(template).substitute(subs)


def architecture(config: dict, source: str) -> tuple[str, dict]:
    """(architecture name, mergekit's modular definition) of a base's config.json."""
    archs = config.get("architectures")
    name = archs[0] if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) else None
    defs = MODULAR.get(name, [])
    if len(defs) > 1:
        defs = [d for d in defs if d["model_type"] == config.get("model_type")]
    if not defs:
        raise ConfigError(f"{source}: modules: the base is a {name or 'model without one architecture name'}, "
                          f"which mergekit {MERGEKIT_VERSION} has no multi-module definition of (modular "
                          f"architectures: {', '.join(sorted(MODULAR))}); a single-module model's one module is "
                          f"`default`")
    return name, defs[0]


def _layer_count(spec, config: dict) -> int | None:
    if isinstance(spec, int):
        return spec
    value = config
    for part in (spec or "").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def expand_modules(cfg, ids: dict[str, str], base_id: str, tensors: dict[str, dict[str, tuple]],
                   config: dict) -> Expansion:
    """Each expert's weight and density and the merge-wide gradients, per tensor, as mergekit resolves them
    module by module (``tensors``: model id -> {name: shape}; ``config``: the base's config.json)."""
    arch, definition = architecture(config, cfg.source)
    known = definition["modules"]
    _check_listed(cfg, arch, known)
    base_names = tensors[base_id]
    entries = _plannings(cfg, arch, known, config, base_names)
    outside = [name for name in base_names if name not in entries]
    if outside:
        raise ConfigError(f"{cfg.source}: modules: {len(outside)} tensor(s) of the base are in no module of mergekit "
                          f"{MERGEKIT_VERSION}'s {arch} (first: {outside[0]}): mergekit would not write them")
    settings = _expert_settings(cfg, ids, base_id, entries)
    return Expansion(None, settings, _gradient_params(cfg, entries))


def _check_listed(cfg, arch: str, known: dict) -> None:
    """The config lists every module of the architecture, and no other."""
    for m in cfg.modules:
        if m.name not in known:
            raise ConfigError(f"{cfg.source}: {m.where}: {arch} has no module {m.name} (mergekit {MERGEKIT_VERSION}'s "
                              f"modules of {arch}: {', '.join(known)})")
    missing = [name for name in known if name not in {m.name for m in cfg.modules}]
    if missing:
        raise ConfigError(f"{cfg.source}: modules: {', '.join(missing)} of {arch} not listed: mergekit writes no "
                          f"tensor of a module the config omits; list every module ({', '.join(known)})")


def _plannings(cfg, arch: str, known: dict, config: dict, base_names) -> dict[str, list]:
    """Output name -> [(module, slice, t), ...]: each time mergekit plans it, module by module."""
    entries: dict[str, list] = {}
    for m in cfg.modules:
        spec = known[m.name]
        n = _layer_count(spec["layers"], config)
        if n is None:
            raise ConfigError(f"{cfg.source}: {m.where}: the base's config.json has no layer count "
                              f"`{spec['layers']}` for module {m.name}")
        end = m.slices[-1].layers[1] if m.slices[-1].layers is not None else n
        if end != n:
            raise ConfigError(f"{cfg.source}: {m.where}: the slices cover layers 0-{end - 1}, module {m.name} of the "
                              f"base has {n} (0-{n - 1}): MergePipe merges every layer of a module in place")

        def add(template, sl, t, layer=None):
            optional = template.endswith("?")
            name = spec["prefix"] + _name(template.rstrip("?"), n, layer)
            if name not in base_names:
                if optional:
                    return
                raise ConfigError(f"{cfg.source}: {m.where}: the base has no tensor {name}, which mergekit "
                                  f"{MERGEKIT_VERSION}'s {arch} lists in module {m.name}")
            entries.setdefault(name, []).append((m, sl, t))

        for template in spec["pre"]:
            add(template, m.slices[0], 0.0)
        layer = 0
        for sl in m.slices:
            length = n if sl.layers is None else sl.layers[1] - sl.layers[0]
            for i in range(length):
                for template in spec["layer"]:
                    add(template, sl, i / (length - 1) if length > 1 else 1.0, layer)
                layer += 1
        for template in spec["post"]:
            add(template, m.slices[-1], 0.0)
    return entries


def _expert_settings(cfg, ids: dict[str, str], base_id: str, entries: dict[str, list]) -> dict:
    """Expert id -> its weight and density per tensor."""
    settings = {}
    whole = get_op(cfg.method).whole_models
    globals_ = {p: getattr(cfg.models[0], p, None) if cfg.models else None for p in ("weight", "density")}
    for ref, mid in ids.items():
        if mid == base_id and not whole:
            continue
        settings[mid] = {}
        for p in ("weight", "density"):
            per = {name: _once(cfg, name, p, ref, [
                _resolve([next(s for s in sl.sources if s.ref == ref).params.get(p), sl.params.get(p),
                          m.params.get(p), globals_[p]], name, t) for m, sl, t in plannings], plannings)
                for name, plannings in entries.items()}
            settings[mid][p] = _exact(per, 1.0)
    return settings


def _gradient_params(cfg, entries: dict[str, list]) -> dict:
    """The method's parameters with each merge-wide gradient (t) resolved per tensor."""
    method_params = dict(cfg.method_params)
    for p in GRADIENT_PARAMS:
        if p == "scale":
            method_params.pop(p, None)
            continue
        per = {name: _once(cfg, name, p, None, [_resolve([sl.params.get(p), m.params.get(p),
                                                          cfg.method_params.get(p)], name, t)
                                                for m, sl, t in plannings], plannings)
               for name, plannings in entries.items()}
        value = _exact(per, None)
        if value is not None:
            method_params[p] = value
    return method_params


def _once(cfg, name: str, p: str, ref: str | None, values: list, plannings: list):
    """The one value of a parameter for a tensor mergekit plans more than once (a projector's layers whose
    names do not depend on the layer index, a tensor two modules list): mergekit writes every planning under
    the same name and which one it keeps depends on its task order, so they must agree."""
    if len(set(values)) > 1:
        where = ", ".join(f"{m.where} at t = {t:g}" for m, _, t in plannings)
        whose = f"{ref}'s " if ref is not None else ""
        raise ConfigError(f"{cfg.source}: mergekit plans {name} {len(plannings)} times ({where}) with different "
                          f"values of {whose}{p} ({', '.join('none' if v is None else f'{v:g}' for v in values)}); which one it writes "
                          f"depends on its task order: give a value that does not vary there")
    return values[-1]
