"""The model card a snapshot is published to the Hub with (README.md): built from the snapshot's own card
(manifest/card.py: method, inputs by fingerprint, budget, estimated vs realized bytes, error bound) and
extended with what only the catalog and the Hub know.

Front matter: ``base_model`` (every input's Hub repo id), ``base_model_relation: merge`` (the Hub draws
the model tree from it), ``tags`` (merge, mergepipe, the operator), ``library_name`` and a ``model-index``
with the evaluations stored for the snapshot (perplexity, accuracy and per-task accuracy; the weight-space
deviation is shown in the body only). The body replaces the card's MergePipe recipe with the mergekit YAML
export of the snapshot's plan (config/export.py), and names the manifest hash and how to reproduce.

The snapshot's manifest records its own card's hash; on the Hub README.md is this card, so the
publisher checks it against the card it uploaded and every other file against the manifest.
"""

from __future__ import annotations

import re

from mergepipe.manifest.card import model_card

RECIPE_HEADING = "## Recipe (mergekit)"
MAX_CARD_BYTES = 16 << 20
_MANIFEST_LINE = re.compile(r"^- manifest hash: `(sha256:[0-9a-f]{64})`", re.MULTILINE)
_MODEL_INDEX_METRICS = ("perplexity", "accuracy")


def card_body(text: str) -> str:
    """A card's markdown after its front matter (not parsed: a published card may come from anyone)."""
    if text.startswith("---\n") and "\n---\n" in text[4:]:
        return text[4:].split("\n---\n", 1)[1].lstrip("\n")
    return text


def recipe_from_card(text: str) -> str | None:
    """The mergekit YAML a Hub card carries under :data:`RECIPE_HEADING`, or None."""
    body = card_body(text)
    if RECIPE_HEADING not in body:
        return None
    rest = body.split(RECIPE_HEADING, 1)[1]
    if "```yaml\n" not in rest:
        return None
    block = rest.split("```yaml\n", 1)[1]
    return block.split("\n```", 1)[0] + "\n" if "\n```" in block else None


def is_hub_card_of(path, manifest_hash: str) -> bool:
    """Whether the file at ``path`` is a Hub card (:func:`hub_card`) naming ``manifest_hash``: the README.md a
    snapshot downloaded from the Hub holds in place of its own card (its other files match the manifest)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(MAX_CARD_BYTES + 1)
    except OSError:
        return False
    text = head.decode("utf-8", "replace")
    found = _MANIFEST_LINE.search(text)
    return len(head) <= MAX_CARD_BYTES and RECIPE_HEADING in text and bool(found) and found[1] == manifest_hash


def _model_index(name: str, evaluations: list[dict]) -> list[dict] | None:
    results = []
    for e in evaluations:
        metric = e["metric"]
        family, _, task = metric.partition(":")
        if family not in _MODEL_INDEX_METRICS:
            continue
        dataset = e.get("dataset_name") or "held-out data"
        results.append({"task": {"type": "text-generation", "name": task or family},
                        "dataset": {"name": dataset, "type": dataset},
                        "metrics": [{"type": family, "value": round(float(e["value"]), 6),
                                     "name": f"{family} ({task})" if task else family}]})
    return [{"name": name, "results": results}] if results else None


def hub_front(core: dict, repo_ids: list[str], name: str, evaluations: list[dict]) -> dict:
    front: dict = {}
    if repo_ids:
        front["base_model"] = list(dict.fromkeys(repo_ids))
        front["base_model_relation"] = "merge"
    front["tags"] = ["merge", "mergepipe", core["operator"]]
    front["library_name"] = "transformers"
    index = _model_index(name, evaluations)
    if index:
        front["model-index"] = index
    return front


def _evaluation_lines(evaluations: list[dict]) -> list[str]:
    if not evaluations:
        return ["No evaluation is stored for this snapshot (`mergepipe evaluate`)."]
    lines = ["| metric | data | value | tokens |", "|---|---|---|---|"]
    for e in evaluations:
        lines.append(f"| {e['metric']} | {e.get('dataset_name') or ''} | {float(e['value']):.6g} | "
                     f"{e.get('tokens') or ''} |")
    return lines


def hub_card(core: dict, manifest_hash: str, *, name: str, repo_ids: list[str], missing: list[str],
             evaluations: list[dict], recipe_yaml: str, reproduce_uri: str) -> str:
    """README.md for the Hub: ``name`` the repository, ``repo_ids`` the inputs' Hub repo ids (``missing``: the
    inputs that have none), ``evaluations`` the snapshot's stored results, ``recipe_yaml`` its mergekit export."""
    import yaml  # (an import of ~0.03 s: only where a Hub card is written)

    body = card_body(model_card(core))
    body = body.split("\n## Recipe\n", 1)[0].rstrip("\n")
    front = hub_front(core, repo_ids, name, evaluations)
    lines = ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(), "---", "", body, ""]
    if missing:
        lines += [f"Not on the Hub (local inputs, matched by fingerprint): {', '.join(missing)}.", ""]
    lines += ["## Evaluations", "", *_evaluation_lines(evaluations), "",
              RECIPE_HEADING, "", "```yaml", recipe_yaml.rstrip("\n"), "```", "",
              "## Reproduce", "",
              f"- manifest hash: `{manifest_hash}` (`mergepipe_manifest.json` in this repository: every file's "
              "sha256, the inputs by fingerprint, the plan)",
              f"- `mergepipe reproduce {reproduce_uri}` re-runs this recipe with the same budget and seed and says "
              "whether the result is the same bit for bit", ""]
    return "\n".join(lines)
