"""Synthetic tasks with exact-match answers, a character vocabulary, and the generic pretraining text.

Every example is one line ``<s>T:input=answer</s>`` where ``T`` is the task's one-letter code. The model
sees ``<s>T:input=`` and must produce ``answer</s>``; scoring is exact match of the decoded answer.

Inputs use a small alphabet (letters a..p, digits 0..9) so a ~1M-parameter model learns each task in a
few hundred steps on CPU. Every generator is a pure function of its seed (``random.Random(seed)``).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass

from mergepipe.research.evaluate import BOS, EOS, PAD, CharTokenizer, write_suite

LETTERS = "abcdefghijklmnop"  # 16 letters: the alphabet of every letter task (Caesar shifts within it)
DIGITS = "0123456789"
SPECIALS = (PAD, BOS, EOS)
CAESAR_SHIFT = 3


@dataclass(frozen=True)
class Task:
    name: str
    code: str  # one capital letter, the task tag in the prompt
    make_input: Callable[[random.Random], str]
    answer: Callable[[str], str]

    def prompt(self, x: str) -> str:
        return f"{self.code}:{x}="

    def examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``n`` (prompt, answer) pairs, deterministic in ``seed`` (and the task name)."""
        rng = random.Random(f"{seed}/{self.name}")
        out = []
        for _ in range(n):
            x = self.make_input(rng)
            out.append((self.prompt(x), self.answer(x)))
        return out


def _letters(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(DIGITS) for _ in range(rng.randint(lo, hi)))


def _dedup(s: str) -> str:
    seen, out = set(), []
    for ch in s:
        if ch not in seen:
            seen.add(ch)
            out.append(ch)
    return "".join(out)


def _caesar(s: str, shift: int = CAESAR_SHIFT) -> str:
    return "".join(LETTERS[(LETTERS.index(c) + shift) % len(LETTERS)] for c in s)


def _count_input(rng: random.Random) -> str:
    # letters from a 4-letter pool so the first letter recurs 1..several times
    pool = rng.sample(LETTERS, 4)
    return "".join(rng.choice(pool) for _ in range(rng.randint(2, 8)))


def _dedup_input(rng: random.Random) -> str:
    pool = rng.sample(LETTERS, rng.randint(2, 5))
    return "".join(rng.choice(pool) for _ in range(rng.randint(3, 7)))


def _add_input(rng: random.Random) -> str:
    return f"{rng.randint(0, 9)}+{rng.randint(0, 9)}"


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("reverse", "R", lambda r: _letters(r, 2, 6), lambda x: x[::-1]),
    Task("sort", "S", lambda r: _letters(r, 2, 6), lambda x: "".join(sorted(x))),
    Task("modadd", "A", _add_input, lambda x: str((int(x[0]) + int(x[2])) % 10)),
    Task("length", "L", lambda r: _letters(r, 1, 9), lambda x: str(len(x))),
    Task("count", "C", _count_input, lambda x: str(x.count(x[0]))),
    Task("max", "M", lambda r: _digits(r, 2, 8), lambda x: max(x)),
    Task("caesar", "K", lambda r: _letters(r, 2, 6), _caesar),
    Task("dedup", "D", _dedup_input, _dedup),
)}
TASK_NAMES = tuple(TASKS)


def vocab() -> list[str]:
    """Token list (index = id): specials, then every character any example or generic text uses."""
    chars = sorted(set(LETTERS + DIGITS + "".join(t.code for t in TASKS.values()) + ":=+ "))
    return [*SPECIALS, *chars]


def tokenizer() -> CharTokenizer:
    return CharTokenizer(vocab())


def suite(n: int, seed: int, names=TASK_NAMES) -> dict[str, list[tuple[str, str]]]:
    """The evaluation suite: ``n`` held-out examples per task (use a seed the training never uses)."""
    return {name: TASKS[name].examples(n, seed) for name in names}


def generic_text(rng: random.Random, max_chars: int) -> str:
    """Generic 'text': words of letters and numbers with spaces, from a seeded random bigram model.

    Gives the base a language-model prior over the alphabet without any task structure."""
    words = []
    while sum(len(w) + 1 for w in words) < max_chars:
        if rng.random() < 0.2:
            words.append(_digits(rng, 1, 4))
        else:
            w = [rng.choice(LETTERS)]
            for _ in range(rng.randint(1, 6)):
                # mild structure: the next letter is often close to the previous one
                j = (LETTERS.index(w[-1]) + rng.choice((-2, -1, 1, 1, 2, 3, rng.randint(0, 15)))) % len(LETTERS)
                w.append(LETTERS[j])
            words.append("".join(w))
    return " ".join(words)[:max_chars]


def task_line(task: Task, rng: random.Random) -> tuple[str, str]:
    x = task.make_input(rng)
    return task.prompt(x), task.answer(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="write the fidelity task suite as JSONL for mergepipe.research.evaluate")
    ap.add_argument("--write", required=True, help="output .jsonl")
    ap.add_argument("--n", type=int, default=200, help="examples per task")
    ap.add_argument("--seed", type=int, default=10_000, help="suite seed (training uses other seeds)")
    ap.add_argument("--tasks", default=",".join(TASK_NAMES))
    args = ap.parse_args(argv)
    write_suite(suite(args.n, args.seed, args.tasks.split(",")), args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
