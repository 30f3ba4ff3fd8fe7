"""A plain per-window, per-head implementation of SPEC §1–4 and §5b, written for the tests.

Deliberately naive: Python loops over windows, heads and pairs, numpy float64, head outputs
recomputed from Hugging Face's own attention probabilities and hidden states (not from the
hooks), sentence ids by a token-by-token scan, word tokens from the tokenizer's own token texts
(a byte-level vocabulary's decoded from GPT-2's byte alphabet) with ``unicodedata`` (not
service.engine.windows). Slow, but easy to check against the SPEC.
"""

from __future__ import annotations

import math
import unicodedata

import numpy as np
import torch

HEAD_NAMES = [
    "high_pairs",
    "sim_sum_all",
    "sim_sum_high",
    "same_sentence_high",
    "same_token_high",
    "attended_high",
    "attn_to_cls",
    "attn_to_sep",
    "attn_to_punct",
    "attn_to_self",
    "attn_to_prev",
    "attn_to_next",
    "attn_entropy",
    "same_word_high",
    "anchor_frequent",
    "anchored_windows",
    # SPEC §8
    "attn_to_first",
    "attn_dup",
    "attn_induction",
]
CHANCE_NAMES = [
    "windows",
    "pairs",
    "same_sentence_pairs",
    "same_token_pairs",
    "attn_rows",
    "same_word_pairs",
    "punct_tokens",
    # SPEC §8 (an encoder: every row sees all n keys)
    "uniform_cls",
    "uniform_sep",
    "uniform_punct",
    "uniform_first",
    "next_rows",
    "dup_rows",
    "attn_dup_chance",
    "induction_rows",
    "attn_induction_chance",
]
FLOAT_CHANCE = {
    "uniform_cls",
    "uniform_sep",
    "uniform_punct",
    "uniform_first",
    "attn_dup_chance",
    "attn_induction_chance",
}
HIST_NAMES = ["pairs", "same_sentence", "same_token", "same_word"]


def word_piece_is_word(token: str) -> bool:
    """SPEC §5b: after a word-piece prefix, at least one character of Unicode category L* or N*."""
    for prefix in ("##", "Ġ", "▁"):
        if token.startswith(prefix):
            token = token[len(prefix) :]
            break
    return any(unicodedata.category(ch).startswith(("L", "N")) for ch in token)


def _gpt2_byte_of_symbol() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the stand-in character of each byte -> the byte
    (printable Latin-1 bytes stand for themselves, the other 68 are shifted to U+0100 onwards)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(shifted)}}


BYTE_OF_SYMBOL = _gpt2_byte_of_symbol()


def vocabulary_is_byte_level(tokenizer) -> bool:
    """A byte-level BPE vocabulary: its tokenizer.json decoder is (or holds) ByteLevel."""
    import json

    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")
    return '"type": "ByteLevel"' in json.dumps(decoder)


def byte_level_text(token: str) -> str:
    """The text a byte-level token stands for: its symbols as bytes, decoded as UTF-8 (an
    incomplete character becomes U+FFFD); a symbol outside the alphabet stands for itself."""
    raw = b"".join(bytes([BYTE_OF_SYMBOL[ch]]) if ch in BYTE_OF_SYMBOL else ch.encode() for ch in token)
    return raw.decode("utf-8", errors="replace")


def reference_word_ids(tokenizer) -> set[int]:
    """Ids of the word tokens (SPEC §5b), special tokens included (the caller excludes them): on
    the vocabulary string, or on the decoded text for a byte-level vocabulary (no prefix there)."""
    byte_level = vocabulary_is_byte_level(tokenizer)
    words = set()
    for token, idx in tokenizer.get_vocab().items():
        if byte_level:
            word = any(unicodedata.category(ch).startswith(("L", "N")) for ch in byte_level_text(token))
        else:
            word = word_piece_is_word(token)
        if word:
            words.add(idx)
    return words


def reference_windows(
    model,
    input_ids,
    attention_mask,
    tokens,
    *,
    count,
    gate=4.0,
    include_special=False,
    seq_len=128,
    vectors="pre_wo",
    sentences=None,
):
    """One record per window: ``heads`` (name -> [layer, head]), ``dist_hist`` and ``attended_hist``
    ([layer, head, seq_len]), ``chance`` (name -> int), ``hists`` (name -> [seq_len]), ``anchors``
    ([layer, head] token id or -1) and ``anchor_frequent`` ([layer, head] bool).

    ``count(n_pairs)``: |H| of a window with n_pairs pairs (the selection rule). ``sentences``:
    ``[window, pos]`` sentence ids given by the windows (segmenter); None: the punct scan."""
    hf = model.model
    with torch.no_grad():
        out = hf(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True, output_hidden_states=True)
    n_layers, n_heads, d = model.n_layers, model.n_heads, model.d_head
    blocks = hf.encoder.layer
    records = []
    word_ids = reference_word_ids(model.tokenizer)
    for w in range(input_ids.shape[0]):
        n = int(attention_mask[w].sum())
        ids = input_ids[w, :n].tolist()
        special = [t in tokens.special_ids for t in ids]
        word = [not special[i] and ids[i] in word_ids for i in range(n)]
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
        # the window's most frequent non-special token; ties: the earliest first occurrence
        occurrences: dict[int, int] = {}
        for i in range(n):
            if not special[i]:
                occurrences[ids[i]] = occurrences.get(ids[i], 0) + 1
        frequent = min(occurrences, key=lambda t: (-occurrences[t], ids.index(t))) if occurrences else None
        pairs = [(i, j) for a, i in enumerate(members) for j in members[a + 1 :]]
        chance = {k: 0 for k in CHANCE_NAMES}
        hists = {k: np.zeros(seq_len, dtype=np.int64) for k in HIST_NAMES}
        chance["windows"] = 1
        chance["pairs"] = len(pairs)
        chance["attn_rows"] = n
        chance["punct_tokens"] = sum(1 for t in ids if t in tokens.punct_ids)
        # SPEC §8, bidirectional: k_i = n for every row
        chance["uniform_cls"] = sum(1 for t in ids if t == tokens.cls_id) * n / n
        chance["uniform_sep"] = sum(1 for t in ids if t == tokens.sep_id) * n / n
        chance["uniform_punct"] = chance["punct_tokens"] * n / n
        chance["uniform_first"] = 1.0 if n else 0.0
        chance["next_rows"] = max(n - 1, 0)
        copies = {}  # row -> (earlier copies D(i), induction targets I(i))
        for i in range(n):
            if special[i]:
                continue
            dup = [k for k in range(i) if ids[k] == ids[i] and not special[k]]
            ind = [k + 1 for k in range(i - 1) if ids[k] == ids[i] and not special[k]]
            copies[i] = (dup, ind)
            chance["dup_rows"] += bool(dup)
            chance["attn_dup_chance"] += len(dup) / n
            chance["induction_rows"] += bool(ind)
            chance["attn_induction_chance"] += len(ind) / n
        for i, j in pairs:
            same_sentence = sentence[i] == sentence[j] and sentence[i] >= 0
            same_token = ids[i] == ids[j]
            same_word = same_token and word[i]
            chance["same_sentence_pairs"] += same_sentence
            chance["same_token_pairs"] += same_token
            chance["same_word_pairs"] += same_word
            hists["pairs"][j - i] += 1
            hists["same_sentence"][j - i] += same_sentence
            hists["same_token"][j - i] += same_token
            hists["same_word"][j - i] += same_word
        k = count(len(pairs))
        heads = {name: np.zeros((n_layers, n_heads)) for name in HEAD_NAMES}
        dist_hist = np.zeros((n_layers, n_heads, seq_len), dtype=np.int64)
        attended_hist = np.zeros((n_layers, n_heads, seq_len), dtype=np.int64)
        anchors = np.full((n_layers, n_heads), -1, dtype=np.int64)
        anchor_frequent = np.zeros((n_layers, n_heads), dtype=bool)
        for layer in range(n_layers):
            with torch.no_grad():
                hidden = out.hidden_states[layer][w, :n].double()
                value = blocks[layer].attention.self.value
                v_all = hidden @ value.weight.detach().double().T + value.bias.detach().double()
                w_o = blocks[layer].attention.output.dense.weight.detach().double()
            for h in range(n_heads):
                attn = out.attentions[layer][w, h, :n, :n].double().numpy()
                z = attn @ v_all[:, h * d : (h + 1) * d].numpy()
                if vectors == "post_wo":
                    z = z @ w_o[:, h * d : (h + 1) * d].numpy().T
                sim = z @ z.T
                ranked = sorted(pairs, key=lambda p: (-sim[p], p[0], p[1]))
                high = ranked[:k]
                heads["high_pairs"][layer, h] += len(high)
                heads["sim_sum_all"][layer, h] += sum(sim[p] for p in pairs)
                heads["sim_sum_high"][layer, h] += sum(sim[p] for p in high)
                counts: dict[int, int] = {}
                for i, j in high:
                    attended = max(attn[i, j], attn[j, i]) >= gate / n
                    heads["same_sentence_high"][layer, h] += sentence[i] == sentence[j] and sentence[i] >= 0
                    heads["same_token_high"][layer, h] += ids[i] == ids[j]
                    heads["same_word_high"][layer, h] += ids[i] == ids[j] and word[i]
                    heads["attended_high"][layer, h] += attended
                    dist_hist[layer, h, j - i] += 1
                    attended_hist[layer, h, j - i] += attended
                    counts[ids[i]] = counts.get(ids[i], 0) + 1
                    counts[ids[j]] = counts.get(ids[j], 0) + 1
                if counts:
                    first = {t: ids.index(t) for t in counts}
                    anchors[layer, h] = min(counts, key=lambda t: (-counts[t], first[t]))
                    anchor_frequent[layer, h] = anchors[layer, h] == frequent
                    heads["anchored_windows"][layer, h] += 1
                    heads["anchor_frequent"][layer, h] += anchor_frequent[layer, h]
                for i in range(n):
                    row = attn[i]
                    heads["attn_to_cls"][layer, h] += sum(row[j] for j in range(n) if ids[j] == tokens.cls_id)
                    heads["attn_to_sep"][layer, h] += sum(row[j] for j in range(n) if ids[j] == tokens.sep_id)
                    heads["attn_to_punct"][layer, h] += sum(row[j] for j in range(n) if ids[j] in tokens.punct_ids)
                    heads["attn_to_self"][layer, h] += row[i]
                    heads["attn_to_prev"][layer, h] += row[i - 1] if i > 0 else 0.0
                    heads["attn_to_next"][layer, h] += row[i + 1] if i + 1 < n else 0.0
                    heads["attn_entropy"][layer, h] += -sum(a * math.log(a) for a in row if a > 0)
                    heads["attn_to_first"][layer, h] += row[0]
                    dup, ind = copies.get(i, ([], []))
                    heads["attn_dup"][layer, h] += sum(row[k] for k in dup)
                    heads["attn_induction"][layer, h] += sum(row[k] for k in ind)
        records.append(
            {
                "heads": heads,
                "dist_hist": dist_hist,
                "attended_hist": attended_hist,
                "chance": chance,
                "hists": hists,
                "anchors": anchors,
                "anchor_frequent": anchor_frequent,
            }
        )
    return records


def summed(records: list[dict]) -> dict:
    """The additive parts of window records, summed: heads, dist_hist, attended_hist, chance, hists."""
    return {
        "heads": {k: sum(r["heads"][k] for r in records) for k in HEAD_NAMES},
        "dist_hist": sum(r["dist_hist"] for r in records),
        "attended_hist": sum(r["attended_hist"] for r in records),
        "chance": {
            k: (float if k in FLOAT_CHANCE else int)(sum(r["chance"][k] for r in records)) for k in CHANCE_NAMES
        },
        "hists": {k: sum(r["hists"][k] for r in records) for k in HIST_NAMES},
    }


def reference_statistics(
    model,
    input_ids,
    attention_mask,
    tokens,
    *,
    q=0.02,
    gate=4.0,
    include_special=False,
    seq_len=128,
    vectors="pre_wo",
    sentences=None,
):
    """SPEC §1–4 totals with ``select = top:q`` (kept for callers of the first version).

    Returns (heads: dict name -> [layer, head] array, dist_hist [layer, head, seq_len],
    chance: dict, pair_hist [seq_len], anchors: [window, layer, head] token id or -1)."""
    records = reference_windows(
        model,
        input_ids,
        attention_mask,
        tokens,
        gate=gate,
        include_special=include_special,
        seq_len=seq_len,
        vectors=vectors,
        sentences=sentences,
        count=lambda n_pairs: min(n_pairs, math.ceil(q * n_pairs - 1e-9)),
    )
    total = summed(records)
    return (
        total["heads"],
        total["dist_hist"],
        total["chance"],
        total["hists"]["pairs"],
        np.stack([r["anchors"] for r in records]),
    )
