"""What the mixing measures need of a block beyond the adapter interface, per family.

The adapters (service/engine/adapters/) say where z, A, W_O and the values are. The mixing
measures (SPEC §6) also need: the module whose output is the embedding-layer output ``e`` (the
point gradient attribution differentiates against), whether a block normalises before attention
(pre-norm) or after the residual sum (post-norm), and the norm that ALTI runs through. These are
family facts too; they live here, one ``BlockParts`` per family, until the adapter interface
carries them (``ModelAdapter.embedding_output``, ``pre_norm``, ``attention_norm``).

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from headatlas.service.engine.adapters import FAMILIES, ModelAdapter
from headatlas.service.errors import ModelError

# a module reached by attribute (nn.Module's __getattr__ is typed Tensor | Module): typed Any
Accessor = Callable[[Any], Any]


@dataclass(frozen=True)
class BlockParts:
    """One family's modules, as the mixing measures see them.

    pre_norm: the block normalises the attention's input (``x + Attn(LN(x))``: GPT-2, Llama);
    otherwise it normalises after the residual sum (``LN(x + Attn(x))``: BERT).
    embedding_output(model): the module whose output is ``e`` ``[batch, pos, d_model]``, the
    input of block 0 (token embeddings plus learned positions where the family has them).
    attention_norm(block): pre-norm, the norm applied to the block input before attention;
    post-norm, the norm after the attention's residual sum.
    final_norm(model): the norm the base model applies after its last block (pre-norm families),
    or None; the causal effects (SPEC §9) replay the blocks and need it to end where the model ends.
    """

    pre_norm: bool
    embedding_output: Accessor
    attention_norm: Accessor
    final_norm: Accessor = lambda _model: None


PARTS: dict[str, BlockParts] = {
    # BertEmbeddings: words + positions + token types, LayerNorm, dropout
    "bert": BlockParts(False, lambda model: model.embeddings, lambda block: block.attention.output.LayerNorm),
    # GPT2Model: wte + wpe, then the embedding dropout (an identity in eval mode) hands it to h[0]
    "gpt2": BlockParts(True, lambda model: model.drop, lambda block: block.ln_1, lambda model: model.ln_f),
    # LlamaModel: embed_tokens hands its output to layers[0]; RoPE acts inside attention
    "llama": BlockParts(
        True, lambda model: model.embed_tokens, lambda block: block.input_layernorm, lambda model: model.norm
    ),
}


def parts(adapter: ModelAdapter) -> BlockParts:
    try:
        return PARTS[adapter.family]
    except KeyError:
        raise ModelError(
            f"model family {adapter.family!r}: the mixing measures do not know its embedding output and norms; "
            f"they support {', '.join(PARTS)}"
        ) from None


def adapter_of_block(block: torch.nn.Module) -> ModelAdapter:
    """The adapter whose blocks look like ``block`` (for callers that hold a block, not a model)."""
    for adapter in FAMILIES.values():
        try:
            adapter.attention(block)
            adapter.output_projection(block)
        except AttributeError:
            continue
        return adapter
    raise ModelError(f"{type(block).__name__} is not a block of a supported family ({', '.join(FAMILIES)})")
