"""A malformed manifest on disk (issue 14): not JSON, not an object, fields missing or of the wrong type,
huge numbers, deep nesting, duplicate keys, outputs naming files outside the snapshot. Each is one
VerifyError naming the file and the field -- from the API and from `mergepipe verify`, which prints one
`error:` line and exits with VerifyError's code (1: the snapshot does not verify)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mergepipe.cli.app import main
import torch
from safetensors.torch import save_file

from mergepipe.errors import VerifyError
from mergepipe.manifest.build import MANIFEST_NAME, Manifest
from mergepipe.manifest.verify import load_manifest, parse_manifest, verify
from mergepipe.storage.registry import open_checkpoint


def _input(path: Path) -> dict:
    """A real (tiny) checkpoint as a manifest input: verify re-fingerprints its inputs."""
    if not path.exists():
        save_file({"w": torch.zeros(2)}, str(path))
    return {"id": path.stem, "uri": str(path), "fingerprint": open_checkpoint(path).fingerprint()}


def good(out: Path) -> dict:
    data = b"weights"
    (out / "model.safetensors").write_bytes(data)
    core = {"plan_id": "plan-1", "outputs": {"model.safetensors": {"sha256": "sha256:" + hashlib.sha256(data).hexdigest()}},
            "inputs": {"base": _input(out.parent / "b.safetensors"), "experts": []}, "budget": {"spec": "100%"},
            "estimated": {"base_read": 1, "expert_read": 2, "output_write": 3},
            "realized": {"base_read": 1, "expert_read": 2, "output_write": 3}}
    run = {"snapshot_id": "snap-1", "model_id": "m", "out": str(out)}
    return Manifest(core, run).to_dict()


def snapshot(tmp_path: Path, edit=None, raw: bytes | None = None) -> Path:
    out = tmp_path / "snap"
    out.mkdir()
    doc = good(out)
    if edit:
        doc.pop("manifest_hash")  # the edits are the point; the hash check is tested elsewhere
        edit(doc)
    (out / MANIFEST_NAME).write_bytes(raw if raw is not None else json.dumps(doc).encode())
    return out


def test_a_good_manifest_verifies(tmp_path):
    out = snapshot(tmp_path)
    assert verify(None, str(out))["ok"]


def _set(path: str, value):
    def edit(doc):
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[p]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return edit


CASES = {
    "not json": (None, b"{core: 1", "not valid JSON"),
    "a list": (None, b"[1, 2]", "not a JSON object but a list"),
    "null": (None, b"null", "not a JSON object but null"),
    "not utf-8": (None, b'{"core": "\xff"}', "not UTF-8 text"),
    "no core": (_set("core", KeyError), None, "`core` is missing, not an object"),
    "run is a string": (_set("run", "x"), None, "`run` is a string, not an object"),
    "no out": (_set("run.out", KeyError), None, "`run.out` is missing, not a string"),
    "snapshot id a number": (_set("run.snapshot_id", 3), None, "`run.snapshot_id` is an integer, not a string"),
    "outputs a list": (_set("core.outputs", ["model.safetensors"]), None, "`core.outputs` is a list, not an object"),
    "output without sha": (_set("core.outputs", {"model.safetensors": {"sha": 1}}), None,
                           "entry 'model.safetensors' has no sha256 string"),
    "output escapes": (_set("core.outputs", {"../../etc/passwd": {"sha256": "x"}}), None,
                       "`core.outputs` names a file outside the snapshot directory"),
    "output absolute": (_set("core.outputs", {"/etc/passwd": {"sha256": "x"}}), None, "outside the snapshot"),
    "realized a string": (_set("core.realized.base_read", "1"), None, "`core.realized.base_read` is a string"),
    "hash a number": (_set("manifest_hash", 7), None, "`manifest_hash` is an integer, not a string"),
    "huge number": (None, b'{"core": {"seed": ' + b"9" * 5000 + b"}}", "holds a number too large to read"),
    "deep": (None, b'{"core": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "deep but parsable": (None, b'{"run": {}, "core": ' + b"[" * 100 + b"]" * 100 + b"}", "nested more than 64"),
    "duplicate key": (None, b'{"core": {}, "core": {}, "run": {}}', "a key appears twice"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_manifest_is_one_verify_error(tmp_path, capsys, case):
    edit, raw, needle = CASES[case]
    out = snapshot(tmp_path, edit, raw)
    for call in (lambda: load_manifest(None, str(out)), lambda: verify(None, str(out))):
        with pytest.raises(VerifyError) as ei:
            call()
        msg = str(ei.value)
        assert MANIFEST_NAME in msg and needle in msg and "\n" not in msg, msg
        assert "999999" not in msg and "[[[[" not in msg
    rc = main(["verify", "--db", str(tmp_path / "none.sqlite"), str(out)])
    stdout, err = capsys.readouterr()
    assert rc == VerifyError.exit_code and stdout == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def test_catalog_manifest_text_is_checked_too():
    with pytest.raises(VerifyError, match="the catalog's manifest of snap-x: unreadable manifest"):
        parse_manifest('{"core": 1, "run": {}}', "the catalog's manifest of snap-x")


def test_an_output_that_is_a_directory_is_a_problem_not_a_crash(tmp_path):
    out = snapshot(tmp_path)
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").mkdir()
    res = verify(None, str(out))
    assert not res["ok"] and res["problems"][0].startswith("model.safetensors: cannot read")
