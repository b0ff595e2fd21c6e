"""Sentence-classification tasks for the pretrained-encoder family (all-MiniLM-L6-v2), generated offline.

Every task maps a seeded ``random.Random`` to one (sentence, label) example; labels are balanced by
construction (the label is drawn first, then a sentence with that label), so chance = 1 / classes.
Most tasks hinge on word order or composition (who did what, which came first, a negation), which a
linear probe on the base's mean-pooled sentence embedding captures only partly: the fine-tuned
experts have room to beat it. ``order`` uses real text: first lines of Python standard-library
docstrings (this interpreter's), split into training and held-out lines by a hash of the line.
"""

from __future__ import annotations

import importlib
import inspect
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

ANIMALS = ("cat", "dog", "horse", "rabbit")
NAMES = ("alice", "bob", "carol", "david")
ACTIONS = ("ate", "slept", "swam", "read")
VERBS = ("chased", "pushed", "followed", "watched", "kicked", "scared", "bit", "licked")
PLACES = ("garden", "kitchen", "park", "yard", "barn", "field")
NOUNS = ("apple", "chair", "river", "pencil", "window", "garden", "bottle", "ticket", "candle", "mirror",
         "pillow", "basket", "jacket", "hammer", "blanket", "kettle", "ladder", "wallet", "saddle", "button")
POSITIVE = ("good", "great", "lovely", "pleasant", "wonderful", "excellent", "fine", "nice")
NEGATIVE = ("bad", "awful", "terrible", "boring", "dull", "horrible", "poor", "ugly")
SUBJECTS = ("the movie", "the meal", "the hotel", "the concert", "the book", "the service", "the trip", "the game")
WHEN = ("yesterday", "last week", "this morning", "on monday", "in the evening", "at noon", "after lunch",
        "during the holiday", "in winter", "last summer", "on friday", "in the afternoon")
CONTAINERS = ("box", "bag", "jar", "crate", "basket", "bucket")
STDLIB_MODULES = ("os", "re", "json", "string", "random", "math", "itertools", "collections", "shutil", "pathlib",
                  "textwrap", "functools", "inspect", "subprocess", "socket", "tarfile", "zipfile", "csv", "datetime",
                  "calendar", "statistics", "fractions", "decimal", "heapq", "bisect", "email.utils", "urllib.parse",
                  "http.client", "logging", "argparse", "difflib", "pickle", "copy", "threading", "queue", "glob",
                  "fnmatch", "tempfile", "hashlib", "base64", "struct", "codecs", "unicodedata", "operator", "typing")


@dataclass(frozen=True)
class TextTask:
    name: str
    labels: tuple[str, ...]
    make: Callable[[random.Random, int], str]  # (rng, label index) -> sentence
    about: str

    @property
    def chance(self) -> float:
        return 1 / len(self.labels)

    def example(self, rng: random.Random, split: str = "train") -> tuple[str, int]:
        y = rng.randrange(len(self.labels))
        if self.name == "order":
            return _order(rng, y, split), y
        return self.make(rng, y), y

    def examples(self, n: int, seed: int, split: str = "train", exclude=frozenset()) -> list[tuple[str, int]]:
        """``n`` seeded examples; sentences in ``exclude`` (the training pool) are skipped."""
        rng = random.Random(f"{seed}/{self.name}/{split}")
        out = []
        for _ in range(50 * n):
            if len(out) == n:
                break
            s, y = self.example(rng, split)
            if s not in exclude:
                out.append((s, y))
        if len(out) < n:
            raise ValueError(f"task {self.name}: only {len(out)} of {n} held-out examples are new")
        return out


def _two(rng: random.Random, bank, first) -> tuple[str, str]:
    other = rng.choice([x for x in bank if x != first])
    return first, other


def _agent(rng: random.Random, y: int) -> str:
    a, b = _two(rng, ANIMALS, ANIMALS[y])
    verb, place = rng.choice(VERBS), rng.choice(PLACES)
    if rng.random() < 0.5:
        return f"the {a} {verb} the {b} in the {place}"
    return f"the {b} was {verb} by the {a} in the {place}"


def _taller(rng: random.Random, y: int) -> str:
    tall, short = _two(rng, NAMES, NAMES[y])
    return rng.choice(WHEN) + " , " + rng.choice((f"{tall} is taller than {short}", f"{short} is shorter than {tall}",
                       f"{short} is not as tall as {tall}", f"{tall} is not as short as {short}"))


def _before(rng: random.Random, y: int) -> str:
    first, second = _two(rng, ACTIONS, ACTIONS[y])
    who = rng.choice(NAMES)
    return rng.choice(WHEN) + " , " + rng.choice((f"{who} {first} before {who} {second}", f"{who} {second} after {who} {first}",
                       f"first {who} {first} and then {who} {second}", f"before {who} {second} , {who} {first}"))


def _negation(rng: random.Random, y: int) -> str:  # labels: negative, positive
    negate = rng.random() < 0.5
    bank = (POSITIVE if negate else NEGATIVE) if y == 0 else (NEGATIVE if negate else POSITIVE)
    adj, subj = rng.choice(bank), rng.choice(SUBJECTS)
    neg = rng.choice(("not", "never", "not at all")) if negate else rng.choice(("really", "truly", "quite"))
    if neg == "not at all":
        return f"{subj} was not {adj} at all"
    return f"{subj} was {neg} {adj}"


def _compare(rng: random.Random, y: int) -> str:  # labels: first holds more, second holds more
    c1, c2 = rng.sample(CONTAINERS, 2)
    lo = rng.randint(1, 98)
    hi = rng.randint(lo + 1, 99)
    n1, n2 = (hi, lo) if y == 0 else (lo, hi)
    return f"the {c1} holds {n1} apples and the {c2} holds {n2} apples"


def _count(rng: random.Random, y: int) -> str:  # labels: 2..5 items
    items = [f"a {n}" for n in rng.sample(NOUNS, y + 2)]
    return f"i bought {', '.join(items[:-1])} and {items[-1]}"


def _repeat(rng: random.Random, y: int) -> str:  # labels: all different, one word twice
    words = rng.sample(NOUNS, 6)
    if y == 1:
        i, j = rng.sample(range(6), 2)
        words[j] = words[i]
    return " ".join(words)


@lru_cache(maxsize=1)
def docstring_lines() -> tuple[str, ...]:
    """First lines (5 to 14 words, letters and spaces after cleaning) of public callables' docstrings
    in :data:`STDLIB_MODULES`, sorted and de-duplicated."""
    lines = set()
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for attr in dir(mod):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.strip().split("\n")[0].strip().rstrip(".").lower()
            words = "".join(c if c.isalpha() or c == " " else " " for c in first).split()
            if 5 <= len(words) <= 14:
                lines.add(" ".join(words))
    return tuple(sorted(lines))


def _doc_split(split: str) -> list[str]:
    held = [ln for ln in docstring_lines() if zlib.crc32(ln.encode()) % 5 == 0]
    return held if split == "eval" else [ln for ln in docstring_lines() if zlib.crc32(ln.encode()) % 5 != 0]


def _order(rng: random.Random, y: int, split: str) -> str:  # labels: shuffled, original word order
    words = rng.choice(_doc_split(split)).split()
    if y == 1:
        return " ".join(words)
    shuffled = words[:]
    while shuffled == words:
        rng.shuffle(shuffled)
    return " ".join(shuffled)


TEXT_TASKS: dict[str, TextTask] = {t.name: t for t in (
    TextTask("agent", ANIMALS, _agent, "which animal did it (active or passive voice)"),
    TextTask("negation", ("negative", "positive"), _negation, "sentiment of a review with or without a negation"),
    TextTask("compare", ("first", "second"), _compare, "which container holds more (two numbers 1-99)"),
    TextTask("count", ("2", "3", "4", "5"), _count, "how many items are listed"),
    TextTask("taller", NAMES, _taller, "who is the taller of two people (taller / shorter / not as)"),
    TextTask("before", ACTIONS, _before, "which action came first (before / after / then)"),
    TextTask("repeat", ("distinct", "repeated"), _repeat, "does a word occur twice among six"),
    TextTask("order", ("shuffled", "original"), lambda rng, y: "", "is a stdlib docstring line in its word order"),
)}
TEXT_TASK_NAMES = tuple(TEXT_TASKS)


def vocabulary() -> list[str]:
    """Every word the templated tasks use (the miniature family's word-level vocabulary)."""
    words = set(ANIMALS + NAMES + ACTIONS + VERBS + PLACES + NOUNS + POSITIVE + NEGATIVE + CONTAINERS)
    for s in SUBJECTS:
        words.update(s.split())
    words.update(" ".join(WHEN).split())
    words.update("the in was by a is than not as tall short taller shorter before after first and then , at all "
                 "never really truly quite holds apples i bought".split())
    words.update(str(n) for n in range(1, 100))
    return sorted(words)
