"""Fuzzing the parsers of everything MergePipe reads from disk or from a user: safetensors headers, shard
indexes, config.json, adapter_config.json, manifests, mergekit YAML, budget strings, tokenizer files,
task-suite JSONL, recipes and their output patterns, sweep files, and .bin checkpoints (zip directories
and pickles).

The property, for every generated input: parsing either succeeds with a consistent result or raises
the project's own error (a MergePipeError whose message is one short line) -- never another exception,
never a hang. Inputs are structurally wrong on purpose: random JSON values of every type and nesting in
every field, wrong length prefixes, truncations, byte flips of valid headers, duplicate names, huge
integers, deep nesting.

Bounded for CI (about 3,200 cases in all, derandomized: the same cases on every run). The long run
scales it up: ``MERGEPIPE_FUZZ_EXAMPLES=100000`` spreads that many cases over the tests below (see
docs/reliability/fuzz.md).
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import tempfile
import time
import zipfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergepipe.config.parse import parse_config
from mergepipe.errors import MergePipeError
from mergepipe.manifest.verify import parse_manifest
from mergepipe.planner.budget import Budget, mib
from mergepipe.storage.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, open_adapter
from mergepipe.storage.safetensors import INDEX_NAME, ITEMSIZE, open_checkpoint, parse_header

TOTAL = int(os.environ.get("MERGEPIPE_FUZZ_EXAMPLES", "3200"))
# Share of the total per test (sums to 1).
SHARES = {"header": 0.16, "mutated": 0.18, "framing": 0.08, "index": 0.10, "config": 0.05, "adapter": 0.05,
          "budget": 0.05, "manifest": 0.05, "yaml": 0.04, "tokenizer": 0.05, "task_suite": 0.05, "recipe": 0.02,
          "sweep": 0.04, "bin_zip": 0.04, "bin_pickle": 0.04}
assert abs(sum(SHARES.values()) - 1) < 1e-9
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
              YAML_BASE + "mergepipe: {seed: " + "7" * (deep % 6000 + 1) + "}\n",
              YAML_BASE + key + ":\n" + laughs(deep % 10 + 1, deep % 7 + 2)):
        outcome(parse_config, t)


def laughs(levels: int, width: int) -> str:
    """A YAML block list of anchors, each aliasing the previous one ``width`` times (width**levels values)."""
    lines = [f"  - &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


# --- tokenizer files ---------------------------------------------------------------------------------------
TOK_DIR = TMP / "tokenizer"
TOK_DIR.mkdir()
_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 12)}}
TOK_FILES = {
    "tokenizer.json": {"version": "1.0", "truncation": None, "padding": None,
                       "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                                         "normalized": False, "special": True} for c, i in list(_VOCAB.items())[:3]],
                       "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                       "decoder": None, "model": {"type": "WordLevel", "vocab": _VOCAB, "unk_token": "<unk>"}},
    "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                              "unk_token": "<unk>", "model_max_length": 2048, "chat_template": "{{ messages }}"},
    "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "config.json": {"vocab_size": 12, "text_config": {"vocab_size": 12}},
}
TOK_PATHS = {"tokenizer.json": ["model", "vocab", "model.type", "model.unk_token", "added_tokens", "pre_tokenizer",
                                "normalizer", "version"],
             "tokenizer_config.json": ["chat_template", "tokenizer_class", "model_max_length", "bos_token",
                                       "added_tokens_decoder"],
             "special_tokens_map.json": ["bos_token", "additional_special_tokens"],
             "config.json": ["vocab_size", "text_config", "text_config.vocab_size"]}


def _set_path(doc, path: str, value):
    """``doc`` with the value at a dotted path replaced (the parents must be objects; else unchanged)."""
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node[last] = value
    return doc


def _write_tokenizer(files: dict[str, bytes]) -> None:
    for name in [n for n in os.listdir(TOK_DIR)]:
        (TOK_DIR / name).unlink()
    for name, raw in files.items():
        (TOK_DIR / name).write_bytes(raw)


@st.composite
def tokenizer_edits(draw):
    """The four files, one of them changed: a field replaced by any JSON, bytes flipped or cut, or replaced."""
    files = {n: json.loads(json.dumps(doc)) for n, doc in TOK_FILES.items()}
    name = draw(st.sampled_from(sorted(files)))
    kind = draw(st.integers(0, 5))
    raw = {n: dumps(doc) for n, doc in files.items()}
    if kind <= 2:
        raw[name] = dumps(_set_path(files[name], draw(st.sampled_from(TOK_PATHS[name])), draw(JSON)))
    elif kind == 3:
        b = bytearray(raw[name])
        for pos, byte in draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4)):
            b[pos % len(b)] = byte
        raw[name] = bytes(b[:draw(st.integers(0, len(b)))] if draw(st.booleans()) else b)
    elif kind == 4:
        raw[name] = draw(st.sampled_from([b"", b"[" * 5000 + b"]" * 5000, b'{"vocab_size": ' + b"9" * 5000 + b"}",
                                          b"\xff\xfe", b"null", b"[]", b'"x"', b"{" * 100_000]))
    else:
        del raw[name]
    return raw


@fuzz("tokenizer")
@given(files=tokenizer_edits())
def test_fuzz_tokenizer_files(files):
    from mergepipe.storage.tokenizer_files import read_chat_template, vocabulary
    from mergepipe.storage.vocab_union import config_vocab_size
    _write_tokenizer(files)
    template = outcome(read_chat_template, TOK_DIR)
    assert template is None or isinstance(template, str)
    size = outcome(config_vocab_size, TOK_DIR)
    assert size is None or isinstance(size, int) and not isinstance(size, bool)
    vocab = outcome(vocabulary, TOK_DIR)
    if vocab is not None:
        assert all(isinstance(t, str) and isinstance(i, int) for t, i in vocab.items())


# --- task suites (JSONL) -------------------------------------------------------------------------------
@st.composite
def suite_lines(draw):
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return dumps(draw(JSON)).decode("utf-8", "surrogatepass")
    if kind == 1:
        return draw(st.sampled_from(["", "   ", "{", "[" * 100_000, '{"task": ' + "1" * 5000 + "}",
                                     '{"task": "t", "prompt": "p", "choices": ["a", "b"], "answer": ' + "9" * 5000 + "}",
                                     '{"a": ' * 50_000 + "1" + "}" * 50_000, "\x00", "\ufeff{}"])) + draw(
            st.text(max_size=10))
    row = {"task": draw(st.just("t") | SCALARS), "prompt": draw(st.just("p") | SCALARS | JSON),
           "answer": draw(st.sampled_from(["a", "b", 0, 1, 5, -1, 10**4000, True]) | SCALARS | JSON)}
    if draw(st.booleans()):
        row["choices"] = draw(st.just(["a", "b"]) | st.lists(SCALARS, max_size=4) | JSON)
    for key in draw(st.lists(st.sampled_from(["task", "prompt", "answer"]), max_size=1)):
        del row[key]
    return dumps(row).decode("utf-8", "surrogatepass")


@fuzz("task_suite")
@given(lines=st.lists(suite_lines(), max_size=4), good=st.booleans(), cut=st.none() | st.integers(0, 10**6))
def test_fuzz_task_suite(lines, good, cut):
    from mergepipe.config.task_suite import TaskExample, parse_task_suite
    text = "\n".join((['{"task": "t", "prompt": "p", "answer": "a"}'] if good else []) + lines)
    raw = text.encode("utf-8", "surrogatepass")
    if cut is not None:
        raw = raw[:cut % (len(raw) + 1)]
    suite = outcome(parse_task_suite, raw, "fuzz.jsonl")
    if suite is not None:
        assert suite and all(isinstance(k, str) and v for k, v in suite.items())
        for examples in suite.values():
            for ex in examples:
                assert isinstance(ex, TaskExample) and isinstance(ex.prompt, str) and isinstance(ex.answer, str)
                assert ex.choices is None or ex.answer in ex.choices


# --- recipes and their output patterns -------------------------------------------------------------------
OUT_PIECES = st.sampled_from(["{name}", "{n}", "{version}", "{date}", "{name:>1000000000}", "{name.__class__}",
                              "{n!r}", "{0}", "{}", "{name[0]}", "{", "}", "{{", "}}", "{name:{n}}", "{who}",
                              "runs/", "-", "x" * 300]) | st.text(max_size=5)


@fuzz("recipe")
@given(name=st.sampled_from(["r", "daily-1", "a.b_c"]) | st.text(max_size=12) | SCALARS,
       experts=st.lists(st.sampled_from(["e1", "math-*", "[", ""]) | st.text(max_size=5), max_size=3) | JSON,
       operator=st.sampled_from(["linear", "ties", "task_arithmetic", "dare_ties", "nope"]) | SCALARS,
       weights=st.none() | st.dictionaries(st.text(max_size=4), SCALARS, max_size=2),
       params=st.none() | st.dictionaries(st.sampled_from(["lam", "density", "normalize", "rescale", "gamma", "seed"]),
                                          SCALARS | JSON, max_size=2),
       budget=st.none() | BUDGET_TEXT | SCALARS, out=st.none() | st.lists(OUT_PIECES, max_size=5).map("".join))
def test_fuzz_recipe(name, experts, operator, weights, params, budget, out):
    from mergepipe.config.recipe import MAX_OUT, Recipe, out_path
    recipe = outcome(Recipe.build, name, "base", experts, operator, weights, params, budget, out)
    if recipe is not None:
        path = out_path(recipe.out, name=recipe.name, n=12, version=3, date="20260101")
        assert isinstance(path, str) and len(path) <= MAX_OUT
    if out is not None:
        path = outcome(lambda: out_path(out, name="r", n=1, version=1, date="20260101"))
        assert path is None or len(path) <= MAX_OUT


# --- sweep files ---------------------------------------------------------------------------------------------
SWEEP_KEYS = st.sampled_from(["name", "base", "experts", "out", "executor", "address", "concurrency", "settings",
                              "grid", "points", "evaluate", "budgets"])
GRID = st.dictionaries(st.sampled_from(["operator", "budget", "density", "weights"]) | st.text(max_size=3),
                       st.lists(SCALARS, max_size=12) | JSON, max_size=6)


@st.composite
def sweep_docs(draw):
    doc = {"base": "b", "experts": ["e1", "e2"], "out": "o"}
    if draw(st.booleans()):
        doc["grid"] = draw(GRID)
    if draw(st.booleans()):
        doc["points"] = draw(st.lists(st.dictionaries(st.sampled_from(["operator", "density"]), SCALARS, max_size=2)
                                      | JSON, max_size=3))
    for key, value in draw(st.lists(st.tuples(SWEEP_KEYS, JSON), max_size=2)):
        doc[key] = value
    for key in draw(st.lists(st.sampled_from(["base", "experts", "out"]), max_size=1)):
        del doc[key]
    return doc


@fuzz("sweep")
@given(doc=sweep_docs() | JSON, raw=st.text(max_size=30), deep=st.integers(0, 20_000))
def test_fuzz_sweep(doc, raw, deep):
    import yaml
    from mergepipe.config.sweep import MAX_POINTS, load_sweep, parse_sweep
    cfg = outcome(parse_sweep, doc)
    if cfg is not None:
        assert 1 <= len(cfg.points) <= MAX_POINTS and all(isinstance(p, dict) for p in cfg.points)
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except (yaml.YAMLError, ValueError, UnicodeEncodeError):
        text = "base: b\n"
    base = "base: b\nexperts: [e]\nout: o\n"
    for t in (text, base + raw, base + "points: [{}]\nconcurrency: " + "7" * (deep % 6000 + 1) + "\n",
              base + "grid:\n" + "".join(f"  k{i}: [{', '.join(['1'] * (deep % 9 + 2))}]\n" for i in range(deep % 30)),
              base + "settings: " + "[" * (deep % 500) + "]" * (deep % 500) + "\n",
              base + "points: [{}]\nname:\n" + laughs(deep % 10 + 1, deep % 7 + 2)):
        outcome(load_sweep, write("sweep.yml", t.encode("utf-8", "surrogatepass")))


# --- .bin checkpoints: zip directories and pickles -----------------------------------------------------
def _valid_bin() -> bytes:
    import torch
    buf = io.BytesIO()
    emb = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.save({"a": emb, "b": torch.ones(4, dtype=torch.bfloat16), "c": emb}, buf)
    return buf.getvalue()


VALID_BIN = _valid_bin()


def check_bin(path: Path) -> None:
    from mergepipe.storage.torchbin import parse_bin
    tensors = outcome(parse_bin, path)
    if tensors is not None:
        size = path.stat().st_size
        for name, t in tensors.items():
            assert isinstance(name, str) and t.dtype in ITEMSIZE
            assert t.nbytes == math.prod(t.shape) * ITEMSIZE[t.dtype]
            assert 0 <= t.offset and t.offset + t.nbytes <= size


@fuzz("bin_zip")
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       tail=st.booleans(), cut=st.none() | st.integers(0, 10**6), extra=st.binary(max_size=8))
def test_fuzz_bin_zip(edits, tail, cut, extra):
    """A real torch.save file with bytes overwritten (half the time in its last 200 bytes: the central
    directory and end record), truncated, or with bytes appended."""
    raw = bytearray(VALID_BIN)
    for pos, byte in edits:
        raw[(len(raw) - 1 - pos % 200) if tail else pos % len(raw)] = byte
    if cut is not None:
        raw = raw[:cut % (len(raw) + 1)]
    check_bin(write("fuzz.bin", bytes(raw) + extra))


PICKLE_OPS = st.sampled_from([
    b"]", b"}", b")", b"(", b"N", b"\x88", b"\x89", b"K\x05", b"M\xff\xff", b"J\xff\xff\xff\x7f", b"a", b"e", b"s",
    b"u", b"t", b"\x85", b"\x86", b"\x87", b"R", b"Q", b"0", b"1", b"2", b"q\x00", b"h\x00", b"r\xff\xff\xff\x7f",
    b"j\x00\x00\x00\x00", b"X\x01\x00\x00\x00a", b"X\xff\xff\xff\x7f", b"\x8d" + b"\xff" * 8, b"\x94",
    b"\x8c\x01a", b"\x95" + b"\x08" + b"\x00" * 7, b"c__builtin__\neval\n", b"cos\nsystem\n",
    b"ccollections\nOrderedDict\n", b"ctorch._utils\n_rebuild_tensor_v2\n", b"ctorch\nFloatStorage\n",
    b"\x8c\x02os\x8c\x06system\x93", b"\x8a\x01\x05", b"\x8b\x00\x00\x10\x00", b"I5\n", b"L5\n",
    b"S'x'\n", ("S'touch " + str(TMP / "pwned") + "'\n").encode(), b"Vx\n", b"p0\n", b"g0\n", b"\x81", b"\x92", b"b", b"i__main__\nX\n", b"o", b".", b"\xff"])


def _valid_pickle() -> bytes:
    with zipfile.ZipFile(io.BytesIO(VALID_BIN)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


VALID_PKL = _valid_pickle()


@fuzz("bin_pickle")
@given(kind=st.integers(0, 3), ops=st.lists(PICKLE_OPS, max_size=24),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
       at=st.integers(0, 10**6), value=JSON)
def test_fuzz_bin_pickle(kind, ops, edits, at, value):
    """data.pkl: random opcode sequences (globals that must never be called among them), a real state dict's
    pickle with bytes overwritten or opcodes spliced in, or any JSON value pickled; the zip around it is
    valid. Nothing a pickle names is ever executed (os.system would create MARKER)."""
    import pickle
    if kind == 0:
        pkl = b"\x80\x02" + b"".join(ops) + b"."
    elif kind == 1:
        b = bytearray(VALID_PKL)
        for pos, byte in edits:
            b[pos % len(b)] = byte
        pkl = bytes(b)
    elif kind == 2:
        pos = at % len(VALID_PKL)
        pkl = VALID_PKL[:pos] + b"".join(ops) + VALID_PKL[pos:]
    else:
        try:
            pkl = pickle.dumps(value, protocol=2)
        except (RecursionError, ValueError):
            pkl = b"N."
    with zipfile.ZipFile(io.BytesIO(VALID_BIN)) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    path = TMP / "pickle.bin"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, pkl if name.endswith("/data.pkl") else data)
    check_bin(path)
    assert not (TMP / "pwned").exists()
