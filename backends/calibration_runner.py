"""Calibration benchmarks that need a generated kernel (capabilities/ cannot import backends/).

`portlayer calibrate` passes ``extras()`` to ``capabilities.calibrate.calibrate``; each extra
takes (device, sizes, progress) and returns entries merged into the measured results.
"""

from __future__ import annotations

from portlayer.capabilities.calibrate import Extra


def extras() -> list[Extra]:
    """The backend benchmarks for this installation (none yet on the torch family)."""
    return []


__all__ = ["extras"]
