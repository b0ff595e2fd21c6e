"""Layer views (storage/views.py): the layer map's text form, and a checkpoint seen through a view."""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.errors import StorageError
from mergepipe.storage.safetensors import Checkpoint, TensorInfo
from mergepipe.storage.views import layer_view, map_text, parse_map, split_view, view_uri


def test_layer_map_text_round_trips():
    for mapping, text in [({0: 2, 1: 3}, "0-1:2-3"), ({0: 2, 1: 3, 2: 0, 3: 1}, "0-1:2-3,2-3:0-1"),
                          ({0: 1, 1: 1}, "0:1,1:1"), ({4: 0}, "4:0")]:
        assert map_text(mapping) == text
        assert parse_map(text) == mapping
    assert split_view(view_uri("/m/e1", {0: 2})) == ("/m/e1", {0: 2})
    assert split_view("/m/e1") == ("/m/e1", None)


@pytest.mark.parametrize("text", ["0-1:2", "1-0:3-2", "0:1,0:2", "a:b", ""])
def test_bad_layer_maps_are_refused(text):
    with pytest.raises(StorageError):
        parse_map(text, "x")


def test_a_view_renames_the_mapped_layers_and_keeps_their_bytes():
    def info(name, offset):
        return TensorInfo(name, "F32", (2, 2), "model.safetensors", offset, 16)
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.2.mlp.up_proj.weight", "model.norm.weight"]
    ckpt = Checkpoint(Path("/nowhere"), [], {n: info(n, 16 * k) for k, n in enumerate(names)}, {})
    view = layer_view(ckpt, {0: 2, 1: 2})
    assert sorted(view.tensors) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                                    "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    for n in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        assert (view.tensors[n].file, view.tensors[n].offset) == ("model.safetensors", 48)
        assert view.tensors[n].name == n
    assert view.tensors["model.norm.weight"] == ckpt.tensors["model.norm.weight"]
    with pytest.raises(StorageError, match="reads layer 7"):
        layer_view(ckpt, {0: 7})
