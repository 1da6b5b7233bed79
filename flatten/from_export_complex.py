"""The aten -> portable op table, part 5: complex rotary embeddings as real pairs.

DeepSeek-V2-style rotary builds ``freqs_cis = polar(1, angle)``, views q/k as complex
(``view_as_complex(x.reshape(..., -1, 2))``), multiplies and views back as real. The Flat IR
has no complex dtype, so a complex value is carried as its real pair: a float tensor with a
trailing axis of 2 (re, im), wrapped in :class:`Complex` so that an op without a complex
rule here fails loudly instead of treating the pair as real data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from portlayer.flatten.from_export import Converter, UnsupportedOpError, lower

aten = torch.ops.aten
Node = torch.fx.Node


@dataclass(frozen=True)
class Complex:
    """A complex value of logical shape S, stored as the real value ``pair`` [*S, 2]."""

    pair: str


def is_complex(v: Any) -> bool:
    return isinstance(v, Complex) or (isinstance(v, (list, tuple)) and any(is_complex(x) for x in v))


def _last(cv: Converter, x: str, which: int, name: str) -> str:
    return cv.emit("slice", [x], {"dim": cv.type_of(x).rank - 1, "start": which, "end": which + 1, "step": 1},
                   name=name)


def _pair(cv: Converter, re: str, im: str) -> Complex:
    return Complex(cv.emit("concat", [re, im], {"dim": cv.type_of(re).rank - 1}))


def _as_column(cv: Converter, x: str) -> str:
    return cv.reshape_to(x, tuple(cv.type_of(x).shape) + (1,))


@lower(aten.polar)
def _polar(cv: Converter, node: Node, args: list, kwargs: dict) -> Complex:
    mag, angle = args[0], args[1]
    re = cv.emit("mul", [mag, cv.emit("cos", [angle], name=f"{node.name}_cos")], name=f"{node.name}_re")
    im = cv.emit("mul", [mag, cv.emit("sin", [angle], name=f"{node.name}_sin")], name=f"{node.name}_im")
    return _pair(cv, _as_column(cv, re), _as_column(cv, im))


@lower(aten.view_as_complex)
def _view_as_complex(cv: Converter, node: Node, args: list, kwargs: dict) -> Complex:
    if cv.type_of(args[0]).shape[-1] != 2:
        raise UnsupportedOpError(f"view_as_complex of {cv.type_of(args[0])} at FX node {node.name}")
    return Complex(args[0])


def convert_complex(cv: Converter, node: Node, args: list, kwargs: dict) -> Any:
    """Ops that take complex operands (called by the converter when an argument is Complex)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet in (aten._assert_tensor_metadata,):
        return None
    if packet is aten.view_as_real:
        return args[0].pair
    if packet in (aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze, aten.squeeze, aten.flatten,
                  aten.expand, aten.unflatten):
        shape = tuple(cv.out_shape()) + (2,)
        x = args[0].pair
        if packet is aten.expand:
            return Complex(x if tuple(cv.type_of(x).shape) == shape else cv.emit("expand", [x], {"shape": list(shape)}))
        return Complex(cv.reshape_to(x, shape))
    if packet in (aten.to, aten._to_copy, aten.clone, aten.alias, aten.detach, aten.contiguous, aten.type_as):
        if not node.meta["val"].is_complex():
            raise UnsupportedOpError(f"{node.target} from complex to real at FX node {node.name}")
        return args[0]
    if packet is aten.mul:
        a, b = args[0], args[1]
        if not isinstance(a, Complex):
            a, b = b, a
        if not isinstance(b, Complex):
            if isinstance(b, str):
                return Complex(cv.emit("mul", [a.pair, _as_column(cv, b)]))
            return Complex(cv.emit("mul", [a.pair], {"scalar": float(b)}))
        ar, ai = _last(cv, a.pair, 0, f"{node.name}_ar"), _last(cv, a.pair, 1, f"{node.name}_ai")
        br, bi = _last(cv, b.pair, 0, f"{node.name}_br"), _last(cv, b.pair, 1, f"{node.name}_bi")
        re = cv.emit("sub", [cv.emit("mul", [ar, br]), cv.emit("mul", [ai, bi])], name=f"{node.name}_re")
        im = cv.emit("add", [cv.emit("mul", [ar, bi]), cv.emit("mul", [ai, br])], name=f"{node.name}_im")
        return _pair(cv, re, im)
    raise UnsupportedOpError(
        f"aten op {node.target} on complex values (FX node '{node.name}'); portlayer carries complex rotary "
        "embeddings (polar, view_as_complex, multiply, reshape, view_as_real) and nothing else complex"
    )
