"""Tokenizer settings in a plain install (issue 32 item 1): `mergepipe merge --config` run in a process where
`transformers`, `tokenizers` and `sentencepiece` cannot be imported (an import hook on sys.meta_path, as if
they were not installed).

* where no embedding row moves -- `tokenizer_source: base`, `union` over one vocabulary, a model with the
  base's vocabulary, a `tokenizer:` block, a chat template -- the merge runs (the vocabularies are read from
  the tokenizer files with json) and writes the same tensors and tokenizer files as the same merge run here,
  where transformers is importable;
* where rows move (a union over an expert's added tokens, which mergekit builds through transformers) the
  merge is refused with one `error:` line naming the extra: pip install 'mergepipe[tokenizers]'.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from vocab_helpers import add_tokens  # noqa: E402

pytestmark = pytest.mark.slow  # a CLI subprocess per case (seconds each): out of the quick loop

BLOCKED = ("transformers", "tokenizers", "sentencepiece")
RUN_BLOCKED = textwrap.dedent(f"""\
    import importlib.abc, sys
    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, Blocked())
    from mergepipe.cli.app import main
    code = main(sys.argv[1:])
    assert not any(m.partition(".")[0] in {BLOCKED!r} for m in sys.modules)
    sys.exit(code)
    """)


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    from mergepipe.research.family import make_family
    root = tmp_path_factory.mktemp("plain")
    paths = make_family(root / "fam", experts=2, size="tiny", dtype="fp32", shard_bytes=1 << 30, seed=9)
    return root, Path(paths["base"]), [Path(p) for p in paths["experts"]]


def _config(base: Path, experts: list[Path], extra: str) -> str:
    return textwrap.dedent(f"""\
        merge_method: task_arithmetic
        base_model: {base}
        models:
          - model: {experts[0]}
            parameters: {{weight: 0.4}}
          - model: {experts[1]}
            parameters: {{weight: 0.7}}
        dtype: float32
        """) + extra


def _run(tmp: Path, text: str, blocked: bool, tag: str) -> subprocess.CompletedProcess:
    work = tmp / tag
    work.mkdir()
    (work / "merge.yml").write_text(text)
    args = ["merge", "--db", str(work / "c.sqlite"), "--config", str(work / "merge.yml"), "--out", str(work / "out")]
    cmd = [sys.executable, "-c", RUN_BLOCKED, *args] if blocked else [sys.executable, "-m", "mergepipe.cli", *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=work)


def _files(d: Path) -> dict[str, bytes]:
    """The tokenizer files and config.json of an output (the manifest and model card hold ids and timings)."""
    from mergepipe.storage.tokenizer_files import is_tokenizer_file
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())
            if p.is_file() and (is_tokenizer_file(p.name) or p.name == "config.json")}


SETTINGS = {
    "source-base": "tokenizer_source: base\n",
    "source-union-one-vocabulary": "tokenizer_source: union\n",
    "source-expert-same-vocabulary": "tokenizer_source: {e1}\n",
    "tokenizer-block": "tokenizer:\n  source: base\n",
    "chat-template": "tokenizer_source: base\nchat_template: chatml\n",
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_no_rows_move_merges_without_transformers(fam, tmp_path, name):
    _, base, experts = fam
    text = _config(base, experts, SETTINGS[name].format(e1=experts[1]))
    plain = _run(tmp_path, text, blocked=True, tag="plain")
    assert plain.returncode == 0, plain.stderr
    assert "error" not in plain.stderr
    full = _run(tmp_path, text, blocked=False, tag="full")
    assert full.returncode == 0, full.stderr
    a, b = tmp_path / "plain" / "out", tmp_path / "full" / "out"
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(ta) == set(tb) and all((ta[n] == tb[n]).all() for n in ta)
    fa, fb = _files(a), _files(b)
    assert "tokenizer.json" in fa and fa.keys() == fb.keys()
    assert fa == fb


def test_rows_moving_names_the_extra(fam, tmp_path):
    root, base, experts = fam
    import shutil
    grown = tmp_path / "grown"
    shutil.copytree(experts[0], grown)
    add_tokens(grown, ["<tool>", "<think>"], 5)
    text = _config(base, [grown, experts[1]], "tokenizer_source: union\n")
    res = _run(tmp_path, text, blocked=True, tag="union")
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "pip install 'mergepipe[tokenizers]'" in lines[0] and "transformers" in lines[0]
    assert "Traceback" not in res.stderr
