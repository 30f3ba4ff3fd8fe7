"""A naive baseline: the same statistics computed per window and per head with numpy on
Hugging Face's ``output_attentions`` / ``output_hidden_states`` outputs.

This is how one would write the analysis without batching the statistics: a Python loop
over windows and heads, numpy sorting per head. Used by the benchmarks as the yardstick
for the vectorised path (the counts agree; see tests/test_reference.py for exact parity).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def naive_batch_statistics(model, batch, tokens, *, q: float = 0.02, gate: float = 4.0, seq_len: int = 128) -> dict:
    hf = model.model
    with torch.inference_mode():
        out = hf(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            output_attentions=True,
            output_hidden_states=True,
        )
    n_layers, n_heads, d = model.n_layers, model.n_heads, model.d_head
    high = np.zeros((n_layers, n_heads), dtype=np.int64)
    same_sentence = np.zeros_like(high)
    same_token = np.zeros_like(high)
    attended = np.zeros_like(high)
    dist_hist = np.zeros((n_layers, n_heads, seq_len), dtype=np.int64)
    entropy = np.zeros((n_layers, n_heads))
    ids_all = batch.input_ids.numpy()
    for layer in range(n_layers):
        value = hf.encoder.layer[layer].attention.self.value
        with torch.inference_mode():
            v_all = value(out.hidden_states[layer]).numpy()  # [batch, pos, head·d]
        attn_all = out.attentions[layer].numpy()
        for w in range(ids_all.shape[0]):
            n = int(batch.attention_mask[w].sum())
            ids = ids_all[w, :n]
            words = np.array([t not in tokens.special_ids for t in ids])
            ends = np.isin(ids, list(tokens.sentence_end_ids)) & words
            sentence = np.where(words, np.cumsum(ends) - ends, -1)
            iu, ju = np.triu_indices(n, 1)
            keep = words[iu] & words[ju]
            iu, ju = iu[keep], ju[keep]
            k = min(len(iu), math.ceil(q * len(iu) - 1e-9))
            for h in range(n_heads):
                attn = attn_all[w, h, :n, :n]
                z = attn @ v_all[w, :n, h * d : (h + 1) * d]
                sim = (z @ z.T)[iu, ju]
                order = np.lexsort((ju, iu, -sim))[:k]
                i, j = iu[order], ju[order]
                high[layer, h] += k
                same_sentence[layer, h] += int(((sentence[i] == sentence[j]) & (sentence[i] >= 0)).sum())
                same_token[layer, h] += int((ids[i] == ids[j]).sum())
                attended[layer, h] += int((np.maximum(attn[i, j], attn[j, i]) >= gate / n).sum())
                dist_hist[layer, h] += np.bincount(j - i, minlength=seq_len)[:seq_len]
                with np.errstate(divide="ignore", invalid="ignore"):
                    entropy[layer, h] += float(-np.nansum(attn * np.log(attn)))
    return {
        "high_pairs": high,
        "same_sentence_high": same_sentence,
        "same_token_high": same_token,
        "attended_high": attended,
        "dist_hist": dist_hist,
        "attn_entropy": entropy,
    }
