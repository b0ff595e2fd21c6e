"""Structurally wrong mergekit YAML (issue 14): huge integers, deep nesting (flow and block), odd values in
every key. Each is one ConfigError naming the source and the key or position, quickly, never another
exception; refusals quoting a value are cut short."""

from __future__ import annotations

import time

import pytest

from mergepipe.config.model import ConfigError
from mergepipe.config.parse import MAX_MESSAGE, load_config, parse_config

BASE = "merge_method: linear\nbase_model: b\nmodels:\n  - model: e\n"


def refused(text: str, *needles: str, source: str = "cfg.yaml") -> str:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source=source)
    assert time.perf_counter() - t0 < 2.0
    msg = str(ei.value)
    assert msg.startswith(source + ": ") and "\n" not in msg and len(msg) <= MAX_MESSAGE + 40, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


@pytest.mark.parametrize("where, text", [
    ("seed", BASE + "mergepipe:\n  seed: " + "9" * 5000 + "\n"),
    ("weight", BASE + "parameters:\n  weight: " + "9" * 5000 + "\n"),
    ("budget", BASE + "mergepipe:\n  budget: " + "9" * 5000 + "\n"),
])
def test_huge_integers(where, text):
    msg = refused(text, "holds a number too large to read")
    assert "99999" not in msg


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deep_flow_nesting(depth):
    refused(BASE + "parameters:\n  weight: " + "[" * depth + "]" * depth + "\n", "nested more than 64 levels deep")


def test_deep_block_nesting():
    text = BASE + "parameters:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(80)) + "  " * 81 + "x\n"
    refused(text, "line", "nested more than 64 levels deep")


def test_mixed_nesting_just_above_the_limit():
    text = BASE + "parameters:\n  weight: " + "[ {a: " * 40 + "1" + "} ]" * 40 + "\n"
    refused(text, "nested more than 64 levels deep")


@pytest.mark.parametrize("extra, needles", [
    ("mergepipe:\n  budget: 1e309B\n", ["mergepipe.budget", "the number is too large"]),
    ("mergepipe:\n  budget: -5%\n", ["mergepipe.budget", "must be positive"]),
    ("mergepipe:\n  strategy: [1]\n", ["mergepipe.strategy"]),
    ("mergepipe:\n  strategy: {a: 1}\n", ["mergepipe.strategy"]),
    ("mergepipe:\n  target_bound: .inf\n", ["mergepipe.target_bound must be a finite number"]),
    ("dtype: [1]\n", ["dtype: unknown dtype"]),
    ("tokenizer_source: {a: [1]}\n", ["tokenizer_source"]),
    ("parameters:\n  weight: !!binary aGVsbG8=\n", ["parameters.weight must be a number"]),
    ("parameters:\n  weight: 2020-01-01\n", ["parameters.weight must be a number"]),
    ("parameters:\n  weight: !!python/object:os.system x\n", ["not valid YAML (line 6"]),
    ("parameters:\n  weight: [{filter: [1], value: 0.5}]\n", ["parameters.weight[0].filter"]),
])
def test_odd_values_name_the_key(extra, needles):
    refused(BASE + extra, *needles)


def test_long_values_are_cut_in_messages():
    msg = refused(BASE + "mergepipe:\n  strategy: " + "s" * 100_000 + "\n", "mergepipe.strategy", "'...")
    assert msg.count("s" * 100) == 0 and len(msg) < 300


def test_nul_and_control_characters_are_one_line():
    refused(BASE + "\x00", "not valid YAML")
    refused("\t\x01", "not valid YAML")


def test_a_directory_or_huge_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="too large for a merge config"):
        load_config(big)


def test_tilde_of_no_such_user():
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("~no-such-user-xyz/merge.yaml")
