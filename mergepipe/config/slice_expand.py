"""Expand a ``slices:`` config against the models' tensors (:func:`expand`, at resolve time): the plan's
layout, each expert's weight and density per tensor, the gradients (t) per tensor and the layer views of
the experts merged at other layers than the base's (slices.py describes what mergekit does)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.config.model import ConfigError, GRADIENT_PARAMS
from mergepipe.config.per_tensor import _exact, _resolve
from mergepipe.ops.core import get_op
from mergepipe.ops.setting import LAYER, PRE_LAYER_NAMES


@dataclass
class Expansion:
    """What a ``slices:`` config asks of the planner: the layout, each expert's weight and density settings,
    and the merge-wide gradient parameters (t) per tensor."""

    layout: dict | None
    settings: dict  # expert id -> {"weight": setting, "density": setting}
    method_params: dict
    # expert id -> {base layer: the expert's layer merged with it}, for the experts merged at other layers than
    # the base's (merged through a layer view, storage/views.py)
    views: dict = field(default_factory=dict)


def expand(cfg, ids: dict[str, str], base_id: str, tensors: dict[str, dict[str, tuple]],
           layers: dict[str, int], adapters=frozenset()) -> Expansion:
    """``ids``: reference as written -> catalog id; ``tensors``: model id -> {name: shape};
    ``layers``: model id -> its number of layers; ``adapters``: the ids of LoRA adapters (no layer view)."""
    slices, copies = cfg.slices, cfg.method == "passthrough"
    _check_layer_ranges(cfg, ids, layers)
    base_names = list(tensors[base_id])
    by_layer, outside = _base_layers(cfg, base_names)
    base_ref = None if copies else next(ref for ref, mid in ids.items() if mid == base_id
                                        and any(s.ref == ref for s in slices[0].sources))
    entries, out_layers = _entries(slices, ids, base_id, base_ref, copies, by_layer, outside)
    layout = {"tensors": [], "layers": out_layers}
    if copies:
        return _copy_expansion(cfg, ids, base_id, tensors, entries, layout)
    layout["tensors"] = [[out, base_id, name, None] for out, _, name, _, _ in entries]
    if all(out == name for out, _, name, _, _ in entries) and len(entries) == len(base_names):
        layout = None  # the base's own tensors, in place: a plain merge
    settings, views = _expert_settings(cfg, ids, base_id, base_ref, tensors, entries, by_layer, adapters)
    return Expansion(layout, settings, _gradient_params(cfg, entries), views)


def _check_layer_ranges(cfg, ids: dict[str, str], layers: dict[str, int]) -> None:
    for sl in cfg.slices:
        for s in sl.sources:
            n = layers[ids[s.ref]]
            if s.end > n:
                raise ConfigError(f"{cfg.source}: {s.where}.layer_range [{s.start}, {s.end}] is out of range: "
                                  f"{s.ref} has {n} layers (0-{n - 1})")


def _base_layers(cfg, base_names: list[str]) -> tuple[dict[int, list[str]], list[str]]:
    """(layer -> the base's tensors in it, the base's tensors outside the layers)."""
    by_layer: dict[int, list[str]] = {}
    outside = []
    for name in base_names:
        m = LAYER.search(name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(name)
        else:
            outside.append(name)
    if not by_layer:
        raise ConfigError(f"{cfg.source}: slices: the base has no tensors named like `...layers.N...`, `...h.N...`, "
                          f"`...layer.N...` or `...blocks.N...`; MergePipe slices layers named that way (Llama, "
                          f"Mistral, Qwen, Gemma, GPT-2, BERT, ...)")
    return by_layer, outside


def _entries(slices, ids: dict[str, str], base_id: str, base_ref: str | None, copies: bool,
             by_layer: dict[int, list[str]], outside: list[str]) -> tuple[list[tuple], list[list]]:
    """(the output tensors in order: the tensors before the layers, the layers slice by slice, the others;
    the layout's output layers)."""
    pre = [n for n in outside if any(p in n for p in PRE_LAYER_NAMES)]
    post = [n for n in outside if n not in pre]
    entries = []  # (out name, slice, the base's input name, t, layer offset in the slice or None)
    for name in pre:
        entries.append((name, slices[0], name, 0.0, None))
    out_layers = []
    j = 0
    for sl in slices:
        # the base's layer is the base source's (mergekit pairs layer start + i of every source)
        first = sl.sources[0] if copies else next(s for s in sl.sources if s.ref == base_ref)
        for i in range(sl.length):
            t = i / (sl.length - 1) if sl.length > 1 else 1.0
            src_layer = first.start + i
            for name in by_layer.get(src_layer, ()):
                entries.append((_renumber(name, j), sl, name, t, i))
            out_layers.append([ids[first.ref] if copies else base_id, src_layer])
            j += 1
    for name in post:
        entries.append((name, slices[-1], name, 0.0, None))
    return entries, out_layers


def _copy_expansion(cfg, ids: dict[str, str], base_id: str, tensors: dict, entries: list, layout: dict) -> Expansion:
    """passthrough: every output tensor copied from its slice's one source (scaled)."""
    for out, sl, name, t, _ in entries:
        src = sl.sources[0]
        mid = ids[src.ref]
        if name not in tensors[mid] or tensors[mid][name] != tensors[base_id][name]:
            raise ConfigError(f"{cfg.source}: {src.where}: {src.ref} has no tensor {name} of the base's shape")
        scale = _resolve([src.params.get("scale"), sl.params.get("scale"), cfg.method_params.get("scale")],
                         name, t)
        layout["tensors"].append([out, mid, name, None if scale == 1.0 else scale])  # x * 1.0 is x
    return Expansion(layout, {}, {})


def _expert_settings(cfg, ids: dict[str, str], base_id: str, base_ref: str, tensors: dict, entries: list,
                     by_layer: dict[int, list[str]], adapters) -> tuple[dict, dict]:
    """(expert id -> its weight and density per tensor, expert id -> its layer map when it is merged at other
    layers than the base's)."""
    settings = {}
    views = {}
    whole = get_op(cfg.method).whole_models
    for ref, mid in ids.items():
        if mid == base_id and not whole:  # linear: the base is averaged in, weighted like any source
            continue
        settings[mid] = {}
        for p in ("weight", "density"):
            per = {}
            for out, sl, name, t, i in entries:
                src = next(s for s in sl.sources if s.ref == ref)
                # mergekit matches a per-input parameter's filters on that input's own tensor name
                own = name if i is None else _renumber(name, src.start + i)
                per[name] = _resolve([src.params.get(p), sl.params.get(p), _global(cfg, ref, p)], own, t)
            settings[mid][p] = _exact(per, 1.0)
        if mid != base_id:
            mapping = _layer_map(cfg, cfg.slices, ref, base_ref, tensors[mid], tensors[base_id], by_layer,
                                 mid in adapters)
            if any(a != b for a, b in mapping.items()):
                views[mid] = mapping
    return settings, views


def _gradient_params(cfg, entries: list) -> dict:
    """The method's parameters with each merge-wide gradient (t) resolved per output tensor."""
    method_params = dict(cfg.method_params)
    for p in GRADIENT_PARAMS:
        if p == "scale":
            method_params.pop(p, None)
            continue
        per = {name: _resolve([sl.params.get(p), cfg.method_params.get(p)], out, t) for out, sl, name, t, _ in entries}
        value = _exact(per, None)
        if value is not None:
            method_params[p] = value
    return method_params


def _layer_map(cfg, slices, ref: str, base_ref: str, shapes: dict, base_shapes: dict, by_layer,
               adapter: bool) -> dict[int, int]:
    """Base layer -> the layer of ``ref`` merged with it (mergekit: layer start + i of every source of a slice),
    each of its tensors checked against the base's."""
    mapping = {}
    for sl in slices:
        src = next(s for s in sl.sources if s.ref == ref)
        base_src = next(s for s in sl.sources if s.ref == base_ref)
        for i in range(sl.length):
            b, e = base_src.start + i, src.start + i
            mapping[b] = e
            if b == e:
                continue
            if adapter:
                raise ConfigError(f"{cfg.source}: {src.where}: {ref} is a LoRA adapter, whose delta is trained on "
                                  f"its base's own layers: give it the base's layer_range [{base_src.start}, "
                                  f"{base_src.end}], or merge the adapter into a model first")
            for name in by_layer.get(b, ()):
                own = _renumber(name, e)
                if shapes.get(own) != base_shapes[name]:
                    raise ConfigError(f"{cfg.source}: {src.where}: {ref} has no tensor {own} of the shape of the "
                                      f"base's {name} ({list(base_shapes[name])}), which it is merged with")
    return mapping


def _global(cfg, ref: str, p: str):
    """The merge-wide value of a per-input parameter (parse keeps it on every model)."""
    # every model carries the merge-wide value (read_slices); the base is not among them (linear averages it too)
    m = next((m for m in cfg.models if m.ref == ref), cfg.models[0] if cfg.models else None)
    return getattr(m, p, None) if m is not None else None


def _renumber(name: str, layer: int) -> str:
    m = LAYER.search(name)
    return name[:m.start(1)] + str(layer) + name[m.end(1):]


def model_layers(config: dict, names) -> int:
    n = config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
    if isinstance(n, int) and n > 0:
        return n
    found = [int(m.group(1)) for name in names if (m := LAYER.search(name))]
    return max(found) + 1 if found else 0


def read_config(root: Path) -> dict:
    try:
        return json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
