"""The ``mergepipe`` command line: a thin layer over the Python API.

User errors print one line (``error: ...``) and exit 2; nothing in the catalog changes.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import sys

# Importing a command module registers its commands (in this order: catalog, merge, snapshots, recipes).
# By full name: this module does not import the package mergepipe.cli, whose __init__ imports this module.
import mergepipe.cli.catalog  # noqa: F401
import mergepipe.cli.merge  # noqa: F401
import mergepipe.cli.snapshots  # noqa: F401
import mergepipe.cli.recipes  # noqa: F401
import mergepipe.cli.search  # noqa: F401
import mergepipe.cli.hub  # noqa: F401
from mergepipe.cli.common import COMMANDS, add_commands, default_db
from mergepipe.errors import MergePipeError


def build_parser() -> argparse.ArgumentParser:
    """The parser of every registered command; each command module declares its own flags."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=argparse.SUPPRESS, help="catalog path (default $MERGEPIPE_DB or ./mergepipe.sqlite)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    parser = argparse.ArgumentParser(prog="mergepipe", parents=[common],
                                     description="Budget-aware parameter management for LLM merging.")
    add_commands(parser, COMMANDS, [common])
    return parser


def _first_positional(argv: list[str]) -> str | None:
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--db":
            i += 2
        elif tok.startswith("-"):
            i += 1
        else:
            return tok
    return None


# Options taking one value that may be written with a leading minus (`--budget -5%`, `--target-bound
# -1e-3`): argparse takes such a value for an option and prints its usage; joined as `--budget=-5%`,
# the value reaches its own parser, which refuses it in one error line.
VALUE_OPTIONS = ("--budget", "--io-budget-mb", "--target-bound")
_LOOKS_NEGATIVE = re.compile(r"^-[0-9.]")


def _join_negative_values(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return out + argv[i:]
        if tok in VALUE_OPTIONS and i + 1 < len(argv) and _LOOKS_NEGATIVE.match(argv[i + 1]):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def _one_line(message: str) -> str:
    """An error message on one line, whatever names it quotes."""
    return " ".join(message.splitlines()) or "(no message)"


# The exit status of a command whose output went into a closed pipe (`mergepipe explain ID | head`): a
# process ended by SIGPIPE, 128 + 13, as the shell reports one; nothing is printed.
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Output into a closed pipe ends quietly (EXIT_BROKEN_PIPE)."""
    try:
        try:
            return _main(argv)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe or socket broke: not the reader of our output going away
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _stdout_closed() -> bool:
    """Whether standard output is a pipe (or socket) whose reader has gone."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real descriptor (redirected in-process), no poll
        return False


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that what is left in its buffer is dropped at exit (Python
    flushes it then and would report the broken pipe again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _main(argv: list[str] | None = None) -> int:
    argv = _join_negative_values(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    if _first_positional(argv) not in COMMANDS and ("--base" in argv or "--config" in argv):
        argv = ["merge", *argv]  # the original MergePipe quick start: `mergepipe --db P --base B ...`
    args = parser.parse_args(argv)
    args.db = getattr(args, "db", None) or default_db()
    args.json = getattr(args, "json", False)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)  # a command may return its exit status (doctor: 1 on findings)
    except MergePipeError as exc:
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
