"""What the fuzz suite (test_fuzz_parsers.py) found in the parsers added since issue 14, each kept as a plain
test (issue 28; docs/reliability/fuzz.md)."""

from __future__ import annotations

import io
import zipfile

import pytest

from mergepipe.config.model import ConfigError
from mergepipe.config.recipe import Recipe
from mergepipe.config.sweep import parse_sweep
from mergepipe.errors import PlanError, StorageError
from mergepipe.storage.torchbin import parse_bin
from mergepipe.storage.vocab_union import config_vocab_size


@pytest.mark.parametrize("raw, expected", [
    (b"", "not valid JSON"), (b"[]", "expected a JSON object"), (b'{"vocab_size": ' + b"9" * 5000 + b"}", None),
    (b"[" * 100_000, None), (b'{"text_config": 5}', "ok"), (b'{"vocab_size": true}', "ok"),
])
def test_config_vocab_size_of_a_bad_config_json(tmp_path, raw, expected):
    """config.json's vocab_size for a tokenizer union: bad JSON was a raw JSONDecodeError, a non-object an
    AttributeError, `text_config: 5` an AttributeError, `vocab_size: true` the size 1."""
    (tmp_path / "config.json").write_bytes(raw)
    if expected == "ok":
        assert config_vocab_size(tmp_path) is None
        return
    with pytest.raises(StorageError) as ei:
        config_vocab_size(tmp_path)
    msg = str(ei.value)
    assert msg.startswith(f"{tmp_path / 'config.json'}: ") and "\n" not in msg and len(msg) < 300
    if expected:
        assert expected in msg


@pytest.mark.parametrize("kwargs, message", [
    ({"name": True}, "recipe name True: use letters, digits"),
    ({"experts": True}, "a recipe's experts are a list of model ids or patterns, not True"),
    ({"experts": ["e1", 3]}, "a recipe's experts are a list of model ids or patterns, not ['e1', 3]"),
    ({"weights": {"e1": "x"}}, "a recipe's weights map patterns to numbers, not {'e1': 'x'}"),
    ({"weights": [["e1", 1]]}, "a recipe's weights map patterns to numbers"),
    ({"params": {1: 2}}, "a recipe's parameters map names to values, not {1: 2}"),
    ({"operator": ["linear"]}, "unknown operator ['linear']"),
])
def test_recipe_fields_of_the_wrong_type(kwargs, message):
    """Through the API (recipe_save) any value reaches Recipe.build: a bool name was AttributeError, a bool
    expert list TypeError, a non-string operator AttributeError."""
    args = {"name": "r", "base": "base", "experts": ["e1"], **kwargs}
    with pytest.raises(PlanError) as ei:
        Recipe.build(**args)
    assert str(ei.value).startswith(message), str(ei.value)


def test_sweep_keys_with_line_breaks_are_one_line():
    with pytest.raises(ConfigError) as ei:
        parse_sweep({"\x1e": None, "base": "b", "experts": ["e"], "out": "o"})
    assert str(ei.value).startswith("unknown sweep key(s): \\x1e (known: address,") and \
        len(str(ei.value).splitlines()) == 1
    with pytest.raises(ConfigError) as ei:
        parse_sweep({"base": "b", "experts": ["e"], "out": "o", "grid": {"a\nb": []}})
    assert str(ei.value) == "grid.a\\nb: a non-empty list of values"


def test_a_pickle_length_past_its_end_is_refused_before_unpickling(tmp_path):
    """A BINUNICODE8 of 2^62 bytes in a tiny data.pkl: the opcode scan refuses it (the unpickler would first
    try to allocate the length)."""
    pkl = b"\x80\x04\x8d" + (1 << 62).to_bytes(8, "little") + b"x."
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
    (tmp_path / "a.bin").write_bytes(buf.getvalue())
    with pytest.raises(StorageError, match=r"^a.bin: data.pkl is not a readable torch state dict \(ValueError: "):
        parse_bin(tmp_path / "a.bin")


def test_a_deeply_nested_tokenizer_config_has_no_chat_template(tmp_path):
    """read_chat_template: json's RecursionError escaped (the long fuzz run of issue 28)."""
    from mergepipe.storage.tokenizer_files import read_chat_template
    (tmp_path / "tokenizer_config.json").write_bytes(b"[" * 5000 + b"]" * 5000)
    assert read_chat_template(tmp_path) is None


def _zip_bytes(members: dict[str, bytes]) -> bytearray:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return bytearray(buf.getvalue())


GOOD = {"archive/data.pkl": b"\x80\x02}.", "archive/byteorder": b"little"}


def _refused(tmp_path, raw: bytes, needle: str) -> str:
    (tmp_path / "z.bin").write_bytes(bytes(raw))
    with pytest.raises(StorageError) as ei:
        parse_bin(tmp_path / "z.bin")
    msg = str(ei.value)
    assert needle in msg and len(msg.splitlines()) == 1 and len(msg) < 400, msg
    return msg


def test_corrupt_zip_directories_are_one_error(tmp_path):
    """The long fuzz run: a central directory entry needing zip version 6.4 (NotImplementedError), and a
    start-of-directory offset past the real one (negative entry offsets: OSError from pread; huge ones:
    OverflowError)."""
    raw = _zip_bytes(GOOD)
    cd = raw.index(b"PK\x01\x02")
    raw[cd + 6:cd + 8] = (64).to_bytes(2, "little")  # version needed to extract: 6.4
    _refused(tmp_path, raw, "not a valid torch checkpoint zip (zip file version 6.4)")
    raw = _zip_bytes(GOOD)
    eocd = raw.rindex(b"PK\x05\x06")
    start = int.from_bytes(raw[eocd + 16:eocd + 20], "little")
    raw[eocd + 16:eocd + 20] = (start + 100).to_bytes(4, "little")  # entries now start at -100
    _refused(tmp_path, raw, "has no valid local header (corrupt zip)")


def test_control_characters_in_names_from_the_file_are_escaped(tmp_path):
    raw = _zip_bytes({"archive/data.pkl": b"\x80\x02ctorch\n\x0bFloat16Storage\n.", "archive/byteorder": b"little"})
    assert "its pickle uses torch.\\x0bFloat16Storage;" in _refused(tmp_path, raw, "refused to load")
    raw = _zip_bytes({"archive/data.pkl": b"\x80\x02c\x0borch\nx\n.", "archive/byteorder": b"little"})
    assert "its pickle asks for \\x0borch.x," in _refused(tmp_path, raw, "refused to load")
