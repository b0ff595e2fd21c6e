"""Refusing a change to a snapshot merged with a non-additive operator: the message says why and offers the
from-scratch `mergepipe merge` of the new set (the snapshot's recipe with the change applied)."""

from __future__ import annotations

import shlex

from mergepipe.ops.core import get_op
from mergepipe.planner.extend_request import ExtendRequest


def non_additive_message(operator: str, ref: str, core: dict, request: ExtendRequest) -> str:
    """The refusal of a change to a non-additive snapshot, with the from-scratch command of the new set: the
    snapshot's recipe (its operator, parameters, budget, strategy, seed) with the change applied."""
    why = (f"snapshot {ref} was merged with {operator}, which is not additive: its result is not a fixed-"
           f"coefficient sum of the experts' deltas (sign election, trimming and random drops depend on every "
           f"expert together), so one expert cannot be added, removed or reweighted without reading them all")
    experts = [dict(e) for e in core["inputs"]["experts"]]
    ids = [e["id"] for e in experts]
    eid, weight = request.expert, request.weight
    if request.action == "add" and eid in ids:
        return _already_in_message(core, experts, request, ref, why)
    if request.action != "add" and eid not in ids:
        return f"{eid!r} is not an expert of snapshot {ref} (its experts: {', '.join(ids)})"
    if request.action == "remove" and len(ids) == 1:
        return f"{eid} is the only expert of snapshot {ref}: a merge needs at least one expert"
    if request.action == "add":
        density = _common(e.get("density") for e in experts)
        experts.append({"id": eid, "weight": 1.0 if weight is None else weight, "density": density})
    elif request.action == "remove":
        experts = [e for e in experts if e["id"] != eid]
    else:
        experts = [dict(e, weight=weight) if e["id"] == eid else e for e in experts]
    return f"{why}; merge the new set from scratch instead: {_scratch_text(core, experts, request, ref)}"


def _already_in_message(core: dict, experts: list[dict], request: ExtendRequest, ref: str, why: str) -> str:
    eid, weight = request.expert, request.weight
    old = next(e for e in experts if e["id"] == eid)
    held = f"{eid!r} is already an expert of snapshot {ref}" + \
        (f" (weight {old['weight']:g})" if old.get("weight") is not None else "")
    if weight is None or weight == old.get("weight"):
        return f"{held}: nothing to add (and {why})"
    experts = [dict(e, weight=weight) if e["id"] == eid else e for e in experts]
    return (f"{held}; {why}; to give it weight {weight:g}, merge the set from scratch instead: "
            f"{_scratch_text(core, experts, request, ref)}")


def _scratch_text(core: dict, experts: list[dict], request: ExtendRequest, ref: str) -> str:
    command = scratch_command(core, experts, request)
    if command is not None:
        return command
    return (f"write the snapshot's recipe with `mergepipe explain {shlex.quote(ref)} --as-mergekit --out recipe.yaml`, "
            f"change its models and run `mergepipe merge --config recipe.yaml --out DIR` (its settings cannot all be "
            f"given as flags)")


def _common(values):
    """The one value all of ``values`` share; None when they differ or there are none."""
    values = list(values)
    return values[0] if values and all(v == values[0] for v in values) else None


def scratch_command(core: dict, experts: list[dict], request: ExtendRequest) -> str | None:
    """`mergepipe merge` of ``experts`` with the snapshot's settings, runnable as printed (the request's
    --out and --model-id, else DIR); None where a setting has no flag (per-tensor values, slices, a
    re-ordered vocabulary, a model soup): the recipe then goes through a YAML config."""
    op = get_op(core["operator"])
    if not _flags_can_say(core, experts, op):
        return None
    args = ["mergepipe", "merge", "--base", core["inputs"]["base"]["id"], "--experts", *[e["id"] for e in experts],
            "--op", op.name]
    if _takes(op, "weight"):
        args += ["--weights", *[_number(e["weight"]) for e in experts]]
    if op.uses_density and experts[0].get("density") is not None:
        args += ["--density", _number(experts[0]["density"])]
    args += _param_flags(op, core["params"]) + _plan_flags(core)
    args += ["--out", request.out or "DIR"] + (["--model-id", request.model_id] if request.model_id else [])
    return " ".join(a if a == "DIR" else shlex.quote(str(a)) for a in args)


def _flags_can_say(core: dict, experts: list[dict], op) -> bool:
    if core.get("layout") or core["inputs"].get("base_member") or (core.get("tokenizer") or {}).get("vocab"):
        return False
    if any((_takes(op, "weight") and e.get("weight") is None) or e.get("settings") or e.get("tensors")
           for e in experts):
        return False
    if any(e.get(k) is not None and e.get(k) != core["params"].get(k) for e in experts for k in ("gamma", "epsilon")):
        return False
    if op.uses_density and len({e.get("density") for e in experts}) > 1:
        return False
    return all(isinstance(core["params"].get(p.name), (bool, int, float)) for p in op.parameters
               if p.name not in ("weight", "density"))


def _number(x) -> str:
    """``x`` as short as it reads back exactly."""
    short = f"{float(x):g}"
    return short if float(short) == float(x) else repr(float(x))


def _takes(op, name: str) -> bool:
    return any(p.name == name for p in op.parameters)


def _param_flags(op, params: dict) -> list[str]:
    """The operator's parameters that differ from its defaults, as flags."""
    out = []
    for p in op.parameters:
        if p.name in ("weight", "density") or params.get(p.name) == p.default:
            continue
        value = params[p.name]
        out += [p.option if value else f"--no-{p.name}"] if p.kind is bool else [p.option, _number(value)]
    return out


def _plan_flags(core: dict) -> list[str]:
    """Budget, strategy, seed and compact tier as the snapshot's plan had them."""
    spec = core["budget"]["spec"]
    out = ["--target-bound", spec.split()[1]] if spec.startswith("target-bound ") else ["--budget", spec]
    if core.get("strategy") not in (None, "norm"):
        out += ["--strategy", core["strategy"]]
    if core.get("seed"):
        out += ["--seed", str(core["seed"])]
    mode = (core.get("compact") or {}).get("mode")
    return out + (["--compact", mode] if mode not in (None, "auto", "off") else [])
