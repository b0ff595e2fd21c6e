"""The output vocabulary over models with different vocabularies and each model's re-ordered
embedding rows (mergepipe/storage/vocab_union.py), against mergekit 0.1.5's own build_tokenizer and
PermutedVocabulary run on the same tokenizer folders and tensors; the union tokenizer written by
MergePipe loads with transformers and round-trips the union vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mergepipe.errors import StorageError
from mergepipe.storage.vocab_union import (OWN, ROW, MEAN, ZERO, TokenSetting, build_vocabulary, compose_rows,
                                           compose_tensor, row_sources)

import transformers
import mergekit  # noqa: F401  (the parity cases compare with it; in the test extra)

SPECIAL = ["<unk>", "<s>", "</s>"]


def write_tokenizer(d: Path, words: list[str], added: list[str] = (), vocab_size: int | None = None) -> Path:
    """A WordLevel tokenizer folder (offline, no hub): the special tokens, ``words``, then ``added``
    (special added tokens); config.json's vocab_size = every token unless given."""
    d.mkdir(parents=True)
    vocab = {t: i for i, t in enumerate(SPECIAL + list(words))}
    entries = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i, c in enumerate(SPECIAL)]
    for t in added:
        vocab[t] = len(vocab)
        entries.append({"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": True})
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": entries, "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "bos_token": "<s>", "eos_token": "</s>",
                                                         "unk_token": "<unk>"}))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               "vocab_size": vocab_size or len(vocab)}))
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vu")
    return {
        # the common case: experts ADD tokens to the base's vocabulary
        "base": write_tokenizer(root / "base", ["a", "b", "c", "d"]),
        "e1": write_tokenizer(root / "e1", ["a", "b", "c", "d", "x", "y"], added=["<tool>"]),
        # another order, a token the base lacks shared with e1, one the base has missing
        "e2": write_tokenizer(root / "e2", ["y", "c", "a", "b", "z"], added=["<tool>", "<im>"]),
    }


def mk_reference(folders: dict[str, Path], models: list[str], source, tokens: dict, pad: int | None,
                 tensors: dict[str, torch.Tensor]):
    """mergekit 0.1.5's vocabulary and re-ordered tensors for the same folders."""
    from mergekit.common import ImmutableMap, ModelReference
    from mergekit.tokenizer.build import build_tokenizer
    from mergekit.tokenizer.config import ModelTokenEmbedding, TokenEmbeddingConfig, ZeroEmbedding
    from mergekit.tokenizer.embed import PermutedVocabulary

    refs = {m: ModelReference.model_validate(str(folders[m])) for m in models}

    def mk_setting(s: TokenSetting) -> TokenEmbeddingConfig:
        if isinstance(s.source, tuple) and s.source[0] == ZERO:
            src = ZeroEmbedding(kind="zero")
        elif isinstance(s.source, tuple):
            key = "token_id" if isinstance(s.source[1], int) else "token"
            src = ModelTokenEmbedding(kind="model_token", model=refs[s.source[0]], **{key: s.source[1]})
        else:
            src = refs[s.source]
        return TokenEmbeddingConfig(source=src, force=s.force)

    src = source if source in ("union", "base") else refs[source]
    info = build_tokenizer(refs["base"], list(refs.values()), src, False, add_tokens=list(tokens))
    task = PermutedVocabulary.model_construct(
        tokens=ImmutableMap({t: mk_setting(s) for t, s in tokens.items()}) if tokens else None,
        pad_to_multiple_of=pad, base_model=refs["base"], vocabulary_axis=0)
    out = task.execute(tokenizer_info=info, tensors={refs[m]: tensors[m] for m in models})
    return info, {m: out[refs[m]] for m in models}


def added_tokens(folders, models):
    return [transformers.AutoTokenizer.from_pretrained(str(folders[m])).added_tokens_decoder for m in models]


def embeddings(folders, models, width=5, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = {m: json.loads((folders[m] / "config.json").read_text())["vocab_size"] for m in models}
    return {m: torch.randn(sizes[m], width, generator=g) for m in models}


CASES = {
    "experts_add_tokens": (["base", "e1"], "union", {}, None),
    "different_vocabularies": (["base", "e1", "e2"], "union", {}, None),
    "padded": (["base", "e1", "e2"], "union", {}, 8),
    "model_source": (["base", "e1", "e2"], "e2", {}, None),
    # `base`: mergekit still re-orders every other model's rows to the base's vocabulary
    "base_source": (["base", "e1", "e2"], "base", {}, None),
    # (with `source: base` mergekit 0.1.5 crashes here, KeyError in PermutedVocabulary: it adds the
    # token to the base's own tokenizer object, then skips it as past the base's vocab_size)
    "tokens_added_padded": (["base", "e2"], "union", {"<new>": TokenSetting(source=("e2", "<im>")),
                                                      "d": TokenSetting(source=(ZERO,), force=True)}, 4),
    "tokens_block": (["base", "e1", "e2"], "union",
                     {"<new>": TokenSetting(source=("e1", "x")), "a": TokenSetting(source="e2", force=True),
                      "z": TokenSetting(source=(ZERO,)), "y": TokenSetting(source=("base", 4))}, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_vocabulary_and_rows_match_mergekit(folders, case):
    models, source, tokens, pad = CASES[case]
    tensors = embeddings(folders, models)
    info, mk_rows = mk_reference(folders, models, source, tokens, pad, tensors)
    roots = {m: folders[m] for m in models}
    vocab = build_vocabulary("base", roots, source, tuple(tokens), pad)
    theirs = info.tokenizer.get_vocab()
    assert set(vocab.vocab) == set(theirs) and len(vocab.vocab) == len(theirs)
    # the same ids for every token but the ordinary tokens a union adds: mergekit appends those in the
    # iteration order of transformers' get_vocab() (a Rust hash map: it changes from call to call),
    # MergePipe in each model's id order
    added = {info.content for tok in added_tokens(folders, models) for info in tok.values()}
    moved = set() if source != "union" else {t for t in vocab.vocab if t not in vocab.original_vocabs["base"]
                                              and t not in added
                                              and any(t in v for v in vocab.original_vocabs.values())}
    assert {t: i for t, i in vocab.vocab.items() if t not in moved} == {
        t: i for t, i in theirs.items() if t not in moved}
    assert sorted(vocab.vocab[t] for t in moved) == sorted(theirs[t] for t in moved)
    for m, ref in zip(models, info.permutations.values()):
        assert {t: vocab.permutations[m][i] for t, i in vocab.vocab.items()} == {
            t: ref[i] for t, i in theirs.items()}
    sources = row_sources(vocab, models, "base", tokens)

    def read_rows(m: str, rows: list[int]) -> np.ndarray:
        return tensors[m].numpy()[rows]

    for m in models:
        ours = compose_tensor(m, sources, read_rows, len(vocab.vocab), (5,), np.float32)
        want = mk_rows[m].numpy()
        assert ours.shape == want.shape == (vocab.rows, 5)
        for t, i in vocab.vocab.items():
            assert np.array_equal(ours[i], want[theirs[t]]), (case, m, t)
        n = len(vocab.vocab)
        np.testing.assert_allclose(ours[n:], want[n:], rtol=1e-6, atol=1e-7)
        assert n == vocab.rows or not np.array_equal(ours[n:], np.zeros_like(ours[n:]))


def test_union_where_experts_add_tokens_keeps_base_ids_and_appends(folders):
    vocab = build_vocabulary("base", {m: folders[m] for m in ("base", "e1", "e2")})
    base_vocab = {t: i for i, t in enumerate(SPECIAL + ["a", "b", "c", "d"])}
    assert {t: vocab.vocab[t] for t in base_vocab} == base_vocab
    assert sorted(vocab.vocab, key=vocab.vocab.get)[7:] == ["x", "y", "z", "<tool>", "<im>"]
    src = row_sources(vocab, ["base", "e1", "e2"], "base")
    x, y, z, tool = (vocab.vocab[t] for t in ("x", "y", "z", "<tool>"))
    assert src["base"][x] == src["e2"][x] == (ROW, "e1", 4 + 3)  # only e1 has x: its row for everyone
    assert src["e1"][x] == (OWN, 7)
    assert src["base"][y] == (MEAN, (("e1", 8), ("e2", 3)))  # base lacks y: mean of those holding it
    assert src["e1"][vocab.vocab["d"]] == (OWN, 6) and src["e2"][vocab.vocab["d"]] == (ROW, "base", 6)
    assert src["base"][z] == (ROW, "e2", 7) and src["base"][tool] == (MEAN, (("e1", 9), ("e2", 8)))


def test_compose_rows_reads_only_the_rows_of_its_block(folders):
    models = ["base", "e1", "e2"]
    tensors = embeddings(folders, models, seed=1)
    vocab = build_vocabulary("base", {m: folders[m] for m in models})
    sources = row_sources(vocab, models, "base")
    asked = []

    def read_rows(m, rows):
        asked.append((m, list(rows)))
        return tensors[m].numpy()[rows]

    block = compose_rows("base", sources, read_rows, 7, 9, (5,), np.float32)  # x (e1's only) and y (e1 and e2)
    assert sorted(asked) == [("e1", [7, 8]), ("e2", [3])]
    full = compose_tensor("base", sources, lambda m, r: tensors[m].numpy()[r], len(vocab.vocab), (5,), np.float32)
    assert np.array_equal(block, full[7:9])
    asked.clear()
    src = row_sources(vocab, models, "base", {"x": TokenSetting(source=(ZERO,), force=True)})
    zero = compose_rows("e1", src, read_rows, 7, 8, (5,), np.float32)  # a block of zero rows reads nothing
    assert asked == [] and np.array_equal(zero, np.zeros((1, 5), np.float32))


def test_union_tokenizer_saved_loads_and_round_trips(folders, tmp_path):
    vocab = build_vocabulary("base", {m: folders[m] for m in ("base", "e1", "e2")})
    vocab.save(tmp_path / "out")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert tok.get_vocab() == vocab.vocab and len(tok) == 12
    ids = tok("a x z <tool> y")["input_ids"]
    assert ids == [vocab.vocab[t] for t in ("a", "x", "z", "<tool>", "y")]
    assert tok.decode(ids, skip_special_tokens=False).split() == ["a", "x", "z", "<tool>", "y"]


def test_tokens_setting_from_a_model_that_is_not_merged_is_refused(folders):
    vocab = build_vocabulary("base", {m: folders[m] for m in ("base", "e1")}, add_tokens=("<new>",))
    with pytest.raises(StorageError, match=r"tokenizer.tokens: '<new>' takes its row from e2, which is not merged"):
        row_sources(vocab, ["base", "e1"], "base", {"<new>": TokenSetting(source="e2")})


def test_base_source_with_a_new_token_gives_it_default_rows(folders):
    """mergekit 0.1.5 fails here (KeyError); MergePipe treats the base as lacking the new token."""
    vocab = build_vocabulary("base", {m: folders[m] for m in ("base", "e2")}, "base", ("<new>",))
    new = vocab.vocab["<new>"]
    assert new == 7 and vocab.permutations["base"][new] == vocab.permutations["e2"][new] == -1
    src = row_sources(vocab, ["base", "e2"], "base", {"<new>": TokenSetting(source=("e2", "z"))})
    assert src["base"][new] == src["e2"][new] == (ROW, "e2", 7)
    assert src["e2"][vocab.vocab["d"]] == (ROW, "base", 6)
