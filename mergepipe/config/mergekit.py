"""mergekit YAML configs: read one into planner arguments, and write a stored plan back as one.

mergekit users describe a merge in YAML (``models:`` with per-model ``parameters``, ``base_model``,
``merge_method``, global ``parameters``, ``dtype``/``out_dtype``, ``tokenizer_source``). This module
lets them keep doing so:

* :func:`parse_config` validates the YAML without touching a catalog. ``weight`` and ``density`` may be
  mergekit settings (per-tensor ``filter`` conditions, gradients over the layers), resolved with
  mergekit's precedence (a model's own value, else the global one) by the planner. Everything
  MergePipe cannot do exactly is refused with one message naming the key (``slices``, filters or
  gradients of the other parameters, unknown merge methods and parameters, an output dtype other than
  the base's); nothing is silently approximated. The compute ``dtype`` may be any float type: MergePipe
  computes in float32 whatever it says, which is at least as precise.
* :func:`prepare` maps each model reference to a catalog model: a registered id is used as is; a path
  is matched to a registered model by uri and fingerprint, or else registered under an id derived
  from its folder name (the merge analyzes it on the way); ``BASE+ADAPTER`` registers a PEFT LoRA adapter against the base.
  It only looks; :func:`plan_from_config` then applies the registrations and plans inside one catalog
  transaction, so a config that fails anywhere before the merge starts leaves the catalog unchanged.
* :func:`export_mergekit` writes a stored plan or snapshot as the equivalent YAML; merging from that
  YAML gives the same plan digest (the budget, strategy and seed travel in a ``mergepipe:`` key).

Budgets are not a mergekit concept: they come from ``--budget`` or the ``mergepipe:`` extension key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mergepipe.catalog.db import Catalog
from mergepipe.errors import MergePipeError
from mergepipe.ops.core import OPERATORS, get_op, resolve_params
from mergepipe.planner.strategies import STRATEGIES
from mergepipe.planner.plan import Plan
from mergepipe.planner.context import Planner
from mergepipe.catalog.models import check_unchanged, model_ids, models_at, register
from mergepipe.catalog.plans import find_plan_id
from mergepipe.planner.settings import check_setting
from mergepipe.storage.safetensors import open_checkpoint

MAX_CONFIG_BYTES = 1 << 20  # a merge config is a few hundred bytes; refuse to parse anything huge

TOP_KEYS = ("models", "base_model", "merge_method", "parameters", "dtype", "out_dtype", "tokenizer_source",
            "mergepipe")
REFUSED_TOP_KEYS = {
    "slices": "layer slices (`slices:`) are not supported: MergePipe merges whole models with the same "
              "tensors; use `models:`",
    "modules": "per-module definitions (`modules:`) are not supported; use one `models:` list",
    "tokenizer": "tokenizer merging (`tokenizer:`) is not supported: MergePipe copies the base's tokenizer "
                 "files (`tokenizer_source: base`)",
    "chat_template": "`chat_template` is not supported: MergePipe copies the base's tokenizer and chat "
                     "template files as they are",
}
GLOBAL_PARAMS = ("weight", "density", "normalize", "rescale", "lambda", "gamma", "epsilon", "int8_mask")
MODEL_PARAMS = ("weight", "density", "gamma", "epsilon", "lambda")
SHARED_PARAMS = ("lambda", "gamma", "epsilon")  # per-model in some mergekit versions, one value in MergePipe
EXTENSION_KEYS = ("budget", "target_bound", "strategy", "seed", "plan")
# mergekit methods MergePipe does not implement (named so that the refusal says so).
MERGEKIT_ONLY_METHODS = ("slerp", "nuslerp", "multislerp", "model_stock", "passthrough", "karcher", "sce",
                         "arcee_fusion", "nearswap", "ram", "core_space", "task_adapter", "cabs", "lrp", "pcb",
                         "zipit", "generalized_anysize", "tokenizer_permute")
# mergekit dtype names -> safetensors dtype names, and back.
DTYPE_NAMES = {"float32": "F32", "fp32": "F32", "float": "F32", "bfloat16": "BF16", "bf16": "BF16",
               "float16": "F16", "fp16": "F16", "half": "F16", "float64": "F64", "fp64": "F64"}
MERGEKIT_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class ConfigError(MergePipeError):
    """A mergekit config is malformed or asks for something MergePipe does not do."""


# --- the parsed config ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigModel:
    """One entry of ``models:``: a reference as written, with its effective weight and density."""

    ref: str
    weight: float | list | None = None  # a number, or a mergekit setting (gradient, filter conditions)
    density: float | list | None = None
    where: str = ""  # for messages: "models[2]"


@dataclass(frozen=True)
class MergekitConfig:
    """A validated mergekit config, in MergePipe terms (operator name, one value per shared parameter)."""

    source: str
    method: str
    base: str
    models: tuple[ConfigModel, ...]
    normalize: bool | None = None
    rescale: bool | None = None
    lam: float | None = None
    gamma: float | None = None
    epsilon: float | None = None
    dtype: str | None = None  # safetensors names (F32, BF16, ...)
    out_dtype: str | None = None
    budget: str | None = None
    target_bound: float | None = None
    strategy: str | None = None
    seed: int | None = None
    plan_id: str | None = None  # informational (written by export)

    def with_overrides(self, operator=None, weights=None, density=None, lam=None, normalize=None, rescale=None,
                       gamma=None, epsilon=None, budget=None, target_bound=None, strategy=None,
                       seed=None) -> MergekitConfig:
        """The config with command-line settings replacing its own (None: keep the config's value).

        ``density`` replaces every model's density; ``weights`` lists one weight per model in config
        order; a budget or target bound replaces both of the config's budget settings."""
        changes: dict = {}
        if operator is not None:
            changes["method"] = get_op(operator).name
        models = list(self.models)
        if weights is not None:
            if len(weights) != len(models):
                raise ConfigError(f"{len(weights)} weights given for the {len(models)} models of {self.source}")
            models = [dataclasses.replace(m, weight=float(w)) for m, w in zip(models, weights)]
        if density is not None:
            models = [dataclasses.replace(m, density=float(density)) for m in models]
        changes["models"] = tuple(models)
        for name, value in (("lam", lam), ("normalize", normalize), ("rescale", rescale), ("gamma", gamma),
                            ("epsilon", epsilon), ("strategy", strategy), ("seed", seed)):
            if value is not None:
                changes[name] = value
        if budget is not None or target_bound is not None:
            changes["budget"] = None if budget is None else str(budget)
            changes["target_bound"] = target_bound
        return dataclasses.replace(self, **changes)


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
            raise ConfigError(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_config(path: str | Path) -> MergekitConfig:
    """Read and validate a mergekit YAML file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: {p.stat().st_size} bytes is too large for a merge config")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file") from None
    return parse_config(text, source=p.name)


def parse_config(text: str | bytes, source: str = "config") -> MergekitConfig:
    """Validate mergekit YAML text; every refusal is a :class:`ConfigError` naming the key."""
    try:
        return _parse(text, source)
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(f"{source}: ") else f"{source}: {msg}") from None


def _parse(text, source: str) -> MergekitConfig:
    if isinstance(text, bytes):
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{len(text)} bytes is too large for a merge config")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("not a UTF-8 text file") from None
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"not valid YAML{where}: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}") from None
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

    method = doc.get("merge_method")
    if method is None:
        raise ConfigError("`merge_method` is required")
    if not isinstance(method, str):
        raise ConfigError(f"`merge_method` must be a name, not {method!r}")
    if method not in OPERATORS:
        supported = ", ".join(OPERATORS)
        if method in MERGEKIT_ONLY_METHODS:
            raise ConfigError(f"merge_method `{method}` is not supported by MergePipe (supported: {supported})")
        raise ConfigError(f"unknown merge_method `{method}` (supported: {supported})")

    base = doc.get("base_model")
    if base is None:
        raise ConfigError("`base_model` is required: MergePipe stores experts as deltas against their base "
                          "(for linear, name the base the models were fine-tuned from; it is not averaged in)")
    base = _ref(base, "base_model")

    raw_globals = doc.get("parameters") or {}
    if not isinstance(raw_globals, dict):
        raise ConfigError("`parameters` must be a mapping of parameter names to values")
    globals_ = {k: _param(v, f"parameters.{k}", k) for k, v in raw_globals.items() if _known(k, GLOBAL_PARAMS,
                                                                                              "parameters")}

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
        distinct = sorted(set(per.values()))
        if len(distinct) > 1:
            raise ConfigError(f"`{p}` differs between models ({', '.join(f'{v:g}' for v in distinct)}): "
                              f"MergePipe applies one {p} to every model")
        values[p] = distinct[0] if distinct else None

    # The compute dtype: MergePipe always computes in float32, at least as precise as any float dtype
    # asked for (outputs may differ from mergekit's bf16/fp16 arithmetic by that dtype's rounding).
    dtype = _dtype(doc.get("dtype"), "dtype")
    out_dtype = _dtype(doc.get("out_dtype"), "out_dtype")
    tok = doc.get("tokenizer_source")
    if tok is not None and tok != "base":
        raise ConfigError(f"tokenizer_source: {tok!r} is not supported: MergePipe copies the base's tokenizer "
                          f"files (use `tokenizer_source: base` or leave it out)")

    ext = doc.get("mergepipe") or {}
    if not isinstance(ext, dict):
        raise ConfigError("`mergepipe` must be a mapping (budget, target_bound, strategy, seed)")
    for key in ext:
        if key not in EXTENSION_KEYS:
            raise ConfigError(f"unsupported key `{key}` in mergepipe (allowed: {', '.join(EXTENSION_KEYS)})")
    budget = ext.get("budget")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (str, int, float)):
            raise ConfigError(f"mergepipe.budget must be like 25%, 0.25 or 512MiB, not {budget!r}")
        budget = str(budget)
    target = ext.get("target_bound")
    if target is not None:
        target = _number(target, "mergepipe.target_bound")
        if budget is not None:
            raise ConfigError("give either mergepipe.budget or mergepipe.target_bound, not both")
    strategy = ext.get("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        raise ConfigError(f"mergepipe.strategy {strategy!r} is unknown (choose from {', '.join(STRATEGIES)})")
    seed = ext.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"mergepipe.seed must be an integer, not {seed!r}")
    plan_id = ext.get("plan")
    if plan_id is not None and not isinstance(plan_id, str):
        raise ConfigError("mergepipe.plan must be a plan id")

    return MergekitConfig(
        source=source, method=method, base=base, models=tuple(models),
        normalize=_flag(globals_.get("normalize"), "parameters.normalize"),
        rescale=_flag(globals_.get("rescale"), "parameters.rescale"),
        lam=values["lambda"], gamma=values["gamma"], epsilon=values["epsilon"],
        dtype=dtype, out_dtype=out_dtype, budget=budget, target_bound=target, strategy=strategy, seed=seed,
        plan_id=plan_id)


def _known(key, allowed, where: str) -> bool:
    if key not in allowed:
        raise ConfigError(f"unsupported parameter `{key}` in {where} (MergePipe supports {', '.join(allowed)})")
    return True


def _ref(value, where: str) -> str:
    if isinstance(value, dict):
        raise ConfigError(f"{where}: the mapping form of a model reference is not supported; "
                          f"write a path, a catalog id or BASE+ADAPTER")
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} must be a path or a model id, not {value!r}")
    return value.strip()


PER_TENSOR = ("weight", "density")  # may vary per tensor (filters, gradients); the others are one value


def _param(value, where: str, name: str):
    """One parameter value. ``weight`` and ``density`` may be mergekit settings: a number, a gradient
    (a list of numbers over the layers) or a list of ``{filter, value}`` conditions; the other
    parameters are one value (a gradient or filter for them is refused)."""
    if isinstance(value, dict) and set(value) <= {"value", "filter"} and "value" in value \
            and value.get("filter") in (None, "*"):
        return _param(value["value"], where, name)  # {value: x} without a filter is just x
    if name in PER_TENSOR:
        return _setting(value, where)
    if isinstance(value, (list, dict)):
        kind = "per-tensor filters" if isinstance(value, dict) or any(isinstance(v, dict) for v in value) \
            else "a gradient across layers"
        raise ConfigError(f"{where} is {kind}: not supported for {name}; MergePipe applies one {name} to every "
                          f"tensor (filters and gradients work for weight and density)")
    if name in ("normalize", "rescale", "int8_mask"):
        return _flag(value, where)
    return _number(value, where)


def _setting(value, where: str):
    """A weight/density setting in the planner's JSON form (floats, lists, {filter, value} dicts)."""
    return check_setting(value, where, ConfigError)


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


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, not {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, not {value!r}")
    return float(value)


def _flag(value, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{where} must be true or false, not {value!r}")


def _dtype(value, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in DTYPE_NAMES:
        raise ConfigError(f"{key}: unknown dtype {value!r} (float32, bfloat16, float16)")
    return DTYPE_NAMES[value.lower()]


def _exists(path) -> bool:
    try:
        return Path(path).expanduser().exists()
    except (OSError, ValueError):
        return False


# --- resolving references against the catalog ---------------------------------------------------------
@dataclass
class Resolved:
    """A config resolved to catalog ids, plus the registrations and analyses it still needs."""

    config: MergekitConfig
    base: str
    experts: list[dict]  # {"model": id, "weight"?: w, "density"?: d}
    to_register: list[dict] = field(default_factory=list)  # register() keyword arguments, in order
    reused: dict[str, str] = field(default_factory=dict)  # reference as written -> registered id it matched

    @property
    def pending(self) -> bool:
        return bool(self.to_register)

    def plan_kwargs(self) -> dict:
        """Keyword arguments for ``Planner.plan`` (and ``api.plan_merge``) without ``save``."""
        c = self.config
        return {"base_model": self.base, "experts": self.experts, "operator": c.method, "budget": c.budget,
                "target_bound": c.target_bound, "lam": c.lam, "normalize": c.normalize, "rescale": c.rescale,
                "gamma": c.gamma, "epsilon": c.epsilon, "seed": 0 if c.seed is None else c.seed,
                "strategy": c.strategy or "norm"}


PathCheck = Callable[[str], Path]


def _default_check(text: str) -> Path:
    return Path(text).expanduser().absolute()


class _Resolver:
    def __init__(self, cat: Catalog, cfg: MergekitConfig, register_paths: bool, check_path: PathCheck | None,
                 reserved_ids):
        self.cat, self.cfg, self.register_paths = cat, cfg, register_paths
        self.check = check_path or _default_check
        self.taken = model_ids(cat) | set(reserved_ids or ())
        self.out = Resolved(cfg, "", [])
        self.base_path: Path | None = None

    def fail(self, where: str, message: str):
        raise ConfigError(f"{self.cfg.source}: {where}: {message}")

    def _path(self, text: str, where: str) -> Path | None:
        """The absolute path a reference names, or None when nothing exists there."""
        if not _exists(text):
            return None
        p = self.check(text)
        return Path(p).resolve()

    def _derive_id(self, path: Path) -> str:
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
        text, where = self.cfg.base, "base_model"
        if self.cat.has_model(text):
            return text, Path(self.cat.model(text)["uri"])
        path = self._path(text, where)
        if path is None:
            if self.split_lora(text):
                self.fail(where, "a LoRA-patched model (BASE+ADAPTER) cannot be the base; "
                                 "list the adapter under `models:`")
            self.fail(where, f"{text!r} is neither a registered model id nor an existing path "
                             f"(MergePipe reads local checkpoints; it does not download from the Hub)")
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
                if left and right and (self.cat.has_model(left) or _exists(left)) and _exists(right):
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
            same_base = left == base_id or (base_path is not None and _exists(left)
                                            and Path(self.check(left)).resolve() == base_path)
            if not same_base:
                self.fail(where, f"the adapter {right} is applied to {left}, but the merge base is "
                                 f"{self.cfg.base}: MergePipe merges adapters trained on the merge base")
            path = self._path(right, where)
        else:
            path = self._path(text, where)
            if path is None:
                self.fail(where, f"{text!r} is neither a registered model id nor an existing path "
                                 f"(MergePipe reads local checkpoints; it does not download from the Hub)")
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
    resolve_params(op, normalize=cfg.normalize, rescale=cfg.rescale, lam=cfg.lam,
                            **{k: v for k, v in (("gamma", cfg.gamma), ("epsilon", cfg.epsilon)) if v is not None})
    r = _Resolver(cat, cfg, register_paths, check_path, reserved_ids)
    base_id, base_path = r.base()
    r.out.base, r.base_path = base_id, base_path
    _check_out_dtype(cat, cfg, base_id, base_path)
    for m in cfg.models:
        mid = r.expert(m, base_id, base_path)
        if mid is None:
            if op.whole_models:
                raise ConfigError(f"{cfg.source}: {m.where}: the base model is listed among the models; MergePipe's "
                                  f"linear averages the other models only (remove it, or give the models' "
                                  f"weights relative to each other)")
            continue  # mergekit skips the base model in task-vector methods
        spec = {"model": mid}
        if m.weight is not None:
            spec["weight"] = m.weight
        if m.density is not None:
            spec["density"] = m.density
        r.out.experts.append(spec)
    if not r.out.experts:
        raise ConfigError(f"{cfg.source}: `models:` lists no model other than the base")
    return r.out


def _check_out_dtype(cat: Catalog, cfg: MergekitConfig, base_id: str, base_path: Path | None) -> None:
    # mergekit writes out_dtype, or else dtype; MergePipe always writes the base's own dtype.
    want = cfg.out_dtype or cfg.dtype
    if want is None:
        return
    if cat.has_model(base_id):
        have = cat.model(base_id)["dtype"]
    else:
        dtypes = sorted({t.dtype for t in open_checkpoint(base_path).tensors.values()})
        have = dtypes[0] if len(dtypes) == 1 else "mixed:" + ",".join(dtypes)
    if want != have:
        key = "out_dtype" if cfg.out_dtype else "dtype (which mergekit also uses as the output dtype)"
        fix = (f"set `out_dtype: {MERGEKIT_DTYPE[have]}`" if have in MERGEKIT_DTYPE
               else "leave out_dtype out")
        raise ConfigError(f"{cfg.source}: {key}: {MERGEKIT_DTYPE.get(want, want)} cannot be honoured: MergePipe "
                          f"writes the base's dtype ({MERGEKIT_DTYPE.get(have, have)}); {fix}")


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
    if not resolved.pending:
        return planner.plan(save=save, **resolved.plan_kwargs()), resolved
    with cat.transaction():
        apply(cat, resolved)
        plan = planner.plan(save=save, **resolved.plan_kwargs())
    return plan, resolved


# --- export -------------------------------------------------------------------------------------------
def _record(cat: Catalog | None, ref: str) -> dict:
    """The merge settings of a stored plan (by id) or of a snapshot (id, merged model id or directory)."""
    from mergepipe.manifest.build import load_manifest
    from mergepipe.planner.plan import load_plan

    if cat is not None and find_plan_id(cat, ref) is not None:
        p = load_plan(cat, ref).data
        return {"plan_id": p["id"], "digest": p["digest"], "base": p["base"], "experts": p["experts"],
                "operator": p["operator"], "params": p["params"], "seed": p["seed"], "strategy": p["strategy"],
                "budget": p["budget"], "target_bound": p.get("target_bound"), "snapshot_id": None,
                "full_expert_bytes": p["full_expert_bytes"]}
    try:
        m = load_manifest(cat, ref)
    except MergePipeError:
        raise MergePipeError(f"unknown plan or snapshot {ref!r}") from None
    c = m.core
    spec = c["budget"]["spec"]
    target = float(spec.split()[1]) if spec.startswith("target-bound ") else None
    return {"plan_id": c["plan_id"], "digest": c["plan_digest"], "base": c["inputs"]["base"],
            "experts": c["inputs"]["experts"], "operator": c["operator"], "params": c["params"], "seed": c["seed"],
            "strategy": c["strategy"], "budget": c["budget"], "target_bound": target,
            "snapshot_id": m.snapshot_id, "full_expert_bytes": c["full_expert_bytes"]}


def _base_dtype(cat: Catalog | None, base: dict) -> str | None:
    if cat is not None and cat.has_model(base["id"]):
        return cat.model(base["id"])["dtype"]
    try:
        dtypes = sorted({t.dtype for t in open_checkpoint(base["uri"]).tensors.values()})
    except MergePipeError:
        return None
    return dtypes[0] if len(dtypes) == 1 else None


def _expert_setting(e: dict, key: str):
    """(setting, exact) of one expert's weight or density as recorded in a plan.

    A plain plan records a number; a plan with filters or gradients records the expert's own setting
    (which is all a config merged by MergePipe ever has). When only per-tensor values are recorded,
    they are written as one exact-name filter per tensor."""
    own = (e.get("settings") or {}).get(key)
    if own is not None:
        return own, True
    if e.get(key) is not None:
        return e[key], "settings" not in e
    per = e.get("tensors") or {}
    i = 0 if key == "weight" else 1
    if not per:
        return None, True
    return [{"filter": name, "value": v[i]} for name, v in per.items() if v[i] is not None], False


def export_mergekit(cat: Catalog | None, ref: str) -> str:
    """The mergekit YAML equivalent to a stored plan or a published snapshot.

    Paths are the registered uris; a LoRA expert is written as ``BASE+ADAPTER``. ``dtype: float32`` and
    ``out_dtype`` (the base's dtype) say what MergePipe does. The budget, strategy, seed and plan id go
    in the ``mergepipe:`` key (and in a comment), so merging from this YAML reproduces the plan digest."""
    r = _record(cat, ref)
    op = get_op(r["operator"])
    base = r["base"]
    models = []
    notes = []
    for e in r["experts"]:
        path = f"{base['uri']}+{e['uri']}" if e["kind"] == "lora" else e["uri"]
        if e["kind"] == "delta":
            notes.append(f"# NOTE: {e['id']} is a MergePipe delta checkpoint: mergekit would read it as a full model.")
        params = {}
        for key in ("weight", "density") if op.uses_density else ("weight",):
            value, exact = _expert_setting(e, key)
            if value is not None:
                params[key] = value
            if not exact:
                notes.append(f"# NOTE: the {key} of {e['id']} came from a merge-wide setting given to the Python "
                             f"API; it is written per tensor: same values, another plan digest.")
        models.append({"model": path, "parameters": params})
    params = {"normalize": r["params"]["normalize"], "rescale": r["params"]["rescale"],
              "lambda": r["params"]["lambda"]}
    for key in op.params:
        params[key] = r["params"][key]
    doc: dict = {"merge_method": op.name, "base_model": base["uri"], "models": models, "parameters": params,
                 "dtype": "float32"}
    base_dtype = _base_dtype(cat, base)
    if base_dtype in MERGEKIT_DTYPE:
        doc["out_dtype"] = MERGEKIT_DTYPE[base_dtype]
    doc["tokenizer_source"] = "base"
    ext: dict = {}
    if r["target_bound"] is not None:
        ext["target_bound"] = r["target_bound"]
    else:
        ext["budget"] = r["budget"]["spec"]
    ext.update({"strategy": r["strategy"], "seed": r["seed"], "plan": r["plan_id"]})
    doc["mergepipe"] = ext
    source = f"snapshot {r['snapshot_id']} " if r["snapshot_id"] else ""
    header = [f"# mergekit config exported by MergePipe from {source}plan {r['plan_id']} ({r['digest']})",
              (f"# budget {r['budget']['spec']} = {r['budget']['bytes']} B of {r['full_expert_bytes']} B expert read, "
              f"strategy {r['strategy']}, seed {r['seed']}"),
              ("# MergePipe computes in float32 and writes the base's dtype. The `mergepipe:` key holds what mergekit "
              "has no key for; mergekit ignores it."), *notes]
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return "\n".join(header) + "\n" + body
