"""Write a plan's layout back as mergekit ``slices:`` (:func:`export_slices`, for export.py): one slice per run
of consecutive input layers, per-tensor values as exact-name conditions."""

from __future__ import annotations

from mergepipe.config.per_tensor import _exact
from mergepipe.ops.setting import LAYER


def export_slices(layout: dict, base: dict, experts: list[dict], params: dict, copies: bool) -> tuple[list, dict]:
    """(``slices:``, merge-wide ``parameters`` changes) that plan back to ``layout`` and its per-tensor
    settings: one slice per run of consecutive input layers of one model (and of each layer view's expert,
    storage/views.py: an expert merged at other layers is written with its own layer_range); per-tensor values
    as exact-name conditions (per-input ones on each input's own names, per source; t on the output names)."""
    uris = {base["id"]: base["uri"], **{e["id"]: e["uri"] for e in experts}}
    views = _views(experts)
    slices = []
    for model, lo, hi, entries in _runs(layout, views):
        rng = [lo, hi + 1]
        if copies:
            slices.append({"sources": [_copied_source(uris[model], rng, entries)]})
            continue
        sources = [{"model": base["uri"], "layer_range": rng}]
        sources += [_expert_source(e, uris, views, lo, hi, rng, entries) for e in experts]
        slices.append({"sources": sources})
    return slices, _gradient_changes(layout, params, copies)


def _views(experts: list[dict]) -> dict:
    """Expert id -> (its checkpoint's uri, base layer -> its layer), for the layer views among the experts."""
    from mergepipe.storage.views import split_view
    views = {}
    for e in experts:
        own, mapping = split_view(e["uri"])
        if mapping is not None:
            views[e["id"]] = (own, mapping)
    return views


def _runs(layout: dict, views: dict) -> list[list]:
    """[model, first input layer, last input layer, [layout entries]] per run of consecutive input layers of
    one model (and of each view's expert); each layout entry is in the run of its output layer (before the
    layers: the first run, after them: the last)."""
    runs: list[list] = []
    for model, i in layout["layers"]:
        if runs and runs[-1][0] == model and runs[-1][2] + 1 == i and all(
                m.get(i) is not None and m.get(i) == m.get(i - 1, -2) + 1 for _, m in views.values()):
            runs[-1][2] = i
        else:
            runs.append([model, i, i, []])
    first_out = {}
    j = 0
    for k, run in enumerate(runs):
        for _ in range(run[1], run[2] + 1):
            first_out[j] = k
            j += 1
    seen_layer = False
    for entry in layout["tensors"]:
        m = LAYER.search(entry[0])
        seen_layer = seen_layer or bool(m)
        runs[first_out[int(m.group(1))] if m else (-1 if seen_layer else 0)][3].append(entry)
    return runs


def _copied_source(uri: str, rng: list[int], entries: list) -> dict:
    """passthrough's one source of a slice, with its scale per tensor."""
    source = {"model": uri, "layer_range": rng}
    scale = _exact({e[2]: e[3] for e in entries}, 1.0)
    if scale is not None:
        source["parameters"] = {"scale": scale}
    return source


def _expert_source(e: dict, uris: dict, views: dict, lo: int, hi: int, rng: list[int], entries: list) -> dict:
    """One expert's source of a slice: its layer range (a view's expert: its own layers) and its weight and
    density on its own tensor names."""
    from mergepipe.storage.views import renumber
    if e["id"] in views:
        own_uri, mapping = views[e["id"]]
        source = {"model": own_uri, "layer_range": [mapping[lo], mapping[hi] + 1]}
        name_of = lambda n, mapping=mapping: (renumber(n, mapping[int(LAYER.search(n).group(1))])
                                              if LAYER.search(n) else n)
    else:
        source = {"model": uris[e["id"]], "layer_range": rng}
        name_of = lambda n: n
    own = {}
    for i, key in ((0, "weight"), (1, "density")):
        per = {name_of(t[2]): (e["tensors"][t[2]][i] if e.get("tensors") and t[2] in e["tensors"]
                               else e.get(key)) for t in entries}
        value = _exact(per, 1.0)
        if value is not None and not (key == "density" and value == 1.0):
            own[key] = value
    if own:
        source["parameters"] = own
    return source


def _gradient_changes(layout: dict, params: dict, copies: bool) -> dict:
    """The merge-wide ``parameters`` changes: t per input tensor written per output tensor (mergekit matches
    t on the outputs); passthrough's scale dropped (it is per tensor, in the slices)."""
    changes = {"scale": None} if copies else {}  # passthrough's scale is per tensor, in the slices
    out_of = {t[2]: t[0] for t in layout["tensors"]}
    for key, value in params.items():
        if isinstance(value, list):  # t per input tensor -> per output tensor (mergekit matches t on outputs)
            changes[key] = _exact({out_of[c["filter"]]: c["value"] for c in value if c["filter"] in out_of}, None)
    return changes
