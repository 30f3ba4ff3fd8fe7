"""GPT-NeoX and Pythia: pre-norm decoder blocks ``layers[i]`` with a parallel residual, rotary
positions, one fused QKV projection whose heads are interleaved (q, k, v of head 0, then head 1…)."""

from headatlas.service.engine.adapters import ConfigKeys, ModelAdapter, RandomShape


class NeoXAdapter(ModelAdapter):
    family = "gpt_neox"
    title = "GPT-NeoX, Pythia"
    model_types = ("gpt_neox",)
    causal = True
    pre_norm = True
    config_keys = ConfigKeys()  # num_hidden_layers, num_attention_heads, hidden_size, …
    random_shapes = {"neox": RandomShape("gpt_neox", 2, 4, 32)}

    def blocks(self, model):
        return list(model.layers)

    def attention(self, block):
        return block.attention

    def output_projection(self, block):
        return block.attention.dense

    def output_weight(self, block):
        return block.attention.dense.weight  # nn.Linear: [d_model, head·d_head]

    def values(self, block, x):
        attn = block.attention
        qkv = attn.query_key_value(x).view(*x.shape[:2], -1, 3 * attn.head_size)  # heads interleaved
        return qkv[..., 2 * attn.head_size :].transpose(1, 2)  # [batch, head, pos, d_head]

    def embedding_output(self, model):
        return model.emb_dropout  # embed_in, then the dropout (an identity in eval mode) hands it to layers[0]

    def attention_norm(self, block):
        return block.input_layernorm

    def final_norm(self, model):
        return model.final_layer_norm

    def random_config(self, shape, vocab_size):
        from transformers import GPTNeoXConfig

        return GPTNeoXConfig(
            vocab_size=vocab_size,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            hidden_size=shape.hidden,
            intermediate_size=4 * shape.hidden,
            attn_implementation="eager",
        )
