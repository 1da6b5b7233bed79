"""portlayer: compile Hugging Face models for the accelerator you have, and run them.

``portlayer.compile(model, target="auto")`` returns an Artifact; ``portlayer.load(path)``
verifies one and gives its graph, plan, executable and validation. Importing this
package stays cheap: torch and the compiler load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _checkout_subpackages() -> None:
    """Running from a source checkout without installing (e.g. a GPU box with no network):
    let ``portlayer.flatten`` & co. resolve to the checkout's top-level folders, exactly
    what setup.cfg's package_dir mapping does for an installed copy."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = os.path.join(root, "setup.cfg")
    if root not in __path__ and os.path.isfile(cfg) and os.path.isdir(os.path.join(root, "flatten")):
        with open(cfg, encoding="utf-8") as f:
            if "name = portlayer" in f.read():
                __path__.append(root)


_checkout_subpackages()
__all__ = ["__version__", "compile", "load"]

if TYPE_CHECKING:
    from portlayer.api import compile, load


def __getattr__(name: str) -> Any:
    if name in ("compile", "load"):
        from portlayer import api

        return getattr(api, name)
    raise AttributeError(f"module 'portlayer' has no attribute {name!r}")
