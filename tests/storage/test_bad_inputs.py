"""One test per class of structurally wrong input found by the parser fuzzing campaign (issue 14): each is
one StorageError (or CatalogError for an adapter) naming the file and the field, on one line, quoting no
bytes of the file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from mergepipe.errors import CatalogError, MergePipeError, StorageError
from mergepipe.storage.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, open_adapter
from mergepipe.storage.safetensors import INDEX_NAME, MAX_HEADER_BYTES, open_checkpoint, parse_header


def frame(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def write(path: Path, header, data_len: int = 0, **kw) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(frame(raw, b"\0" * data_len, **kw))
    return path


def refused(target, *needles, error=StorageError, opener=open_checkpoint) -> str:
    with pytest.raises(error) as ei:
        opener(target)
    msg = str(ei.value)
    assert isinstance(ei.value, MergePipeError) and type(ei.value) is error
    assert "\n" not in msg and len(msg) < 500, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


W = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


# --- safetensors headers --------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, needle", [
    ("dtype", ["F32"], "dtype must be a string (is a list)"),
    ("dtype", None, "dtype must be a string (is null)"),
    ("dtype", "F33", "unknown dtype 'F33'"),
    ("shape", "2", "shape must be a list of non-negative integers (is a string)"),
    ("shape", [True, 2], "shape[0] must be a non-negative integer (is a boolean)"),
    ("shape", [2.0], "shape[0] must be a non-negative integer (is a number)"),
    ("shape", [-2], "shape[0] must be a non-negative integer (is negative)"),
    ("shape", [2**64], "shape[0] must be a non-negative integer (is too large)"),
    ("data_offsets", {"begin": 0}, "data_offsets must be a list [begin, end] of two integers (is an object)"),
    ("data_offsets", [0, 8, 16], "(is a list of 3)"),
    ("data_offsets", [0, None], "data_offsets[1] must be an integer (is null)"),
    ("data_offsets", [False, 8], "data_offsets[0] must be an integer (is a boolean)"),
    ("data_offsets", [8, 0], "must satisfy 0 <= begin <= end"),
])
def test_header_field_of_the_wrong_type(tmp_path, field, value, needle):
    p = write(tmp_path / "w.safetensors", {"w": dict(W, **{field: value})}, 8)
    refused(p, "w.safetensors", "tensor 'w'", needle)


def test_header_entry_not_an_object_or_incomplete(tmp_path):
    refused(write(tmp_path / "a.safetensors", {"w": [1, 2]}, 8), "tensor 'w'", "malformed header entry (a list")
    refused(write(tmp_path / "b.safetensors", {"w": {"dtype": "F32"}}, 8), "tensor 'w'",
            "malformed header entry (no shape, data_offsets)")


def test_huge_integer_offset(tmp_path):
    """A 5000-digit offset: Python's int-string limit raises ValueError inside json; reported, not crashed."""
    raw = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, ' + b"9" * 5000 + b"]}}"
    msg = refused(write(tmp_path / "big.safetensors", raw, 8), "big.safetensors", "number too large")
    assert "999" not in msg
    raw = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, ' + b"9" * 4000 + b"]}}"
    msg = refused(write(tmp_path / "big2.safetensors", raw, 8), "tensor 'w'", "(huge numbers)")
    assert "9999" not in msg


def test_huge_shape_product_is_quick(tmp_path):
    shape = [2**62] * 200_000  # a product of 200,000 huge dimensions is never computed in full
    p = write(tmp_path / "s.safetensors", {"w": dict(W, shape=shape)}, 8)
    refused(p, "tensor 'w'", "of 200000 dimensions", "more than 2^64")


def test_deeply_nested_metadata(tmp_path):
    raw = b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    refused(write(tmp_path / "deep.safetensors", raw), "deep.safetensors", "nested too deeply")


@pytest.mark.parametrize("metadata, needle", [
    ({"a": {"b": "c"}}, "__metadata__ value of 'a' must be a string (is an object)"),
    ({"n": 1}, "__metadata__ value of 'n' must be a string (is an integer)"),
    (["format", "pt"], "__metadata__ must be an object of strings (is a list)"),
])
def test_metadata_is_a_map_of_strings(tmp_path, metadata, needle):
    p = write(tmp_path / "m.safetensors", {"__metadata__": metadata, "w": W}, 8)
    refused(p, "m.safetensors", needle)


def test_duplicate_tensor_names_are_refused(tmp_path):
    """json.loads silently keeps the last of two equal keys; the header parser refuses them."""
    raw = (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
           b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    refused(write(tmp_path / "dup.safetensors", raw, 8), "dup.safetensors", "key 'w' appears more than once")


@pytest.mark.parametrize("raw, needle", [
    (b' {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', "does not begin with '{'"),
    (b"\xef\xbb\xbf{}", "not valid JSON"),
    ('{"w": 1}'.encode("utf-16"), "not valid JSON (not UTF-8 text"),
    (b"", "not valid JSON"),
    (b"null", "not a JSON object"),
    (b'{"\\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}', "the name is not valid text"),
])
def test_header_text_framing(tmp_path, raw, needle):
    msg = refused(write(tmp_path / "f.safetensors", raw), "f.safetensors", needle)
    assert "\\x" not in msg and "\xff" not in msg


def test_trailing_space_padding_is_allowed(tmp_path):
    p = write(tmp_path / "pad.safetensors", json.dumps({"w": W}).encode() + b"       ", 8)
    assert list(parse_header(p)) == ["w"]


def test_header_length_limits(tmp_path):
    p = write(tmp_path / "len.safetensors", b"{}", 0, length=MAX_HEADER_BYTES + 1)
    refused(p, "len.safetensors", "exceeds the 104857600-byte limit")
    p = write(tmp_path / "len2.safetensors", b"{}", 0, length=2**64 - 1)
    refused(p, "len2.safetensors", "exceeds")
    p = write(tmp_path / "len3.safetensors", b"{}", 0, length=1000)
    refused(p, "len3.safetensors", "runs past the end of the file")


def test_not_a_regular_file_never_blocks(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(StorageError, match="pipe.safetensors: is a FIFO, not a regular file"):
        parse_header(fifo)


def test_error_messages_never_quote_the_file(tmp_path):
    secret = "SECRET-CONTENT-" * 20
    for i, header in enumerate([{"w": dict(W, dtype=secret)}, {"w": dict(W, shape=[secret])},
                                {"w": dict(W, data_offsets=[secret, 8])}, {"__metadata__": {"k": [secret]}}]):
        msg = refused(write(tmp_path / f"q{i}.safetensors", header, 8))
        assert "SECRET-CONTENT-SECRET" not in msg, msg


# --- shard index ----------------------------------------------------------------------------------------
def _sharded(tmp_path: Path, weight_map) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    write(d / "model-1.safetensors", {"a": W}, 8)
    write(d / "model-2.safetensors", {"b": W}, 8)
    raw = weight_map if isinstance(weight_map, bytes) else json.dumps({"weight_map": weight_map}).encode()
    (d / INDEX_NAME).write_bytes(raw)
    return d


@pytest.mark.parametrize("value, needle", [
    (["model-1.safetensors"], "must be a shard file name (is a list)"),
    (1, "must be a shard file name (is an integer)"),
    (None, "must be a shard file name (is null)"),
    ("../ckpt/model-1.safetensors", "must be a file name in the checkpoint directory (no path)"),
    ("/etc/passwd", "must be a file name in the checkpoint directory (no path)"),
    ("..", "must be a file name in the checkpoint directory"),
    ("a\x00b", "must be a file name in the checkpoint directory"),
])
def test_index_weight_map_values(tmp_path, value, needle):
    d = _sharded(tmp_path, {"a": "model-1.safetensors", "b": value})
    refused(d, INDEX_NAME, "weight_map['b']", needle)


@pytest.mark.parametrize("doc, needle", [
    ({"weight_map": ["a"]}, "weight_map must be an object of tensor names to shard files (is a list)"),
    ({"metadata": {}}, "(is missing)"),
    ([1], "expected a JSON object (is a list)"),
])
def test_index_structure(tmp_path, doc, needle):
    d = _sharded(tmp_path, json.dumps(doc).encode())
    refused(d, INDEX_NAME, needle)


def test_index_duplicate_and_deep(tmp_path):
    raw = b'{"weight_map": {"a": "model-1.safetensors", "a": "model-2.safetensors", "b": "model-2.safetensors"}}'
    refused(_sharded(tmp_path, raw), INDEX_NAME, "key 'a' appears more than once")
    (tmp_path / "ckpt" / INDEX_NAME).write_bytes(b'{"metadata": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    refused(tmp_path / "ckpt", INDEX_NAME, "nested too deeply")
    (tmp_path / "ckpt" / INDEX_NAME).write_bytes(b'{"metadata": ' + b"[" * 100 + b"]" * 100 + b"}")
    refused(tmp_path / "ckpt", INDEX_NAME, "nested more than 64 levels deep")


# --- config.json ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, needle", [
    ({"architectures": 7}, "architectures must be a list of names (is an integer)"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of names (is a string)"),
    ({"architectures": [["Llama"]]}, "architectures must be a list of names (is a list holding a list)"),
    ({"architectures": [None]}, "(is a list holding null)"),
    ({"model_type": {"a": 1}}, "model_type must be a name (is an object)"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a non-negative integer"),
    ({"n_layer": 10**30}, "n_layer must be a non-negative integer of at most 1000000 (is too large)"),
])
def test_config_json_fields(tmp_path, config, needle):
    d = _sharded(tmp_path, {"a": "model-1.safetensors", "b": "model-2.safetensors"})
    (d / "config.json").write_text(json.dumps(config))
    refused(d, "config.json", needle)


def test_config_json_not_utf8_quotes_no_byte(tmp_path):
    d = _sharded(tmp_path, {"a": "model-1.safetensors", "b": "model-2.safetensors"})
    (d / "config.json").write_bytes(b'{"architectures": ["\xff\xfe"]}')
    msg = refused(d, "config.json", "not UTF-8 text: invalid byte at position 20")
    assert "0xff" not in msg and "\\xff" not in msg


# --- adapter_config.json --------------------------------------------------------------------------------
def _adapter(tmp_path: Path, config) -> Path:
    d = tmp_path / "adapter"
    d.mkdir()
    header = {"base_model.model.l.lora_A.weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "base_model.model.l.lora_B.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [24, 56]}}
    write(d / ADAPTER_WEIGHTS, header, 56)
    raw = config if isinstance(config, bytes) else json.dumps(config).encode()
    (d / ADAPTER_CONFIG).write_bytes(raw)
    return d


GOOD = {"peft_type": "LORA", "r": 2, "lora_alpha": 4}


def test_good_adapter_parses(tmp_path):
    a = open_adapter(_adapter(tmp_path, dict(GOOD, rank_pattern={"l": 2}, target_modules=["l"])))
    assert a.pairs["l.weight"].scale == 2.0


@pytest.mark.parametrize("edit, needle", [
    ({"r": "8"}, "r must be a positive number (got a string)"),
    ({"r": 10**400}, "r must be a positive number (got too large)"),
    ({"lora_alpha": True}, "lora_alpha must be a positive number (got a boolean)"),
    ({"peft_type": ["LORA"]}, "peft_type must be a name (is a list)"),
    ({"use_dora": "no"}, "use_dora must be true or false (is a string)"),
    ({"rank_pattern": ["l"]}, "rank_pattern must be an object of module patterns to numbers (is a list)"),
    ({"rank_pattern": {"l": None}}, "rank_pattern['l'] must be a positive number (got null)"),
    ({"alpha_pattern": {"(": 4}}, "alpha_pattern['(']: not a valid regular expression"),
    ({"alpha_pattern": {"(a+)+": 4}}, "pattern too long or with a repeated group"),
    ({"target_modules": [1, 2]}, "target_modules must be a name or a list of names (is a list)"),
])
def test_adapter_config_fields(tmp_path, edit, needle):
    refused(_adapter(tmp_path, dict(GOOD, **edit)), ADAPTER_CONFIG, needle, error=CatalogError, opener=open_adapter)


def test_adapter_config_non_finite(tmp_path):
    d = _adapter(tmp_path, b'{"peft_type": "LORA", "r": 2, "lora_alpha": NaN}')
    refused(d, ADAPTER_CONFIG, "lora_alpha must be a positive number (got too large or not finite)",
            error=CatalogError, opener=open_adapter)
    (d / ADAPTER_CONFIG).write_bytes(b'{"peft_type": "LORA", "r": Infinity, "lora_alpha": 4}')
    refused(d, ADAPTER_CONFIG, "r must be a positive number", error=CatalogError, opener=open_adapter)


def test_adapter_config_not_an_object(tmp_path):
    refused(_adapter(tmp_path, [GOOD]), ADAPTER_CONFIG, "expected a JSON object (is a list)", opener=open_adapter)
