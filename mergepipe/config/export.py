"""Export a stored plan or snapshot as the equivalent mergekit YAML (:func:`export_mergekit`); merging
from that YAML gives the same plan digest (budget, strategy and seed travel in a ``mergepipe:`` key)."""

from __future__ import annotations

import yaml

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.plans import find_plan_id
from mergepipe.config.model import MERGEKIT_DTYPE
from mergepipe.errors import MergePipeError, brief
from mergepipe.ops.core import get_op
from mergepipe.ops.setting import Setting
from mergepipe.storage.dtypes import float_dtype, label_float_dtype
from mergepipe.planner.budget import human_bytes
from mergepipe.planner.plan import as_plan
from mergepipe.storage.views import is_view
from mergepipe.storage.registry import open_checkpoint


# --- export -------------------------------------------------------------------------------------------
def _record(cat: Catalog | None, ref: str) -> dict:
    """The merge settings of a stored plan (by id) or of a snapshot (id, merged model id or directory)."""
    from mergepipe.manifest.verify import load_manifest
    from mergepipe.planner.plan import load_plan

    if cat is not None and find_plan_id(cat, ref) is not None:
        return _plan_record(load_plan(cat, ref).data)
    try:
        m = load_manifest(cat, ref)
    except MergePipeError:
        raise MergePipeError(f"unknown plan or snapshot {brief(ref)}") from None
    c = m.core
    spec = c["budget"]["spec"]
    target = float(spec.split()[1]) if spec.startswith("target-bound ") else None
    return {"plan_id": c["plan_id"], "digest": c["plan_digest"], "base": c["inputs"]["base"],
            "experts": c["inputs"]["experts"], "operator": c["operator"], "params": c["params"], "seed": c["seed"],
            "strategy": c["strategy"], "budget": c["budget"], "target_bound": target,
            "snapshot_id": m.snapshot_id, "full_expert_bytes": c["full_expert_bytes"], "tokenizer": c.get("tokenizer"),
            "layout": c.get("layout"), "base_member": c["inputs"].get("base_member"), "out_dtype": c.get("out_dtype"),
            "moe_layout": c.get("moe_layout"),
            "compact": (c.get("compact") or {}).get("mode")}


def _plan_record(data: dict) -> dict:
    p = as_plan(data)
    return {"plan_id": p.id, "digest": p.digest, "base": p.base, "experts": p.experts,
            "operator": p.operator, "params": p.params, "seed": p.seed, "strategy": p.strategy,
            "budget": p.budget, "target_bound": p.target_bound, "snapshot_id": None,
            "full_expert_bytes": p.full_expert_bytes, "tokenizer": p.tokenizer, "layout": p.layout,
            "out_dtype": p.out_dtype, "moe_layout": p.moe_layout,
            "base_member": p.base_member, "compact": p.compact_mode}


def _base_dtype(cat: Catalog | None, base: dict) -> str | None:
    """The base's one float dtype (non-float buffers aside), or None."""
    if cat is not None and cat.has_model(base["id"]):
        return label_float_dtype(cat.model(base["id"])["dtype"])
    try:
        return float_dtype(t.dtype for t in open_checkpoint(base["uri"]).tensors.values())
    except MergePipeError:
        return None


def _in_place_layout(cat: Catalog | None, base: dict) -> dict:
    """The layout of a merge that keeps the base's tensors in place (as config/slices.py expands it: the
    tensors before the layers, the layers, the others), for writing its layer views as slices."""
    from mergepipe.ops.setting import LAYER, PRE_LAYER_NAMES
    if cat is not None and cat.has_model(base["id"]):
        names = [t["name"] for t in cat.tensors(base["id"])]
    else:
        names = list(open_checkpoint(base["uri"]).tensors)
    layer = {n: int(m.group(1)) for n in names if (m := LAYER.search(n))}
    pre = [n for n in names if n not in layer and any(p in n for p in PRE_LAYER_NAMES)]
    post = [n for n in names if n not in layer and n not in pre]
    inside = sorted(layer, key=lambda n: (layer[n], names.index(n)))
    return {"tensors": [[n, base["id"], n, None] for n in pre + inside + post],
            "layers": [[base["id"], i] for i in sorted(set(layer.values()))]}


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


def _flag_out(value):
    """normalize/rescale as mergekit writes them: a bool, or filters of bools (stored as 1.0/0.0)."""
    return Setting.from_json(value).to_yaml(flag=True) if isinstance(value, list) else value


def export_mergekit(cat: Catalog | None, ref: str) -> str:
    """The mergekit YAML equivalent to a stored plan or a published snapshot.

    Paths are the registered uris; a LoRA expert is written as ``BASE+ADAPTER``. ``dtype: float32`` and
    ``out_dtype`` (the plan's output dtype, else the base's) say what MergePipe does. The budget, strategy,
    seed and plan id go in the ``mergepipe:`` key (and in a comment), so merging from this YAML reproduces the
    plan digest."""
    return _to_yaml(cat, _record(cat, ref))


def export_plan_data(cat: Catalog | None, plan_data: dict) -> str:
    """The mergekit YAML of a plan that need not be stored (``Plan.data``): what the dashboard's Plan
    page shows and edits for its current settings."""
    return _to_yaml(cat, _plan_record(plan_data))


def _to_yaml(cat: Catalog | None, r: dict) -> str:
    op = get_op(r["operator"])
    base = r["base"]
    models, notes = _expert_models(op, base, r["experts"])
    params = _merge_params(op, r)
    if op.common is not None and op.max_experts == 1:  # slerp, nearswap: mergekit lists the base among two models
        models.insert(0, {"model": base["uri"]})
    member = r.get("base_member")
    if member:  # a model soup: the base is one of the models (config/soup.py)
        weight, _ = _expert_setting(member, "weight")
        takes_weight = op.common is None or "weight" in op.common
        models.insert(member["position"], {"model": base["uri"], "parameters": {"weight": weight}} if takes_weight
                      else {"model": base["uri"]})
    doc: dict = {"merge_method": op.name, "base_model": base["uri"], "models": models, "parameters": params,
                 "dtype": "float32"}
    layout = r.get("layout")
    if not layout and any(is_view(e["uri"]) for e in r["experts"]):  # experts merged at other layers
        layout = _in_place_layout(cat, base)
    if layout:  # a `slices:` merge: its layers as slices (config/slice_export.py)
        doc = _slices_doc(op, base, r["experts"], params, layout)
    if member and member.get("reference"):  # no base_model: MergePipe chose the first model as the reference
        del doc["base_model"]
    base_dtype = r.get("out_dtype") or _base_dtype(cat, base)  # a converted output's dtype, else the base's
    if base_dtype in MERGEKIT_DTYPE:
        doc["out_dtype"] = MERGEKIT_DTYPE[base_dtype]
    _add_tokenizer_keys(doc, r["tokenizer"] or {})
    doc["mergepipe"] = _extension(r)
    header = _header(r, notes)
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return "\n".join(header) + "\n" + body


def _expert_models(op, base: dict, experts: list[dict]) -> tuple[list[dict], list[str]]:
    """(the ``models:`` entries of the experts, the notes on what mergekit would read otherwise)."""
    models = []
    notes = []
    for e in experts:
        path = f"{base['uri']}+{e['uri']}" if e["kind"] == "lora" else e["uri"]
        if e["kind"] == "delta":
            notes.append(f"# NOTE: {e['id']} is a MergePipe delta checkpoint: mergekit would read it as a full model.")
        params = {}
        keys = ("weight", "density") if op.uses_density else ("weight",)
        for key in keys if op.common is None or "weight" in op.common else ():
            value, exact = _expert_setting(e, key)
            if value is not None:
                params[key] = value
            if not exact:
                notes.append(f"# NOTE: the {key} of {e['id']} came from a merge-wide setting given to the Python "
                             f"API; it is written per tensor: same values, another plan digest.")
        for key in ("gamma", "epsilon"):  # an expert's own (mergekit's per-model parameters)
            if e.get(key) is not None:
                params[key] = e[key]
        models.append({"model": path, "parameters": params})
    return models, notes


def _merge_params(op, r: dict) -> dict:
    """The merge-wide ``parameters``."""
    params = {"normalize": _flag_out(r["params"]["normalize"]), "rescale": _flag_out(r["params"]["rescale"]),
              "lambda": r["params"]["lambda"]}
    if op.common is not None:  # the interpolation methods take only their own parameters
        params = {k: v for k, v in params.items() if k in op.common}
    for key in op.params:
        params[key] = r["params"][key]
    return params


def _slices_doc(op, base: dict, experts: list[dict], params: dict, layout: dict) -> dict:
    """The document of a merge with a layout: its layers as ``slices:``."""
    from mergepipe.config.slice_export import export_slices
    slices, changes = export_slices(layout, base, experts, params, op.copies)
    params.update(changes)
    params = {k: v for k, v in params.items() if v is not None}
    return {"merge_method": op.name, "base_model": base["uri"], "slices": slices, "parameters": params,
            "dtype": "float32"}


def _add_tokenizer_keys(doc: dict, tok: dict) -> None:
    vocab = tok.get("vocab")
    if vocab:  # re-ordered rows: the tokenizer settings that made them
        doc.update(_vocab_settings(vocab, tok, {m: uri for m, uri in vocab["models"]}))
    elif tok.get("source_uri") or "base_model" in doc:
        doc["tokenizer_source"] = tok.get("source_uri", "base")
    if tok.get("chat_template"):
        doc["chat_template"] = tok["chat_template"]


def _extension(r: dict) -> dict:
    """The ``mergepipe:`` key: what mergekit has no key for (budget or target bound, strategy, seed, plan id)."""
    ext: dict = {}
    if r["target_bound"] is not None:
        ext["target_bound"] = r["target_bound"]
    else:
        ext["budget"] = r["budget"]["spec"]
    ext.update({"strategy": r["strategy"], "seed": r["seed"], "plan": r["plan_id"]})
    if r.get("compact") not in (None, "auto"):  # the compact tier as the request set it (planner/tiers.py)
        ext["compact"] = r["compact"]
    if (r.get("moe_layout") or {}).get("layout") == "per-expert":  # not mergekit's (fused) layout
        ext["moe_layout"] = "per-expert"
    return ext


def _header(r: dict, notes: list[str]) -> list[str]:
    source = f"snapshot {r['snapshot_id']} " if r["snapshot_id"] else ""
    return [f"# mergekit config exported by MergePipe from {source}plan {r['plan_id']} ({r['digest']})",
            (f"# budget {r['budget']['spec']} = {human_bytes(r['budget']['bytes'])} of "
             f"{human_bytes(r['full_expert_bytes'])} changed (delta != 0) expert bytes, "
             f"strategy {r['strategy']}, seed {r['seed']}"),
            ("# MergePipe computes in float32 and writes out_dtype. The `mergepipe:` key holds what mergekit "
             "has no key for; mergekit ignores it."), *notes]


def _vocab_settings(vocab: dict, tok: dict, uris: dict[str, str]) -> dict:
    """``tokenizer_source`` or the ``tokenizer:`` block of a plan that re-ordered embedding rows."""
    source = vocab["source"] if vocab["source"] in ("union", "base") else tok.get("source_uri", uris[vocab["source"]])
    if not vocab["tokens"] and vocab.get("pad_to_multiple_of") is None:
        return {"tokenizer_source": source}
    block: dict = {"source": source}
    if vocab["tokens"]:
        block["tokens"] = {t: {"source": _token_source(s, uris), **({"force": True} if force else {})}
                           for t, force, s in vocab["tokens"]}
    if vocab.get("pad_to_multiple_of") is not None:
        block["pad_to_multiple_of"] = vocab["pad_to_multiple_of"]
    return {"tokenizer": block}


def _token_source(src, uris: dict[str, str]):
    if isinstance(src, list) and src[0] == "zero":
        return {"kind": "zero"}
    if isinstance(src, list):
        key = "token_id" if isinstance(src[1], int) else "token"
        return {"kind": "model_token", "model": uris[src[0]], key: src[1]}
    return uris[src]
