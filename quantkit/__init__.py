"""quantkit: offline LLM quantization with packed, Hub-ready checkpoints and a runtime that proves them.

The heavy imports (torch, transformers) happen on first use of the API, so `import quantkit`
stays cheap and never needs a GPU.
"""
__version__ = "0.1.0"

from quantkit.errors import QuantkitError  # noqa: F401


def __getattr__(name):
    if name in ("quantize", "load", "evaluate"):
        from quantkit import api

        return getattr(api, name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
