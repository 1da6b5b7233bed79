"""Jinja2 rendering of the kernel and host-program templates.

Templates live beside this file (templates/triton/*.py.j2, templates/host/*.py.j2) so
that the generated source people read is visible as source, not as Python string soup.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jinja2

TEMPLATE_DIR = Path(__file__).parent / "templates"


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,  # a typo in a template variable is an error, not ""
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    return env


def render(template: str, **context: Any) -> str:
    """Render ``template`` (relative to templates/) and tidy blank-line runs."""
    text = environment().get_template(template).render(**context)
    lines: list[str] = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line and len(lines) >= 2 and not lines[-1] and not lines[-2]:
            continue
        lines.append(line)
    return "\n".join(lines).strip("\n") + "\n"
