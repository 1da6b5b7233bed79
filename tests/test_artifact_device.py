"""The device check: an artifact runs only where arch and codegen family match, else says what to run."""

from __future__ import annotations

from pathlib import Path

import pytest
from artifact_samples import sample_graph

import portlayer
from portlayer.capabilities.probe import DetectedDevice
from portlayer.runtime.artifact import ArtifactError, check_device, verify_artifact


@pytest.fixture(scope="module")
def h200_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dev") / "h200"
    return portlayer.compile(sample_graph(), target="nvidia-h200", output=out, progress=False).path


def _cpu() -> DetectedDevice:
    return DetectedDevice("cpu", 0, "Some CPU", "x86_64", "cpu", "cpu-x86_64", "matched", "test")


def _gpu(arch: str, desc: str) -> DetectedDevice:
    return DetectedDevice("cuda", 0, "NVIDIA Test GPU", arch, "cuda:0", desc, "matched", "test")


def test_wrong_device_message_says_expected_found_and_command(h200_artifact: Path) -> None:
    m = verify_artifact(h200_artifact)
    skipped = DetectedDevice("cuda", -1, "-", "-", None, None, "skipped", "torch is a CPU-only build")
    with pytest.raises(ArtifactError) as e:
        check_device(m, [skipped, _cpu()])
    msg = str(e.value)
    assert "compiled for nvidia-h200 (cuda, arch sm_90, codegen triton)" in msg
    assert "expected: a device with arch sm_90 and codegen triton (cuda)" in msg
    assert "cuda: skipped (torch is a CPU-only build)" in msg
    assert "cpu Some CPU (arch x86_64, codegen torch, descriptor cpu-x86_64)" in msg
    assert "portlayer compile '<in-memory graph>' --target cpu-x86_64" in msg


def test_wrong_device_on_this_machine(h200_artifact: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ArtifactError, match=r"(?s)expected: a device with arch sm_90.*Recompile for this machine: portlayer compile"):
        portlayer.load(h200_artifact)
    loaded = portlayer.load(h200_artifact, check_device=False)  # inspecting is still allowed
    assert loaded.plan.target == "nvidia-h200"
    with pytest.raises(ArtifactError, match="check_device=False"):
        loaded.executable()


def test_same_arch_and_codegen_is_accepted(h200_artifact: Path) -> None:
    m = verify_artifact(h200_artifact)
    # an H100 (same sm_90, same Triton codegen) runs an H200 artifact
    assert check_device(m, [_cpu(), _gpu("sm_90", "nvidia-h100-sxm")]).torch_device == "cuda:0"
    with pytest.raises(ArtifactError, match="arch sm_80, codegen triton"):
        check_device(m, [_gpu("sm_80", "nvidia-a100-80gb")])


def test_cpu_artifact_accepted_on_cpu(tmp_path: Path) -> None:
    art = portlayer.compile(sample_graph(), target="cpu-x86_64", output=tmp_path / "c", progress=False)
    assert check_device(verify_artifact(art.path), [_cpu()]).device_type == "cpu"


def test_the_recompile_command_is_one_the_cli_takes(h200_artifact: Path) -> None:
    """The command the wrong-device message prints parses with `portlayer compile`'s own parser, flags spelled as
    the CLI spells them (a boolean option as a bare flag), the options carried over."""
    import shlex

    from portlayer.cli import build_parser

    m = verify_artifact(h200_artifact)
    m.raw["options"] = {"quantize": "int4", "sources_only": True, "calibration_device": "cuda", "verify": False,
                        "dtype": None}
    words = shlex.split(m.recompile_command("cpu-x86_64"))
    args = build_parser().parse_args(words[1:])
    assert (args.target, args.quantize, args.sources_only, args.calibration_device, args.no_verify, args.dtype) == (
        "cpu-x86_64", "int4", True, "cuda", True, None)
