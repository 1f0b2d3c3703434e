"""Architecture adapters: per-family knowledge of where layers, norms and linears live in a causal LM."""
from quantkit.models.base import (  # noqa: F401
    SUPPORTED_MODEL_TYPES,
    ArchitectureAdapter,
    InputGroup,
    get_adapter,
)
from quantkit.models.folding import fold_scales  # noqa: F401

__all__ = ["SUPPORTED_MODEL_TYPES", "ArchitectureAdapter", "InputGroup", "fold_scales", "get_adapter"]
