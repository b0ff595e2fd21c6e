"""Layer-shifted views: a checkpoint's layer tensors read under other layer numbers.

mergekit's ``slices:`` may pair layer ``i`` of the base with layer ``j`` of an expert (sources starting at
different layers). MergePipe merges an expert's tensor with the *same-named* base tensor (ANALYZE's
statistics, the plan's budget and bound are per base tensor), so such an expert is merged through a view:
the expert's tensor ``...layers.{j}.X`` read under the name ``...layers.{i}.X``, same file, same byte
range. The view is registered in the catalog as a model of its own (against the base) and analyzed like
any expert; the planner and the engine then read it as they read any checkpoint.

A view is named by its URI: the expert's URI followed by ``::layers=`` and the layer map, runs of view
layers and the expert layers they read (``::layers=0-1:2-3,4:0``: view layers 0-1 are expert layers 2-3,
view layer 4 is expert layer 0). A view holds the mapped layers and every tensor outside the layers (same
names); the expert's other layers are not part of it.
"""

from __future__ import annotations

import dataclasses
import re

from mergepipe.errors import StorageError

# a decoder/encoder layer's tensors: ``layers.N.`` (Llama, Mistral, Qwen, Gemma, GPT-NeoX, Phi), ``h.N.``
# (GPT-2, Falcon, Bloom), ``layer.N.`` (BERT, RoBERTa: ``encoder.layer.N.``), ``blocks.N.`` (MPT)
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")
VIEW_MARK = "::layers="
_RUN = re.compile(r"^(\d+)(?:-(\d+))?:(\d+)(?:-(\d+))?$")


def renumber(name: str, layer: int) -> str:
    """``name`` with its layer number replaced by ``layer`` (a name with no layer number is returned as is)."""
    m = LAYER.search(name)
    return name if m is None else name[:m.start(1)] + str(layer) + name[m.end(1):]


def map_text(mapping: dict[int, int]) -> str:
    """``{0: 2, 1: 3, 4: 0}`` -> ``0-1:2-3,4:0`` (runs of consecutive view layers reading consecutive layers)."""
    runs: list[list[int]] = []  # [first view layer, last view layer, first expert layer]
    for i in sorted(mapping):
        j = mapping[i]
        if runs and runs[-1][1] + 1 == i and runs[-1][2] + (i - runs[-1][0]) == j:
            runs[-1][1] = i
        else:
            runs.append([i, i, j])
    out = []
    for lo, hi, j in runs:
        out.append(f"{lo}:{j}" if lo == hi else f"{lo}-{hi}:{j}-{j + hi - lo}")
    return ",".join(out)


def parse_map(text: str, where: str = "") -> dict[int, int]:
    mapping: dict[int, int] = {}
    for part in text.split(","):
        m = _RUN.match(part)
        if m is None:
            raise StorageError(f"{where}: bad layer map {text!r} (want runs like 0-1:2-3,4:0)")
        lo, hi, j0, j1 = (None if g is None else int(g) for g in m.groups())
        hi = lo if hi is None else hi
        j1 = j0 if j1 is None else j1
        if hi < lo or j1 - j0 != hi - lo:
            raise StorageError(f"{where}: bad layer map {text!r} (a run maps as many layers on each side)")
        for k in range(hi - lo + 1):
            if lo + k in mapping:
                raise StorageError(f"{where}: bad layer map {text!r} (view layer {lo + k} given twice)")
            mapping[lo + k] = j0 + k
    return mapping


def view_uri(uri: str, mapping: dict[int, int]) -> str:
    return f"{uri}{VIEW_MARK}{map_text(mapping)}"


def split_view(uri) -> tuple[str, dict[int, int] | None]:
    """(the checkpoint's own URI, the layer map) of a view URI; (uri, None) for any other URI."""
    text = str(uri)
    k = text.rfind(VIEW_MARK)
    if k < 0:
        return text, None
    return text[:k], parse_map(text[k + len(VIEW_MARK):], text)


def is_view(uri) -> bool:
    return split_view(uri)[1] is not None


def layer_view(ckpt, mapping: dict[int, int], uri: str = ""):
    """The checkpoint seen through ``mapping`` (view layer -> the checkpoint's layer): same files, storage and
    byte ranges; the mapped layers renamed, the tensors outside the layers as they are."""
    by_layer: dict[int, list] = {}
    tensors = {}
    for name, info in ckpt.tensors.items():
        m = LAYER.search(name)
        if m is None:
            tensors[name] = info
        else:
            by_layer.setdefault(int(m.group(1)), []).append(info)
    for i in sorted(mapping):
        j = mapping[i]
        if j not in by_layer:
            raise StorageError(f"{uri or ckpt.root}: the layer view reads layer {j}, which the checkpoint does not "
                               f"have")
        for info in by_layer[j]:
            name = renumber(info.name, i)
            tensors[name] = dataclasses.replace(info, name=name)
    return dataclasses.replace(ckpt, tensors=tensors)
