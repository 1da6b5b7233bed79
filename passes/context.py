"""What every pass receives besides the graph: the device descriptor, the Plan, options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from portlayer.capabilities.descriptor import Descriptor
from portlayer.capabilities.plan import Plan


@dataclass
class PassContext:
    descriptor: Descriptor
    plan: Plan
    options: dict[str, Any] = field(default_factory=dict)
