"""The Plan page's settings as mergekit YAML: a config (uploaded, typed as a path, or edited on the page)
turned into the page's settings, refused where the page cannot show it, and a plan written back as YAML."""

from __future__ import annotations

from pathlib import Path

from mergepipe import api
from mergepipe.api import Budget, Catalog, Plan
from mergepipe.dashboard.paths import check_path
from mergepipe.errors import MergePipeError, PlanError


PLAN_PAGE_TRI = {None: "default", True: "on", False: "off"}


def read_config_source(upload: bytes | None, path: str | None, roots: list[Path],
                       upload_name: str | None = None) -> tuple[bytes, str]:
    """The bytes of a mergekit YAML from an upload, else from a typed path under an allowed folder."""
    if upload is not None:
        return upload, upload_name or "uploaded config"
    p = check_path(path or "", roots)
    return api.read_config_file(p), p.name


def mergekit_plan_settings(cat: Catalog, text: str | bytes, source: str, roots: list[Path]) -> dict:
    """Plan-page settings (widget key -> value) equivalent to a mergekit YAML config.

    Only looks at the catalog: the config's models must be registered already (a path is matched by
    uri and fingerprint; paths must lie under an allowed folder). Refuses what the page cannot show
    (per-model densities that differ, a budget that is not a whole percentage)."""
    cfg = api.parse_config(text, source)
    r = api.resolve_config(cat, cfg, register_paths=False, check_path=lambda t: check_path(t, roots))
    spec = api.operator_spec(cfg.method)
    if r.layout is not None:
        raise PlanError(f"{source}: its `slices:` renumber, repeat or copy layers, which the Plan page cannot show; "
                        f"use `mergepipe merge --config`")
    experts = [e["model"] for e in r.experts]
    for e in experts:
        if cat.model(e)["base_id"] != r.base:
            raise PlanError(f"expert {e!r} is registered with base {cat.model(e)['base_id']!r}, not {r.base!r}")
    settings: dict = {"base": r.base, "experts": experts, "op": spec.name, "lam": 1.0 if cfg.lam is None else cfg.lam,
                      "normalize": PLAN_PAGE_TRI[cfg.normalize], "rescale": PLAN_PAGE_TRI[cfg.rescale],
                      "seed": 0 if cfg.seed is None else cfg.seed, "strategy": cfg.strategy or "norm"}
    if getattr(cfg, "compact", None) is not None:  # the `mergepipe: compact:` key (issue 27)
        settings["compact"] = cfg.compact
    for e in r.experts:
        for key in ("weight", "density"):
            if isinstance(e.get(key), list):
                raise PlanError(f"{source}: the {key} of {e['model']} varies per tensor (a filter or gradient), "
                                f"which the Plan page cannot show; use `mergepipe merge --config`")
        settings[f"w_{e['model']}"] = float(e.get("weight", 1.0))
    if spec.uses_density:
        densities = sorted({float(e.get("density", 1.0)) for e in r.experts})
        if len(densities) > 1:
            raise PlanError(f"{source}: the models' densities differ ({', '.join(f'{d:g}' for d in densities)}); "
                            f"the Plan page uses one density for all (use `mergepipe merge --config`)")
        d = densities[0]
        if not (0.01 <= d <= 1.0 and abs(round(d, 2) - d) < 1e-9):
            raise PlanError(f"{source}: density {d:g} is not one the Plan page offers (0.01 to 1 in steps of 0.01)")
        settings["density"] = round(d, 2)
    for p in spec.extras:
        value = cfg.method_params.get(p.name) if p.name in cfg.method_params else getattr(cfg, p.key, None)
        value = p.default if value is None else value
        if isinstance(value, (list, dict)):
            raise PlanError(f"{source}: {p.name} varies per tensor, which the Plan page cannot show; use "
                            f"`mergepipe merge --config`")
        if not p.in_range(value):
            raise PlanError(f"{source}: {p.name} {value:g} is outside the Plan page's range {p.range_text()}")
        settings[p.name] = float(value)
    if cfg.target_bound is not None:
        if not spec.additive:
            raise PlanError(f"{source}: a target bound needs an additive operator (linear, task_arithmetic)")
        settings.update({"mode": "target bound", "target": float(cfg.target_bound)})
    elif cfg.budget is not None:
        settings.update({"mode": "budget", "budget": _whole_percent(cfg.budget, source)})
    return settings


def _whole_percent(budget: Budget, source: str) -> int:
    pct = None if budget.fraction is None else budget.fraction * 100
    if pct is None or not 0 <= pct <= 100 or abs(pct - round(pct)) > 1e-9:
        raise PlanError(f"{source}: budget {budget.spec} is not a whole percentage, which the Plan page's slider needs "
                        f"(use `mergepipe merge --config` for other budgets)")
    return round(pct)


def plan_yaml(cat: Catalog, plan: Plan | dict) -> str:
    """The mergekit YAML (with the ``mergepipe:`` key: budget, strategy, seed) of a plan, saved or not."""
    return api.plan_as_yaml(cat, plan)


def check_plan_yaml(cat: Catalog, text: str, roots: list[Path]) -> tuple[dict, str]:
    """(Plan-page settings, a one-line description) of an edited YAML; raises a MergePipeError saying what
    is wrong (syntax, unknown model, a value out of range, what the page cannot show)."""
    if not (text or "").strip():
        raise MergePipeError("the YAML is empty")
    settings = mergekit_plan_settings(cat, text, "the edited YAML", roots)
    how = (f"target bound {settings['target']:g}" if settings.get("mode") == "target bound"
           else f"budget {settings['budget']}%" if "budget" in settings else "budget 100%")
    return settings, f"{settings['op']} of {', '.join(settings['experts'])} on {settings['base']}, {how}"
