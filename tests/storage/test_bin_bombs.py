"""Pickle bombs in a `.bin` checkpoint (issue 28): a data.pkl of 8 MiB of `]` builds 8 million lists, and a
memo index of 2^31 sizes the unpickler's memo table to 16 GiB. Both are refused from the opcodes, before
anything is built: one `error:` line from `mergepipe register`, exit 2, and a peak RSS within a few MiB of
registering a one-tensor file. Malicious pickles still run nothing."""

from __future__ import annotations

import os
import pickle
import zipfile
from functools import cache
from pathlib import Path

import pytest
import torch

from mergepipe.catalog.db import Catalog
from mergepipe.errors import StorageError
from mergepipe.storage.torchbin import MAX_PICKLE_OPS, parse_bin
from rss_helpers import cli, measured, one_error_line

MIB = 1 << 20
N = 4 * MIB


def bin_file(path: Path, pkl: bytes) -> Path:
    """A zip laid out like torch.save's (archive/data.pkl, byteorder, version) around ``pkl``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return path


BOMBS = {  # name -> (data.pkl, what the refusal says)
    "nested lists": (b"\x80\x02" + b"]" * N + b"a" * (N - 1) + b".", "more than 1,000,000 pickle operations"),
    "flat lists": (b"\x80\x02" + b"]" * (2 * N) + b".", "more than 1,000,000 pickle operations"),
    "empty dicts": (b"\x80\x02" + b"}" * (2 * N) + b".", "more than 1,000,000 pickle operations"),
    "memo slot 2^31": (b"\x80\x02N" + b"r\xff\xff\xff\x7f" + b".", "stores to memo slot 2147483647"),
}


@cache
def baseline_mib(tmp: str) -> float:
    """Peak RSS of registering a one-tensor .bin through the same CLI (imports and catalog included)."""
    d = Path(tmp) / "good"
    d.mkdir()
    torch.save({"w": torch.zeros(2)}, d / "pytorch_model.bin")
    Catalog(Path(tmp) / "c.sqlite").close()
    m = measured(cli("--db", str(Path(tmp) / "c.sqlite"), "register", str(d)), timeout=120)
    assert m.rc == 0, m.stderr
    return m.peak_mib


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_pickle_bomb_is_refused_before_it_is_built(name, tmp_path, tmp_path_factory):
    pkl, needle = BOMBS[name]
    d = tmp_path / "bomb"
    bin_file(d / "pytorch_model.bin", pkl)
    db = tmp_path / "c.sqlite"
    Catalog(db).close()
    before = db.read_bytes()
    m = measured(cli("--db", str(db), "register", str(d)), timeout=120)
    one_error_line(m, "pytorch_model.bin: refused to load: data.pkl", needle)
    base = baseline_mib(str(tmp_path_factory.mktemp("baseline")))
    assert m.peak_mib < base + 48, (name, m.peak_mib, base)  # before: +440 to +600 MiB
    assert db.read_bytes() == before


def test_the_op_count_is_checked_in_process(tmp_path):
    ok = bin_file(tmp_path / "ok.bin", b"\x80\x02" + b"]" * (MAX_PICKLE_OPS - 3) + b".")
    with pytest.raises(StorageError, match="holds a list"):  # just under the limit: unpickled, then refused
        parse_bin(ok)
    over = bin_file(tmp_path / "over.bin", b"\x80\x02" + b"]" * MAX_PICKLE_OPS + b".")
    with pytest.raises(StorageError, match="more than 1,000,000 pickle operations"):
        parse_bin(over)


def test_a_real_state_dict_is_far_below_the_limits(tmp_path):
    sd = {f"model.layers.{i}.mlp.experts.{j}.weight": torch.zeros(2, 2) for i in range(50) for j in range(40)}
    torch.save(sd, tmp_path / "big.bin")
    assert len(parse_bin(tmp_path / "big.bin")) == 2000


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _malicious(marker: Path) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    return {
        "os.system": pickle.dumps({"w": _Reduce(os.system, (cmd,))}, protocol=2),
        "builtins.exec": pickle.dumps({"w": _Reduce(exec, (f"open({str(marker)!r}, 'w')",))}, protocol=4),
        "subprocess.Popen": pickle.dumps(_Reduce(__import__("subprocess").Popen, (["touch", str(marker)],)),
                                         protocol=2),
        "INST opcode": b"(S'" + cmd.encode() + b"'\nios\nsystem\n.",
        "STACK_GLOBAL in a memo": (b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x93\x94h\x02\x8c"
                                   + bytes([len(cmd)]) + cmd.encode() + b"\x85R."),
    }


@pytest.mark.parametrize("kind", sorted(_malicious(Path("x"))))
def test_malicious_pickles_run_nothing(kind, tmp_path):
    marker = tmp_path / "pwned"
    path = bin_file(tmp_path / "evil.bin", _malicious(marker)[kind])
    with pytest.raises(StorageError, match="refused to load: its pickle asks for "):
        parse_bin(path)
    assert not marker.exists()
