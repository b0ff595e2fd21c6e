"""A tokenizer folder's vocabulary read from its files with json alone (:func:`read_vocabulary`), where
they settle what ``transformers.AutoTokenizer.from_pretrained(folder).get_vocab()`` returns -- so that
comparing the models' vocabularies (``tokenizer_source``, ``tokenizer:``, a union over one vocabulary:
no embedding row moves) needs neither transformers nor its start-up (seconds).

The vocabulary is the model's (``tokenizer.json``'s ``model.vocab``: BPE, WordPiece, WordLevel, Unigram;
or, for a BERT/GPT-2 tokenizer class without tokenizer.json, ``vocab.txt`` lines / ``vocab.json``) with
the ``added_tokens`` over it. transformers adds to it every special token the tokenizer names (in
tokenizer_config.json, special_tokens_map.json, added_tokens.json, or its class's defaults) that it
lacks: when any of those is missing, or an added token's id disagrees, or the class is one whose defaults
are not listed here, or the files are sentencepiece only, the answer is None and the caller asks
transformers (storage/tokenizer_files.py ``vocabulary``).
"""

from __future__ import annotations

import json
from pathlib import Path

from mergepipe.errors import StorageError
from mergepipe.storage.paths import read_regular

MAX_FILE_BYTES = 512 << 20
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# the special tokens a tokenizer class of transformers falls back to when tokenizer_config.json does not
# name them (its __init__ defaults); a class not listed: asked of transformers
CLASS_DEFAULTS: dict[str, dict[str, str]] = {
    "PreTrainedTokenizer": {}, "TokenizersBackend": {},
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "GemmaTokenizer": {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                       "mask_token": "<mask>"},
    "Qwen2Tokenizer": {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "GPT2Tokenizer": {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "BertTokenizer": {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                      "mask_token": "[MASK]"},
}
WORDPIECE_CLASSES = ("BertTokenizer",)  # vocab.txt without tokenizer.json
BYTE_BPE_CLASSES = ("GPT2Tokenizer",)  # vocab.json + merges.txt without tokenizer.json


def _json(path: Path):
    """The JSON document of ``path``; None when absent or unreadable as JSON (transformers then decides)."""
    if not path.is_file():
        return None
    try:
        return json.loads(read_regular(path, MAX_FILE_BYTES))
    except (ValueError, UnicodeDecodeError, RecursionError, StorageError):
        return None


def read_vocabulary(root: Path) -> dict[str, int] | None:
    """``root``'s vocabulary (token -> id, added tokens included) when its files settle it, else None."""
    root = Path(root)
    cfg = _json(root / "tokenizer_config.json") or {}
    if not isinstance(cfg, dict):
        return None
    cls = cfg.get("tokenizer_class")
    cls = cls.removesuffix("Fast") if isinstance(cls, str) else None
    if cls not in CLASS_DEFAULTS:
        return None
    if (root / "tokenizer.json").is_file():
        vocab = _tokenizer_json(_json(root / "tokenizer.json"))
    elif cls in WORDPIECE_CLASSES and (root / "vocab.txt").is_file():
        vocab = _vocab_txt(root / "vocab.txt")
    elif cls in BYTE_BPE_CLASSES and (root / "vocab.json").is_file() and (root / "merges.txt").is_file():
        vocab = _token_ids(_json(root / "vocab.json"))
    else:
        return None  # sentencepiece only, or another layout: transformers (and its converters) decide
    if vocab is None or not _specials_present(root, cfg, CLASS_DEFAULTS[cls], vocab):
        return None
    return vocab


def _token_ids(doc) -> dict[str, int] | None:
    if not isinstance(doc, dict) or not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in doc.items()):
        return None
    return dict(doc)


def _tokenizer_json(doc) -> dict[str, int] | None:
    """tokenizer.json's model vocabulary with its added tokens (what the tokenizers library's get_vocab gives)."""
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict):
        return None
    kind, raw = model.get("type"), model.get("vocab")
    if kind in ("BPE", "WordPiece", "WordLevel"):
        vocab = _token_ids(raw)
    elif kind == "Unigram" and isinstance(raw, list):
        pieces = [p[0] if isinstance(p, list) and p and isinstance(p[0], str) else None for p in raw]
        vocab = None if None in pieces or len(set(pieces)) != len(pieces) else {p: i for i, p in enumerate(pieces)}
    else:
        return None
    added = doc.get("added_tokens") or []
    if vocab is None or not isinstance(added, list):
        return None
    for a in added:
        content, idx = (a.get("content"), a.get("id")) if isinstance(a, dict) else (None, None)
        if not isinstance(content, str) or type(idx) is not int or vocab.get(content, idx) != idx:
            return None
        vocab[content] = idx
    return vocab


def _vocab_txt(path: Path) -> dict[str, int] | None:
    """BERT's vocab.txt: one token a line, its id the line number (a repeated token: its last line)."""
    try:
        text = read_regular(path, MAX_FILE_BYTES).decode("utf-8")
    except (UnicodeDecodeError, StorageError):
        return None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return {tok: i for i, tok in enumerate(lines)}


def _names(value) -> list:
    """The token contents of a special-token setting (a string, {content: ...}, or a list/dict of them)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and "content" in value:
        return [value["content"]]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _names(v)]
    if isinstance(value, list):
        return [n for v in value for n in _names(v)]
    return [object()]  # anything else: unknown, so not settled


def _specials_present(root: Path, cfg: dict, defaults: dict[str, str], vocab: dict[str, int]) -> bool:
    """Every special and added token transformers would add is already in ``vocab`` (at the id given)."""
    smap = _json(root / "special_tokens_map.json") or {}
    if not isinstance(smap, dict):
        return False
    names: list = []
    for key in SPECIAL_KEYS:
        if key not in cfg and key not in smap:
            names += _names(defaults.get(key))
        names += _names(cfg.get(key)) + _names(smap.get(key))
    for key in ("additional_special_tokens", "extra_special_tokens"):
        names += _names(cfg.get(key)) + _names(smap.get(key))
    if not all(isinstance(n, str) and n in vocab for n in names):
        return False
    decoder = cfg.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        return False
    for idx, info in decoder.items():
        content = info.get("content") if isinstance(info, dict) else None
        if not isinstance(content, str) or not str(idx).isdigit() or vocab.get(content) != int(idx):
            return False
    extra = _json(root / "added_tokens.json") if (root / "added_tokens.json").is_file() else {}
    return isinstance(extra, dict) and all(vocab.get(t) == i for t, i in extra.items())
