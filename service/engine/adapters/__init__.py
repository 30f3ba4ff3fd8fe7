"""Model adapters, one module per family (see base.py). Importing the package registers the
built-in ones; families from installed plugins (the ``headatlas.families`` entry point) are
registered the first time a model type, a family or a ``random:`` shape is not found among
them, or when every family is listed (``families()``)."""

from headatlas.service.engine.adapters import bert, distilbert, gpt2, llama  # noqa: F401  (registration)
from headatlas.service.engine.adapters.base import (
    ADAPTERS,
    CONTRACT,
    FAMILIES,
    ConfigKeys,
    ModelAdapter,
    RandomShape,
    Shape,
    adapter_by_family,
    adapter_for,
    adapter_of_block,
    families,
    kv_group,
    random_shape,
    random_shapes,
    supported_families,
)

# the family of random:LAYERS,HEADS,HIDDEN, of the default model, and of a ModelInfo that names none
ENCODER_FAMILY = bert.BertAdapter.family

__all__ = [
    "ENCODER_FAMILY",
    "ADAPTERS",
    "CONTRACT",
    "FAMILIES",
    "ConfigKeys",
    "ModelAdapter",
    "RandomShape",
    "Shape",
    "adapter_by_family",
    "adapter_for",
    "adapter_of_block",
    "families",
    "kv_group",
    "random_shape",
    "random_shapes",
    "supported_families",
]
