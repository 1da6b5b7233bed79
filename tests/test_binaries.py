"""GPU artifacts carry one compiled binary per kernel (cubin for CUDA, hsaco for ROCm), listed in the
manifest with sha256 and toolchain; the loader's device / ABI checks refuse what does not fit.

Compiled here without a GPU (Triton's AOT path, codegen/aot.py). The binaries are checked with tools
that did not make them: NVIDIA's cuobjdump (bundled with Triton) for the cubin's SM, the ELF header
for the hsaco's machine and gfx target. Launching them needs the GPU: scripts/gpu_binaries.sh.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch

import portlayer
from portlayer.codegen import kernel_binaries as KB
from portlayer.runtime.artifact import ArtifactError

EM_CUDA, EM_AMDGPU, EF_AMDGPU_MACH_GFX942 = 190, 224, 0x4C


@pytest.fixture(scope="module")
def arts(tiny_dirs, tmp_path_factory):
    out = {}
    for target in ("nvidia-h200", "amd-mi300x"):
        d = tmp_path_factory.mktemp("bin") / target
        portlayer.compile(str(tiny_dirs["tiny-qwen3"]), target=target, output=d, progress=False, sources_only=False)
        out[target] = d
    return out


def _elf(data: bytes) -> tuple[int, int]:
    assert data[:4] == b"\x7fELF" and data[4] == 2  # ELF64
    return int.from_bytes(data[18:20], "little"), int.from_bytes(data[48:52], "little")  # e_machine, e_flags


@pytest.mark.parametrize("target,kind", [("nvidia-h200", "cubin"), ("amd-mi300x", "hsaco")])
def test_manifest_lists_one_binary_per_kernel(arts, target, kind):
    import triton

    art = arts[target]
    m = json.loads((art / "manifest.json").read_text())
    kernels = json.loads((art / "kernels.json").read_text())["kernels"]
    b = m["binaries"]
    assert b["kind"] == kind and set(b["kernels"]) == set(kernels)
    assert b["toolchain"]["triton"] == triton.__version__
    index = json.loads((art / "binaries.json").read_text())["kernels"]
    for name, k in kernels.items():  # one binary per launch configuration, in the same order
        made = [index[name], *index[name].get("variants", ())]
        assert ([{**r["constexprs"], "PDL": False} for r in made]  # PDL: test_pdl_binaries_only_for_descriptors_...
                == [c["constexprs"] for c in (k, *k.get("variants", ()))])
        assert len({r["file"] for r in made}) == len(made)
        assert [v["sha256"] for v in b["kernels"][name].get("variants", ())] == [r["sha256"] for r in made[1:]]
    for name, k in ((n, r) for n, x in b["kernels"].items() for r in (x, *x.get("variants", ()))):
        data = (art / k["file"]).read_bytes()
        assert k["file"].endswith(f".{kind}") and m["files"][k["file"]]["kind"] == "source"
        assert hashlib.sha256(data).hexdigest() == k["sha256"] == m["files"][k["file"]]["sha256"]
        machine, flags = _elf(data)
        if kind == "hsaco":
            assert machine == EM_AMDGPU and flags & 0xFF == EF_AMDGPU_MACH_GFX942, (name, hex(flags))
        else:
            assert machine == EM_CUDA
    assert m["files"]["binaries.json"]["kind"] == "source"


def test_cubins_are_sm90_by_cuda_12_ptxas(arts):
    from triton import knobs

    art = arts["nvidia-h200"]
    b = json.loads((art / "manifest.json").read_text())["binaries"]
    assert b["toolchain"]["ptxas_version"].startswith("12.") and b["toolchain"]["cuda_driver_min"] == "12.0"
    cuobjdump = Path(knobs.nvidia.ptxas.path).with_name("cuobjdump")
    for k in list(b["kernels"].values())[:3]:
        text = subprocess.run([str(cuobjdump), "--list-elf", str(art / k["file"])], capture_output=True, text=True)
        dump = subprocess.run([str(cuobjdump), "--dump-elf", str(art / k["file"])], capture_output=True, text=True)
        assert "sm_90" in (text.stdout + dump.stdout), text.stdout + text.stderr


@pytest.mark.parametrize("target", ["nvidia-h200", "amd-mi300x"])
def test_every_kernel_abi_matches_its_signature(arts, target):
    index = json.loads((arts[target] / "binaries.json").read_text())
    kernels = json.loads((arts[target] / "kernels.json").read_text())["kernels"]  # the generator's order
    for name, rec in index["kernels"].items():
        runtime, _, scratch = KB.check_abi(name, rec)
        assert scratch == 2 and runtime == [a for a, t in kernels[name]["signature"].items() if t != "constexpr"]
    name, rec = next(iter(index["kernels"].items()))
    with pytest.raises(KB.KernelBinaryError, match="do not match the kernels"):
        KB.check_abi(name, {**rec, "params": rec["params"][1:]})


def test_other_arch_or_kind_is_refused_with_expected_and_found(arts, monkeypatch):
    cuda = json.loads((arts["nvidia-h200"] / "binaries.json").read_text())
    rocm = json.loads((arts["amd-mi300x"] / "binaries.json").read_text())
    monkeypatch.setattr(KB, "_runtime_kind", lambda device: "cubin")
    monkeypatch.setattr(KB, "_device_arch", lambda device, kind: "80")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(KB.KernelBinaryError, match=r"expected arch 90 .*found 80 .*--sources-only"):
        KB.check_device(cuda, torch.device("cuda:0"))
    with pytest.raises(KB.KernelBinaryError, match=r"expected a device that runs hsaco .*found cuda:0 \(cubin\)"):
        KB.check_device(rocm, torch.device("cuda:0"))


def test_cpu_and_interpreter_keep_the_jit_functions(arts):
    from portlayer.runtime.artifact import verified_sources, verify_artifact

    src = verified_sources(verify_artifact(arts["nvidia-h200"]))
    assert KB.INDEX in src.files and any(r.endswith(".cubin") for r in src.files)
    fns = {"a": object()}
    assert KB.bind(fns, src, "cpu") == fns


def test_tampered_binary_is_refused(arts, tmp_path):
    import shutil

    art = tmp_path / "copy"
    shutil.copytree(arts["nvidia-h200"], art)
    victim = next((art / "binaries").glob("*.cubin"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=victim.name):
        portlayer.load(art)


def test_sources_only_ships_no_binaries(tiny_dirs, tmp_path):
    from portlayer.cli import main

    out = tmp_path / "src-only"
    assert main(["compile", str(tiny_dirs["tiny-qwen3"]), "--target", "nvidia-h200", "-o", str(out), "--no-progress",
                 "--sources-only"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert "binaries" not in m and not (out / "binaries").exists()
    assert m["options"]["sources_only"] is True and any(f.startswith("kernels/") for f in m["files"])


class _NoDriver:
    """Packing parameters needs no GPU; loading and launching do (scripts/gpu_binaries.sh)."""

    def function(self, image, entry, shared):
        return None


def test_launch_parameters_follow_the_binary_abi(arts):
    import ctypes

    index = json.loads((arts["nvidia-h200"] / "binaries.json").read_text())
    name = next(n for n in index["kernels"] if n.startswith("reduction_rms_norm"))
    rec = index["kernels"][name]
    assert [a for a, t in rec["args"] if t != "constexpr"] == ["x_ptr", "w_ptr", "out_ptr", "n_rows", "eps"]
    k = KB.BinaryKernel(name, rec, b"", _NoDriver(), torch.device("cpu"))
    x, w, out = torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16), torch.empty(4, 64)
    held = k.pack((x, w, out), {"n_rows": 4, "eps": 1e-6, **rec["constexprs"], "num_warps": rec["num_warps"]})
    assert [type(h) for h in held] == [ctypes.c_uint64] * 3 + [ctypes.c_int32, ctypes.c_float] + [ctypes.c_uint64] * 2
    assert [h.value for h in held[:4]] == [x.data_ptr(), w.data_ptr(), out.data_ptr(), 4]
    assert held[4].value == pytest.approx(1e-6) and held[5].value == held[6].value == 0  # no scratch needed
    assert k.block == rec["num_warps"] * 32
    wrong = {**rec["constexprs"], "N": 2 * rec["constexprs"]["N"]}
    with pytest.raises(KB.KernelBinaryError, match="compiled for"):
        k.pack((x, w, out, 4, 1e-6), wrong)


def test_a_launch_goes_on_torchs_current_stream_with_the_grid_padded_to_three_dims(arts, monkeypatch):
    """BinaryKernel.run passes the driver the grid (padded with 1s), the block the binary was compiled for and the
    raw handle of torch's current stream on the kernel's device (inside torch.cuda.graph: the capture stream);
    an empty grid launches nothing. The driver and the stream lookup are stand-ins: no GPU here."""
    index = json.loads((arts["nvidia-h200"] / "binaries.json").read_text())
    name = next(n for n in index["kernels"] if n.startswith("reduction_rms_norm"))
    rec = index["kernels"][name]
    launches = []

    class Recorder(_NoDriver):
        def launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            launches.append(((gx, gy, gz), (bx, by, bz), shared, stream))
            return 0

    monkeypatch.setattr(KB, "_RAW_STREAM", lambda index: 7000 + index)
    k = KB.BinaryKernel(name, rec, b"", Recorder(), torch.device("cuda", 3))
    x, w, out = torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16), torch.empty(4, 64)
    kw = {**rec["constexprs"], "num_warps": rec["num_warps"]}
    k[(4,)](x, w, out, 4, 1e-6, **kw)
    k[(2, 3)](x, w, out, 4, 1e-6, **kw)
    k[(0,)](x, w, out, 4, 1e-6, **kw)
    block = (rec["num_warps"] * rec["warp_size"], 1, 1)
    assert launches == [((4, 1, 1), block, rec["shared"], 7003), ((2, 3, 1), block, rec["shared"], 7003)]


@pytest.mark.parametrize("model,quantize", [("tiny-qwen3", "int4"), ("qwen3-moe", None)])
def test_every_launch_the_program_makes_has_its_binary(tiny_dirs, tmp_path, monkeypatch, model, quantize):
    """A kernel shared by groups of different shapes is one module but several binaries (its constexprs
    differ per launch), and row tiles chosen per step (GEMM, few-rows GEMM, MoE) are binaries too. Every
    launch a real run makes — prefill and decode at two batch sizes, recorded under the Triton interpreter —
    must be one of the launch configurations in kernels.json, the list the AOT build compiles one binary
    for each of (test_manifest_lists_one_binary_per_kernel checks that every entry has its binary)."""
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    if model == "qwen3-moe":
        from test_moe_archs import build

        src = build("qwen3-moe")
    else:
        src = str(tiny_dirs[model])
    art = tmp_path / "h200-fp32"
    portlayer.compile(src, target="nvidia-h200", dtype="float32", output=art, quantize=quantize, progress=False,
                      sources_only=True, verify=False)
    launches: list[tuple[str, dict]] = []

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, dict(kwargs)))
                return self.fn[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(KB, "bind", lambda fns, sources, device: {n: Recorder(n, f) for n, f in fns.items()})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eng = LLMEngine.from_artifact(art, interpret=True)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.generate([list(range(3, 24)), [5, 6, 7]], params)  # a 24-token prefill step, then decode at batch 2
    eng.generate([[7] * 3], params)  # decode at batch 1
    kernels = json.loads((art / "kernels.json").read_text())["kernels"]
    configs = {n: [k, *k.get("variants", ())] for n, k in kernels.items()}
    assert launches and {n for n, _ in launches} <= set(configs)
    assert any(len(c) > 1 for c in configs.values())  # several (N, K), or row tiles chosen per step
    for name, kwargs in launches:
        KB.match_launch(name, configs[name], kwargs)  # raises KernelBinaryError: no binary for this launch
    name, some = next((n, c) for n, c in configs.items() if len(c) > 1)
    with pytest.raises(KB.KernelBinaryError, match="compiled for"):
        KB.match_launch(name, some, {c: -1 for c in some[0]["constexprs"]})


def test_a_pointer_the_binary_assumes_aligned_but_is_not_runs_the_jit_kernel(arts, monkeypatch):
    """Shipped binaries are compiled with every float-tensor pointer 16-byte aligned (codegen/aot.POINTER_ALIGN, as
    Triton's JIT specializes aligned tensors; integer index arrays are not assumed aligned); a launch whose tensor is a view 2 bytes in goes to the JIT kernel with the same
    grid and arguments (warned once), an aligned one to the binary. Stand-in driver and JIT: no GPU here."""
    index = json.loads((arts["nvidia-h200"] / "binaries.json").read_text())
    name = next(n for n in index["kernels"] if n.startswith("reduction_rms_norm"))
    rec = index["kernels"][name]
    assert rec["pointer_align"] == 16
    assert KB.assumes_aligned("*bf16") and KB.assumes_aligned("*fp32") and not KB.assumes_aligned("*i32")
    assert not KB.assumes_aligned("*i64") and not KB.assumes_aligned("i32")  # index arrays arrive as slices
    launches, jit = [], []

    class Recorder(_NoDriver):
        def launch(self, fn, gx, gy, gz, *rest):
            launches.append((gx, gy, gz))
            return 0

    class Jit:
        def __getitem__(self, grid):
            return lambda *a, **kw: jit.append((grid, a, kw))

    monkeypatch.setattr(KB, "_RAW_STREAM", lambda index: 0)
    k = KB.BinaryKernel(name, rec, b"", Recorder(), torch.device("cuda", 0), fallback=Jit())
    x, w = torch.zeros(4, 65, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    out = torch.empty(4, 64)
    kw = {**rec["constexprs"], "num_warps": rec["num_warps"]}
    k[(4,)](x[:, :64], w, out, 4, 1e-6, **kw)
    assert launches == [(4, 1, 1)] and not jit
    shifted = x.view(-1)[1:257].view(4, 64)  # 2 bytes past a 16-byte boundary
    with pytest.warns(UserWarning, match="not 16-byte aligned"):
        k[(4,)](shifted, w, out, 4, 1e-6, **kw)
    k[(4,)](shifted, w, out, 4, 1e-6, **kw)
    assert launches == [(4, 1, 1)] and len(jit) == 2 and jit[0][0] == (4,) and jit[0][1][0] is shifted
    old = {k2: v for k2, v in rec.items() if k2 != "pointer_align"}  # an older artifact: nothing assumed
    KB.BinaryKernel(name, old, b"", Recorder(), torch.device("cuda", 0))[(4,)](shifted, w, out, 4, 1e-6, **kw)
    assert launches[-1] == (4, 1, 1) and len(jit) == 2


def test_shipped_binaries_use_vector_loads_where_the_jit_would():
    """The aligned-pointer specialization is what makes Triton emit 16-byte loads: the generated rms_norm kernel
    compiled for sm_90 as codegen/aot compiles a binary reads rows with ld.global.v4, without it with 2-byte loads
    (compiled in a child process: Triton compiles nothing under the interpreter these tests run in)."""
    import os
    import sys

    path = Path(__file__).parent / "golden" / "triton" / "reduction_rms_norm_bf16.py"  # the generated kernel
    code = f"""
import importlib.util, json, re
import triton
from triton.backends.compiler import GPUTarget
from portlayer.codegen.aot import pointer_attrs
spec = importlib.util.spec_from_file_location("golden_rms_norm", {str(path)!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = getattr(mod, re.search(r"^def (\\w+)\\(", open({str(path)!r}).read(), re.M).group(1))
sig = {{"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "n_rows": "i32", "eps": "fp32",
       "N": "constexpr", "BLOCK_N": "constexpr", "PDL": "constexpr"}}
out = {{}}
for attrs in (None, pointer_attrs(sig)):
    c = triton.compile(triton.compiler.ASTSource(fn, signature=sig, constexprs={{"N": 1024, "BLOCK_N": 1024, "PDL": False}},
                       attrs=attrs), target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4, "num_stages": 1}})
    out[str(attrs is not None)] = re.findall(r"ld\\.global[\\w.]*", c.asm["ptx"])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    loads = json.loads(r.stdout.strip().splitlines()[-1])
    assert any(".v4" in ld for ld in loads["True"]), loads["True"]
    assert not any(".v4" in ld for ld in loads["False"]), loads["False"]


# ---- programmatic dependent launch (templates/triton/_pdl.j2) ----------------------------------------------------


def test_pdl_binaries_only_for_descriptors_with_the_feature(arts):
    """nvidia-h200 lists programmatic_dependent_launch: every binary is compiled with PDL=True and says so; the
    MI300X descriptor does not: PDL=False. kernels.json (what the JIT and the interpreter run) keeps PDL=False."""
    for target, pdl in (("nvidia-h200", True), ("amd-mi300x", False)):
        kernels = json.loads((arts[target] / "kernels.json").read_text())["kernels"]
        index = json.loads((arts[target] / "binaries.json").read_text())["kernels"]
        for name, k in kernels.items():
            assert k["signature"]["PDL"] == "constexpr" and k["constexprs"]["PDL"] is False
            for r in (index[name], *index[name].get("variants", ())):
                assert r["pdl"] is pdl and r["constexprs"]["PDL"] is pdl, (target, name)


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_pdl_kernels_wait_for_the_previous_grid_before_touching_memory(quantize):
    """The PTX of a PDL=True kernel starts with griddepcontrol.wait (then .launch_dependents) before its first
    global load; a few-rows GEMV's first prefetches its weights into L2 (no kernel writes them; int4: the packed
    bytes, scales and offsets), then waits before its first load; PDL=False compiles the block away. Checked in
    the PTX Triton emits for sm_90."""
    import os
    import subprocess
    import sys
    import tempfile

    import portlayer

    with tempfile.TemporaryDirectory() as d:
        art = Path(d) / "a"
        portlayer.compile("tiny-qwen3", target="nvidia-h200", output=art, progress=False, sources_only=True,
                          quantize=quantize)
        probe = rf"""
import json, re, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from portlayer.codegen import aot
art = Path({str(art)!r})
info = json.loads((art / "kernels.json").read_text())["kernels"]
out = {{}}
gemvs = [n for n in sorted(info) if n.startswith("gemv") and (not {quantize!r} or "_w4" in n)]
for name in sorted(info)[:3] + gemvs[:{4 if quantize else 2}]:
    k = info[name]
    mod = aot._module(art / "kernels" / (k["module"] + ".py"))
    for pdl in (False, True):
        src = triton.compiler.ASTSource(getattr(mod, k["fn"]), signature=dict(k["signature"]),
                                        constexprs={{**k["constexprs"], "PDL": pdl}})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": k["num_warps"]}}).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        marks = [m.group(0) for m in re.finditer(r"griddepcontrol\.\w+|ld\.global|prefetch\.global\.L2", body)]
        first = [m for i, m in enumerate(marks) if m != "prefetch.global.L2" or marks[i - 1 : i] != [m]][:4]
        out[f"{{name}}:{{pdl}}"] = first + (["(triggers)"] if "griddepcontrol.launch_dependents" in marks else [])
print(json.dumps(out))
"""
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    marks = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(marks) == (14 if quantize else 10)
    for key, seen in marks.items():
        if key.endswith(":True") and key.startswith("gemv_wq"):  # launch.gemv_wq's PDL_TRIGGER 2: never triggers early
            assert seen == ["griddepcontrol.wait", "ld.global", "ld.global", "ld.global"], (key, seen)  # no prefetch
        elif key.endswith(":True") and key.startswith("gemv"):  # the weights' prefetch into L2, then the wait
            assert seen[:3] == ["prefetch.global.L2", "griddepcontrol.wait", "griddepcontrol.launch_dependents"], (key, seen)
            assert seen[3] == "ld.global", (key, seen)
        elif key.endswith(":True"):
            assert seen[:2] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"], (key, seen)
        else:
            assert not any(s.startswith(("griddepcontrol", "prefetch", "(")) for s in seen), (key, seen)
    assert not quantize or any(k.startswith("gemv_wq") for k in marks), sorted(marks)


def test_launch_config_matches_cuda_h():
    """The ctypes CUlaunchConfig / CUlaunchAttribute have cuda.h's sizes, and the attribute id is cuda.h's
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (read from the header Triton bundles)."""
    import ctypes
    import re

    import triton

    header = Path(triton.__file__).parent / "backends" / "nvidia" / "include" / "cuda.h"
    text = header.read_text(errors="replace")
    assert int(re.search(r"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\s*=\s*(\d+)", text)[1]) == KB._PDL_ATTRIBUTE
    # CUlaunchConfig: 7 unsigned ints, a stream, an attribute pointer, a count (64-bit: 56 bytes); CUlaunchAttribute:
    # an enum padded to 8 bytes and the 64-byte CUlaunchAttributeValue union
    assert re.search(r"typedef struct CUlaunchConfig_st \{.*?unsigned int numAttrs;", text, re.S)
    assert re.search(r"union CUlaunchAttributeValue_union \{\s*char pad\[64\];", text)
    assert ctypes.sizeof(KB._LaunchConfig) == 56 and KB._LaunchConfig.stream.offset == 32
    assert ctypes.sizeof(KB._LaunchAttribute) == 72 and KB._LaunchAttribute.value.offset == 8


def test_a_pdl_binary_launches_through_cuLaunchKernelEx_unless_switched_off(arts, monkeypatch):
    """A PDL binary goes through cuLaunchKernelEx with the programmatic-stream-serialization attribute, on torch's
    current stream, with the grid, block and shared memory the plain launch would get; PORTLAYER_PDL=0 (read at
    load) or a driver without cuLaunchKernelEx: the plain cuLaunchKernel. Stand-in driver: no GPU here."""
    import ctypes

    index = json.loads((arts["nvidia-h200"] / "binaries.json").read_text())
    name = next(n for n in index["kernels"] if n.startswith("reduction_rms_norm"))
    rec = index["kernels"][name]
    assert rec["pdl"]
    seen = []

    class Recorder(_NoDriver):
        def launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            seen.append(("plain", (gx, gy, gz), (bx, by, bz), shared, stream))
            return 0

        def launch_ex(self, cfg_ref, fn, params, extra):
            cfg = ctypes.cast(cfg_ref, ctypes.POINTER(KB._LaunchConfig)).contents
            attrs = [(cfg.attrs[i].id, cfg.attrs[i].value) for i in range(cfg.num_attrs)]
            seen.append(("ex", (cfg.grid_x, cfg.grid_y, cfg.grid_z), (cfg.block_x, cfg.block_y, cfg.block_z),
                         cfg.shared, cfg.stream, attrs))
            return 0

    monkeypatch.setattr(KB, "_RAW_STREAM", lambda index: 7000 + index)
    x, w, out = torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16), torch.empty(4, 64)
    kw = {**rec["constexprs"], "num_warps": rec["num_warps"]}
    block = (rec["num_warps"] * rec["warp_size"], 1, 1)
    KB.BinaryKernel(name, rec, b"", Recorder(), torch.device("cuda", 1))[(4, 2)](x, w, out, 4, 1e-6, **kw)
    assert seen == [("ex", (4, 2, 1), block, rec["shared"], 7001, [(6, 1)])]
    seen.clear()
    monkeypatch.setenv("PORTLAYER_PDL", "0")
    KB.BinaryKernel(name, rec, b"", Recorder(), torch.device("cuda", 1))[(4,)](x, w, out, 4, 1e-6, **kw)
    assert seen == [("plain", (4, 1, 1), block, rec["shared"], 7001)]
