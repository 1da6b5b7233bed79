"""Messages between the API process and the engine-core process: JSON, schema-checked.

Nothing that crosses the pipe is evaluated: each message is a JSON object whose ``t`` names
its kind, and ``decode`` checks every field of the kinds the receiver accepts (type and
shape) before anyone reads it, so a malformed or unexpected message is a ``ProtocolError``
that names the field, never an attribute lookup or a call chosen by the sender.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class ProtocolError(Exception):
    """A message that is not one the receiver accepts (bad JSON, unknown kind, wrong field type)."""


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _opt_int(v: Any) -> bool:
    return v is None or type(v) is int


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _params(v: Any) -> bool:
    return (isinstance(v, dict) and _number(v.get("temperature")) and type(v.get("top_k")) is int
            and _number(v.get("top_p")) and _opt_int(v.get("seed")) and type(v.get("max_tokens")) is int
            and _ints(v.get("stop_token_ids")) and type(v.get("ignore_eos")) is bool)  # fmt: skip


def _add_reqs(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(r, dict) and isinstance(r.get("rid"), str) and _ints(r.get("prompt"))
        and _params(r.get("params")) and _opt_int(r.get("logprobs")) for r in v)  # fmt: skip


def _outs(v: Any) -> bool:  # [rid, new ids, finish_reason | None, logprobs | None]
    return isinstance(v, list) and all(
        isinstance(o, list) and len(o) == 4 and isinstance(o[0], str) and _ints(o[1])
        and (o[2] is None or isinstance(o[2], str)) and (o[3] is None or isinstance(o[3], list)) for o in v)  # fmt: skip


def _dict(v: Any) -> bool:
    return isinstance(v, dict)


#: what the engine-core process accepts
TO_CORE: Mapping[str, Mapping[str, Any]] = {
    "add": {"call": lambda v: type(v) is int, "reqs": _add_reqs},
    "abort": {"rids": _strs},
    "embed": {"call": lambda v: type(v) is int, "ids": lambda v: isinstance(v, list) and all(_ints(x) for x in v)},
    "shutdown": {},
}

#: what the API process accepts
FROM_CORE: Mapping[str, Mapping[str, Any]] = {
    "ready": {"info": _dict},
    "load_error": {"message": lambda v: isinstance(v, str), "kind": lambda v: isinstance(v, str),
                   "user_error": lambda v: type(v) is bool},
    "reply": {"call": lambda v: type(v) is int, "error": lambda v: v is None or _dict(v)},
    "step": {"dt": _number, "outs": _outs, "stats": _dict},
    "failed": {"error": lambda v: isinstance(v, str), "stats": _dict},
    "stats": {"stats": _dict},
}


def encode(kind: str, /, **fields: Any) -> bytes:
    return json.dumps({"t": kind, **fields}, separators=(",", ":")).encode()


def decode(data: bytes, accepted: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The message in ``data`` if it is one of ``accepted`` with every field well-formed."""
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not a JSON message ({e})") from None
    if not isinstance(msg, dict) or msg.get("t") not in accepted:
        kind = msg.get("t") if isinstance(msg, dict) else type(msg).__name__
        raise ProtocolError(f"unexpected message kind {kind!r}; accepted: {', '.join(accepted)}")
    for name, ok in accepted[msg["t"]].items():
        if name not in msg or not ok(msg[name]):
            raise ProtocolError(f"message {msg['t']!r}: field {name!r} is missing or malformed")
    return msg
