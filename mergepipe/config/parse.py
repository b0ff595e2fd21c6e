"""Parse and validate a mergekit YAML config without touching a catalog (:func:`parse_config`).

``weight`` and ``density`` may be mergekit settings (per-tensor ``filter`` conditions, gradients over
the layers), resolved with mergekit's precedence by the planner. Everything MergePipe cannot do
exactly is refused with one message naming the key; nothing is silently approximated."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import yaml

from mergepipe.config.model import (
    ConfigError, ConfigModel, DTYPE_NAMES, EXTENSION_KEYS, GLOBAL_PARAMS, MAX_CONFIG_BYTES,
    BASELESS_LATER, GRADIENT_PARAMS, MERGEKIT_ONLY_METHODS, METHOD_PARAMS, MODEL_PARAMS, MergekitConfig, PARAMS, PER_TENSOR,
    REFUSED_TOP_KEYS, SHARED_PARAMS, TOKENIZER_KEYS, TOP_KEYS,
)
from mergepipe.config.modules import read_modules
from mergepipe.config.slices import lift_modules, read_slices
from mergepipe.config.templates import CHAT_TEMPLATES
from mergepipe.errors import PlanError, StorageError, brief
from mergepipe.ops.core import OPERATORS
from mergepipe.planner.budget import Budget
from mergepipe.ops.setting import Setting
from mergepipe.planner.settings import PER_MODEL_PARAMS
from mergepipe.storage.codecs import COMPACT_MODES
from mergepipe.planner.strategies import STRATEGIES
from mergepipe.storage.paths import read_regular


# --- parsing ----------------------------------------------------------------------------------------
class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int, float, bool)):
            continue
        if key in seen:
            raise ConfigError(f"duplicate key {brief(key)} (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


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
        slices=slices, modules=modules, slices_reference=reference)


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


def load_yaml(text: str):
    """One YAML document, through the shape checks (depth, values with aliases expanded) and the
    duplicate-key loader; every refusal is one :class:`ConfigError` line."""
    try:
        _check_shape(text)
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"not valid YAML{where}: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {(str(exc).splitlines() or [''])[0]}") from None
    except RecursionError:
        raise ConfigError("not valid YAML: nested too deeply") from None
    except (ValueError, OverflowError):  # PyYAML's int(): a number of thousands of digits
        raise ConfigError("not valid YAML: holds a number too large to read") from None


MAX_DEPTH = 64  # a merge config nests a few levels; PyYAML's composer recurses once per level
MAX_NODES = 200_000  # values in a document, an alias counted at the size of what it names
_OPENERS = re.compile(r"(?:[\[{][ \t\r\n]*){%d}" % (MAX_DEPTH + 1))


def _check_shape(text: str) -> None:
    """Refuse from the event stream (which PyYAML parses without recursion), before anything is built:
    nesting deeper than MAX_DEPTH (the recursive composer would take seconds to hit the recursion
    limit), and more than MAX_NODES values once aliases are expanded (nested anchors make a 1 KB
    "billion laughs" of 10^9 values, which any walk over the document -- a message, a check -- would
    then take hours and gigabytes to visit)."""
    if _OPENERS.search(text):  # the scanner alone is quadratic in the flow depth: refuse the obvious at once
        raise ConfigError(f"not valid YAML: nested more than {MAX_DEPTH} levels deep")
    sizes: dict[str, int] = {}  # anchor -> values under it
    open_: list[list] = [[0, None]]  # per open collection: [values so far, its anchor]
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append([1, event.anchor])
            if len(open_) - 1 > MAX_DEPTH:
                mark = event.start_mark
                raise ConfigError(f"not valid YAML (line {mark.line + 1}, column {mark.column + 1}): nested more "
                                  f"than {MAX_DEPTH} levels deep")
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            n, anchor = open_.pop()
        elif isinstance(event, yaml.AliasEvent):
            n, anchor = sizes.get(event.anchor, 1), None
        elif isinstance(event, yaml.ScalarEvent):
            n, anchor = 1, event.anchor
        else:
            continue
        if anchor is not None:
            sizes[anchor] = n
        open_[-1][0] += n
        if open_[-1][0] > MAX_NODES:
            raise ConfigError(f"refused: the document holds more than {MAX_NODES:,} values once its aliases "
                              f"(*name) are expanded")


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


def _token_source(tok: str, src):
    """A ``tokens:`` entry's source as written: a model reference (str), ``("zero",)``, or
    ``(model reference, token or token_id)`` (mergekit's ``kind: model_token``); None: none given."""
    if src is None or isinstance(src, str):
        return src
    where = f"tokenizer.tokens.{tok}.source"
    if not isinstance(src, dict) or src.get("kind") not in ("zero", "model_token"):
        raise ConfigError(f"{where} must be a model, {{kind: zero}} or {{kind: model_token, model, token | token_id}}")
    if src["kind"] == "zero":
        if set(src) != {"kind"}:
            raise ConfigError(f"{where}: kind: zero takes no other key")
        return ("zero",)
    keys = set(src) - {"kind", "model"}
    if not isinstance(src.get("model"), str) or len(keys) != 1 or keys - {"token", "token_id"}:
        raise ConfigError(f"{where}: kind: model_token needs `model` and one of `token`, `token_id`")
    value = src.get("token", src.get("token_id"))
    if "token" in src and not isinstance(value, str) or "token_id" in src and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{where}: token must be a string, token_id a non-negative integer")
    return (src["model"], value)


def _tokenizer(doc: dict) -> tuple:
    """(tokenizer source: ``union``, a model reference, or None for the base; the ``tokens`` settings as
    ((token, force, source), ...); ``pad_to_multiple_of``; chat_template as written).

    ``tokenizer_source`` or the ``tokenizer:`` block's ``source`` (mergekit's default there: union).
    Whether a union, a model's tokenizer, tokens or padding can be honoured depends on the models'
    vocabularies: the resolver checks (mergepipe.config.resolve)."""
    src = doc.get("tokenizer_source")
    block = doc.get("tokenizer")
    tokens: tuple = ()
    pad = None
    if block is not None:
        if src is not None:
            raise ConfigError("give either `tokenizer_source` or a `tokenizer:` block, not both")
        if not isinstance(block, dict):
            raise ConfigError("`tokenizer` must be a mapping (source, tokens, pad_to_multiple_of)")
        unknown = sorted(set(map(str, block)) - set(TOKENIZER_KEYS))
        if unknown:
            raise ConfigError(f"unsupported key `{unknown[0]}` in tokenizer (mergekit's are "
                              f"{', '.join(TOKENIZER_KEYS)})")
        raw_tokens = block.get("tokens") or {}
        if not isinstance(raw_tokens, dict):
            raise ConfigError("tokenizer.tokens must map tokens to their settings (source, force)")
        out = []
        for tok, setting in raw_tokens.items():
            setting = setting or {}
            if not isinstance(tok, str) or not isinstance(setting, dict) or set(setting) - {"source", "force"}:
                raise ConfigError(f"tokenizer.tokens.{tok}: settings are `source` and `force`")
            force = setting.get("force", False)
            if not isinstance(force, bool):
                raise ConfigError(f"tokenizer.tokens.{tok}.force must be true or false")
            out.append((tok, force, _token_source(tok, setting.get("source"))))
        tokens = tuple(out)
        pad = block.get("pad_to_multiple_of")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
            raise ConfigError("tokenizer.pad_to_multiple_of must be a positive integer")
        src = block.get("source", "union")
        where = "tokenizer.source"
    else:
        where = "tokenizer_source"
    if src is not None and not isinstance(src, str):
        raise ConfigError(f"{where} must be `base`, `union` or a model (a path or a catalog id)")
    template = doc.get("chat_template")
    if template is not None:
        if not isinstance(template, str) or not template.strip():
            raise ConfigError("chat_template must be `auto`, a template name or the template text")
        if template != "auto" and "{" not in template and template not in CHAT_TEMPLATES:
            raise ConfigError(f"chat_template: {brief(template)} is neither `auto`, a known template name "
                              f"({', '.join(sorted(CHAT_TEMPLATES))}) nor a Jinja template (paste its text)")
        if "{" in template and len(template) < 20:
            raise ConfigError(f"chat_template: {brief(template)} is too short to be a Jinja chat template")
    return src, tokens, pad, template


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


def _known(key, allowed, where: str) -> bool:
    if key not in allowed:
        raise ConfigError(f"unsupported parameter `{key}` in {where} (MergePipe supports {', '.join(allowed)})")
    return True


def _ref(value, where: str) -> str:
    if isinstance(value, dict):
        raise ConfigError(f"{where}: the mapping form of a model reference is not supported; "
                          f"write a path, a catalog id or BASE+ADAPTER")
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} must be a path or a model id, not {brief(value)}")
    return value.strip()


def _param(value, where: str, name: str):
    """One parameter value. ``weight`` and ``density`` may be mergekit settings: a number, a gradient
    (a list of numbers over the layers) or a list of ``{filter, value}`` conditions; the other
    parameters are one value (a gradient or filter for them is refused)."""
    if isinstance(value, dict) and set(value) <= {"value", "filter"} and "value" in value \
            and value.get("filter") in (None, "*"):
        return _param(value["value"], where, name)  # {value: x} without a filter is just x
    if name in PER_TENSOR or name in GRADIENT_PARAMS or (name == "lambda" and where == "parameters.lambda"):
        return _setting(value, where)
    if name in PER_MODEL_PARAMS and isinstance(value, (list, dict)):
        return _setting(value, where)  # gamma/epsilon per tensor: each value range-checked by the planner
    if name in ("normalize", "rescale") and where == f"parameters.{name}" and isinstance(value, (list, dict)):
        return value  # filters of true/false: checked by _flag_setting
    if isinstance(value, (list, dict)):
        kind = "per-tensor filters" if isinstance(value, dict) or any(isinstance(v, dict) for v in value) \
            else "a gradient across layers"
        raise ConfigError(f"{where} is {kind}: not supported for {name}; MergePipe applies one {name} to every "
                          f"tensor (filters and gradients work for weight, density, gamma and epsilon, and "
                          f"merge-wide for lambda, normalize and rescale)")
    if name == "int8_mask" or PARAMS[name].kind is bool:
        return _flag(value, where)
    return PARAMS[name].check(_number(value, where), where, ConfigError)


def _setting(value, where: str):
    """A weight/density setting in the planner's JSON form (floats, lists, {filter, value} dicts)."""
    return Setting.parse(value, where, ConfigError).json


def _with_fallback(own, merge_wide):
    """One model's setting with mergekit's fallback to the merge-wide one folded in.

    mergekit takes a model's own value when it yields one for a tensor, else the global value. A
    number or gradient always yields one; a condition list may not, so the global value is appended
    as its last condition(s). The result resolves, tensor by tensor, exactly like the two levels."""
    if own is None:
        return merge_wide
    if merge_wide is None or not isinstance(own, list) or not isinstance(own[0], dict):
        return own
    if isinstance(merge_wide, list) and isinstance(merge_wide[0], dict):
        return own + merge_wide
    return own + [{"filter": None, "value": merge_wide}]


def _raw_fallback(own, merge_wide):
    """A module's parameter over the merge-wide one, as written (a condition list falls back to it)."""
    if isinstance(own, dict):
        own = [own]
    if not isinstance(own, list) or not own or not isinstance(own[0], dict):
        return own
    if isinstance(merge_wide, dict):
        merge_wide = [merge_wide]
    if isinstance(merge_wide, list) and merge_wide and isinstance(merge_wide[0], dict):
        return own + merge_wide
    return own + [{"value": merge_wide}]
def _flag_setting(value, where: str):
    """A merge-wide normalize/rescale: true/false, or filters of true/false (mergekit's per-tensor setting)."""
    if not isinstance(value, (list, dict)):
        return _flag(value, where)
    try:
        return Setting.parse_flag(value, where).json
    except PlanError as exc:
        raise ConfigError(str(exc)) from None


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, not {brief(value)}")
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, not {brief(value)}")
    return float(value)


def _flag(value, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{where} must be true or false, not {brief(value)}")


def _dtype(value, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in DTYPE_NAMES:
        raise ConfigError(f"{key}: unknown dtype {brief(value)} (float32, bfloat16, float16)")
    return DTYPE_NAMES[value.lower()]


def _exists(path) -> bool:
    try:
        return Path(path).expanduser().exists()
    except (OSError, ValueError):
        return False
