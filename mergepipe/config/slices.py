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

This module reads ``slices:`` (:func:`read_slices`, at parse time); slice_expand.py expands it against the
models' tensors (:func:`~mergepipe.config.slice_expand.expand`, at resolve time) into data the planner and
engine already understand:

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
own layer_range (slice_export.py).

What MergePipe cannot do exactly is refused: a LoRA adapter at other layers than the base's (its delta is
trained on its base's own layers), an expert whose tensor at the paired layer has another shape than the base's,
and re-ordered embedding rows (``tokenizer_source`` with different vocabularies) combined with views; every
slice lists the same models with the base among them, and each base layer is merged at most once (repeat
layers with passthrough): the plan merges each base tensor once.
"""

from __future__ import annotations

from dataclasses import dataclass

from mergepipe.config.model import ConfigError, ConfigModel, GRADIENT_PARAMS, PER_TENSOR
from mergepipe.errors import brief
from mergepipe.ops.core import get_op
from mergepipe.ops.setting import Setting

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

