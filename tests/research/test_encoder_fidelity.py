"""The pretrained-encoder fidelity harness on a miniature family (a tiny random BERT, 2 tasks, seconds):
task labels, held-out splits, probes and head accuracy against hand counts, the family builder (full
and LoRA experts, heads outside the checkpoints), budgeted merges scored with each task's head, and
the report's arithmetic on hand-made results."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.fidelity import text_tasks as tt
from benchmarks.fidelity.encoder import (
    BEFORE_FIELDS, MINI, build_family, data, eval_suite, family_accuracy, finetune, prepare_family,
)
from benchmarks.fidelity.encoder_findings import recommendation, rule_threshold, strategy_margins
from benchmarks.fidelity.encoder_report import cell, f1_rows, f2_rows, smallest_budget
from benchmarks.fidelity.encoder_study import EncoderStudy, op_params
from mergepipe.research.classify import (
    embed, fit_probe, head_accuracy, load_encoder, load_head, mean_pool, merged_accuracy, save_head,
)


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("encfam")
    return build_family(root / "family", MINI, log=lambda *_: None)


# --- tasks --------------------------------------------------------------------------------------------
def _label_of(task: str, s: str) -> int:
    """An independent reading of each generated sentence's label."""
    w = s.split()
    if task == "parity":
        return int(len(w[w.index("said") + 1:]) % 2 == 0)
    if task == "negparity":
        return int(w.count("not") % 2 == 0)
    if task == "larger":
        i = w.index("is")
        x, word, y = w[i - 1], w[i + 1], w[i + 3]
        bigger = tt.NUMBERS.index(x) > tt.NUMBERS.index(y)
        return int(bigger == (word in ("more", "bigger", "greater")))
    if task == "xor":
        first_state = {t: p for t, p, _ in tt.STATES}
        things = [w[i + 1] for i, x in enumerate(w) if x == "the" and w[i + 1] in first_state]
        states = [w[i + 1] for i, x in enumerate(w) if x == "was"]
        return int((states[0] == first_state[things[0]]) != (states[1] == first_state[things[1]]))
    if task == "older":
        i = w.index("than")
        return int((w[i - 3] == "alice") == (w[i - 1] in ("older", "taller")))
    if task == "negation":
        holds = any(h in s for h in tt.HOLDS)
        return int((w[-1] in ("open", "unlocked")) == holds)
    if task == "majority":
        return int(w.count(w[0]) == 3)
    if task == "order":
        return int(s in tt.docstring_lines())
    raise AssertionError(task)


@pytest.mark.parametrize("task", tt.TEXT_TASK_NAMES)
def test_generated_labels_match_an_independent_reading(task):
    t = tt.TEXT_TASKS[task]
    pairs = t.examples(200, 3)
    assert [_label_of(task, s) for s, _ in pairs] == [y for _, y in pairs]
    assert {y for _, y in pairs} == set(range(len(t.labels)))  # every class occurs
    assert 0.4 < sum(y for _, y in pairs) / len(pairs) < 0.6  # balanced
    assert t.chance == pytest.approx(1 / len(t.labels))
    if task != "order":  # the miniature family's word-level vocabulary covers every templated sentence
        assert {x for s, _ in pairs for x in s.split()} <= set(tt.vocabulary())


@pytest.mark.parametrize("task,sentence,label", [
    ("parity", "bob said apple apple apple", 0), ("parity", "kate said river river river river", 1),
    ("negparity", "at noon emma was not not happy", 1), ("negparity", "on monday jack was not not not busy", 0),
    ("larger", "seven is more than twelve", 0), ("larger", "seven is fewer than twelve", 1),
    ("xor", "at noon the door was open and the lamp was off", 1),
    ("xor", "in winter the cup was empty and the road was dry", 0),
    ("older", "last week alice was younger than bob", 0), ("older", "at noon mary was shorter than alice", 1),
    ("negation", "at noon , it is not true that the gate was locked", 1),
    ("negation", "at noon , it is not false that the tap was shut", 0),
    ("majority", "apple chair apple chair apple", 1), ("majority", "chair apple apple chair apple", 0),
    ("majority", "river river kettle kettle kettle", 0)])
def test_hand_made_sentences_read_as_expected(task, sentence, label):
    assert _label_of(task, sentence) == label


def test_splits_are_seeded_and_held_out():
    for task in tt.TEXT_TASK_NAMES:
        train, held = data(task, MINI)
        assert len(train) == MINI.steps * MINI.batch and len(held) == MINI.n_eval
        assert not {s for s, _ in train} & {s for s, _ in held}
        assert data(task, MINI) == (train, held)
        assert data(task, replace(MINI, seed=1)) != (train, held)
        if task != "order":  # templated sentences: held out by their hash, never generated for training
            assert all(tt.held_out(x) for x, _ in held) and not any(tt.held_out(x) for x, _ in train)
    doc_eval = set(tt._doc_split("eval"))
    assert doc_eval and not doc_eval & set(tt._doc_split("train"))
    held_lines = [s for s, y in data("order", MINI)[1] if y == 1]
    assert held_lines and all(s in doc_eval for s in held_lines)


# --- probes and heads ---------------------------------------------------------------------------------
def test_probe_separates_hand_made_clusters_and_head_accuracy_counts():
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[4.0, 0, 0], [0, 4.0, 0], [0, 0, 4.0]]) + 10.0  # offset: the probe standardises
    labels = [i % 3 for i in range(60)]
    feats = centers[labels] + 0.3 * torch.randn(60, 3, generator=g)
    probe = fit_probe(feats, labels, 3)
    assert head_accuracy(feats, probe, labels) == 1.0
    head = torch.nn.Linear(2, 2)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        head.bias.zero_()
    x = torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, 4.0], [1.0, 2.0]])  # predicts 0, 1, 0, 1
    assert head_accuracy(x, head, [0, 1, 1, 1]) == 0.75
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert mean_pool(h, torch.tensor([[1, 1, 0]])).tolist() == [[2.0, 3.0]]  # padding is ignored


def test_head_roundtrip(tmp_path):
    head = torch.nn.Linear(5, 3)
    save_head(head, tmp_path / "h.safetensors")
    again = load_head(tmp_path / "h.safetensors")
    assert torch.equal(again.weight, head.weight) and torch.equal(again.bias, head.bias)


# --- the family ---------------------------------------------------------------------------------------
def _digest(d) -> str:
    return hashlib.sha256((Path(d) / "model.safetensors").read_bytes()).hexdigest()


def test_family_layout_and_update_structure(fam):
    base = load_file(str(Path(fam["base"]) / "model.safetensors"))
    for task in MINI.tasks:
        full = load_file(str(Path(fam["experts"]["full"][task]) / "model.safetensors"))
        lora = load_file(str(Path(fam["experts"]["lora"][task]) / "model.safetensors"))
        assert set(full) == set(lora) == set(base)  # the head is not in the checkpoint
        head = load_file(fam["heads"]["full"][task])
        assert head["weight"].shape == (len(tt.TEXT_TASKS[task].labels), 32)
        moved_lora = {n for n in base if not torch.equal(base[n], lora[n])}
        # LoRA on every linear layer of the blocks: exactly those weight matrices moved, nothing else (no bias,
        # no embedding, no LayerNorm, not the pooler)
        linear = [f"attention.self.{m}" for m in ("query", "key", "value")] + [
            "attention.output.dense", "intermediate.dense", "output.dense"]
        assert moved_lora == {f"encoder.layer.{i}.{m}.weight" for i in range(2) for m in linear}
        moved_full = {n for n in base if not torch.equal(base[n], full[n])}
        # full fine-tuning moves every tensor the loss reaches; the pooler is unused by mean pooling
        assert moved_full == {n for n in base if not n.startswith("pooler.") and base[n].is_floating_point()}


def test_family_is_reproducible_and_reused(tmp_path, fam):
    spec = replace(MINI, steps=3, tasks=("larger",))
    a = build_family(tmp_path / "a", spec, log=lambda *_: None)
    b = build_family(tmp_path / "b", spec, log=lambda *_: None)
    for v in ("full", "lora"):
        assert _digest(a["experts"][v]["larger"]) == _digest(b["experts"][v]["larger"])
    assert _digest(a["experts"]["full"]["larger"]) != _digest(a["base"])
    log = []
    build_family(tmp_path / "a", spec, log=log.append)
    assert log == []  # nothing retrained
    with pytest.raises(SystemExit, match="different spec"):
        build_family(tmp_path / "a", replace(spec, steps=4), log=log.append)


def test_a_changed_lora_setting_rebuilds_the_lora_experts_only(tmp_path):
    spec = replace(MINI, steps=3, tasks=("larger",))
    a = build_family(tmp_path / "a", spec, log=lambda *_: None)
    full, lora = _digest(a["experts"]["full"]["larger"]), _digest(a["experts"]["lora"]["larger"])
    log = []
    assert prepare_family(tmp_path / "a", replace(spec, lora_lr=spec.lora_lr / 2), log=log.append) == ["lora"]
    assert log == ["a: lora settings changed (lora_lr): its experts are rebuilt"]
    assert not (tmp_path / "a" / "lora").exists() and not (tmp_path / "a" / "heads" / "lora").exists()
    again = build_family(tmp_path / "a", replace(spec, lora_lr=spec.lora_lr / 2), log=lambda *_: None)
    assert _digest(again["experts"]["full"]["larger"]) == full  # kept, not retrained
    assert _digest(again["experts"]["lora"]["larger"]) != lora
    with pytest.raises(SystemExit, match=r"different spec \(batch\)"):
        prepare_family(tmp_path / "a", replace(spec, batch=8, lora_lr=1.0))
    assert (tmp_path / "a" / "lora").exists()  # refused before anything was removed


def test_lora_head_starts_as_the_probe_and_trains_without_dropout(fam):
    task = "larger"
    train, _ = data(task, MINI)
    probe = load_head(fam["probes"][task])
    still = finetune(Path(fam["base"]), task, "lora", replace(MINI, steps=0), train, head_init=probe)[2]
    assert torch.equal(still.weight, probe.weight) and torch.equal(still.bias, probe.bias)
    random_head = finetune(Path(fam["base"]), task, "lora", replace(MINI, steps=0, lora_head_init="random"),
                           train)[2]
    assert not torch.equal(random_head.weight, probe.weight)
    lora_cfg = (Path(fam["experts"]["lora"][task]) / "config.json").read_text()
    full_cfg = (Path(fam["experts"]["full"][task]) / "config.json").read_text()
    assert re.search(r'"hidden_dropout_prob": 0\.0\b', lora_cfg)
    assert re.search(r'"hidden_dropout_prob": 0\.1\b', full_cfg)


def test_merged_accuracy_matches_one_sentence_at_a_time(fam):
    """Batched, padded scoring vs an independent loop: each sentence alone, its own forward, mean, argmax."""
    task = "larger"
    expert = fam["experts"]["full"][task]
    pairs = eval_suite(MINI, [task])[task][:20]
    model, tok = load_encoder(expert)
    head = load_head(fam["heads"]["full"][task])
    right = 0
    with torch.no_grad():
        for s, y in pairs:
            ids = tok(s, return_tensors="pt")["input_ids"]
            h = model(input_ids=ids).last_hidden_state[0].mean(0)
            right += int(head(h).argmax()) == y
    got = merged_accuracy(expert, {task: fam["heads"]["full"][task]}, {task: pairs}, batch_size=7)
    assert got["per_task"][task] == pytest.approx(right / len(pairs))
    feats = embed(model, tok, [s for s, _ in pairs], batch_size=3)
    assert feats.shape == (20, 32)


def test_family_accuracy_scores_probe_heads_and_experts(fam):
    acc = family_accuracy(fam, MINI)
    for t in MINI.tasks:
        for v in ("full", "lora"):
            n = MINI.n_eval
            assert round(acc["experts"][v][t] * n) == pytest.approx(acc["experts"][v][t] * n, abs=1e-4)
        pairs = eval_suite(MINI, [t])[t]
        want = merged_accuracy(fam["base"], {t: fam["probes"][t]}, {t: pairs})["per_task"][t]
        assert acc["base_probe"][t] == pytest.approx(want)


# --- merges ---------------------------------------------------------------------------------------------
def test_budgeted_merges_scored_with_each_head(tmp_path, fam):
    suite = eval_suite(MINI)
    st = EncoderStudy(fam, "full", tmp_path / "study", suite, 4096, log=lambda *_: None)
    ref = st.full_reference("linear", op_params("linear", 1.0))
    # the full linear merge is the experts' mean, tensor by tensor (an independent reference)
    merged = load_file(str(Path(ref["dir"]) / "model.safetensors"))
    experts = [load_file(str(Path(fam["experts"]["full"][t]) / "model.safetensors")) for t in MINI.tasks]
    name = "encoder.layer.0.attention.self.query.weight"
    assert torch.allclose(merged[name], sum(e[name] for e in experts) / len(experts), atol=1e-6)
    assert ref["accuracy"]["per_task"].keys() == set(MINI.tasks)
    rec = st.merge("linear", 25, "norm", {}, reference=ref["dir"], keep=True)
    assert rec["bound_check"]["holds"] and 0 < rec["deviation"]["relative"] < rec["deviation"]["relative_delta"]
    assert 0 < rec["bytes_realized"] <= rec["budget_bytes"] == pytest.approx(0.25 * rec["full_expert_bytes"], abs=1)
    assert rec["accuracy"] == merged_accuracy(rec["dir"], fam["heads"]["full"], suite)
    none = st.merge("linear", 25, "norm", {}, tasks=())
    assert "accuracy" not in none and "deviation" not in none


# --- report arithmetic ----------------------------------------------------------------------------------
def _m(k, op, b, s, acc, rel=0.0, bound=None):
    m = {"k": k, "operator": op, "budget_pct": b, "strategy": s if b < 100 else "all", "block_bytes": 65536,
         "accuracy": {"mean": acc}, "retention": {"mean": acc - 0.5},
         "deviation": {"relative": rel, "relative_delta": 10 * rel, "update_norm": 2.0},
         "bound": None if bound is None else {"relative": bound}, "bytes_realized": b, "full_expert_bytes": 100}
    if bound is not None:
        m["bound_disjoint_blocks"] = bound / 5  # relative to the update norm 2.0: bound / 10
    return m


def test_report_cells_targets_and_budget_rule():
    merges = [_m(8, "linear", 100, "all", 0.80)]
    for b, acc, rel, bound in ((5, 0.70, 4e-3, 0.9), (10, 0.75, 2e-3, 0.7), (25, 0.795, 1e-3, 0.5),
                               (50, 0.80, 4e-4, 0.3)):
        merges.append(_m(8, "linear", b, "norm", acc, rel, bound))
    merges.append(_m(8, "linear", 25, "random", 0.60, 3e-3, 0.8))
    res = {"variants": {"full": {"merges": merges}}}
    assert cell(merges, 8, "linear", 25)["acc"] == 0.795 and cell(merges, 8, "linear", 25, "random")["acc"] == 0.60
    (f1,) = f1_rows(res)
    assert f1["met"] and f1["diff"] == pytest.approx(-0.005)
    (f2,) = f2_rows(res)
    assert f2["met"] and f2["value"] == 4e-4  # 4e-4 <= 5e-4
    merges[-2]["deviation"]["relative"] = 6e-4
    assert not f2_rows(res)[0]["met"]
    (sb,) = smallest_budget(res)
    assert (sb["budget"], sb["bound_rel"], sb["disjoint_rel"]) == (25, 0.5, pytest.approx(0.05))
    rule = rule_threshold(res)  # the smallest budget whose disjoint-block bound <= 0.05 of the update
    assert rule["x"] == pytest.approx(0.05) and rule["picks"][0]["pick"] == 25
    assert rule["picks"][0]["diff"] == pytest.approx(-0.005)


def test_strategy_margins_and_recommendation_keep_norm_within_the_standard_error():
    merges = [_m(8, "linear", 100, "all", 0.80)]
    for b, norm, conflict, rnd in ((10, 0.70, 0.69, 0.60), (25, 0.75, 0.77, 0.65)):
        merges += [_m(8, "linear", b, "norm", norm, 1e-3), _m(8, "linear", b, "conflict", conflict, 1e-3),
                   _m(8, "linear", b, "random", rnd, 2e-3)]
    res = {"variants": {"full": {"merges": merges}}, "family": {"spec": {"n_eval": 100}}}
    m = strategy_margins(res)
    assert m["conflict"] == (pytest.approx(0.005), pytest.approx(-0.01), pytest.approx(0.02), 2)
    assert m["random"][0] == pytest.approx(-0.10)
    text = recommendation(res, {})
    assert text.startswith("default strategy `norm`") and "conflict +0.5 (-1.0..+2.0, 2 cells)" in text
    assert "standard error (1.8 points)" in text  # sqrt(0.25 / 100 / 8)
    for mm in merges:  # conflict 4 points better everywhere: recommended instead
        if mm["strategy"] == "conflict":
            mm["accuracy"]["mean"] += 0.04
    assert recommendation(res, {}).startswith("default strategy `conflict`")


def test_a_family_from_before_the_lora_settings_rebuilds_its_lora_experts(tmp_path):
    spec = replace(MINI, steps=3, tasks=("larger",))
    build_family(tmp_path / "a", spec, log=lambda *_: None)
    stored = json.loads((tmp_path / "a" / "spec.json").read_text())
    old = {k: v for k, v in stored.items() if k not in BEFORE_FIELDS}  # a spec.json of the earlier harness
    (tmp_path / "a" / "spec.json").write_text(json.dumps(old))
    log = []
    assert prepare_family(tmp_path / "a", spec, log=log.append) == ["lora"]
    assert "lora_encoder_dropout, lora_head_init" in log[0] and "lora_dropout" in log[0]
    assert json.loads((tmp_path / "a" / "spec.json").read_text()) == stored


def test_run_text_says_what_a_one_variant_rerun_kept():
    from benchmarks.fidelity.encoder_report import run_text
    assert run_text({"procs": 2, "seconds_total": 600.0}) == "2 processes, 10 min in all."
    assert run_text({"procs": 2, "seconds_total": 1980.0, "variants": ["lora"],
                     "previous": {"procs": 16, "seconds_total": 5010.0}}) == (
        "2 processes, 33 min in all (this run: lora only, the other results kept from a run of 16 processes, 84 min).")
