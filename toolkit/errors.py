"""Errors that are the user's to fix (a config, a path, a dataset, a checkpoint that does not fit): `run.py` shows
them as one message naming the file, key or sample, and exits 1, without a traceback (`--debug` or
DIFFTUNE_DEBUG=1 shows it). Anything else is a bug or an environment failure and keeps its traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user gave; the message says what and where."""


class PathNotFound(UserError, FileNotFoundError):
    """A configured path that does not exist (the message names its config key)."""
