"""PyTorch .bin checkpoints (torch.save zip format, single file or shards with
pytorch_model.bin.index.json) are read in place with exact ranges: a .bin family registers, analyzes and
merges to the same output, bit for bit, as its safetensors twin; a malicious pickle is refused without
running anything; the cases MergePipe cannot read in place are refused with a clear message."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergepipe import api
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.errors import MergePipeError, StorageError
from mergepipe.research.family import make_family
from mergepipe.storage.registry import open_checkpoint
from mergepipe.storage.safetensors import bytes_to_tensor
from mergepipe.storage.torchbin import BIN_INDEX

BLOCK = 4096


def to_bin(src: Path, dest: Path, shards: int) -> Path:
    """The safetensors checkpoint ``src`` re-saved with torch.save: one pytorch_model.bin, or ``shards``
    files with an index; config and tokenizer files copied."""
    dest.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    names = list(tensors)
    if shards == 1:
        torch.save({n: tensors[n] for n in names}, dest / "pytorch_model.bin")
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for i in range(shards):
            fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
            part = names[i * per:(i + 1) * per]
            torch.save({n: tensors[n] for n in part}, dest / fname)
            weight_map.update({n: fname for n in part})
        (dest / BIN_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copyfile(f, dest / f.name)
    return dest


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    root = tmp_path_factory.mktemp("bin")
    paths = make_family(root / "st", experts=2, size="tiny", dtype="fp32", shard_bytes=64 << 10)
    st = {"base": Path(paths["base"]), "e1": Path(paths["experts"][0]), "e2": Path(paths["experts"][1])}
    bn = {"base": to_bin(st["base"], root / "bin" / "base", 3), "e1": to_bin(st["e1"], root / "bin" / "e1", 1),
          "e2": to_bin(st["e2"], root / "bin" / "e2", 2)}
    return root, st, bn


def catalog(path: Path, models: dict, analyzed: bool) -> Catalog:
    cat = Catalog(path)
    register(cat, "base", str(models["base"]))
    register(cat, "e1", str(models["e1"]), base_id="base")
    register(cat, "e2", str(models["e2"]), base_id="base")
    if analyzed:
        analyze(cat, ["e1", "e2"], block_bytes=BLOCK, densities=[0.3])
    return cat


def test_layout_matches_the_safetensors_twin(twins):
    _, st, bn = twins
    a, b = open_checkpoint(st["base"]), open_checkpoint(bn["base"])
    assert {n: (t.dtype, t.shape) for n, t in a.tensors.items()} == {n: (t.dtype, t.shape) for n, t in b.tensors.items()}
    assert len(b.files) == 3 and all(f.suffix == ".bin" for f in b.files)
    ra, rb = a.reader(), b.reader()
    for name, tb in b.tensors.items():
        ta = a.tensors[name]
        assert rb.read(tb.file, tb.offset, tb.nbytes) == ra.read(ta.file, ta.offset, ta.nbytes), name
    assert rb.bytes_read == b.nbytes  # exact ranges: not a byte of zip metadata counted as tensor data


@pytest.mark.parametrize("analyzed", [True, False], ids=["budgeted", "first-merge"])
def test_bin_family_merges_bit_equal_to_safetensors_twin(twins, tmp_path, analyzed):
    _, st, bn = twins
    outs = {}
    for kind, models in (("st", st), ("bin", bn)):
        cat = catalog(tmp_path / f"{kind}.sqlite", models, analyzed)
        req = api.merge_request("base", ["e1", "e2"], "ties", density=0.3, budget="40%" if analyzed else None,
                                out=str(tmp_path / f"out-{kind}"))
        plan, _, manifest = api.run(cat, req)
        assert manifest.core["realized"]["expert_read"] == plan["estimate"]["expert_read"]
        if analyzed:
            assert 0 < plan["estimate"]["expert_read"] < plan["full_expert_bytes"]
        outs[kind] = (plan, manifest)
    assert outs["st"][0]["access"] == outs["bin"][0]["access"]
    a = (tmp_path / "out-st" / "model.safetensors").read_bytes()
    b = (tmp_path / "out-bin" / "model.safetensors").read_bytes()
    assert a == b
    # outputs are safetensors; the tokenizer files came along
    assert not list((tmp_path / "out-bin").glob("*.bin"))
    assert "tokenizer.json" in outs["bin"][1].core["outputs"]


def test_bin_registration_stamp_and_fingerprint_follow_the_files(twins, tmp_path):
    root, _, bn = twins
    copy = tmp_path / "e1"
    shutil.copytree(bn["e1"], copy)
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(bn["base"]))
    register(cat, "e1", str(copy), base_id="base")
    row = cat.model("e1")
    assert row["dtype"] == "F32" and "pytorch_model.bin" in row["file_stats"]
    os.utime(copy / "pytorch_model.bin", ns=(1, 1))
    with pytest.raises(MergePipeError, match="changed since registration"):
        api.merge(cat, "base", ["e1"], out=str(tmp_path / "o"), operator="linear")


# --- refusals ---------------------------------------------------------------------------------------
class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {Evil.marker}",))


def torch_zip(path: Path, obj_pickle: bytes, storages: dict[str, bytes] | None = None,
              compress: int = zipfile.ZIP_STORED) -> Path:
    """A file laid out like torch.save's zip (prefix/data.pkl, prefix/data/<key>)."""
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        z.writestr("archive/data.pkl", obj_pickle)
        z.writestr("archive/byteorder", "little")
        for key, data in (storages or {}).items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")
    return path


def test_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    Evil.marker = marker
    d = tmp_path / "evil"
    d.mkdir()
    torch_zip(d / "pytorch_model.bin", pickle.dumps({"w": Evil()}, protocol=2))
    with pytest.raises(StorageError, match=r"refused to load: its pickle asks for (posix|os)\.system"):
        open_checkpoint(d)
    # the same object saved by torch.save itself (a real checkpoint file around it)
    torch.save({"w": torch.zeros(2), "x": Evil()}, d / "pytorch_model.bin")
    with pytest.raises(StorageError, match="refused to load"):
        open_checkpoint(d)
    # and through register: one clear error, nothing registered, nothing executed
    cat = Catalog(tmp_path / "c.sqlite")
    with pytest.raises(MergePipeError, match="refused to load"):
        register(cat, "evil", str(d))
    assert not marker.exists()
    assert not cat.has_model("evil")


def test_other_globals_refused(tmp_path):
    class Builtin:
        def __reduce__(self):
            return (eval, ("1+1",))
    torch_zip(tmp_path / "a.bin", pickle.dumps({"w": Builtin()}, protocol=2))
    with pytest.raises(StorageError, match=r"(__builtin__|builtins)\.eval"):
        open_checkpoint(tmp_path / "a.bin")


def test_unsupported_layouts_are_refused(tmp_path):
    # legacy (non-zip) torch.save format
    torch.save({"w": torch.zeros(3)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(StorageError, match="legacy torch.save format"):
        open_checkpoint(tmp_path / "legacy.bin")
    # non-contiguous tensor (a transposed view is saved with its strides)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save({"w": base.t()}, tmp_path / "strided.bin")
    with pytest.raises(StorageError, match="not contiguous"):
        open_checkpoint(tmp_path / "strided.bin")
    # two different views of one storage
    torch.save({"a": base[:1], "b": base[1:]}, tmp_path / "views.bin")
    with pytest.raises(StorageError, match="different views of one storage"):
        open_checkpoint(tmp_path / "views.bin")
    # a nested training checkpoint
    torch.save({"model": {"w": torch.zeros(2)}, "step": 3}, tmp_path / "nested.bin")
    with pytest.raises(StorageError, match="not a flat state dict"):
        open_checkpoint(tmp_path / "nested.bin")
    # compressed entries
    good = tmp_path / "good.bin"
    torch.save({"w": torch.ones(4)}, good)
    with zipfile.ZipFile(good) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(tmp_path / "zipped.bin", "w", compression=zipfile.ZIP_DEFLATED) as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(StorageError, match="compressed"):
        open_checkpoint(tmp_path / "zipped.bin")


def test_tied_weights_are_two_names_for_the_same_bytes(tmp_path):
    emb = torch.randn(8, 4)
    torch.save({"embed.weight": emb, "lm_head.weight": emb, "pos": torch.arange(8)}, tmp_path / "tied.bin")
    ck = open_checkpoint(tmp_path / "tied.bin")
    a, b = ck.tensors["embed.weight"], ck.tensors["lm_head.weight"]
    assert (a.offset, a.nbytes) == (b.offset, b.nbytes)
    r = ck.reader()
    assert torch.equal(bytes_to_tensor(r.read(a.file, a.offset, a.nbytes), "F32", a.shape), emb)
    assert ck.tensors["pos"].dtype == "I64"


def test_quantized_or_sparse_tensors_are_refused(tmp_path):
    torch.save({"w": torch.eye(3).to_sparse()}, tmp_path / "sparse.bin")
    with pytest.raises(StorageError, match="dense tensors of the standard dtypes only"):
        open_checkpoint(tmp_path / "sparse.bin")
