"""Intel XPU kernels to SPIR-V through triton-xpu, in its own environment, on a machine without an Intel GPU.

Why its own environment: ``triton-xpu`` is another distribution of the ``triton`` module (3.3.0b1
against the main environment's upstream Triton), so it is installed with ``pip install --no-deps
--target DIR`` once and used by a child process that puts DIR first on PYTHONPATH; the main
environment is never touched. Its XPU backend's constructor compiles ``arch_parser.c`` with SYCL
headers (icpx) to name the device architecture; that step only feeds an ``ocloc`` query and the
native (zebin) path, neither of which SPIR-V needs, so the child process replaces it (``device_arch``
empty, the target properties parsed as usual, ``binary_ext = "spv"``). The properties come from the
descriptor (:func:`xpu_properties`): ``has_subgroup_matrix_multiply_accumulate`` (XMX) decides DPAS layouts.

``python -m portlayer.codegen.xpu_toolchain ARGS`` = ``python -m portlayer.codegen.aot ARGS`` inside that
environment (run by :func:`run_aot`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

XPU_DIST, XPU_VERSION = "triton-xpu", "3.3.0b1"
ENV_VAR = "PORTLAYER_TRITON_XPU"


class XPUToolchainError(RuntimeError):
    """triton-xpu is not installed and could not be installed, or its compile failed."""


def xpu_properties(desc: Any) -> dict[str, Any]:
    """Triton-xpu's GPUTarget properties from a descriptor (data, not code). XMX (``xmx`` feature) means
    subgroup matrix multiply-accumulate (DPAS); 2-D block IO and tf32 DPAS are Xe-HPC/Xe2 features no
    shipped descriptor claims; bf16 conversions are assumed on XMX parts (unconfirmed for Xe-LP)."""
    xmx = desc.has("xmx")
    return {"name": desc.display_name or desc.name, "max_work_group_size": 1024, "max_num_sub_groups": 64,
            "sub_group_sizes": list(desc.raw.get("warp_sizes") or [desc.warp_size]),
            "has_fp64": "fp64" in (desc.raw.get("throughput_tflops") or {}),
            "has_subgroup_matrix_multiply_accumulate": xmx,
            "has_subgroup_matrix_multiply_accumulate_tensor_float32": desc.has("xmx_tf32"),
            "has_subgroup_2d_block_io": desc.has("subgroup_2d_block_io"), "has_bfloat16_conversions": xmx}


def env_dir() -> Path:
    """$PORTLAYER_TRITON_XPU, else <portlayer cache>/toolchains/triton-xpu-3.3.0b1."""
    from portlayer.config import cache_root

    return Path(os.environ.get(ENV_VAR) or cache_root() / "toolchains" / f"{XPU_DIST}-{XPU_VERSION}")


def installed(directory: Path | None = None) -> bool:
    d = directory or env_dir()
    return (d / "triton" / "backends" / "intel" / "compiler.py").is_file()


def ensure_installed(directory: Path | None = None, timeout: float = 900) -> Path:
    """Install triton-xpu into its own directory once (``pip install --no-deps --target``)."""
    d = directory or env_dir()
    if installed(d):
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.with_name(f".{d.name}.{os.getpid()}")
    print(f"[portlayer] installing {XPU_DIST}=={XPU_VERSION} into {d} (once; it compiles XPU kernels to SPIR-V)",
          file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q", "--target", str(tmp),
           f"{XPU_DIST}=={XPU_VERSION}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise XPUToolchainError(f"`pip install {XPU_DIST}=={XPU_VERSION}` did not run ({e}); compile with "
                                "--sources-only, or set PORTLAYER_TRITON_XPU to an existing install") from None
    if r.returncode:
        raise XPUToolchainError(f"`pip install --target {tmp} {XPU_DIST}=={XPU_VERSION}` failed: "
                                f"{(r.stderr or r.stdout).strip()[-500:]}; compile with --sources-only, or set "
                                f"{ENV_VAR} to an existing install")
    try:
        tmp.rename(d)
    except OSError:
        if not installed(d):
            raise
    return d


def run_aot(args: list[str], directory: Path | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """``portlayer.codegen.aot`` with ``args`` in the triton-xpu environment (a child process)."""
    d = ensure_installed(directory)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(d), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("TRITON_CACHE_DIR", str(d.parent / "triton-xpu-cache"))
    return subprocess.run([sys.executable, "-m", "portlayer.codegen.xpu_toolchain", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _patch_backend() -> None:
    """Skip the SYCL-dependent arch_parser build of triton-xpu's backend (see the module docstring)."""
    from triton.backends import backends
    from triton.backends.compiler import BaseBackend

    def init(self: Any, target: Any) -> None:
        BaseBackend.__init__(self, target)
        if not isinstance(target.arch, dict):
            raise TypeError("target.arch is not a dict")
        self.device_arch = ""  # no ocloc query, no native binary: SPIR-V only
        self.properties = self.parse_target(target.arch)
        self.binary_ext = "spv"

    backends["intel"].compiler.__init__ = init  # the class triton's backend discovery loaded (not an import)


def main(argv: list[str]) -> int:
    import triton

    here = Path(triton.__file__).parent
    if not (here / "backends" / "intel").is_dir():
        print(f"triton at {here} has no intel backend: run this through run_aot (PYTHONPATH={env_dir()})", file=sys.stderr)
        return 2
    _patch_backend()
    from portlayer.codegen.aot import main as aot_main

    return aot_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
