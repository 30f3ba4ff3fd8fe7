"""The rows a batch result adds to each statistics table, as Arrow tables (the mixing tables'
rows are mixing_rows.py's). Kept apart from ingest.py, which only registers and inserts them in
the batch's own transaction."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from headatlas.service.engine.results import CSM_KINDS, PAIR_HISTS, BatchResult
from headatlas.service.metrics import CHANCE_SUMS, HEAD_SUMS  # every declared sum, the effects' included
from headatlas.service.storage.arrow_rows import TableRows


def batch_tables(run_id: int, items: list[tuple[int, BatchResult]]) -> dict[str, pa.Table]:
    """The rows of every statistics table (and windows, documents, the ledger's ``batches``) for
    ``items`` ([(batch_id, BatchResult)]) of run ``run_id``, one Arrow table per table."""
    rows = TableRows()
    add = rows.add

    # a column left out of an insert is NULL ("unavailable"): a payload made before the per-distance
    # within-sentence counts existed must not make the others' sum look whole
    with_sentence = all(res.rep_same_sentence_hist is not None for _, res in items)
    # the declared sums (service.metrics) that every payload carries; one made before a sum
    # existed leaves its column NULL for the whole insert
    head_sums = [k for k in HEAD_SUMS if all(k in res.rep_heads for _, res in items)]
    run_sums = [k for k in CHANCE_SUMS if all(k in res.rep_chance for _, res in items)]
    for batch_id, res in items:
        # every additive sum is stored per replicate group (column rep, SPEC §5b)
        n_groups, n_layers, n_heads = res.rep_heads["high_pairs"].shape
        group, layer, head = np.meshgrid(np.arange(n_groups), np.arange(n_layers), np.arange(n_heads), indexing="ij")
        add(
            "head_stats",
            run_id=np.full(layer.size, run_id),
            batch_id=np.full(layer.size, batch_id),
            rep=res.reps[group],
            layer=layer,
            head=head,
            **{k: res.rep_heads[k] for k in head_sums},
        )
        add(
            "run_chance",
            run_id=np.full(n_groups, run_id),
            batch_id=np.full(n_groups, batch_id),
            rep=res.reps,
            **{k: res.rep_chance[k] for k in run_sums},
            csm_windows=res.rep_chance["windows"] * (res.csm_sum is not None),
        )
        gi, li, hi, di = np.nonzero(res.rep_dist_hist)
        same = res.rep_same_sentence_hist  # not None in any item when with_sentence
        sentence = {"same_sentence": same[gi, li, hi, di]} if with_sentence and same is not None else {}
        add(
            "dist_hist",
            run_id=np.full(li.size, run_id),
            batch_id=np.full(li.size, batch_id),
            rep=res.reps[gi],
            layer=li,
            head=hi,
            distance=di,
            count=res.rep_dist_hist[gi, li, hi, di],
            attended=res.rep_attended_hist[gi, li, hi, di],
            **sentence,
        )
        if res.csm_sum is not None:
            assert res.csm_count is not None  # a batch has both sums and counts, or neither
            # cells holding pairs only: the upper triangle, and few cells of H per batch
            ki, lc, hc, bi, bj = np.nonzero(res.csm_count)
            add(
                "csm_bins",
                run_id=np.full(ki.size, run_id),
                batch_id=np.full(ki.size, batch_id),
                layer=lc,
                head=hc,
                kind=np.array(CSM_KINDS, dtype=object)[ki],
                bin_i=bi,
                bin_j=bj,
                sim_sum=res.csm_sum[ki, lc, hc, bi, bj].astype(np.float64),
                pairs=res.csm_count[ki, lc, hc, bi, bj].astype(np.int64),
            )
        gp, dp = np.nonzero(res.rep_pair_hist["pairs"])
        add(
            "pair_hist",
            run_id=np.full(dp.size, run_id),
            batch_id=np.full(dp.size, batch_id),
            rep=res.reps[gp],
            distance=dp,
            count=res.rep_pair_hist["pairs"][gp, dp],
            **{k: res.rep_pair_hist[k][gp, dp] for k in PAIR_HISTS if k != "pairs"},
        )
        wi, la, he = np.nonzero(res.anchor_token >= 0)
        token_ids = res.anchor_token[wi, la, he]
        high = res.high_count[wi, la, he]
        count = res.anchor_count[wi, la, he]
        window_ids = np.array(res.window_ids, dtype=object)
        add(
            "anchors",
            run_id=np.full(wi.size, run_id),
            window_id=window_ids[wi],
            layer=la,
            head=he,
            token_id=token_ids,
            token=token_texts(token_ids, res.vocab),
            endpoint_count=count,
            high_pairs=high,
            anchor_share=count / np.maximum(2 * high, 1),
            anchor_is_frequent=res.anchor_frequent[wi, la, he],
        )
        n_layers = res.anchor_token.shape[1]
        share = count / np.maximum(2 * high, 1)
        tok_layer, tok_head, tok_id, tok_windows, tok_share = anchor_token_sums(res.anchor_token, la, he, wi, share)
        add(
            "anchor_tokens",
            run_id=np.full(tok_id.size, run_id),
            batch_id=np.full(tok_id.size, batch_id),
            layer=tok_layer,
            head=tok_head,
            token_id=tok_id,
            token=token_texts(tok_id, res.vocab),
            windows=tok_windows,
            share_sum=tok_share,
        )
        lay_windows, lay_distinct, lay_anchors, lay_heads = anchor_layer_sums(res.anchor_token)
        add(
            "anchor_layers",
            run_id=np.full(n_layers, run_id),
            batch_id=np.full(n_layers, batch_id),
            layer=np.arange(n_layers),
            windows=lay_windows,
            distinct_windows=lay_distinct,
            distinct_anchor_sum=lay_anchors,
            anchored_head_sum=lay_heads,
        )
        add(
            "run_windows",
            run_id=np.full(len(res.window_ids), run_id),
            window_id=window_ids,
            batch_id=np.full(len(res.window_ids), batch_id),
        )
        add("batches", run_id=[run_id], batch_id=[batch_id], n_windows=[len(res.window_ids)], compute_s=[res.compute_s])
        add(
            "windows",
            window_id=[w["window_id"] for w in res.windows],
            doc_id=[w["doc_id"] for w in res.windows],
            window_index=[w["window_index"] for w in res.windows],
            n_tokens=[w["n_tokens"] for w in res.windows],
        )
        docs = res.documents
        add(
            "documents",
            doc_id=[d["doc_id"] for d in docs],
            source=[d["source"] for d in docs],
            line=[d["line"] for d in docs],
            n_chars=[d["n_chars"] for d in docs],
            preview=[d["preview"] for d in docs],
        )
    return rows.tables()


def token_texts(token_ids: np.ndarray, vocab: dict[int, str]) -> np.ndarray:
    """The text of each token id (the id itself where ``vocab`` lacks it), looked up once per
    distinct id: a batch's anchors name a few hundred tokens tens of thousands of times."""
    distinct, where = np.unique(token_ids, return_inverse=True)
    texts = np.array([vocab.get(int(t), str(t)) for t in distinct], dtype=object)
    return texts[where.ravel()] if len(distinct) else np.array([], dtype=object)


def anchor_token_sums(anchor_token: np.ndarray, layer, head, window, share):
    """Per (layer, head, token): windows where it is the anchor, and the sum of anchor_share.

    anchor_token: ``[window, layer, head]``; layer/head/window/share: the anchored entries.
    """
    n_heads = anchor_token.shape[2]
    token = anchor_token[window, layer, head]
    key = (layer.astype(np.int64) * n_heads + head) * (int(token.max(initial=0)) + 1) + token
    uniq, inverse = np.unique(key, return_inverse=True)
    windows = np.bincount(inverse, minlength=uniq.size)
    share_sum = np.bincount(inverse, weights=share, minlength=uniq.size)
    vocab = int(token.max(initial=0)) + 1
    return (uniq // vocab) // n_heads, (uniq // vocab) % n_heads, uniq % vocab, windows, share_sum


def anchor_layer_sums(anchor_token: np.ndarray):
    """Per layer: windows with an anchored head, windows whose anchored heads all differ,
    and the sums of distinct anchors and of anchored heads (for the mean distinct ratio)."""
    ordered = np.sort(anchor_token, axis=2)  # [window, layer, head], -1 (no anchor) first
    anchored = ordered >= 0
    repeat = (ordered[..., 1:] == ordered[..., :-1]) & anchored[..., 1:]
    n_anchored = anchored.sum(2)
    n_distinct = n_anchored - repeat.sum(2)
    has = n_anchored > 0
    return (has.sum(0), (has & (n_distinct == n_anchored)).sum(0), n_distinct.sum(0), n_anchored.sum(0))
