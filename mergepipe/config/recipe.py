"""Merge recipes (issue 17): a named, versioned merge -- base, experts by id or name pattern, operator,
parameters, budget, output folder pattern -- stored in the catalog and re-planned against the catalog as
it is now on every run.

A run resolves the experts (registered models on the recipe's base whose id matches an entry; snapshots
are never experts), plans the from-scratch merge, and, when the recipe's last snapshot differs from the
current set by one added, removed or reweighted expert and the operator is additive, the incremental one
(planner/extend.py). It executes the cheaper by estimated bytes read; EXPLAIN shows both. A re-trained
expert (same id, other files), a changed recipe or more than one change is merged from scratch.
"""

from __future__ import annotations

import fnmatch
import math
import string
import time
from dataclasses import asdict, dataclass, field

from mergepipe.catalog import recipes as store
from mergepipe.catalog.db import Catalog
from mergepipe.errors import MergePipeError, PlanError, brief
from mergepipe.manifest.verify import load_manifest
from mergepipe.ops.core import get_op
from mergepipe.planner.budget import Budget, human_bytes
from mergepipe.planner.extend import ExtendRequest, plan_extend
from mergepipe.planner.request import MergeRequest

OUT_FIELDS = ("name", "n", "version", "date")
MAX_OUT = 4096  # characters of an output pattern, and of the folder name made from it (PATH_MAX)


@dataclass(frozen=True)
class Recipe:
    name: str
    base: str
    experts: tuple  # model ids or fnmatch patterns ("math-*")
    operator: str = "linear"
    weights: dict = field(default_factory=dict)  # id or pattern -> weight (first match; default 1)
    params: dict = field(default_factory=dict)  # lam, normalize, ... as MergeRequest.build takes them
    budget: str = "100%"
    out: str = "{name}-{n}"

    @classmethod
    def build(cls, name: str, base: str, experts, operator: str = "linear", weights=None, params=None,
              budget=None, out: str | None = None) -> Recipe:
        _check_fields(name, experts, weights, params)
        recipe = cls(name, base, tuple(experts), get_op(operator).name, dict(weights or {}),
                     {k: v for k, v in (params or {}).items() if v is not None},
                     Budget.of(budget).spec if budget is not None else "100%", out or "{name}-{n}")
        if Budget.of(recipe.budget).is_target:
            raise PlanError("a recipe takes a byte or fraction budget")
        out_path(recipe.out, name=name, n=10**9, version=10**9, date="20260101")  # refused now, not on a run
        MergeRequest.build(base, list(recipe.experts), recipe.operator, budget=recipe.budget, **recipe.params)
        return recipe

    def body(self) -> dict:
        d = asdict(self)
        d["experts"] = list(self.experts)
        d["weights"] = [[k, v] for k, v in self.weights.items()]  # a list keeps the order (first match wins)
        return d

    def weight_of(self, model_id: str) -> float:
        for pattern, w in self.weights.items():
            if fnmatch.fnmatchcase(model_id, pattern):
                return float(w)
        return 1.0


def _check_fields(name, experts, weights, params) -> None:
    """The recipe's own fields, as the API may pass any value: one PlanError for each kind of mistake."""
    if not isinstance(name, str) or not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise PlanError(f"recipe name {brief(name)}: use letters, digits, '-', '_' and '.'")
    if not experts:
        raise PlanError("a recipe needs at least one expert id or pattern")
    if not isinstance(experts, (list, tuple)) or not all(isinstance(e, str) and e for e in experts):
        raise PlanError(f"a recipe's experts are a list of model ids or patterns, not {brief(experts)}")
    if weights is not None and not (isinstance(weights, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in weights.items())):
        raise PlanError(f"a recipe's weights map patterns to numbers, not {brief(weights)}")
    if params is not None and not (isinstance(params, dict) and all(isinstance(k, str) for k in params)):
        raise PlanError(f"a recipe's parameters map names to values, not {brief(params)}")


def save_recipe(catalog: Catalog, recipe: Recipe) -> int:
    catalog.model(recipe.base)  # an unknown base is refused now
    return store.save_recipe(catalog, recipe.name, recipe.body())


def load_recipe(catalog: Catalog, name: str, version: int | None = None) -> tuple[Recipe, int]:
    import json
    row = store.recipe_row(catalog, name, version)
    if row is None:
        raise PlanError(f"unknown recipe {brief(name)}" + (f" version {version}" if version is not None else "")
                        + " (see `mergepipe recipe list`)")
    body = json.loads(row["json"])
    body["experts"] = tuple(body["experts"])
    body["weights"] = {k: v for k, v in body["weights"]}
    return Recipe(**body), row["version"]


def resolve_experts(catalog: Catalog, recipe: Recipe) -> list[dict]:
    """``[{"model": id, "weight": w}]`` of the registered models the recipe names, sorted by id."""
    candidates = [m for m in catalog.models() if m["base_id"] == recipe.base and not m["snapshot_id"]]
    chosen = []
    for entry in recipe.experts:
        hits = [m["id"] for m in candidates if fnmatch.fnmatchcase(m["id"], entry)]
        if not hits and not any(c in entry for c in "*?["):
            raise PlanError(f"recipe {recipe.name}: expert {brief(entry)} is not registered on base {brief(recipe.base)}")
        chosen += hits
    ids = sorted(set(chosen))
    if not ids:
        raise PlanError(f"recipe {recipe.name}: no registered expert on {brief(recipe.base)} matches "
                        f"{', '.join(recipe.experts)}")
    return [{"model": i, "weight": recipe.weight_of(i)} for i in ids]


def _out(catalog: Catalog, recipe: Recipe, version: int) -> str:
    n = store.recipe_run_count(catalog, recipe.name) + 1
    return out_path(recipe.out, name=recipe.name, n=n, version=version, date=time.strftime("%Y%m%d", time.gmtime()))


def out_path(pattern: str, **values) -> str:
    """The output folder a pattern names: each plain ``{field}`` (one of OUT_FIELDS) replaced by its value.

    Never ``str.format``: a format spec (``{name:>1000000000}``) would build a gigabyte string and
    ``{name.__class__}`` reads attributes. The length is counted before anything is built."""
    pieces = _out_pieces(pattern)
    texts = [(literal, "" if field is None else str(values[field])) for literal, field in pieces]
    length = sum(len(a) + len(b) for a, b in texts)
    if length > MAX_OUT:
        raise PlanError(f"output pattern {brief(pattern)}: makes a folder name of {length:,} characters "
                        f"(at most {MAX_OUT})")
    return "".join(a + b for a, b in texts)


def _out_pieces(pattern) -> list[tuple[str, str | None]]:
    """(literal text, field or None) of an output pattern; anything but plain placeholders is refused."""
    if not isinstance(pattern, str) or len(pattern) > MAX_OUT:
        raise PlanError(f"output pattern {brief(pattern)}: a folder pattern of at most {MAX_OUT} characters")
    try:
        pieces = list(string.Formatter().parse(pattern))
    except ValueError as exc:  # a lone { or }
        raise PlanError(f"output pattern {brief(pattern)}: {exc} (write {{{{ and }}}} for braces)") from None
    for _, field, spec, conversion in pieces:
        if field is not None and (field not in OUT_FIELDS or spec or conversion):
            shown = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise PlanError(f"output pattern {brief(pattern)}: only {{name}}, {{n}}, {{version}} and {{date}} may "
                            f"be used, as written (not {brief(shown)})")
    return [(literal, field) for literal, field, _, _ in pieces]


def _incremental(catalog: Catalog, recipe: Recipe, experts: list[dict], out: str):
    """(ExtendRequest, None) when one change separates the recipe's last snapshot from ``experts``, else
    (None, why not)."""
    if not get_op(recipe.operator).additive:
        return None, f"{recipe.operator} is not additive"
    last = store.last_recipe_snapshot(catalog, recipe.name)
    if last is None:
        return None, "the recipe has no snapshot yet"
    core = load_manifest(catalog, last["snapshot_id"]).core
    same = (core["operator"] == recipe.operator and core["inputs"]["base"]["id"] == recipe.base
            and core["budget"]["spec"] == recipe.budget)
    if not same:
        return None, "the recipe's base, operator or budget changed since its last snapshot"
    old = {e["id"]: e for e in core["inputs"]["experts"]}
    now = {e["model"]: e["weight"] for e in experts}
    retrained = [i for i in old if i in now and catalog.model(i)["fingerprint"] != old[i]["fingerprint"]]
    if retrained:
        return None, f"{', '.join(retrained)} re-trained since the last snapshot"
    changes = [("add", i, w) for i, w in now.items() if i not in old]
    changes += [("remove", i, None) for i in old if i not in now]
    changes += [("reweight", i, now[i]) for i in old if i in now and old[i].get("weight") != now[i]]
    if not changes:
        return None, f"up to date: snapshot {last['snapshot_id']} has this set"
    if len(changes) > 1:
        return None, f"{len(changes)} changes since the last snapshot (an incremental merge takes one)"
    action, expert, weight = changes[0]
    return ExtendRequest.build(last["snapshot_id"], action, expert, weight=weight,
                               budget=recipe.budget if action == "add" else None, out=out), None


def recipe_options(catalog: Catalog, name: str) -> dict:
    """Both ways of running the recipe now, with their estimated reads, and the cheaper one."""
    recipe, version = load_recipe(catalog, name)
    experts = resolve_experts(catalog, recipe)
    out = _out(catalog, recipe, version)
    from mergepipe.planner.context import Planner
    scratch_req = MergeRequest.build(recipe.base, experts, recipe.operator, budget=recipe.budget, out=out,
                                     **recipe.params)
    scratch = Planner(catalog).plan(scratch_req, save=False)
    options = {"recipe": recipe, "version": version, "experts": experts, "out": out,
               "scratch": {"plan": scratch, "request": scratch_req,
                           "reads": scratch.estimated["base_read"] + scratch.estimated["expert_read"]}}
    ext_req, why = _incremental(catalog, recipe, experts, out)
    incremental = {"why_not": why}
    if ext_req is not None:
        try:
            p = plan_extend(catalog, ext_req)
            e = p.estimated
            incremental = {"plan": p, "request": ext_req, "reads": e["snapshot_read"] + e["base_read"] + e["expert_read"],
                           "why_not": None}
        except MergePipeError as exc:
            incremental = {"why_not": str(exc)}
    options["incremental"] = incremental
    if why and why.startswith("up to date"):
        options["choice"] = "none"
    elif incremental.get("plan") is not None and incremental["reads"] < options["scratch"]["reads"]:
        options["choice"] = "incremental"
    else:
        options["choice"] = "scratch"
    return options


def explain_options(options: dict) -> str:
    r = options["recipe"]
    s, i = options["scratch"], options["incremental"]
    lines = [f"RECIPE {r.name} v{options['version']}  {r.operator} on {r.base}, budget {r.budget}, out {options['out']}",
             "  experts     " + ", ".join(f"{e['model']}:{e['weight']:g}" for e in options["experts"]),
             f"  scratch     reads {human_bytes(s['reads'])}  (plan {s['plan'].id})"]
    if i.get("plan") is not None:
        c = i["plan"]["change"]
        lines.append(f"  incremental reads {human_bytes(i['reads'])}  ({c['action']} {c['expert']} on snapshot "
                     f"{i['plan']['parent']['snapshot_id']}, plan {i['plan'].id})")
    else:
        lines.append(f"  incremental n/a: {i['why_not']}")
    choice = options["choice"]
    lines.append("  choice      " + {"none": "nothing to do (up to date)", "scratch": "from scratch",
                                      "incremental": "incremental"}[choice])
    if choice == "none":
        lines.append(f"  ({i['why_not']})")
    return "\n".join(lines)
