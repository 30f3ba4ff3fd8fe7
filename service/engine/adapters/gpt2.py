"""GPT-2: pre-norm decoder blocks ``h[i]``, learned positions, one fused QKV projection.

GPT-2's projections are ``Conv1D`` modules, whose weight is stored transposed against nn.Linear
(``[in, out]``): W_O is ``attn.c_proj.weight.T`` and the values are the last third of ``attn.c_attn``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from headatlas.service.engine.adapters.base import ConfigKeys, ModelAdapter, RandomShape, register
from headatlas.service.errors import ModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@register
class GPT2Adapter(ModelAdapter):
    family = "gpt2"
    title = "GPT-2"
    model_types = ("gpt2",)
    causal = True
    pre_norm = True
    config_keys = ConfigKeys(
        layers="n_layer", heads="n_head", hidden="n_embd", intermediate="n_inner", positions="n_positions"
    )
    random_shapes = {"gpt2": RandomShape("gpt2", 2, 4, 32), "gpt2-small": RandomShape("gpt2", 12, 12, 768)}

    def blocks(self, model: Any) -> list[torch.nn.Module]:
        layers = getattr(model, "h", None)
        if layers is None or not len(layers):
            raise ModelError(f"{type(model).__name__} is not a GPT-2 base model (expected h[i].attn); load AutoModel")
        return list(layers)

    def attention(self, block: Any) -> torch.nn.Module:
        return block.attn

    def output_projection(self, block: Any) -> torch.nn.Module:
        return block.attn.c_proj

    def output_weight(self, block: Any) -> torch.Tensor:
        return block.attn.c_proj.weight.T  # Conv1D: [head·d_head, d_model] -> [d_model, head·d_head]

    def values(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        attn = block.attn
        batch, n_pos, _ = x.shape
        v = attn.c_attn(x).split(attn.split_size, dim=2)[2]
        return v.view(batch, n_pos, attn.num_heads, attn.head_dim).transpose(1, 2)

    # GPT2Model: wte + wpe, then the embedding dropout (an identity in eval mode) hands it to h[0]
    def embedding_output(self, model: Any) -> torch.nn.Module:
        return model.drop

    def attention_norm(self, block: Any) -> torch.nn.Module:
        return block.ln_1

    def final_norm(self, model: Any) -> torch.nn.Module:
        return model.ln_f

    def random_config(self, shape: RandomShape, vocab_size: int) -> PretrainedConfig:
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab_size,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_embd=shape.hidden,
            n_inner=shape.intermediate,  # None: 4 × n_embd
            n_positions=512,
            bos_token_id=None,  # GPT-2's 50256 lies outside a borrowed vocabulary
            eos_token_id=None,
            attn_implementation="eager",
        )
