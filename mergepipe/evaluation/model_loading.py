"""Loading a model and its tokenizer for evaluation: transformers (imported lazily, the ``[eval]`` extra)
reads a checked copy of the model folder; a folder whose vocab.json holds single characters gets the
:class:`CharTokenizer` (the fidelity family in benchmarks/fidelity)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mergepipe.errors import MergePipeError
from mergepipe.storage.tokenizer_files import checked_folder

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
INSTALL_HINT = "evaluating a model needs transformers, which is not installed: pip install 'mergepipe[eval]'"


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise MergePipeError(INSTALL_HINT) from None
    return transformers


class CharTokenizer:
    """One token per character; ids from ``vocab.json`` (token -> id) with ``<pad>``, ``<s>``, ``</s>``."""

    def __init__(self, tokens: list[str]):
        self.tokens = list(tokens)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.bos_id, self.eos_id = self.index[PAD], self.index[BOS], self.index[EOS]

    @classmethod
    def from_dir(cls, model_dir) -> CharTokenizer:
        table = json.loads((Path(model_dir) / "vocab.json").read_text())
        tokens = [None] * len(table)
        for t, i in table.items():
            tokens[i] = t
        return cls(tokens)

    @staticmethod
    def applies(model_dir) -> bool:
        p = Path(model_dir) / "vocab.json"
        if not p.exists():
            return False
        try:
            table = json.loads(p.read_text())
        except ValueError:
            return False
        return isinstance(table, dict) and {PAD, BOS, EOS} <= set(table) and all(
            len(t) == 1 for t in table if t not in (PAD, BOS, EOS))

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = [self.index[c] for c in text]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if self.tokens[i] not in (PAD, BOS, EOS):
                out.append(self.tokens[i])
        return "".join(out)

    def save(self, model_dir) -> None:
        (Path(model_dir) / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(self.tokens)}))

    def __len__(self) -> int:
        return len(self.tokens)


class _HFTokenizer:
    """Adapter so a transformers tokenizer looks like CharTokenizer to the decoding loop."""

    def __init__(self, model_dir, folder):
        """``folder``: the checked copy of ``model_dir``'s files that transformers reads."""
        auto = import_transformers().AutoTokenizer
        try:
            self.tok = auto.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError, ImportError) as exc:
            raise MergePipeError(f"{model_dir}: no usable tokenizer ({_reason(exc, folder, model_dir)})") from None
        self.bos_id, self.eos_id = self.tok.bos_token_id, self.tok.eos_token_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir):
    with checked_folder(model_dir) as folder:
        return CharTokenizer.from_dir(folder) if CharTokenizer.applies(folder) else _HFTokenizer(model_dir, folder)


def load_model(model_dir):
    """The model in float32, eval mode (transformers imported here, lazily)."""
    transformers = import_transformers()
    transformers.utils.logging.disable_progress_bar()
    with checked_folder(model_dir, weights=True) as folder:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:
            raise MergePipeError(f"{model_dir}: cannot load as a causal LM ({_reason(exc, folder, model_dir)})") \
                from None
    model.eval()
    return model


def _reason(exc: Exception, folder: Path, model_dir) -> str:
    """The first line of a transformers error, naming the model folder rather than its checked copy."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__).replace(str(folder), str(model_dir))
