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

NAMES = ("bob", "carol", "david", "emma", "frank", "grace", "henry", "irene", "jack", "kate", "liam", "mary")
NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
           "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
NOUNS = ("apple", "chair", "river", "pencil", "window", "garden", "bottle", "ticket", "candle", "mirror",
         "pillow", "basket", "jacket", "hammer", "blanket", "kettle", "ladder", "wallet", "saddle", "button")
WHEN = ("yesterday", "last week", "this morning", "on monday", "in the evening", "at noon", "after lunch",
        "in winter", "last summer", "on friday")
STATES = (("door", "open", "closed"), ("lamp", "on", "off"), ("window", "open", "shut"), ("oven", "hot", "cold"),
          ("cup", "full", "empty"), ("road", "wet", "dry"), ("shop", "busy", "quiet"), ("dog", "awake", "asleep"))
MOODS = ("happy", "ready", "home", "awake", "here", "busy")
HOLDS = ("it is true that", "it is right that", "it is not false that")  # the claim holds
FAILS = ("it is false that", "it is wrong that", "it is not true that")  # the claim fails
THINGS = ("door", "window", "gate", "shop", "drawer", "box", "lid", "tap")
OPEN_CLOSED = (("open", "closed"), ("open", "shut"), ("unlocked", "locked"))
MORE, LESS = ("more", "bigger", "greater"), ("less", "smaller", "fewer")
COMPARATIVES = {"older": "younger", "taller": "shorter"}  # label 1 words -> their opposites
STDLIB_MODULES = ("os", "re", "json", "string", "random", "math", "itertools", "collections", "shutil", "pathlib",
                  "textwrap", "functools", "inspect", "subprocess", "socket", "tarfile", "zipfile", "csv", "datetime",
                  "calendar", "statistics", "fractions", "decimal", "heapq", "bisect", "email.utils", "urllib.parse",
                  "http.client", "logging", "argparse", "difflib", "pickle", "copy", "threading", "queue", "glob",
                  "fnmatch", "tempfile", "hashlib", "base64", "struct", "codecs", "unicodedata", "operator", "typing")
HELD_OUT = 5  # a templated sentence is held out when crc32(sentence) % HELD_OUT == 0


def held_out(sentence: str) -> bool:
    return zlib.crc32(sentence.encode()) % HELD_OUT == 0


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
        """One (sentence, label) of ``split``: templated sentences are split by a hash of the sentence,
        docstring lines (``order``) by a hash of the line, so no held-out sentence is ever trained on."""
        y = rng.randrange(len(self.labels))
        if self.name == "order":
            return _order(rng, y, split), y
        while True:
            s = self.make(rng, y)
            if held_out(s) == (split == "eval"):
                return s, y

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


# Every task is an interaction the base's mean-pooled embedding keeps only weakly (a parity, a
# comparison, an exclusive or, who-relative-to-whom), so a linear probe on frozen features stays
# well below what fine-tuning reaches; the label is drawn first, so classes are balanced.
def _parity(rng: random.Random, y: int) -> str:  # labels: odd, even number of repeats
    n = rng.choice((2, 4, 6, 8) if y else (1, 3, 5, 7))
    return f"{rng.choice(NAMES)} said " + " ".join([rng.choice(NOUNS)] * n)


def _negparity(rng: random.Random, y: int) -> str:  # labels: negated, affirmed (an even number of "not")
    n = rng.choice((0, 2, 4) if y else (1, 3, 5))
    return f"{rng.choice(WHEN)} {rng.choice(NAMES)} was " + "not " * n + rng.choice(MOODS)


def _larger(rng: random.Random, y: int) -> str:  # labels: false, true
    i, j = rng.sample(range(len(NUMBERS)), 2)
    more = rng.random() < 0.5
    if ((i > j) == more) != bool(y):
        i, j = j, i
    return f"{NUMBERS[i]} is {rng.choice(MORE if more else LESS)} than {NUMBERS[j]}"


def _xor(rng: random.Random, y: int) -> str:  # labels: both or neither in the first state, exactly one
    (t1, p1, n1), (t2, p2, n2) = rng.sample(STATES, 2)
    a = rng.random() < 0.5
    b = a != bool(y)
    return f"{rng.choice(WHEN)} the {t1} was {p1 if a else n1} and the {t2} was {p2 if b else n2}"


def _older(rng: random.Random, y: int) -> str:  # labels: no, yes (alice is the older / taller one)
    word = rng.choice(tuple(COMPARATIVES) + tuple(COMPARATIVES.values()))
    alice_first = bool(y) == (word in COMPARATIVES)
    other = rng.choice(NAMES)
    a, b = ("alice", other) if alice_first else (other, "alice")
    return f"{rng.choice(WHEN)} {a} was {word} than {b}"


def _negation(rng: random.Random, y: int) -> str:  # labels: closed, open (after the true/false wrapper)
    holds = rng.random() < 0.5
    yes, no = rng.choice(OPEN_CLOSED)
    state = yes if bool(y) == holds else no
    return f"{rng.choice(WHEN)} , {rng.choice(HOLDS if holds else FAILS)} the {rng.choice(THINGS)} was {state}"


def _majority(rng: random.Random, y: int) -> str:  # labels: the first word is the minority, the majority
    a, b = rng.sample(NOUNS, 2)  # a is said three times, b twice
    words = [a] * 3 + [b] * 2
    while True:
        rng.shuffle(words)
        if (words[0] == a) == bool(y):
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
    TextTask("parity", ("odd", "even"), _parity, "is a word repeated an even number of times (1-8)"),
    TextTask("negparity", ("negated", "affirmed"), _negparity, "an even or odd number of \"not\" (0-5)"),
    TextTask("larger", ("false", "true"), _larger, "is \"<number> is more/less than <number>\" true (one-twenty)"),
    TextTask("xor", ("same", "different"), _xor, "exactly one of two things in its first state (exclusive or)"),
    TextTask("older", ("no", "yes"), _older, "is alice the older / taller one (older, younger, taller, shorter)"),
    TextTask("negation", ("closed", "open"), _negation, "the state under a true / false / not true wrapper"),
    TextTask("majority", ("minority", "majority"), _majority,
             "is the first of five words the one said three times (two nouns, three and two times)"),
    TextTask("order", ("shuffled", "original"), lambda rng, y: "", "is a stdlib docstring line in its word order"),
)}
TEXT_TASK_NAMES = tuple(TEXT_TASKS)


def vocabulary() -> list[str]:
    """Every word the templated tasks use (the miniature family's word-level vocabulary)."""
    words = set(NAMES + NUMBERS + NOUNS + MOODS + THINGS + MORE + LESS + tuple(COMPARATIVES)
                + tuple(COMPARATIVES.values()))
    for phrase in WHEN + HOLDS + FAILS + tuple(w for s in STATES for w in s) + tuple(w for p in OPEN_CLOSED for w in p):
        words.update(phrase.split())
    words.update("alice said was not is than the and , a".split())
    return sorted(words)
