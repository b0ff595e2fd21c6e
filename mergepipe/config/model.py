"""A mergekit YAML config as MergePipe reads it: the keys it accepts or refuses, and the parsed form.

Budgets are not a mergekit concept: they come from ``--budget`` or the ``mergepipe:`` extension key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mergepipe.errors import MergePipeError
from mergepipe.ops.core import get_op
from mergepipe.ops.spec import all_parameters
from mergepipe.planner.budget import Budget


MAX_CONFIG_BYTES = 1 << 20  # a merge config is a few hundred bytes; refuse to parse anything huge

TOP_KEYS = ("models", "slices", "modules", "base_model", "merge_method", "parameters", "dtype", "out_dtype",
            "tokenizer_source", "tokenizer", "chat_template", "mergepipe")
REFUSED_TOP_KEYS: dict[str, str] = {}
# mergekit's `tokenizer:` block
TOKENIZER_KEYS = ("source", "tokens", "pad_to_multiple_of")


# The parameters a config may give, from the operators' declarations (ops/spec.py): merge-wide, all
# of them (plus mergekit's int8_mask, accepted and ignored); per model, those that may vary per tensor
# (weight, density) and the numbers that some mergekit versions take per model but MergePipe applies
# once (lambda: it must agree between models) or per model (gamma, epsilon: mergekit's per-model
# parameters; one merge-wide value when the models agree).
PARAMS = {p.name: p for p in all_parameters()}
PER_TENSOR = tuple(n for n, p in PARAMS.items() if p.per_tensor)
# the interpolation methods' own parameters (t, nuslerp_flatten, filter_wise, ...): merge-wide, passed to
# the operator as given
METHOD_PARAMS = tuple(n for n in PARAMS if n not in ("weight", "density", "lambda", "normalize", "rescale",
                                                      "gamma", "epsilon"))
SHARED_PARAMS = tuple(n for n, p in PARAMS.items() if not p.per_tensor and p.kind is float and n not in METHOD_PARAMS)
# merge-wide values that may be a gradient or filter list (slerp's and nearswap's t)
GRADIENT_PARAMS = tuple(n for n, p in PARAMS.items() if p.gradient)
GLOBAL_PARAMS = tuple(PARAMS) + ("int8_mask",)
MODEL_PARAMS = PER_TENSOR + SHARED_PARAMS
EXTENSION_KEYS = ("budget", "target_bound", "strategy", "seed", "plan", "compact", "moe_layout")
# mergekit methods MergePipe does not implement (named so that the refusal says so).
MERGEKIT_ONLY_METHODS = ("slerp", "nuslerp", "multislerp", "model_stock", "passthrough", "karcher", "sce",
                         "arcee_fusion", "nearswap", "ram", "core_space", "task_adapter", "cabs", "lrp", "pcb",
                         "zipit", "generalized_anysize", "tokenizer_permute")
# mergekit methods that ignore or allow an absent base_model but that MergePipe still needs one for (named so
# that the refusal says so); linear and karcher take none (OpSpec.base_optional).
BASELESS_LATER = ("passthrough",)
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
    own: dict = dataclasses.field(default_factory=dict)  # its own gamma/epsilon where they differ between models


@dataclass(frozen=True)
class MergekitConfig:
    """A validated mergekit config, in MergePipe terms (operator name, one value per shared parameter)."""

    source: str
    method: str
    base: str | None  # None: a model soup without base_model (the resolver picks a reference model)
    models: tuple[ConfigModel, ...]
    normalize: bool | None = None
    rescale: bool | None = None
    lam: float | None = None
    gamma: float | None = None
    epsilon: float | None = None
    dtype: str | None = None  # safetensors names (F32, BF16, ...)
    out_dtype: str | None = None
    budget: Budget | None = None
    target_bound: float | None = None
    strategy: str | None = None
    seed: int | None = None
    compact: str | None = None  # the compact tier (planner/request.py COMPACT_MODES); None: auto
    plan_id: str | None = None  # informational (written by export)
    tokenizer_source: str | None = None  # "union", "base", a model reference as written; None: not given
    tokenizer_tokens: tuple = ()  # mergekit's tokenizer.tokens as ((token, force, source as written), ...)
    pad_to_multiple_of: int | None = None
    chat_template: str | None = None  # "auto", a template name or the template text
    method_params: dict = dataclasses.field(default_factory=dict)  # METHOD_PARAMS given (t, filter_wise, ...)
    slices: tuple | None = None  # `slices:` as config/slices.py reads it (OutputSlice, ...); None: `models:`
    # a multi-module architecture's `modules:` as config/modules.py reads them (Module, ...); None: not given
    modules: tuple | None = None
    slices_reference: bool = False  # slices (modules) without base_model: the base is the first source (a reference)
    moe_layout: str | None = None  # mergepipe.moe_layout: fused, per-expert (None: mergekit's, storage/moe_layout.py)

    def with_overrides(self, operator=None, budget=None, target_bound=None, strategy=None, seed=None,
                       compact=None, moe_layout=None, **params) -> MergekitConfig:
        """The config with command-line settings replacing its own (None: keep the config's value).

        ``params`` are operator parameters by their request keyword (ops/spec.py declarations:
        ``weights``, ``density``, ``lam``, ``normalize``, ``rescale``, ``gamma``, ``epsilon``):
        ``density`` replaces every model's density; ``weights`` lists one weight per model in config
        order; a budget or target bound replaces both of the config's budget settings."""
        changes: dict = {}
        if operator is not None:
            changes["method"] = get_op(operator).name
        unknown = sorted(set(params) - {p.key for p in PARAMS.values()})
        if unknown:
            raise ConfigError(f"unknown parameter {', '.join(unknown)}")
        models = list(self.models)
        if self.modules is not None and (params.get("weights") is not None or params.get("density") is not None):
            raise ConfigError(f"{self.source}: weights and densities are given per module: edit the config's "
                              f"`modules:` rather than overriding them")
        method_params = dict(self.method_params)
        for p in PARAMS.values():
            value = params.get(p.key)
            if value is None:
                continue
            if p.name in METHOD_PARAMS:
                method_params[p.name] = value
            elif p.name == "weight":
                if len(value) != len(models):
                    raise ConfigError(f"{len(value)} weights given for the {len(models)} models of {self.source}")
                models = [dataclasses.replace(m, weight=float(w)) for m, w in zip(models, value)]
            elif p.per_tensor:
                models = [dataclasses.replace(m, **{p.name: float(value)}) for m in models]
            else:
                changes[p.key] = value
                models = [dataclasses.replace(m, own={k: v for k, v in m.own.items() if k != p.name})
                          for m in models]  # one value for every model now
        changes["models"] = tuple(models)
        changes["method_params"] = method_params
        for name, value in (("strategy", strategy), ("seed", seed), ("compact", compact), ("moe_layout", moe_layout)):
            if value is not None:
                changes[name] = value
        if budget is not None or target_bound is not None:
            changes["budget"] = None if budget is None else Budget.of(budget)
            changes["target_bound"] = target_bound
        return dataclasses.replace(self, **changes)
