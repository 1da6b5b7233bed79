"""Exception types that mean "the user can fix this" (the CLI prints them without a traceback)."""

from __future__ import annotations


class PortlayerError(Exception):
    """Base for portlayer's user-facing errors."""


def _collect() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [PortlayerError, FileNotFoundError]
    for mod, name in (
        ("portlayer.flatten.capture", "CaptureError"),
        ("portlayer.flatten.from_export", "UnsupportedOpError"),
        ("portlayer.capabilities.descriptor", "DescriptorError"),
        ("portlayer.runtime.artifact", "ArtifactError"),
    ):
        try:
            m = __import__(mod, fromlist=[name])
            found.append(getattr(m, name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def __getattr__(name: str):  # resolve lazily so importing this module stays cheap
    if name == "USER_ERRORS":
        return _collect()
    raise AttributeError(name)
