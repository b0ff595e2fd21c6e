"""The command line on bad input (issue 14): a value with a leading minus reaches its own parser (argparse
would take `-5%` for an option and print its usage), and every refusal is exactly one `error:` line on
stderr with exit code 2 (1 for a snapshot that does not verify), whatever the names it quotes."""

from __future__ import annotations

import json
import struct

import pytest

from merge_helpers import run_cli_proc
from mergepipe.cli.app import _join_negative_values, main


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert "usage:" not in err and "Traceback" not in err
    return err


@pytest.fixture
def db(tmp_path, capsys):
    path = tmp_path / "cat.sqlite"
    assert cli(capsys, "init-db", "--db", path)[0] == 0
    return path


@pytest.mark.parametrize("args, needle", [
    (["--budget", "-5%"], "bad budget '-5%': the budget must be positive"),
    (["--budget=-5%"], "bad budget '-5%': the budget must be positive"),
    (["--budget", "-0.5"], "bad budget '-0.5': the budget must be positive"),
    (["--budget", "-.5GiB"], "the budget must be positive"),
    (["--budget", "1e309B"], "bad budget '1e309B': the number is too large"),
    (["--budget", "9" * 5000 + "B"], "the number is too large"),
    (["--target-bound", "-1e-3"], "--target-bound must be a non-negative number"),
    (["--target-bound", "inf"], "--target-bound must be a finite number"),
    (["--io-budget-mb", "-1e3"], "the budget must be positive"),
    (["--io-budget-mb", "nan"], "the budget in MiB must be a finite number"),
])
@pytest.mark.parametrize("command", ["plan", "merge"])
def test_budget_values_reach_the_budget_parser(capsys, tmp_path, db, command, args, needle):
    extra = ["--out", tmp_path / "out"] if command == "merge" else []
    rc, out, err = cli(capsys, command, "--db", db, "--base", "b", "--experts", "e", *extra, *args)
    assert rc == 2 and out == ""
    assert needle in one_error_line(err)
    assert not (tmp_path / "out").exists()


def test_joining_leaves_other_arguments_alone():
    assert _join_negative_values(["plan", "--budget", "-5%", "--seed", "3"]) == ["plan", "--budget=-5%", "--seed", "3"]
    assert _join_negative_values(["--budget", "--seed"]) == ["--budget", "--seed"]  # argparse reports it
    assert _join_negative_values(["--weights", "1", "-0.5"]) == ["--weights", "1", "-0.5"]
    assert _join_negative_values(["--", "--budget", "-5%"]) == ["--", "--budget", "-5%"]


def test_budget_minus_in_a_real_process(tmp_path, db):
    res = run_cli_proc(["plan", "--db", db, "--base", "b", "--experts", "e", "--budget", "-5%"])
    assert res.returncode == 2 and res.stdout == ""
    assert "bad budget '-5%'" in one_error_line(res.stderr)


def _write(path, header: bytes, data_len: int = 8):
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * data_len)
    return path


def test_register_names_with_newlines_stay_on_one_line(capsys, tmp_path, db):
    header = json.dumps({"a\nb\rc\u2028d": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}).encode()
    p = _write(tmp_path / "nl.safetensors", header)
    rc, out, err = cli(capsys, "register", "--db", db, "--model-id", "x", "--uri", p)
    assert rc == 2 and out == ""
    assert "nl.safetensors: tensor 'a\\nb\\rc\\u2028d': dtype must be a string (is a list)" in one_error_line(err)


def test_verify_mismatch_with_odd_snapshot_id_is_one_line(capsys, tmp_path, db):
    out = tmp_path / "snap"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x")
    from safetensors.torch import save_file
    import torch
    from mergepipe.storage.registry import open_checkpoint
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    base = {"id": "b", "uri": str(tmp_path / "b.safetensors"),
            "fingerprint": open_checkpoint(tmp_path / "b.safetensors").fingerprint()}
    core = {"plan_id": "p", "outputs": {"model.safetensors": {"sha256": "sha256:00"}},
            "inputs": {"base": base, "experts": []}, "budget": {},
            "estimated": {"base_read": 0, "expert_read": 0, "output_write": 0},
            "realized": {"base_read": 0, "expert_read": 0, "output_write": 0}}
    doc = {"core": core, "run": {"snapshot_id": "snap\nline2", "model_id": "m", "out": str(out)}}
    (out / "mergepipe_manifest.json").write_text(json.dumps(doc))
    rc, stdout, err = cli(capsys, "verify", "--db", tmp_path / "none.sqlite", out)
    assert rc == 1
    assert "snap line2: model.safetensors: sha256" in one_error_line(err)
