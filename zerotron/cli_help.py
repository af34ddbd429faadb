"""The argparse help formatter every zerotron command uses (no other imports: analysis/ and bench/
build their parsers with it without importing the CLI)."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help text with the default of every option that has one (" (default: X)"), and the
    description/epilog kept as written. Flags (store_true) and options defaulting to None show none."""

    def _get_help_string(self, action):
        h = action.help or ""
        if ("%(default)" in h or not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or isinstance(action.default, bool)):
            return h
        return h + " (default: %(default)s)"
