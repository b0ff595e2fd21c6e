"""Parse and validate a mergekit YAML config without touching a catalog (:func:`parse_config`).

``weight`` and ``density`` may be mergekit settings (per-tensor ``filter`` conditions, gradients over
the layers), resolved with mergekit's precedence by the planner. Everything MergePipe cannot do
exactly is refused with one message naming the key; nothing is silently approximated."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mergepipe.config.model import (
    ConfigError, ConfigModel, EXTENSION_KEYS, GLOBAL_PARAMS, MAX_CONFIG_BYTES,
    BASELESS_LATER, MERGEKIT_ONLY_METHODS, METHOD_PARAMS, MODEL_PARAMS, MergekitConfig,
    REFUSED_TOP_KEYS, SHARED_PARAMS, TOP_KEYS,
)
from mergepipe.config.ignored import drop_ignored
from mergepipe.config.modules import lift_modules, read_modules
from mergepipe.config.parse_tokenizer import _tokenizer
from mergepipe.config.parse_values import (
    _dtype, _flag_setting, _known, _number, _param, _raw_fallback, _ref, _with_fallback,
)
from mergepipe.config.slices import read_slices
from mergepipe.config.yaml_loader import MAX_NODES, load_yaml  # noqa: F401  (MAX_NODES: importable from here)
from mergepipe.errors import PlanError, StorageError, brief
from mergepipe.ops.core import OPERATORS
from mergepipe.planner.budget import Budget
from mergepipe.planner.settings import PER_MODEL_PARAMS
from mergepipe.storage.codecs import COMPACT_MODES
from mergepipe.storage.moe_layout import LAYOUTS as MOE_LAYOUTS
from mergepipe.planner.strategies import STRATEGIES
from mergepipe.storage.paths import read_regular


# --- parsing ----------------------------------------------------------------------------------------
def load_config(path: str | Path) -> MergekitConfig:
    """Read and validate a mergekit YAML file."""
    try:
        p = Path(path).expanduser()
    except RuntimeError:  # ~user of no such user
        raise ConfigError(f"{path}: no such config file") from None
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: {p.stat().st_size} bytes is too large for a merge config")
    try:  # through the path checks: inside the allowed roots, a regular file
        text = read_regular(p, MAX_CONFIG_BYTES).decode("utf-8")
    except StorageError as exc:
        raise ConfigError(str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file") from None
    return parse_config(text, source=p.name)


def parse_config(text: str | bytes, source: str = "config") -> MergekitConfig:
    """Validate mergekit YAML text; every refusal is a :class:`ConfigError` naming the key."""
    try:
        return _parse(text, source)
    except ConfigError as exc:
        msg = _cut(str(exc))
        raise ConfigError(msg if msg.startswith(f"{source}: ") else f"{source}: {msg}") from None
    except RecursionError:  # a value nested deeper than the checks can follow
        raise ConfigError(f"{source}: the config is nested too deeply") from None


MAX_MESSAGE = 400  # a refusal quotes short values; a huge one is cut, never printed whole


_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


def _cut(msg: str) -> str:
    """One line (a key like `"\\n"` quoted in a refusal is escaped), cut short."""
    msg = msg.translate(_LINE_BREAKS)
    return msg if len(msg) <= MAX_MESSAGE else msg[:MAX_MESSAGE] + "... (cut)"


def _parse(text, source: str) -> MergekitConfig:
    doc = lift_modules(_load(text), _raw_fallback)
    method = _method(doc)
    doc = drop_ignored(doc, OPERATORS[method].name)  # what mergekit ignores, named on stderr (config/ignored.py)
    globals_ = _global_params(doc)
    lam_setting = globals_.pop("lambda") if isinstance(globals_.get("lambda"), list) else None
    slices = modules = None
    reference = False
    if "slices" in doc:  # layer ranges (config/slices.py); the models are those the slices name
        base, models, slices = read_slices(doc, method, globals_, _ref)
        values = {p: globals_.get(p) for p in SHARED_PARAMS}
        reference = doc.get("base_model") is None
    elif "modules" in doc:  # a multi-module architecture's modules (config/modules.py)
        base, models, modules, reference = read_modules(doc, method, globals_, _ref)
        values = {p: globals_.get(p) for p in SHARED_PARAMS}
    else:
        base = _base(doc, method)
        entries = _model_entries(doc)
        models, values = _models(entries, globals_)
    if lam_setting is not None:  # a per-tensor lambda (filters, gradient): merge-wide, as mergekit's SHARED lambda
        if values.get("lambda") is not None:
            raise ConfigError("parameters.lambda is per tensor (filters or a gradient): give no lambda per model")
        values["lambda"] = lam_setting
    # The compute dtype: MergePipe always computes in float32, at least as precise as any float dtype
    # asked for (outputs may differ from mergekit's bf16/fp16 arithmetic by that dtype's rounding).
    dtype = _dtype(doc.get("dtype"), "dtype")
    out_dtype = _dtype(doc.get("out_dtype"), "out_dtype")
    tokenizer_source, tokens, pad, chat_template = _tokenizer(doc)
    budget, target, strategy, seed, plan_id, compact = _extension(doc)

    return MergekitConfig(
        source=source, method=method, base=base, models=tuple(models),
        normalize=_flag_setting(globals_.get("normalize"), "parameters.normalize"),
        rescale=_flag_setting(globals_.get("rescale"), "parameters.rescale"),
        lam=values["lambda"], gamma=values["gamma"], epsilon=values["epsilon"],
        dtype=dtype, out_dtype=out_dtype, budget=budget, target_bound=target, strategy=strategy, seed=seed,
        compact=compact,
        plan_id=plan_id, tokenizer_source=tokenizer_source, tokenizer_tokens=tokens,
        pad_to_multiple_of=pad, chat_template=chat_template, method_params=_method_params(globals_, values),
        slices=slices, modules=modules, slices_reference=reference, moe_layout=_moe_layout(doc))


def _method_params(globals_: dict, values: dict) -> dict:
    """The interpolation methods' parameters the config gives (merge-wide; shared numbers from models)."""
    out = {k: values[k] for k in METHOD_PARAMS if values.get(k) is not None}
    out.update({k: globals_[k] for k in METHOD_PARAMS if globals_.get(k) is not None})
    return out


def _load(text) -> dict:
    """The YAML document: a mapping of known top-level keys."""
    if isinstance(text, bytes):
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{len(text)} bytes is too large for a merge config")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("not a UTF-8 text file") from None
    doc = load_yaml(text)
    if doc is None:
        raise ConfigError("the config is empty")
    if not isinstance(doc, dict):
        raise ConfigError(f"a merge config is a mapping of keys (models, base_model, merge_method, ...), "
                          f"not a {type(doc).__name__}")
    for key in doc:
        if key in REFUSED_TOP_KEYS:
            raise ConfigError(REFUSED_TOP_KEYS[key])
        if key not in TOP_KEYS:
            raise ConfigError(f"unsupported key `{key}` (MergePipe reads {', '.join(TOP_KEYS)})")
    return doc


def _method(doc: dict) -> str:
    """``merge_method``: an operator MergePipe has."""
    method = doc.get("merge_method")
    if method is None:
        raise ConfigError("`merge_method` is required")
    if not isinstance(method, str):
        raise ConfigError(f"`merge_method` must be a name, not {brief(method)}")
    if method not in OPERATORS:
        supported = ", ".join(OPERATORS)
        if method in MERGEKIT_ONLY_METHODS:
            raise ConfigError(f"merge_method `{method}` is not supported by MergePipe (supported: {supported})")
        raise ConfigError(f"unknown merge_method `{method}` (supported: {supported})")
    return method


def _base(doc: dict, method: str) -> str | None:
    """``base_model``: required, except by the methods that can merge without one (a model soup: None, the
    resolver then picks a reference model among the models, config/soup.py)."""
    base = doc.get("base_model")
    if base is None:
        if OPERATORS[method].base_optional:
            return None
        raise ConfigError(f"`base_model` is required by {method}: MergePipe stores experts as deltas against their "
                          f"base" + (f" (mergekit's {method} can run without one; MergePipe does not support that yet)"
                                     if method in BASELESS_LATER else ""))
    base = _ref(base, "base_model")
    return base


def _global_params(doc: dict) -> dict:
    """The merge-wide ``parameters``."""
    raw_globals = doc.get("parameters") or {}
    if not isinstance(raw_globals, dict):
        raise ConfigError("`parameters` must be a mapping of parameter names to values")
    globals_ = {k: _param(v, f"parameters.{k}", k) for k, v in raw_globals.items() if _known(k, GLOBAL_PARAMS,
                                                                                              "parameters")}
    return globals_


def _model_entries(doc: dict) -> list[tuple[str, dict, str]]:
    """(reference, own parameters, where) of each ``models:`` entry."""
    raw_models = doc.get("models")
    if raw_models is None:
        raise ConfigError("`models:` is required (the list of models to merge)")
    if not isinstance(raw_models, list) or not raw_models:
        raise ConfigError("`models:` must be a non-empty list of `- model: PATH_OR_ID` entries")
    entries = []
    for i, item in enumerate(raw_models):
        where = f"models[{i}]"
        if isinstance(item, str):
            item = {"model": item}
        if not isinstance(item, dict):
            raise ConfigError(f"{where} must be a mapping with a `model` key")
        for key in item:
            if key not in ("model", "parameters"):
                raise ConfigError(f"unsupported key `{key}` in {where} (a model entry has model and parameters)")
        if "model" not in item:
            raise ConfigError(f"{where} has no `model`")
        ref = _ref(item["model"], f"{where}.model")
        raw = item.get("parameters") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}.parameters must be a mapping of parameter names to values")
        params = {k: _param(v, f"{where}.parameters.{k}", k) for k, v in raw.items()
                  if _known(k, MODEL_PARAMS, f"{where}.parameters")}
        entries.append((ref, params, where))
    return entries


def _models(entries, globals_: dict) -> tuple[list[ConfigModel], dict]:
    """The models with mergekit's precedence applied, and the one value of each shared parameter."""
    # mergekit: a model's own parameter wins over the global one of the same name.
    models = []
    shared: dict[str, dict[str, float]] = {p: {} for p in SHARED_PARAMS}
    for ref, params, where in entries:
        eff = {k: params.get(k, globals_.get(k)) for k in MODEL_PARAMS}
        models.append(ConfigModel(ref, _with_fallback(params.get("weight"), globals_.get("weight")),
                                  _with_fallback(params.get("density"), globals_.get("density")), where))
        for p in SHARED_PARAMS:
            if eff[p] is not None:
                shared[p][where] = eff[p]
    values = {}
    for p, per in shared.items():
        if p in PER_MODEL_PARAMS and any(isinstance(v, list) for v in per.values()):
            # gamma/epsilon per tensor (filters, a gradient): each model its own setting, mergekit's fallback to
            # the merge-wide one folded in (a condition list that yields nothing falls back to it)
            models = [dataclasses.replace(m, own={**m.own, p: _with_fallback(own.get(p), globals_.get(p))})
                      if m.where in per else m for m, (_, own, _) in zip(models, entries)]
            values[p] = None
            continue
        distinct = sorted(set(per.values()))
        if len(distinct) > 1 and p in PER_MODEL_PARAMS:  # mergekit's per-model gamma/epsilon: each model its own
            models = [dataclasses.replace(m, own={**m.own, p: per[m.where]}) if m.where in per else m for m in models]
            distinct = []  # no merge-wide value: the others take the operator's default, as in mergekit
        elif len(distinct) > 1:
            raise ConfigError(f"`{p}` differs between models ({', '.join(f'{v:g}' for v in distinct)}): "
                              f"mergekit applies one {p} to every model (a merge-wide parameter)")
        values[p] = distinct[0] if distinct else None
    return models, values


def _moe_layout(doc: dict) -> str | None:
    """``mergepipe: {moe_layout: fused | per-expert}`` (storage/moe_layout.py); None: mergekit's layout."""
    value = (doc.get("mergepipe") or {}).get("moe_layout") if isinstance(doc.get("mergepipe"), dict) else None
    if value is not None and value not in MOE_LAYOUTS:
        raise ConfigError(f"mergepipe.moe_layout {brief(value)} is unknown (choose from {', '.join(MOE_LAYOUTS)})")
    return value


def _extension(doc: dict):
    """The ``mergepipe:`` extension key: (budget, target_bound, strategy, seed, plan id, compact)."""
    ext = doc.get("mergepipe") or {}
    if not isinstance(ext, dict):
        raise ConfigError("`mergepipe` must be a mapping (budget, target_bound, strategy, seed)")
    for key in ext:
        if key not in EXTENSION_KEYS:
            raise ConfigError(f"unsupported key `{key}` in mergepipe (allowed: {', '.join(EXTENSION_KEYS)})")
    budget = ext.get("budget")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (str, int, float)):
            raise ConfigError(f"mergepipe.budget must be like 25%, 0.25 or 512MiB, not {brief(budget)}")
        try:
            budget = Budget.parse(budget)
        except PlanError as exc:
            raise ConfigError(f"mergepipe.budget: {exc}") from None
    target = ext.get("target_bound")
    if target is not None:
        target = _number(target, "mergepipe.target_bound")
        if budget is not None:
            raise ConfigError("give either mergepipe.budget or mergepipe.target_bound, not both")
    strategy = ext.get("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        raise ConfigError(f"mergepipe.strategy {brief(strategy)} is unknown (choose from {', '.join(STRATEGIES)})")
    seed = ext.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"mergepipe.seed must be an integer, not {brief(seed)}")
    plan_id = ext.get("plan")
    if plan_id is not None and not isinstance(plan_id, str):
        raise ConfigError("mergepipe.plan must be a plan id")
    compact = ext.get("compact")
    if isinstance(compact, bool):
        compact = "auto" if compact else "off"
    if compact is not None and compact not in COMPACT_MODES:
        raise ConfigError(f"mergepipe.compact {brief(compact)} is unknown (choose from {', '.join(COMPACT_MODES)})")
    return budget, target, strategy, seed, plan_id, compact
