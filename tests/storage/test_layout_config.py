"""config.json of a `slices:` output (storage/writers.py write_layout_config): num_hidden_layers is the number
of output layers and a per-layer ``layer_types`` list follows the layers the output took."""

from __future__ import annotations

import json

from mergepipe.storage.writers import write_layout_config


def test_num_hidden_layers_and_layer_types_follow_the_layout(tmp_path):
    config = {"num_hidden_layers": 4, "layer_types": ["sliding", "full", "sliding", "full"], "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_layout_config(tmp_path, {"tensors": [], "layers": [["a", 3], ["a", 0], ["b", 0], ["b", 2], ["a", 1]]})
    out = json.loads((tmp_path / "config.json").read_text())
    assert out == {"num_hidden_layers": 5, "layer_types": ["full", "sliding", "sliding", "sliding", "full"],
                   "hidden_size": 8}


def test_a_config_without_layer_types_gets_only_the_layer_count(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "model_type": "llama"}))
    write_layout_config(tmp_path, {"tensors": [], "layers": [["a", 0], ["a", 1], ["a", 1]]})
    assert json.loads((tmp_path / "config.json").read_text()) == {"num_hidden_layers": 3, "model_type": "llama"}
