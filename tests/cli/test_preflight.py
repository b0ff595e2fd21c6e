"""`mergepipe preflight --config merge.yml` (config/preflight.py, api/hub.py, cli/hub.py) against a real Hub-shaped
server on 127.0.0.1 (tests/hub_server.py), with models named by bare repo ids.

Asserted: a clean config is exit 0 with one table row per model and what the merge will meet (output parameters,
tokenizer, bytes to read and transfer, peak memory, time); a shape mismatch, a vocabulary mismatch and an lm_head
present in a model but not in its tied base are each one ``problem:`` line and exit 1; preflight transfers only the
indexes, headers and config.json files (counted by the server, every range inside a header) and prints that count;
`merge --config` and `plan --config` refuse with the same lines before anything is registered or read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergepipe.storage import registry, remote

from hub_server import HubServer, hub_repos
from merge_helpers import dump_db, run_cli


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    hub_repos(root)
    with HubServer(root) as server:
        yield server, root


@pytest.fixture(autouse=True)
def env(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub[0].url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF", "0.01")
    monkeypatch.setenv("COLUMNS", "200")
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "MERGEPIPE_REMOTE_CACHE"):
        monkeypatch.delenv(name, raising=False)
    fresh(hub[0])
    yield
    registry._BACKENDS.pop("hf", None)


def fresh(server) -> None:
    """Nothing kept from an earlier command: headers are fetched again, and counted from 0."""
    registry._BACKENDS.pop("hf", None)
    remote._HEADER_CACHE.clear()
    server.reset()


def write(tmp_path: Path, name: str, base: str, models, extra: str = "") -> Path:
    rows = "".join(f"  - model: {m}\n    parameters: {{weight: 1.0, density: 0.5}}\n" for m in models)
    path = tmp_path / name
    path.write_text(f"merge_method: ties\nbase_model: {base}\nmodels:\n{rows}{extra}")
    return path


def header_bytes(root: Path, repos) -> int:
    """What reading only the headers costs: 8 + the header of every safetensors file, the index and config.json."""
    total = 0
    for repo in repos:
        folder = root / repo
        total += sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in folder.glob("*.safetensors"))
        total += sum((folder / n).stat().st_size for n in ("model.safetensors.index.json", "config.json")
                     if (folder / n).is_file())
    return total


def assert_headers_only(server, root: Path, repos) -> None:
    assert server.total_bytes() == header_bytes(root, repos)
    for rel, start, end in server.ranges:  # no weight byte: every range ends inside the file's header
        assert end <= 8 + int.from_bytes((root / rel).read_bytes()[:8], "little"), (rel, start, end)


def test_a_clean_config_is_exit_0_with_the_table_and_headers_only(hub, tmp_path):
    server, root = hub
    cfg = write(tmp_path, "ok.yml", "org/base", ["org/expert_1", "org/expert_2@main"], "mergepipe: {budget: 25%}\n")
    res = run_cli(["preflight", "--config", cfg])
    assert (res.returncode, res.stderr) == (0, ""), res.stdout
    lines = res.stdout.splitlines()
    assert lines[0] == "preflight of ok.yml: ties"
    header = next(line for line in lines if line.split()[:3] == ["model", "role", "from"])
    assert header.split()[-2:] == ["bytes", "fetched"]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(" org/")}
    assert list(rows) == ["org/base", "org/expert_1", "org/expert_2@main"]
    assert rows["org/base"][1:3] == ["base", "Hub"] and rows["org/expert_1"][8:11] == ["own", "same", "layout"]
    assert "output     21 tensors, 106,816 parameters (the base's); head: own lm_head (tie_word_embeddings: false)" \
        in lines
    assert "tokenizer  256 rows in every model; the base's tokenizer (copied as it is)" in lines
    assert any(line.startswith("read       full merge 1.22 MiB (base 417.25 KiB, experts 834.50 KiB), transfer "
                               "1.22 MiB, ~") for line in lines)
    assert any(line.startswith("budget     25%: read <= 625.88 KiB (experts 208.62 KiB)") for line in lines)
    assert any(line.startswith("memory     peak ~") for line in lines)
    assert lines[-1] == "the merge will run" and not any(line.startswith("problem:") for line in lines)
    assert_headers_only(server, root, ["org/base", "org/expert_1", "org/expert_2"])
    sent = server.total_bytes() + server.api_bytes  # the files' headers and the commit look-ups
    assert f"preflight transferred {sent:,} bytes (indexes, headers and configs only)" in lines


def test_shape_and_vocabulary_mismatches_are_problems(hub, tmp_path):
    server, root = hub
    cfg = write(tmp_path, "bad.yml", "org/base", ["org/shape", "org/vocab"])
    res = run_cli(["preflight", "--config", cfg])
    assert res.returncode == 1 and res.stderr == ""
    problems = [line for line in res.stdout.splitlines() if line.startswith("problem:")]
    assert problems == [
        "problem: models[0].model org/shape: does not match the base: model.layers.0.mlp.up_proj.weight: shape "
        "[130, 64] != base [128, 64]",
        "problem: models[1].model org/vocab: vocabulary of 260 rows != the base's 256; re-ordering its embedding rows "
        "needs its tokenizer files on local disk (a remote model: download it once into the Hugging Face cache, "
        "then name it by its repo id)"]
    assert res.stdout.splitlines()[-1] == "2 problems: the merge would not run"
    assert "tokenizer  vocabularies of 256, 260 rows; the base's tokenizer (copied as it is)" in res.stdout
    assert_headers_only(server, root, ["org/base", "org/shape", "org/vocab"])


def test_an_lm_head_the_tied_base_lacks_is_a_problem(hub, tmp_path):
    server, root = hub
    cfg = write(tmp_path, "tied.yml", "org/tied", ["org/expert_1"])
    res = run_cli(["--json", "preflight", "--config", cfg])
    assert res.returncode == 1 and res.stderr == ""
    out = json.loads(res.stdout)
    assert out["ok"] is False and out["problems"] == [
        "models[0].model org/expert_1: has its own lm_head.weight [256, 64] but the base ties its embeddings (no "
        "lm_head.weight; tie_word_embeddings: true): an output with it would gain 16,384 parameters; MergePipe keeps "
        "the base's tensors and refuses the extra one (merge onto a base with an untied lm_head.weight, or drop it)"]
    assert [(m["model"], m["lm_head"]) for m in out["models"]] == [("org/tied", "tied"), ("org/expert_1", "own")]
    assert out["output"]["params"] == out["output"]["base_params"] == 90432 and out["output"]["growth"] == 0
    assert out["output"]["head"] == "tied to the embedding (tie_word_embeddings: true)"
    assert out["transferred"] == server.total_bytes() + server.api_bytes
    assert_headers_only(server, root, ["org/tied", "org/expert_1"])


def test_merge_and_plan_refuse_with_the_same_lines_before_registering_anything(hub, tmp_path):
    server, root = hub
    cfg = write(tmp_path, "bad.yml", "org/base", ["org/shape", "org/vocab"])
    preflight = run_cli(["preflight", "--config", cfg])
    problems = [line for line in preflight.stdout.splitlines() if line.startswith("problem:")]
    db = tmp_path / "c.sqlite"
    assert run_cli(["init-db", "--db", db]).returncode == 0
    before = dump_db(db)
    for cmd in (["merge", "--out", tmp_path / "out"], ["plan"]):
        fresh(server)
        res = run_cli([cmd[0], "--db", db, "--config", cfg, *cmd[1:]])
        assert (res.returncode, res.stdout) == (2, ""), res.stderr
        lines = res.stderr.splitlines()
        assert lines[:-1] == problems
        assert lines[-1] == ("error: preflight found 2 problems the merge would meet, nothing was registered or read "
                             "beyond headers; the first: " + problems[0].removeprefix("problem: "))
        assert_headers_only(server, root, ["org/base", "org/shape", "org/vocab"])
    assert dump_db(db) == before and not (tmp_path / "out").exists()


def test_a_clean_config_merges_after_its_preflight(hub, tmp_path):
    cfg = write(tmp_path, "ok.yml", "org/base", ["org/expert_1"])
    res = run_cli(["merge", "--db", tmp_path / "c.sqlite", "--config", cfg, "--out", tmp_path / "out"])
    assert res.returncode == 0, res.stderr
    assert not any(line.startswith("problem:") for line in res.stderr.splitlines())


def test_a_bad_config_is_one_error_line(hub, tmp_path):
    res = run_cli(["preflight", "--config", tmp_path / "none.yml"])
    assert res.returncode == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1
    assert res.stderr.startswith("error: ") and "none.yml" in res.stderr
    res = run_cli(["preflight", "--config", write(tmp_path, "b.yml", "org/base", ["org/expert_1"]), "--budget", "-5%"])
    assert res.returncode == 2 and res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1
