"""HTML views of a Plan for notebooks (``Plan._repr_html_``): every decision, its value and reason."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

_TABLE = "border-collapse:collapse;font-size:12px"
_CELL = "text-align:left;padding:2px 8px;border-bottom:1px solid #ddd;vertical-align:top"


def _e(x: Any) -> str:
    return html.escape(str(x), quote=False)


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "") -> str:
    th = "".join(f"<th style='{_CELL}'>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td style='{_CELL}'>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    cap = f"<caption style='text-align:left;font-weight:bold'>{_e(caption)}</caption>" if caption else ""
    return f"<table style='{_TABLE}'>{cap}<tr>{th}</tr>{body}</table>"


def plan_html(plan: Any) -> str:
    """Every decision with its value and reason (a capabilities.plan.Plan)."""
    rows = plan.table()
    return _table(("decision", "value", "reason"), rows,
                  f"Plan for {plan.model} on {plan.target} (descriptor {plan.target_sha256[:12]})")
