"""The argparse help formatter and parser class every zerotron command uses (no other imports:
analysis/ and bench/ build their parsers with them without importing the CLI)."""
from __future__ import annotations

import argparse
import difflib
import re

# a token that starts like a negative number ("-5", "-5GB", "-.5") is a value, never an option: argparse
# takes only plain numbers ("-5", "-.5") as values, so "--gpu-mem -5GB" was "expected one argument" instead of
# the option's own check naming the bad value
_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help text with the default of every option that has one (" (default: X)"), and the
    description/epilog kept as written. Flags (store_true) and options defaulting to None show none."""

    def _get_help_string(self, action):
        h = action.help or ""
        if ("%(default)" in h or not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or isinstance(action.default, bool)):
            return h
        return h + " (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors (an unknown option, a missing required one, a value of
    the wrong type) are one line on stderr, ``<prog>: error: <what>; run '<prog> --help' for the
    options``, and exit code 2, like the commands' own value checks (argparse's default prints the
    whole usage block first). ``--help`` is unchanged. A token that starts like a negative number
    (``-5GB``) is an option's value, so the option's own check names it. Raises SystemExit(2) on an error."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_VALUE  # argparse's (private) test of "a value, not an option"

    def parse_args(self, args=None, namespace=None):
        """argparse's, except that an unknown option is reported before a missing required one
        (``generate --bogus`` names ``--bogus``, not ``--checkpoint``)."""
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        known = list(self._option_string_actions)
        for tok in argv:
            if tok == "--":
                break
            name = tok.split("=", 1)[0]
            if len(name) < 2 or not name.startswith("-") or _NEGATIVE_VALUE.match(name):
                continue
            if not (name in known or (self.allow_abbrev and name.startswith("--")
                                      and any(k.startswith(name) for k in known))):
                near = difflib.get_close_matches(name, [k for k in known if k.startswith("--")], n=1)
                self.error(f"unrecognized arguments: {tok}" + (f" (did you mean {near[0]}?)" if near else ""))
        return super().parse_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; run '{self.prog} --help' for the options\n")
