"""Tokenizers: every tokenizer/processor file of the tokenizer source is carried into the output and
hashed in the manifest (BERT's vocab.txt, sentencepiece models, processor configs, chat templates);
``tokenizer_source: <model>`` / ``tokenizer: {source: ...}`` copy that model's tokenizer when every
model shares its vocabulary (and otherwise re-order the rows: tests/engine/test_vocab_merge.py);
``chat_template`` (a name, the text, or auto) is set; outputs load with transformers and match
mergekit 0.1.5's (tensors, vocabulary, chat template)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import parse_config
from mergepipe.config.resolve import plan_from_config, prepare
from mergepipe.config.templates import CHATML
from mergepipe.engine.engine import Engine
from mergepipe.catalog.models import register
from mergepipe.manifest.verify import verify
from mergepipe.research.family import make_family
from mergepipe.storage.tokenizer_files import tokenizer_files

import transformers

BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s"]


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    paths = make_family(root / "fam", experts=2, size="tiny", dtype="fp32", shard_bytes=1 << 30, seed=3)
    return root, Path(paths["base"]), [Path(p) for p in paths["experts"]]


def sha(p: Path) -> str:
    return "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def bertify(d: Path) -> Path:
    """Give a checkpoint folder a BERT-style slow tokenizer and the files people have next to it."""
    for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / n).unlink()
    (d / "vocab.txt").write_text("\n".join(BERT_VOCAB) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                                                         "model_max_length": 512}))
    (d / "special_tokens_map.json").write_text(json.dumps({"unk_token": "[UNK]", "sep_token": "[SEP]",
                                                           "pad_token": "[PAD]", "cls_token": "[CLS]",
                                                           "mask_token": "[MASK]"}))
    (d / "spiece.model").write_bytes(b"\x0a\x05dummy sentencepiece bytes")
    (d / "preprocessor_config.json").write_text(json.dumps({"do_resize": False}))
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (d / "README.md").write_text("# a model card\n")
    (d / "training_args.bin").write_bytes(b"not copied")
    return d


CARRIED = ["additional_chat_templates/tool_use.jinja", "chat_template.jinja", "generation_config.json",
           "preprocessor_config.json", "special_tokens_map.json", "spiece.model", "tokenizer_config.json",
           "vocab.txt"]


def test_base_tokenizer_files_carried_and_hashed(fam, tmp_path):
    root, base, experts = fam
    b = bertify(copy_model(base, tmp_path / "bert-base"))
    assert tokenizer_files(b) == CARRIED
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(b))
    for i, e in enumerate(experts):
        register(cat, f"e{i}", str(e), base_id="base")
    _, snap, manifest = api.run(cat, api.merge_request("base", ["e0", "e1"], "linear", out=str(tmp_path / "out")))
    out = tmp_path / "out"
    outputs = manifest.core["outputs"]
    for name in CARRIED + ["config.json"]:
        assert (out / name).read_bytes() == (b / name).read_bytes(), name
        assert outputs[name]["sha256"] == sha(out / name), name
    # the base's README.md is not carried: the output's README.md is its own model card
    assert (out / "README.md").read_bytes() != (b / "README.md").read_bytes()
    assert (out / "README.md").read_text().startswith("---\n") and not (out / "training_args.bin").exists()
    assert "tokenizer.json" not in outputs  # only what the base has
    assert verify(cat, snap)["ok"]
    tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok.convert_tokens_to_ids("mat") == BERT_VOCAB.index("mat")
    assert tok.tokenize("The cats") == ["the", "cat", "##s"]


def cfg(base, experts, extra: str, method: str = "linear") -> str:
    return textwrap.dedent(f"""\
        merge_method: {method}
        base_model: {base}
        models:
          - model: {experts[0]}
            parameters: {{weight: 0.25}}
          - model: {experts[1]}
            parameters: {{weight: 0.75}}
        dtype: float32
        """) + extra


def merge_config(tmp_path, text: str, out: str = "out"):
    cat = Catalog(tmp_path / "c.sqlite")
    plan, _ = plan_from_config(cat, parse_config(text, "tok.yml"))
    _, manifest = Engine(cat).execute(plan, out=tmp_path / out)
    return cat, plan, manifest, tmp_path / out


def test_tokenizer_source_model_copies_its_files(fam, tmp_path):
    _, base, experts = fam
    e0 = copy_model(experts[0], tmp_path / "e0")
    # same vocabulary, its own tokenizer settings and template
    tc = json.loads((e0 / "tokenizer_config.json").read_text())
    tc.update(model_max_length=4096, chat_template="{{ 'expert template' }}{% for m in messages %}{% endfor %}")
    (e0 / "tokenizer_config.json").write_text(json.dumps(tc))
    (e0 / "added_tokens.json").write_text("{}")
    for spelling in (f"tokenizer_source: {e0}\n", f"tokenizer:\n  source: {e0}\n"):
        sub = tmp_path / str(abs(hash(spelling)))
        sub.mkdir()
        cat, plan, manifest, out = merge_config(sub, cfg(base, [e0, experts[1]], spelling))
        assert plan["tokenizer"] == {"source": "e0", "source_uri": str(e0)}
        assert (out / "tokenizer_config.json").read_bytes() == (e0 / "tokenizer_config.json").read_bytes()
        assert (out / "added_tokens.json").exists()
        assert manifest.core["outputs"]["tokenizer_config.json"]["sha256"] == sha(e0 / "tokenizer_config.json")
        assert manifest.core["tokenizer"]["source"] == "e0"
        assert "tokenizer  e0's files" in plan.explain()
        exported = api.export_mergekit(cat, plan.id)
        assert f"tokenizer_source: {e0}" in exported
        again, _ = plan_from_config(cat, parse_config(exported, "exported.yml"), save=False)
        assert again["tokenizer"] == plan["tokenizer"]  # the export names the same tokenizer
    # a plan of the base's tokenizer has no tokenizer key (its digest is as before)
    cat, plan, _, _ = merge_config(tmp_path, cfg(base, [e0, experts[1]], "tokenizer: {source: base}\n"))
    assert "tokenizer" not in plan.data


def test_tokenizer_source_with_another_vocabulary_re_orders_rows(fam, tmp_path):
    """A source whose vocabulary differs (a token past e0's embedding rows): the rows are re-ordered
    to it (tests/engine/test_vocab_merge.py checks the merge against mergekit)."""
    _, base, experts = fam
    e0 = copy_model(experts[0], tmp_path / "e0")
    tj = json.loads((e0 / "tokenizer.json").read_text())
    tj["model"]["vocab"]["<extra>"] = len(tj["model"]["vocab"])
    (e0 / "tokenizer.json").write_text(json.dumps(tj))
    cat = Catalog(tmp_path / "c.sqlite")
    res = prepare(cat, parse_config(cfg(base, [e0, experts[1]], f"tokenizer_source: {e0}\n"), "tok.yml"))
    vocab = res.tokenizer["vocab"]
    assert (vocab["source"], vocab["tokens_n"], vocab["rows"]) == ("e0", 257, 257)
    assert vocab["sources"]["base"][-1] == ["own", 0, 0, 256]  # <extra>: no model has its row (zero)
    assert not cat.query("SELECT id FROM models")


@pytest.mark.parametrize("extra, words", [
    ("tokenizer:\n  source: base\n  tokens:\n    <tool>: {force: maybe}\n", ["tokenizer.tokens.<tool>.force"]),
    ("tokenizer: {source: base, pad_to_multiple_of: 0}\n", ["pad_to_multiple_of must be a positive integer"]),
    ("tokenizer_source: base\ntokenizer: {source: base}\n", ["not both"]),
    ("chat_template: vicuna_v9\n", ["chat_template", "chatml"]),
])
def test_parse_refusals(fam, extra, words):
    _, base, experts = fam
    with pytest.raises(ConfigError) as exc:
        parse_config(cfg(base, experts, extra), "tok.yml")
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


@pytest.mark.parametrize("extra, words", [
    ("tokenizer:\n  source: union\n  tokens:\n    <tool>: {source: base}\n",
     ["tokenizer.tokens", "'<tool>': base has no such token"]),
    ("tokenizer:\n  source: union\n  tokens:\n    <tool>: {source: {kind: model_token, model: base, token: nope}}\n",
     ["tokenizer.tokens", "'<tool>': base has no such token"]),
    ("tokenizer:\n  source: union\n  tokens:\n    t5: {source: {kind: zero, model: base}}\n",
     ["tokenizer.tokens.t5.source: kind: zero takes no other key"]),
])
def test_resolve_refusals(fam, tmp_path, extra, words):
    _, base, experts = fam
    cat = Catalog(tmp_path / "c.sqlite")
    with pytest.raises(ConfigError) as exc:
        prepare(cat, parse_config(cfg(base, experts, extra), "tok.yml"))
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


def test_union_of_one_shared_vocabulary_is_the_base_tokenizer(fam, tmp_path):
    """mergekit's default in the tokenizer block is union; models sharing one vocabulary (the usual
    case) make it the base's vocabulary: accepted, rows unchanged, the base's files copied. A union of
    different vocabularies is refused naming the model and the tokens."""
    _, base, experts = fam
    text = cfg(base, experts, "tokenizer:\n  source: union\n  tokens:\n    t7: {source: base}\n"
                              "  pad_to_multiple_of: 64\n")
    cat, plan, manifest, out = merge_config(tmp_path, text)
    assert "tokenizer" not in plan.data
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    e0 = copy_model(experts[0], tmp_path / "e0")
    tj = json.loads((e0 / "tokenizer.json").read_text())
    tj["model"]["vocab"]["<extra>"] = len(tj["model"]["vocab"])
    (e0 / "tokenizer.json").write_text(json.dumps(tj))
    res = prepare(Catalog(tmp_path / "d.sqlite"), parse_config(cfg(base, [e0, experts[1]], "tokenizer_source: union\n"),
                                                               "tok.yml"))
    assert res.tokenizer["vocab"]["tokens_n"] == 256  # <extra> is past e0's vocab_size: mergekit skips it too


def test_chat_template_named_and_auto(fam, tmp_path):
    _, base, experts = fam
    (tmp_path / "a").mkdir()
    _, plan, _, out = merge_config(tmp_path / "a", cfg(base, experts, "chat_template: chatml\n"))
    tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok.chat_template == CHATML
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # auto: the most common template among the models (two of three carry the same one)
    models = [copy_model(m, tmp_path / n) for m, n in ((base, "b"), (experts[0], "x0"), (experts[1], "x1"))]
    for m, t in zip(models, ["{{ 'A' }}{% for m in messages %}{% endfor %}", "{{ 'B' }}{% for m in x %}{% endfor %}",
                             "{{ 'B' }}{% for m in x %}{% endfor %}"]):
        (m / "chat_template.jinja").write_text(t)
    (tmp_path / "c").mkdir()
    _, plan, _, out = merge_config(tmp_path / "c", cfg(models[0], models[1:], "chat_template: auto\n"))
    assert plan["tokenizer"] == {"chat_template": "{{ 'B' }}{% for m in x %}{% endfor %}"}
    assert (out / "chat_template.jinja").read_text() == "{{ 'B' }}{% for m in x %}{% endfor %}"


@pytest.mark.parametrize("source", ["expert", "union"])
def test_parity_with_mergekit_tokenizer_source_and_chat_template(fam, tmp_path, source):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
    import mergekit  # noqa: F401
    from mergekit_runner import mergekit_merge

    _, base, experts = fam
    # task_arithmetic: mergekit's linear with a tokenizer source also averages the base in (it asks for its weight)
    src = experts[0] if source == "expert" else "union"
    text = cfg(base, experts, f"tokenizer_source: {src}\nchat_template: chatml\n", "task_arithmetic")
    mk = mergekit_merge(text, tmp_path / "mk", copy_tokenizer=True)
    _, _, _, out = merge_config(tmp_path, text, "mp")
    mp = load_file(str(out / "model.safetensors"))
    assert set(mp) == set(mk)
    for name in mp:  # embed_tokens / lm_head rows included (mergekit's permutation is the identity here)
        assert torch.allclose(mp[name], mk[name], atol=1e-6, rtol=0), name
    a = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    b = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "mk"), local_files_only=True)
    assert a.get_vocab() == b.get_vocab()
    assert a.chat_template == b.chat_template == CHATML


def test_expert_with_added_tokens_needs_its_tokenizer_to_register(fam, tmp_path):
    """An expert fine-tuned with added tokens has more embedding rows than its base: it registers with
    its tokenizer files (its rows are re-ordered by a tokenizer setting), and is refused without them,
    saying why."""
    from safetensors.torch import save_file

    _, base, experts = fam
    e0 = copy_model(experts[0], tmp_path / "e0")
    t = load_file(str(e0 / "model.safetensors"))
    for name in [n for n in t if n.endswith(("embed_tokens.weight", "lm_head.weight"))]:
        t[name] = torch.cat([t[name], torch.zeros(2, t[name].shape[1])])
    save_file(t, str(e0 / "model.safetensors"))
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(base))
    register(cat, "e0", str(e0), base_id="base")
    for name in tokenizer_files(e0):
        (e0 / name).unlink()
    with pytest.raises(Exception, match=r"embed_tokens.weight: shape .* \(another vocabulary size\).*tokenizer_source"
                                        r".*needs the model's tokenizer files"):
        register(cat, "e1", str(e0), base_id="base")


def test_tokenizer_source_base_carries_every_tokenizer_file(fam, tmp_path):
    """`tokenizer_source: base` (issue 15 item 4's note): every tokenizer and processor file the base has
    -- BERT's vocab.txt, a sentencepiece spiece.model, processor configs, chat templates -- is carried
    into the output and hashed; models sharing the base's vocabulary and row count keep their rows."""
    _, base, experts = fam
    b = bertify(copy_model(base, tmp_path / "bert-base"))
    models = [bertify(copy_model(e, tmp_path / f"bert-e{i}")) for i, e in enumerate(experts)]
    cat, plan, manifest, out = merge_config(tmp_path, cfg(b, models, "tokenizer_source: base\n"))
    assert "tokenizer" not in plan.data  # nothing moves: the plan is the default one
    for name in CARRIED:
        assert (out / name).read_bytes() == (b / name).read_bytes(), name
        assert manifest.core["outputs"][name]["sha256"] == sha(out / name), name
    tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok.tokenize("The cats") == ["the", "cat", "##s"]
    assert load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"].shape[0] == 256
