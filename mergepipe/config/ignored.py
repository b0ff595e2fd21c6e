"""Parameters mergekit 0.1.5 accepts where they are written but never reads (:func:`drop_ignored`).

mergekit resolves a method's merge-wide (SHARED) parameters from the top-level, module and slice
``parameters`` only (config.py ``ConfigReader.parameter_sources(None)``), and its per-model ones from a
model's or source's own ``parameters`` -- skipping the base for the NON_BASE ones
(parameter_resolver.py ``resolve_parameters``). So a merge-wide parameter given per model (``normalize``,
``rescale``, ``int8_mask``, ``t``, ``select_topk``, ``scale`` outside passthrough, ...) and a per-model one
given for the base (DELLA's ``epsilon`` under the base's ``sources:``, as mergekit's model card renders a
config) change nothing in mergekit's output. MergePipe drops them too, with one ``warning:`` line each on
stderr -- ``lambda`` per model included, which it once applied when the models agreed -- and so writes
mergekit's output; what mergekit does read (a non-base source's ``epsilon``, a slice's ``normalize``),
``weight``/``density`` and unknown keys are left to the parser, which honours or refuses them.
"""

from __future__ import annotations

import sys

from mergepipe.config.model import GLOBAL_PARAMS

# mergekit 0.1.5's per-model parameters of each method (merge_methods/*: ParameterScope INPUT / NON_BASE);
# a method not listed has none
_NON_BASE_GTA = ("weight", "density")
PER_MODEL = {
    **{m: _NON_BASE_GTA for m in ("task_arithmetic", "ties", "dare_ties", "dare_linear")},
    "breadcrumbs": _NON_BASE_GTA + ("gamma",), "breadcrumbs_ties": _NON_BASE_GTA + ("gamma",),
    "della": _NON_BASE_GTA + ("epsilon",), "della_linear": _NON_BASE_GTA + ("epsilon",),
    "nuslerp": ("weight",), "multislerp": ("weight",),
    "linear": ("weight",), "passthrough": ("scale",),
}
FOR_BASE_TOO = {"linear": ("weight",), "passthrough": ("scale",)}  # INPUT scope: the base's value is read
_WARNED: set[str] = set()


def drop_ignored(doc: dict, method: str) -> dict:
    """``doc`` without the per-model / per-source parameters mergekit ignores for ``method`` (each named
    once on stderr). Keys MergePipe does not know and weight/density are left for the parser's checks."""
    base = doc.get("base_model")
    base = base.strip() if isinstance(base, str) else None
    out = dict(doc)
    if isinstance(doc.get("models"), list):
        out["models"] = _entries(doc["models"], "models", method, base)
    if isinstance(doc.get("slices"), list):
        out["slices"] = _slices(doc["slices"], "slices", method, base)
    modules = doc.get("modules")
    if isinstance(modules, dict):
        out["modules"] = {name: _module(body, f"modules.{name}", method, base) for name, body in modules.items()}
    return out


def _module(body, where: str, method: str, base) -> object:
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if isinstance(body.get("models"), list):
        body["models"] = _entries(body["models"], f"{where}.models", method, base)
    if isinstance(body.get("slices"), list):
        body["slices"] = _slices(body["slices"], f"{where}.slices", method, base)
    return body


def _slices(raw: list, where: str, method: str, base) -> list:
    out = []
    for k, sl in enumerate(raw):
        if isinstance(sl, dict) and isinstance(sl.get("sources"), list):
            sl = {**sl, "sources": _entries(sl["sources"], f"{where}[{k}].sources", method, base)}
        out.append(sl)
    return out


def _entries(raw: list, where: str, method: str, base) -> list:
    """Each model entry / source with the keys mergekit ignores dropped."""
    out = []
    for j, item in enumerate(raw):
        params = item.get("parameters") if isinstance(item, dict) else None
        if isinstance(params, dict):
            model = item.get("model")
            is_base = isinstance(model, str) and base is not None and model.strip() == base
            keep = {}
            for key, value in params.items():
                reason = _ignored(key, method, is_base)
                if reason is None:
                    keep[key] = value
                else:
                    warn(f"ignoring `{key}` in {where}[{j}].parameters: {reason}; mergekit 0.1.5 ignores it too")
            item = {**item, "parameters": keep}
        out.append(item)
    return out


def _ignored(key, method: str, is_base: bool) -> str | None:
    """Why mergekit does not read ``key`` here (None: it does, or MergePipe's parser decides: weight, density,
    a key it does not know)."""
    if not isinstance(key, str) or key not in GLOBAL_PARAMS or key in ("weight", "density"):
        return None
    per_model = PER_MODEL.get(method, ())
    if key not in per_model:
        return (f"{method} takes no per-model `{key}` (a merge-wide parameter goes under the top-level, module "
                f"or slice `parameters:`)")
    if is_base and key not in FOR_BASE_TOO.get(method, ()):
        return f"{method} reads `{key}` for the models merged into the base, not for the base"
    return None


def warn(message: str) -> None:
    """One ``warning:`` line on stderr, once per process for the same text (a config is parsed more than once)."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    print(f"warning: {message}", file=sys.stderr)
