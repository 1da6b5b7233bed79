"""Flat IR -> MLIR through torch-mlir's FX importer; optional check by compiling it with IREE.

The graph (after whatever passes the user ran) is turned into a torch.export program of its
reference semantics (flatten/to_fx.py) and imported by ``torch_mlir.fx.export_and_import`` in the
``torch`` dialect or lowered to ``linalg-on-tensors``. The exported function is
``forward(input_ids: tensor<?xi64>, positions: tensor<?xi64>)`` returning the graph's output (logits
[T, vocab], hidden states [T, H], or a pooled [1, H] embedding); weights are inlined constants.
``check`` compiles the text for IREE's ``llvm-cpu`` target, runs it and compares with the
reference interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portlayer.errors import PortlayerError
from portlayer.flatten.ir import Graph

DIALECTS = {"torch": "torch", "linalg": "linalg-on-tensors"}


class MlirExportError(PortlayerError, RuntimeError):
    """The MLIR tools are missing, or the export / the IREE check failed; the message says which."""


def _torch_mlir():
    try:
        from torch_mlir import fx
    except ImportError as e:
        raise MlirExportError(f"torch-mlir is not installed ({e}); pip install 'portlayer[mlir]'") from None
    return fx


def export_mlir(graph: Graph, dialect: str = "torch", *, dynamic: bool = True) -> str:
    """The graph as MLIR text in ``dialect`` ('torch' or 'linalg')."""
    if dialect not in DIALECTS:
        raise MlirExportError(f"--dialect {dialect!r} is not one of {', '.join(DIALECTS)}")
    fx = _torch_mlir()
    from portlayer.flatten.to_fx import to_exported_program

    try:
        ep = to_exported_program(graph, dynamic=dynamic)
        module = fx.export_and_import(ep, output_type=DIALECTS[dialect], func_name="forward")
    except MlirExportError:
        raise
    except Exception as e:  # torch.export / the importer raise many types; keep the cause readable
        raise MlirExportError(f"MLIR export failed: {type(e).__name__}: {str(e)[:1500]}") from e
    return str(module)


def parse_check(text: str) -> None:
    """Parse ``text`` with torch-mlir's own MLIR parser (its dialects registered)."""
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d

    with ir.Context() as ctx:
        torch_d.register_dialect(ctx)
        ir.Module.parse(text)


@dataclass
class CheckResult:
    tokens: int
    max_abs: float

    def __str__(self) -> str:
        return f"{self.tokens} tokens: max abs error {self.max_abs:.3g} vs the reference interpreter"


def iree_check(graph: Graph, text: str, dialect: str, lengths: tuple[int, ...] = (1, 9, 40),
               tol: float = 1e-4) -> list[CheckResult]:
    """Compile ``text`` for IREE llvm-cpu, run it at each length, compare with interpret()."""
    try:
        import iree.compiler as ireec
        import iree.runtime as ireert
    except ImportError as e:
        raise MlirExportError(f"IREE is not installed ({e}); pip install 'portlayer[mlir]'") from None
    from portlayer.flatten.interpret import interpret
    from portlayer.flatten.to_fx import example_inputs

    try:
        vmfb = ireec.compile_str(text, target_backends=["llvm-cpu"],
                                 input_type="torch" if dialect == "torch" else "auto",
                                 extra_args=["--iree-llvmcpu-target-cpu=generic"])
    except Exception as e:
        raise MlirExportError(f"IREE could not compile the MLIR: {str(e)[:1500]}") from e
    config = ireert.Config("local-task")
    ctx = ireert.SystemContext(config=config)
    ctx.add_vm_module(ireert.VmModule.copy_buffer(ctx.instance, vmfb))
    fn = ctx.modules.module["forward"]
    results = []
    for n in lengths:
        ids, pos = example_inputs(graph, n)
        got = torch.from_numpy(fn(ids.numpy(), pos.numpy()).to_host().copy())
        ref = interpret(graph, ids, pos)
        err = (got.float() - ref.float().reshape(got.shape)).abs().max().item()
        results.append(CheckResult(n, err))
        if not err <= tol:
            raise MlirExportError(f"IREE llvm-cpu result differs from the reference interpreter at {n} tokens: "
                                  f"max abs error {err:.3g} > {tol}")
    return results
