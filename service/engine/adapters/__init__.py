"""Model adapters, one module per family (see base.py). Importing the package registers them."""

from headatlas.service.engine.adapters import bert, gpt2, llama  # noqa: F401  (registration)
from headatlas.service.engine.adapters.base import (
    ADAPTERS,
    FAMILIES,
    ModelAdapter,
    RandomShape,
    Shape,
    adapter_by_family,
    adapter_for,
    kv_group,
    supported_families,
)

# the family of random:LAYERS,HEADS,HIDDEN, of the default model, and of a ModelInfo that names none
ENCODER_FAMILY = bert.BertAdapter.family

__all__ = [
    "ENCODER_FAMILY",
    "ADAPTERS",
    "FAMILIES",
    "ModelAdapter",
    "RandomShape",
    "Shape",
    "adapter_by_family",
    "adapter_for",
    "kv_group",
    "random_shapes",
    "supported_families",
]


def random_shapes() -> dict[str, RandomShape]:
    """Every family's named random shapes: ``random:NAME``."""
    return {name: shape for adapter in FAMILIES.values() for name, shape in adapter.random_shapes.items()}
