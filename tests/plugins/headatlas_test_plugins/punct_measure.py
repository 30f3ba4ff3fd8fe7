"""The measure that computes ``both_punct``'s sum (punct.py): per head, the pairs of the
high-similarity set H whose two tokens are both punctuation ('.' and ','). It selects H as the head
statistics do (the same functions on the same head outputs, so the same pairs) and counts those
pairs per replicate group; headatlas stores the sum as ``"punct_pairs.both_punct"``. Run when a
request names it (``--measures punct_pairs``); a module of its own, so that the metric's module
(read by every query) imports no tensor library."""

import numpy as np

from headatlas.service.engine.measure_contract import ATTN_Z, Measure


class PunctPairs(Measure):
    name = "punct_pairs"
    sums = ("both_punct",)
    reads = (ATTN_Z,)

    def on_layer(self, ctx, layer, context, attn):
        import torch

        from headatlas.service.engine import pair_selection

        model, params, feats = ctx.model, ctx.params, ctx.feats
        with torch.autocast(model.device.type, enabled=False):
            w_o = model.adapter.output_weight(model.blocks[layer]) if params.vectors == "post_wo" else None
            z = pair_selection.head_vectors(context, model.n_heads, w_o).float()  # [batch, head, pos, d_head]
            batch, heads, n_pos, _ = z.shape
            rows = pair_selection.similarity_chunk_rows(batch, heads, n_pos)
            if rows >= n_pos:
                selected = pair_selection.select_pairs(pair_selection.masked_similarity(z, feats), feats, params.select)
            else:
                selected = pair_selection.select_pairs_chunked(z, feats, params.select, rows=rows)
            _, index, chosen = pair_selection.rerank_unresolved(z, feats, params.select, *selected)  # [batch, head, k]
        punct_ids = torch.tensor(sorted(ctx.tokens.punct_ids), device=feats.input_ids.device)
        punct = torch.isin(feats.input_ids, punct_ids)  # [batch, pos]
        first = punct.gather(1, (index // n_pos).flatten(1)).view_as(index)
        second = punct.gather(1, (index % n_pos).flatten(1)).view_as(index)
        both = (first & second & chosen).long().sum(2)  # [batch, head]
        ctx.state.setdefault(self.name, []).append(feats.reduce(both))  # [group, head]

    def collect(self, ctx, count):
        import torch

        per_layer = ctx.state.pop(self.name)
        return {"both_punct": torch.stack(per_layer, 1).cpu().numpy().astype(np.int64)}  # [group, layer, head]
