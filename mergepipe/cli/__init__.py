"""The ``mergepipe`` command line (entry point ``mergepipe.cli:main``; ``python -m mergepipe.cli``)."""

from mergepipe.cli.app import main

__all__ = ["main"]
