"""Vocabularies read from the tokenizer files with json alone (storage/vocab_files.py, issue 32 item 1) equal
what transformers' ``AutoTokenizer.from_pretrained(folder).get_vocab()`` gives -- for the research family's
WordLevel tokenizer, BPE (a Llama-class tokenizer.json), Unigram, WordPiece (tokenizer.json and BERT's
vocab.txt), GPT-2's vocab.json -- and are None (transformers asked) where transformers would add a token the
files lack (a special token named but not in the vocabulary, a class's default one), or where the files do not
settle it (an unknown class, sentencepiece only, an added token at another id)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mergepipe.storage.vocab_files import read_vocabulary

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["the quick brown fox jumps over the lazy dog", "merging models one tensor at a time",
          "tokens and vocabularies", "a budget of bytes"] * 20


def _hf_vocab(d: Path) -> dict:
    return dict(transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True).get_vocab())


def _save(tok, d: Path, cls: str, **cfg) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls, **cfg}))
    return d


def _bpe(d: Path, cls="LlamaTokenizerFast", specials=("<unk>", "<s>", "</s>"), **cfg) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=list(specials)))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return _save(tok, d, cls, **cfg)


def _unigram(d: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=60, special_tokens=["<pad>", "<unk>"],
                                                            unk_token="<unk>"))
    return _save(tok, d, "PreTrainedTokenizerFast", unk_token="<unk>", pad_token="<pad>")


def _wordpiece(d: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=80, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    return _save(tok, d, "BertTokenizerFast")


def _vocab_txt(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "##s", "fox"]) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True}))
    return d


def _gpt2(d: Path) -> Path:
    src = _bpe(d.parent / (d.name + "-src"), specials=("<|endoftext|>",))
    model = json.loads((src / "tokenizer.json").read_text())["model"]
    d.mkdir(parents=True)
    (d / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    return d


def _family(d: Path) -> Path:
    from mergepipe.research.family import make_family
    return Path(make_family(d, experts=1, size="tiny", dtype="fp32", shard_bytes=1 << 30, seed=3)["base"])


SETTLED = {
    "family-wordlevel": _family,
    "bpe-llama": _bpe,
    "bpe-specials-named": lambda d: _bpe(d, "PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
                                         additional_special_tokens=["<|im_start|>"]),
    "unigram": _unigram,
    "wordpiece": _wordpiece,
    "bert-vocab-txt": _vocab_txt,
    "gpt2-vocab-json": _gpt2,
}


@pytest.mark.parametrize("name", sorted(SETTLED))
def test_read_vocabulary_equals_transformers(tmp_path, name):
    d = SETTLED[name](tmp_path / name)
    ours = read_vocabulary(d)
    assert ours is not None
    assert ours == _hf_vocab(d)


def _llama_without_bos(d: Path) -> Path:
    return _bpe(d, specials=("<unk>", "</s>"))  # LlamaTokenizer's default bos "<s>" is not in the vocabulary


def _pad_not_in_vocab(d: Path) -> Path:
    return _bpe(d, pad_token="<pad>")


def _added_at_other_id(d: Path) -> Path:
    d = _bpe(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {"3": {"content": "<s>", "special": True}}  # "<s>" is 1
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _unknown_class(d: Path) -> Path:
    return _bpe(d, "T5TokenizerFast")  # adds <extra_id_*> tokens of its own


def _sentencepiece_only(d: Path) -> Path:
    d = _bpe(d)
    shutil.move(d / "tokenizer.json", d / "unused.json")
    (d / "tokenizer.model").write_bytes(b"\x00")
    return d


UNSETTLED = {"llama-default-bos-missing": (_llama_without_bos, True), "pad-not-in-vocab": (_pad_not_in_vocab, True),
             "added-at-other-id": (_added_at_other_id, False), "unknown-class": (_unknown_class, False),
             "sentencepiece-only": (_sentencepiece_only, False)}


@pytest.mark.parametrize("name", sorted(UNSETTLED))
def test_read_vocabulary_leaves_unsettled_folders_to_transformers(tmp_path, name):
    make, differs = UNSETTLED[name]
    d = make(tmp_path / name)
    assert read_vocabulary(d) is None
    if differs:  # the files' own vocabulary is not what transformers gives: the reason to ask it
        model = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
        assert set(_hf_vocab(d)) - set(model)
