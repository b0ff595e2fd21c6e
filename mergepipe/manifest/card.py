"""The model card (README.md) every published snapshot holds: Hugging Face front matter (base_model list,
tags, library_name), the method, the inputs by fingerprint, the budget, estimated vs realized bytes, the
error bound and the recipe as YAML.

Written into the staging directory before publishing and hashed in the manifest's outputs like any other
file. It is made from the manifest core only (no snapshot id, model id, path or time), so two runs of one
plan write the same card and keep the same manifest core.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mergepipe.units import human_bytes

CARD_NAME = "README.md"


_bytes = human_bytes


def _setting(e: dict, key: str):
    own = (e.get("settings") or {}).get(key)
    return own if own is not None else e.get(key)


def recipe(core: dict) -> dict:
    """The merge as a mergekit-style config (``mergepipe:`` holds budget, strategy, seed and plan). For the
    exact mergekit export of a snapshot: ``mergepipe explain SNAPSHOT --as-mergekit``."""
    base = core["inputs"]["base"]
    models = []
    for e in core["inputs"]["experts"]:
        params = {k: v for k in ("weight", "density") if (v := _setting(e, k)) is not None}
        models.append({"model": e.get("uri") or e["id"], "parameters": params})
    spec = core["budget"]["spec"]
    ext = ({"target_bound": float(spec.split()[1])} if spec.startswith("target-bound ") else {"budget": spec})
    ext.update({"strategy": core["strategy"], "seed": core["seed"], "plan": core["plan_id"]})
    doc = {"merge_method": core["operator"], "base_model": base.get("uri") or base["id"], "models": models,
           "parameters": dict(sorted(core["params"].items())), "dtype": "float32", "mergepipe": ext}
    if core.get("out_dtype"):  # its float tensors converted (mergekit's name of the dtype: torch's)
        from mergepipe.storage.dtypes import TORCH_NAMES
        doc = {**{k: v for k, v in doc.items() if k != "mergepipe"}, "out_dtype": TORCH_NAMES[core["out_dtype"]],
               "mergepipe": ext}
    return doc


def model_card(core: dict) -> str:
    """README.md text for a snapshot with manifest core ``core``."""
    import yaml  # (an import of ~0.03 s: only where a card is written)

    base = core["inputs"]["base"]
    experts = core["inputs"]["experts"]
    front = {"base_model": [base["id"], *[e["id"] for e in experts]],
             "tags": ["merge", "mergepipe", core["operator"]], "library_name": "transformers"}
    est, real = core["estimated"], dict(core["realized"])
    own = (core.get("outputs") or {}).get(CARD_NAME)
    if own:  # the card's own bytes count in the manifest's realized write, not in the card's table
        real["output_write"] -= own["bytes"]
    full = core["full_expert_bytes"]
    bound = core.get("error_bound")
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {core['operator']} merge of {len(experts)} expert{'s' if len(experts) != 1 else ''} on {base['id']}",
             "", "Merged with MergePipe (budget-aware merging): only the planned blocks of each expert were read.", "",
             "## Method", "",
             f"- operator: `{core['operator']}`, parameters `{yaml.safe_dump(dict(sorted(core['params'].items())), default_flow_style=True).strip()}`",
             f"- block selection: strategy `{core['strategy']}`, seed {core['seed']}, blocks of "
             f"{_bytes(core['grid']['block_bytes'])}",
             f"- plan: `{core['plan_id']}` ({core['plan_digest']})", "",
             "## Inputs", "", "| role | model | fingerprint | weight | density |", "|---|---|---|---|---|",
             f"| base | {base['id']} | `{base['fingerprint']}` | | |"]
    for e in experts:
        w, d = _setting(e, "weight"), _setting(e, "density")
        lines.append(f"| expert | {e['id']} | `{e['fingerprint']}` | {'' if w is None else w} | "
                     f"{'' if d is None else d} |")
    lines += ["", "## Budget and I/O", "",
              f"- budget: {core['budget']['spec']} = {_bytes(core['budget']['bytes'])} of {_bytes(full)} changed "
              f"(delta != 0) expert bytes",
              "", "| | estimated | realized | difference |", "|---|---|---|---|"]
    for key, label in (("expert_read", "expert read"), ("base_read", "base read"), ("output_write", "write (without this card)")):
        diff = real[key] - est[key]
        lines.append(f"| {label} | {_bytes(est[key])} | {_bytes(real[key])} | {'+' if diff > 0 else '-' if diff < 0 else ''}"
                     f"{_bytes(abs(diff))} |")
    lines += ["", "- error bound: " + (f"{bound['absolute']:.4g} (relative {bound['relative']:.3g})" if bound else
                                       f"n/a ({core['operator']} is not additive)"),
              "", "## Recipe", "", "```yaml", yaml.safe_dump(recipe(core), sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def write_card(staging: Path, core: dict) -> dict:
    """Write README.md into ``staging``; returns its outputs entry ({'sha256', 'bytes'})."""
    data = model_card(core).encode()
    (Path(staging) / CARD_NAME).write_bytes(data)
    return {"sha256": "sha256:" + hashlib.sha256(data).hexdigest(), "bytes": len(data)}
