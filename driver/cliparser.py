"""The argument parser every ``python -m driver`` subcommand uses: usage errors are one line.

argparse prints the whole usage block before its message; with many flags that buries the one
line that matters. Here the message names the flag and points at ``--help`` for the rest.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

USAGE_ERROR = 2  # argparse's own exit status for usage errors, kept so scripts see the same


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are ``<prog>: <message> (<prog> --help lists the flags)``.

    Subparsers made with ``add_subparsers`` are of this class too (argparse uses the parent's class).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: {one_line(message)} ({self.prog} --help lists the flags)\n")


def one_line(text: str) -> str:
    """``text`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(text.split())
