"""A plain per-window, per-head implementation of SPEC §1–4, written for the tests.

Deliberately naive: Python loops over windows, heads and pairs, numpy float64, head outputs
recomputed from Hugging Face's own attention probabilities and hidden states (not from the
hooks), sentence ids by a token-by-token scan. Slow, but easy to check against the SPEC.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def reference_statistics(model, input_ids, attention_mask, tokens, *, q=0.02, gate=4.0,
                         include_special=False, seq_len=128, vectors="pre_wo", sentences=None):
    """Returns (heads: dict name -> [layer, head] array, dist_hist [layer, head, seq_len],
    chance: dict, pair_hist [seq_len], anchors: [window, layer, head] token id or -1).

    ``sentences``: ``[window, pos]`` sentence ids given by the windows (segmenter); None: the
    punct scan below."""
    hf = model.model
    with torch.no_grad():
        out = hf(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True, output_hidden_states=True)
    n_layers, n_heads, d = model.n_layers, model.n_heads, model.d_head
    blocks = hf.encoder.layer
    names = ["high_pairs", "sim_sum_all", "sim_sum_high", "same_sentence_high", "same_token_high", "attended_high",
             "attn_to_cls", "attn_to_sep", "attn_to_punct", "attn_to_self", "attn_to_prev", "attn_to_next",
             "attn_entropy"]
    heads = {k: np.zeros((n_layers, n_heads)) for k in names}
    dist_hist = np.zeros((n_layers, n_heads, seq_len), dtype=np.int64)
    chance = {"windows": 0, "pairs": 0, "same_sentence_pairs": 0, "same_token_pairs": 0, "attn_rows": 0}
    pair_hist = np.zeros(seq_len, dtype=np.int64)
    anchors = np.full((input_ids.shape[0], n_layers, n_heads), -1, dtype=np.int64)
    for w in range(input_ids.shape[0]):
        n = int(attention_mask[w].sum())
        ids = input_ids[w, :n].tolist()
        special = [t in tokens.special_ids for t in ids]
        members = [i for i in range(n) if include_special or not special[i]]
        sentence, current, new_sentence = [-1] * n, 0, False
        seen_word = False
        for i in range(n):
            if special[i]:
                continue
            if new_sentence and seen_word:
                current += 1
            sentence[i] = current
            seen_word = True
            new_sentence = ids[i] in tokens.sentence_end_ids
        if sentences is not None:
            sentence = [int(s) for s in sentences[w, :n]]
        pairs = [(i, j) for a, i in enumerate(members) for j in members[a + 1:]]
        chance["windows"] += 1
        chance["pairs"] += len(pairs)
        chance["attn_rows"] += n
        for i, j in pairs:
            chance["same_sentence_pairs"] += sentence[i] == sentence[j] and sentence[i] >= 0
            chance["same_token_pairs"] += ids[i] == ids[j]
            pair_hist[j - i] += 1
        k = min(len(pairs), math.ceil(q * len(pairs) - 1e-9))
        for layer in range(n_layers):
            with torch.no_grad():
                hidden = out.hidden_states[layer][w, :n].double()
                value = blocks[layer].attention.self.value
                v_all = hidden @ value.weight.detach().double().T + value.bias.detach().double()
                w_o = blocks[layer].attention.output.dense.weight.detach().double()
            for h in range(n_heads):
                attn = out.attentions[layer][w, h, :n, :n].double().numpy()
                z = attn @ v_all[:, h * d:(h + 1) * d].numpy()
                if vectors == "post_wo":
                    z = z @ w_o[:, h * d:(h + 1) * d].numpy().T
                sim = z @ z.T
                ranked = sorted(pairs, key=lambda p: (-sim[p], p[0], p[1]))
                high = ranked[:k]
                heads["high_pairs"][layer, h] += len(high)
                heads["sim_sum_all"][layer, h] += sum(sim[p] for p in pairs)
                heads["sim_sum_high"][layer, h] += sum(sim[p] for p in high)
                counts: dict[int, int] = {}
                for i, j in high:
                    heads["same_sentence_high"][layer, h] += sentence[i] == sentence[j] and sentence[i] >= 0
                    heads["same_token_high"][layer, h] += ids[i] == ids[j]
                    heads["attended_high"][layer, h] += max(attn[i, j], attn[j, i]) >= gate / n
                    dist_hist[layer, h, j - i] += 1
                    counts[ids[i]] = counts.get(ids[i], 0) + 1
                    counts[ids[j]] = counts.get(ids[j], 0) + 1
                if counts:
                    first = {t: ids.index(t) for t in counts}
                    anchors[w, layer, h] = min(counts, key=lambda t: (-counts[t], first[t]))
                for i in range(n):
                    row = attn[i]
                    heads["attn_to_cls"][layer, h] += sum(row[j] for j in range(n) if ids[j] == tokens.cls_id)
                    heads["attn_to_sep"][layer, h] += sum(row[j] for j in range(n) if ids[j] == tokens.sep_id)
                    heads["attn_to_punct"][layer, h] += sum(row[j] for j in range(n) if ids[j] in tokens.punct_ids)
                    heads["attn_to_self"][layer, h] += row[i]
                    heads["attn_to_prev"][layer, h] += row[i - 1] if i > 0 else 0.0
                    heads["attn_to_next"][layer, h] += row[i + 1] if i + 1 < n else 0.0
                    heads["attn_entropy"][layer, h] += -sum(a * math.log(a) for a in row if a > 0)
    return heads, dist_hist, chance, pair_hist, anchors
