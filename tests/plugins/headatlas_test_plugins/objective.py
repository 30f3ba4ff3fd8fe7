"""An objective from outside headatlas: the mean length of an encoder's final hidden states over
a window's valid positions, ``O(w) = (1/n) Σ_i ‖h_i‖`` (not a loss). Measured only when a request
names it (``--objective final_norm``); it applies to encoders alone, decided from the adapter."""

from headatlas.service.measures.objectives import ObjectiveDefinition


def mean_norm(final, attention_mask):
    """``(1/n) Σ_i ‖h_i‖`` per window ``[batch]`` over its valid positions."""
    weight = attention_mask.to(final.dtype)
    return (final.norm(dim=-1) * weight).sum(dim=1) / weight.sum(dim=1)


def _build(_model):
    def per_window(final, _targets, attention_mask, _intact):
        return mean_norm(final, attention_mask)

    return per_window


FINAL_NORM = ObjectiveDefinition(
    "final_norm",
    "norm",
    False,
    "mean ‖h‖ of the final hidden states (encoders)",
    lambda adapter, _config: not adapter.causal,
    _build,
)
