"""Fuzzing the parsers of everything MergePipe reads from disk or from a user: safetensors headers, shard
indexes, config.json, adapter_config.json, manifests, mergekit YAML and budget strings.

The property, for every generated input: parsing either succeeds with a consistent result or raises
the project's own error (a MergePipeError whose message is one short line) -- never another exception,
never a hang. Inputs are structurally wrong on purpose: random JSON values of every type and nesting in
every field, wrong length prefixes, truncations, byte flips of valid headers, duplicate names, huge
integers, deep nesting.

Bounded for CI (about 2,500 cases in all, derandomized: the same cases on every run). The long run
scales it up: ``MERGEPIPE_FUZZ_EXAMPLES=100000`` spreads that many cases over the tests below (see
docs/reliability/fuzz.md).
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergepipe.config.parse import parse_config
from mergepipe.errors import MergePipeError
from mergepipe.manifest.verify import parse_manifest
from mergepipe.planner.budget import Budget, mib
from mergepipe.storage.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, open_adapter
from mergepipe.storage.safetensors import INDEX_NAME, ITEMSIZE, open_checkpoint, parse_header

TOTAL = int(os.environ.get("MERGEPIPE_FUZZ_EXAMPLES", "2500"))
# Share of the total per test (sums to 1).
SHARES = {"header": 0.22, "mutated": 0.25, "framing": 0.10, "index": 0.14, "config": 0.06, "adapter": 0.06,
          "budget": 0.07, "manifest": 0.06, "yaml": 0.04}
SLOW_SECONDS = 5.0  # one parse taking longer than this counts as a hang


def fuzz(share: str):
    return settings(max_examples=max(10, round(TOTAL * SHARES[share])), deadline=None, derandomize=True,
                    database=None, suppress_health_check=list(HealthCheck), print_blob=True)


# --- checking one parse ----------------------------------------------------------------------------------
def outcome(fn, *args):
    """Run one parse: its result, or None after a clean MergePipeError; anything else fails the test."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    except MergePipeError as exc:
        msg = str(exc)
        assert msg and len(msg.splitlines()) == 1, repr(msg)
        assert len(msg) < 2000, len(msg)
        return None
    finally:
        assert time.perf_counter() - t0 < SLOW_SECONDS, "parse took too long"


def check_tensors(tensors: dict, file_size: int) -> None:
    """A parsed header is consistent: every tensor within the file, sized dtype x shape, no overlaps."""
    spans = []
    for name, t in tensors.items():
        assert isinstance(name, str) and t.name == name
        assert t.dtype in ITEMSIZE
        assert all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in t.shape)
        assert t.nbytes == math.prod(t.shape) * ITEMSIZE[t.dtype]
        assert 8 <= t.offset and t.offset + t.nbytes <= file_size
        name.encode("utf-8")  # storable in the catalog
        spans.append((t.offset, t.offset + t.nbytes))
    spans.sort()
    for (_, end), (begin, _) in zip(spans, spans[1:]):
        assert begin >= end


# --- strategies -----------------------------------------------------------------------------------------
BIG_INT = st.builds(lambda n, neg: (-1 if neg else 1) * (10 ** n - 1), st.integers(19, 4200), st.booleans())
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-5, 300) | BIG_INT
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["F32", "BF16", "I8", "f32", "", "__metadata__", "\ud800", "a\x00b", "../x"]))
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                        max_size=4), max_leaves=12)
DTYPE = st.sampled_from(sorted(ITEMSIZE)) | JSON
SHAPE = st.lists(st.integers(0, 5), max_size=3) | st.lists(SCALARS, max_size=4) | JSON
OFFSETS = st.lists(st.integers(-3, 120), min_size=2, max_size=2) | st.lists(SCALARS, max_size=3) | JSON
NAMES = st.text(max_size=8) | st.sampled_from(["w", "a.b", "__metadata__", "\ud800", "x" * 300])


@st.composite
def entries(draw):
    """A header entry: sometimes right, mostly wrong in one or more fields (or not an object at all)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    entry = {}
    for key, strat in (("dtype", DTYPE), ("shape", SHAPE), ("data_offsets", OFFSETS)):
        if draw(st.integers(0, 12)):
            entry[key] = draw(strat)
    if draw(st.booleans()):
        entry[draw(st.text(max_size=5))] = draw(JSON)
    return entry


@st.composite
def valid_headers(draw):
    """A consistent header and its data length (the starting point of the byte mutations)."""
    header, pos = {}, 0
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    return header, pos


def dumps(obj) -> bytes:
    """JSON bytes for any generated value (huge ints, lone surrogates and NaN included)."""
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


def framed(header: bytes, data_len: int, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + b"\0" * data_len


_TMP = tempfile.TemporaryDirectory(prefix="mergepipe-fuzz-")
TMP = Path(_TMP.name)


def write(name: str, content: bytes) -> Path:
    p = TMP / name
    p.write_bytes(content)
    return p


def parse_bytes(content: bytes) -> None:
    p = write("fuzz.safetensors", content)
    tensors = outcome(parse_header, p)
    if tensors is not None:
        check_tensors(tensors, len(content))


# --- safetensors headers --------------------------------------------------------------------------------
@fuzz("header")
@given(entries_=st.lists(st.tuples(NAMES, entries()), max_size=4), metadata=st.none() | JSON,
       data_len=st.integers(0, 128), pad=st.integers(0, 9))
def test_fuzz_header_fields(entries_, metadata, data_len, pad):
    header = dict(entries_)
    if metadata is not None:
        header["__metadata__"] = metadata
    parse_bytes(framed(dumps(header) + b" " * pad, data_len))


@fuzz("mutated")
@given(valid=valid_headers(), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       cut=st.none() | st.integers(0, 10**6), extra=st.integers(-4, 4))
def test_fuzz_header_byte_flips_and_truncations(valid, edits, cut, extra):
    header, data_len = valid
    raw = bytearray(framed(dumps(header), max(0, data_len + extra)))
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    if cut is not None:
        raw = raw[:cut % (len(raw) + 1)]
    parse_bytes(bytes(raw))


TEXT_EDITS = st.sampled_from([
    "dup", "deep_list", "deep_object", "huge_int", "huge_float", "nan", "lead_space", "bom", "utf16", "nul",
    "not_object", "empty", "surrogate", "trailing_garbage", "metadata_nested"])


@fuzz("framing")
@given(valid=valid_headers(), edit=TEXT_EDITS, depth=st.integers(1, 100_000), length=st.none() | st.integers(0, 2**64 - 1))
def test_fuzz_header_framing(valid, edit, depth, length):
    header, data_len = valid
    text = dumps(header).decode("utf-8")
    inner = text[1:-1]
    text = {
        "dup": '{"w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, '
               '"w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}' + (", " + inner if inner else "") + "}",
        "deep_list": '{"__metadata__": ' + "[" * depth + "]" * depth + (", " + inner if inner else "") + "}",
        "deep_object": '{"x": ' + '{"a": ' * depth + "1" + "}" * depth + "}",
        "huge_int": '{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, ' + "9" * (depth % 9000 + 1) + "]}}",
        "huge_float": '{"w": {"dtype": "U8", "shape": [1e309], "data_offsets": [0, 1]}}',
        "nan": '{"w": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, Infinity]}}',
        "lead_space": " " + text,
        "bom": "\ufeff" + text,
        "utf16": text,
        "nul": text[:-1] + "\x00}",
        "not_object": "[" + inner + "]",
        "empty": "",
        "surrogate": '{"\\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}',
        "trailing_garbage": text + " x",
        "metadata_nested": '{"__metadata__": {"a": {"b": "c"}}}',
    }[edit]
    raw = text.encode("utf-16") if edit == "utf16" else text.encode("utf-8", "surrogatepass")
    parse_bytes(framed(raw, data_len, length))


def test_fuzz_header_huge_lengths():
    """Length prefixes around the limits, on tiny files: refused before anything is read."""
    for length in (0, 1, 7, 2**27, 100 * 1024 * 1024, 100 * 1024 * 1024 + 1, 2**63, 2**64 - 1):
        parse_bytes(framed(b"{}", 0, length))
    for n in range(0, 9):
        parse_bytes(b"\x02" * n)


# --- shard indexes, config.json, adapter_config.json -----------------------------------------------------
def _shard(path: Path, names: list[str]) -> None:
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    path.write_bytes(framed(dumps(header), 4 * len(names)))


INDEX_DIR = TMP / "sharded"
INDEX_DIR.mkdir()
_shard(INDEX_DIR / "model-00001-of-00002.safetensors", ["a", "b"])
_shard(INDEX_DIR / "model-00002-of-00002.safetensors", ["c"])
SHARD_NAMES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
GOOD_MAP = {"a": SHARD_NAMES[0], "b": SHARD_NAMES[0], "c": SHARD_NAMES[1]}
FILE_NAMES = (st.sampled_from(SHARD_NAMES + ["../sharded/" + SHARD_NAMES[0], "/etc/passwd", "", ".", "..",
                                             "a\x00b", "\ud800", "missing.safetensors", "config.json"]) | SCALARS | JSON)


@st.composite
def index_docs(draw):
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(JSON)
    weight_map = dict(GOOD_MAP)
    for _ in range(draw(st.integers(0, 3))):
        weight_map[draw(st.sampled_from(["a", "b", "c", "d"]) | NAMES)] = draw(FILE_NAMES)
    if kind == 1:
        weight_map = draw(JSON)
    doc = {"metadata": draw(JSON), "weight_map": weight_map} if kind != 2 else {"weight_map": weight_map}
    return doc


def _open_dir() -> None:
    ckpt = outcome(open_checkpoint, INDEX_DIR)
    if ckpt is not None:
        sizes = {f.name: f.stat().st_size for f in ckpt.files}
        for t in ckpt.tensors.values():
            assert t.file in sizes
        check_tensors(ckpt.tensors, max(sizes.values()))
        assert all(f.parent == INDEX_DIR for f in ckpt.files)


@fuzz("index")
@given(doc=index_docs(), dup=st.booleans())
def test_fuzz_shard_index(doc, dup):
    raw = dumps(doc)
    if dup and isinstance(doc, dict) and isinstance(doc.get("weight_map"), dict) and doc["weight_map"]:
        raw = raw.replace(b'"weight_map": {', b'"weight_map": {"a": "' + SHARD_NAMES[0].encode() + b'", ', 1)
    (INDEX_DIR / INDEX_NAME).write_bytes(raw)
    try:
        _open_dir()
    finally:
        (INDEX_DIR / INDEX_NAME).unlink()


CONFIG_KEYS = st.sampled_from(["architectures", "model_type", "num_hidden_layers", "n_layer", "num_layers",
                               "hidden_size", "torch_dtype"])


@fuzz("config")
@given(config=st.dictionaries(CONFIG_KEYS, JSON | st.lists(SCALARS, max_size=3), max_size=4) | JSON)
def test_fuzz_config_json(config):
    (INDEX_DIR / "config.json").write_bytes(dumps(config))
    try:
        _open_dir()
    finally:
        (INDEX_DIR / "config.json").unlink()


ADAPTER_DIR = TMP / "adapter"
ADAPTER_DIR.mkdir()
_shard(ADAPTER_DIR / ADAPTER_WEIGHTS, [])
_ad = {"base_model.model.l.lora_A.weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
       "base_model.model.l.lora_B.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [24, 56]}}
(ADAPTER_DIR / ADAPTER_WEIGHTS).write_bytes(framed(dumps(_ad), 56))
ADAPTER_KEYS = st.sampled_from(["peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out",
                                "rank_pattern", "alpha_pattern", "target_modules"])
PATTERNS = st.dictionaries(st.sampled_from(["l", "(a+)+", "[", "x" * 300, ".*", "l|m", "\\"]) | st.text(max_size=4),
                           SCALARS, max_size=3)


@fuzz("adapter")
@given(config=st.fixed_dictionaries({"r": st.just(2) | SCALARS, "lora_alpha": st.just(4) | SCALARS},
                                    optional={"peft_type": st.just("LORA") | SCALARS, "rank_pattern": PATTERNS | JSON,
                                              "alpha_pattern": PATTERNS | JSON, "target_modules": JSON,
                                              "use_rslora": SCALARS, "use_dora": SCALARS})
       | st.dictionaries(ADAPTER_KEYS, JSON, max_size=5) | JSON)
def test_fuzz_adapter_config(config):
    (ADAPTER_DIR / ADAPTER_CONFIG).write_bytes(dumps(config))
    adapter = outcome(open_adapter, ADAPTER_DIR)
    if adapter is not None:
        for pair in adapter.pairs.values():
            assert math.isfinite(pair.scale) and pair.scale > 0
        from mergepipe.catalog.models import _architecture
        arch = _architecture("lora", adapter.config)
        assert arch is None or isinstance(arch, str)


# --- budgets, manifests, YAML configs --------------------------------------------------------------------
BUDGET_TEXT = st.from_regex(r"\A\s?[+-]?[0-9]{0,400}\.?[0-9]{0,3}(e[+-]?[0-9]{1,4})?\s?(%|b|kb|mib|gib|tb|x|)\Z")


@fuzz("budget")
@given(value=BUDGET_TEXT | st.text(max_size=20) | st.floats() | st.integers() | BIG_INT | SCALARS | JSON,
       mb=st.none() | st.floats() | st.integers() | BIG_INT, bound=st.none() | st.floats() | BIG_INT | st.text(max_size=5))
def test_fuzz_budget(value, mb, bound):
    for args in ((value,), (value, mb), (value, None, bound)):
        b = outcome(Budget.of, *args)
        if b is not None:
            assert isinstance(b.spec, str) and len(b.spec) < 500
            if b.is_target:
                assert math.isfinite(b.target_bound) and b.target_bound >= 0
            else:
                n = b.bytes_of(10**12)
                assert isinstance(n, int) and 0 <= n <= 10**12
    outcome(Budget.percent, value)
    outcome(mib, mb)


def _manifest(outputs, run_out="/nonexistent") -> dict:
    core = {"plan_id": "p", "outputs": outputs, "inputs": {}, "budget": {"spec": "100%"},
            "estimated": {"base_read": 0, "expert_read": 0, "output_write": 0},
            "realized": {"base_read": 0, "expert_read": 0, "output_write": 0}}
    return {"core": core, "run": {"snapshot_id": "snap-1", "model_id": "m", "out": run_out}}


@fuzz("manifest")
@given(doc=st.builds(_manifest, st.dictionaries(FILE_NAMES.filter(lambda x: isinstance(x, str)) | NAMES,
                                                JSON | st.fixed_dictionaries({"sha256": SCALARS}), max_size=3),
                     SCALARS)
       | JSON, drop=st.none() | st.sampled_from(["core", "run", "outputs", "plan_id", "out", "realized"]),
       replace=st.none() | JSON)
def test_fuzz_manifest(doc, drop, replace):
    if drop and isinstance(doc, dict) and "core" in doc:
        for part in (doc, doc["core"], doc["run"]):
            if drop in part:
                if replace is None:
                    del part[drop]
                else:
                    part[drop] = replace
    m = outcome(parse_manifest, dumps(doc).decode("utf-8", "surrogatepass"), "fuzz-manifest")
    if m is not None:
        assert isinstance(m.core["outputs"], dict) and isinstance(m.run["out"], str)
        assert m.manifest_hash.startswith("sha256:")


YAML_BASE = "merge_method: linear\nbase_model: b\nmodels:\n  - model: e\n"


@fuzz("yaml")
@given(key=st.sampled_from(["parameters", "mergepipe", "models", "dtype", "tokenizer_source", "base_model"]),
       value=JSON, raw=st.text(max_size=40), deep=st.integers(0, 20_000))
def test_fuzz_yaml_config(key, value, raw, deep):
    import yaml
    try:
        text = YAML_BASE + yaml.safe_dump({key: value}, allow_unicode=True)
    except (yaml.YAMLError, ValueError, UnicodeEncodeError):
        text = YAML_BASE
    for t in (text, YAML_BASE + raw, YAML_BASE + "parameters: {weight: " + "[" * deep + "]" * deep + "}\n",
              YAML_BASE + "mergepipe: {seed: " + "7" * (deep % 6000 + 1) + "}\n"):
        outcome(parse_config, t)
