"""Recipe steps: one module per method, registered by name (see base.py), composed by recipe.py."""
from quantkit.quantizers.base import (  # noqa: F401
    LayerContext,
    Quantizer,
    Step,
    Transform,
    available_methods,
    get_quantizer,
    register_step,
)
from quantkit.quantizers.recipe import Recipe, build_recipe  # noqa: F401
