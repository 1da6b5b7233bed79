"""A regular (non-editable) install must carry every subpackage and data file.

An editable install maps folders on the fly and hides a missing `packages` or `package_data`
line; a wheel shows it. Every folder with an __init__.py and every template/descriptor file in
the checkout must be in the wheel under its portlayer.* name.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("flatten", "passes", "backends", "codegen", "runtime", "capabilities")


def test_wheel_has_every_subpackage_and_data_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("portlayer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = set()
    for folder in FOLDERS:
        for f in (ROOT / folder).rglob("*"):
            if "__pycache__" in f.parts or not f.is_file():
                continue
            if f.suffix in (".py", ".j2", ".json"):
                want.add("portlayer/" + f.relative_to(ROOT).as_posix())
    for f in (ROOT / "portlayer").glob("*.py"):
        want.add("portlayer/" + f.name)
    missing = sorted(want - names)
    assert not missing, f"the wheel lacks {missing[:10]} ({len(missing)} files): fix setup.cfg packages/package_data"
