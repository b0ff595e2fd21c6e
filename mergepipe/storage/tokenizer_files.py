"""The tokenizer and processor files a merged model carries over from its tokenizer source (the base
by default), and its chat template.

The rule: every regular file at the top of the source directory whose name is a tokenizer, processor
or generation file -- ``tokenizer*`` (tokenizer.json, tokenizer_config.json, tokenizer.model, ...),
``vocab*`` (BERT's vocab.txt, GPT-2's vocab.json), ``merges*.txt``, any ``*.model`` (sentencepiece:
spiece.model, sentencepiece.bpe.model), ``*.tiktoken``, ``spiece*``/``sentencepiece*``, ``bpe.codes``,
``added_tokens.json``, ``special_tokens_map.json``, ``chat_template*.jinja``/``chat_template*.json``,
``*preprocessor_config.json`` (image/video/audio processors), ``processor_config.json``,
``feature_extractor_config.json``, ``generation_config.json`` -- plus the ``*.jinja`` files of an
``additional_chat_templates/`` folder. Weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ...) and
shard indexes never are. This is a superset of what mergekit 0.1.5 copies (its fixed list misses
vocab.txt, vocab.json, sentencepiece models other than tokenizer.model and preprocessor configs, which
it only gets by re-saving through transformers). ``config.json`` is copied from the base separately.
"""

from __future__ import annotations

import fnmatch
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from mergepipe.errors import StorageError
from mergepipe.storage.paths import open_regular, read_regular

MAX_TOKENIZER_FILE_BYTES = 512 << 20  # a tokenizer.json of a 256k vocabulary is ~30 MB

PATTERNS = ("tokenizer*", "vocab*", "merges*.txt", "*.model", "*.tiktoken", "spiece*", "sentencepiece*",
            "bpe.codes", "added_tokens.json", "special_tokens_map.json", "chat_template*.jinja",
            "chat_template*.json", "*preprocessor_config.json", "processor_config.json",
            "feature_extractor_config.json", "generation_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz",
                   ".pkl", ".index.json")
TEMPLATES_DIR = "additional_chat_templates"
# files that say what a tokenizer is (without one of them a folder has no tokenizer to compare or load)
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                     "spiece.model", "sentencepiece.bpe.model")
MODEL_WEIGHT_SUFFIXES = (".safetensors", ".bin")  # what transformers' from_pretrained loads weights from


def is_tokenizer_file(name: str) -> bool:
    low = name.lower()
    if low.startswith(".") or low.endswith(WEIGHT_SUFFIXES):
        return False
    return any(fnmatch.fnmatchcase(low, p) for p in PATTERNS)


def tokenizer_files(root: Path) -> list[str]:
    """The files (relative names, sorted) a merge copies from ``root``; [] when it is not a directory."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if p.is_file() and is_tokenizer_file(p.name)]
    extra = root / TEMPLATES_DIR
    if extra.is_dir():
        names += [f"{TEMPLATES_DIR}/{p.name}" for p in extra.iterdir() if p.is_file() and p.name.endswith(".jinja")]
    return sorted(names)


def has_tokenizer(root: Path) -> bool:
    return Path(root).is_dir() and any((Path(root) / n).is_file() for n in TOKENIZER_MARKERS)


def copy_tokenizer_files(src: Path, staging: Path) -> list[str]:
    """Copy the tokenizer files of ``src`` into ``staging`` (overwriting); returns their names."""
    names = tokenizer_files(src)
    for name in names:
        dest = staging / name
        dest.parent.mkdir(exist_ok=True)
        # through the path checks: a linked tokenizer file must not carry a file from outside the roots
        dest.write_bytes(read_regular(Path(src) / name, MAX_TOKENIZER_FILE_BYTES))
    return names


@contextmanager
def checked_folder(root: Path, weights: bool = False):
    """A temporary folder for transformers to load instead of ``root``: its tokenizer files and config.json,
    each read through the path checks (inside $MERGEPIPE_ALLOWED_ROOTS when set, a regular file, size-bounded),
    so that no file transformers opens by itself can lead outside the roots. ``weights``: also the weight
    files, as links to their resolved paths once those passed the same checks (shard indexes copied)."""
    root = Path(root)
    if not root.is_dir():
        raise StorageError(f"{root}: not a directory")
    with tempfile.TemporaryDirectory(prefix="mergepipe-checked-") as tmp:
        folder = Path(tmp)
        try:
            copy_tokenizer_files(root, folder)
            if (root / "config.json").is_file():
                (folder / "config.json").write_bytes(read_regular(root / "config.json", MAX_TOKENIZER_FILE_BYTES))
            if weights:
                _link_weights(root, folder)
        except OSError as exc:
            raise StorageError(f"{root}: cannot read its files ({exc.strerror})") from None
        yield folder


def _link_weights(root: Path, folder: Path) -> None:
    for p in sorted(root.iterdir()):
        if p.name.endswith(".index.json"):
            (folder / p.name).write_bytes(read_regular(p, MAX_TOKENIZER_FILE_BYTES))
        elif p.name.endswith(MODEL_WEIGHT_SUFFIXES):
            os.close(open_regular(p))  # inside the roots and a regular file
            os.symlink(p.resolve(), folder / p.name)


def read_chat_template(root: Path) -> str | None:
    """A model's chat template: chat_template.jinja, else tokenizer_config.json's ``chat_template``
    (a string, or a list of named templates: the ``default`` one)."""
    root = Path(root)
    if (root / "chat_template.jinja").is_file():
        return read_regular(root / "chat_template.jinja", MAX_TOKENIZER_FILE_BYTES).decode("utf-8", "replace")
    cfg = root / "tokenizer_config.json"
    if cfg.is_file():
        try:
            t = json.loads(read_regular(cfg, MAX_TOKENIZER_FILE_BYTES)).get("chat_template")
        except (ValueError, UnicodeDecodeError, AttributeError, RecursionError, StorageError):
            return None  # RecursionError: nested thousands deep
        if isinstance(t, list):
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return None


def write_chat_template(staging: Path, template: str) -> None:
    """Set the output tokenizer's chat template: chat_template.jinja (what transformers >= 4.43 saves
    and loads first), and the ``chat_template`` of tokenizer_config.json / chat_template.json when
    those files carry one, so that no stale template survives."""
    if not (staging / "tokenizer_config.json").is_file() and not (staging / "tokenizer.json").is_file():
        raise StorageError("a chat template was asked for, but the output has no tokenizer to attach it to "
                           "(its tokenizer source has no tokenizer files)")
    (staging / "chat_template.jinja").write_text(template, encoding="utf-8")
    cfg = staging / "tokenizer_config.json"
    if cfg.is_file():
        doc = json.loads(cfg.read_text(encoding="utf-8"))
        if "chat_template" in doc:
            doc["chat_template"] = template
            cfg.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tj = staging / "chat_template.json"
    if tj.is_file():
        tj.write_text(json.dumps({"chat_template": template}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


INSTALL_HINT = "pip install 'mergepipe[tokenizers]'"


def load_auto_tokenizer(root: Path, **kwargs):
    """``transformers.AutoTokenizer.from_pretrained(root, local_files_only=True, **kwargs)``, loaded from a
    checked copy of ``root`` (:func:`checked_folder`); any loading failure is one StorageError naming ``root``."""
    try:
        import transformers
    except ImportError:
        raise StorageError(f"{root}: loading its tokenizer needs the 'transformers' package, which is not "
                           f"installed: {INSTALL_HINT}") from None
    with checked_folder(root) as folder:
        try:
            return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any loading failure is one clear message
            first = str(exc).splitlines()[0].replace(str(folder), str(root)) if str(exc).strip() else ""
            raise StorageError(f"{root}: cannot load its tokenizer with transformers ({type(exc).__name__}"
                               f"{': ' + first if first else ''})") from None


def vocabulary(root: Path) -> dict[str, int]:
    """A tokenizer folder's vocabulary (token -> id, added tokens included), as transformers loads it
    (``AutoTokenizer.from_pretrained(root, local_files_only=True).get_vocab()``, what mergekit compares):
    read from its files where they settle it (:func:`~mergepipe.storage.vocab_files.read_vocabulary`,
    no transformers import), else through transformers."""
    from mergepipe.storage.vocab_files import read_vocabulary
    found = read_vocabulary(root)
    return found if found is not None else dict(load_auto_tokenizer(root).get_vocab())


def vocab_difference(want: dict[str, int], have: dict[str, int]) -> str:
    """A short description of how two vocabularies differ."""
    if len(want) != len(have):
        extra = sorted(set(have) - set(want))[:3]
        missing = sorted(set(want) - set(have))[:3]
        bits = [f"{len(have)} tokens vs {len(want)}"]
        if extra:
            bits.append("its own: " + ", ".join(map(repr, extra)))
        if missing:
            bits.append("lacking: " + ", ".join(map(repr, missing)))
        return "; ".join(bits)
    for tok in sorted(want):
        if have.get(tok) != want[tok]:
            return f"token {tok!r} has id {have.get(tok)} vs {want[tok]}"
    return "same tokens"
