"""The one base class of every user-facing error.

An error the user can fix (a missing model, a bad descriptor, a tampered artifact, an
invalid request) derives from :class:`PortlayerError`; the CLI prints its message and
exits 2 with no traceback. Anything else reaching the CLI is a bug in portlayer: it keeps
its traceback and asks for a report. Importing this module imports nothing else, so every
stage can derive its errors from it without import cycles.
"""

from __future__ import annotations

ISSUES_URL = "https://github.com/portlayer/portlayer/issues"


class PortlayerError(Exception):
    """Base for portlayer's user-facing errors: the message names the thing, where, and the fix."""


class UsageError(PortlayerError):
    """A command-line or API value that cannot be used as given."""


class ModelNotFoundError(PortlayerError, FileNotFoundError):
    """A model name or path that is neither a local directory nor a built-in example."""


def is_user_error(e: BaseException) -> bool:
    """True for errors the user can fix: a PortlayerError, or an OS error on a named file
    (permission denied, disk full, no such file) whose message already names the path."""
    if isinstance(e, PortlayerError):
        return True
    return isinstance(e, OSError) and bool(getattr(e, "filename", None))


def __getattr__(name: str):  # kept for callers written against the old name list
    if name == "USER_ERRORS":
        return (PortlayerError,)
    raise AttributeError(name)
