"""The rows a group of batch results adds to each statistics table, as Arrow tables (the mixing
tables' rows are mixing_rows.py's). Kept apart from ingest.py, which only registers and inserts
them in the group's one transaction.

Every statistics table but ``anchors`` holds additive sums (compact.py), so the batches stored in
one transaction are summed here, per replicate group and key, into one row set: a group of 32
MiniLM batches adds about 60,000 rows instead of 1,000,000, and the views read the same sums
(compaction folds them the same way). Those rows carry the group's first ``batch_id``; which
batches and windows a run has stored is the ledger's (``batches``) and ``run_windows``' (one row
per window, with its own batch), which stay per batch and per window, as ``anchors`` does.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from headatlas.service.engine.results import CSM_KINDS, PAIR_HISTS, BatchResult
from headatlas.service.metrics import CHANCE_SUMS, HEAD_SUMS  # every declared sum, the effects' included
from headatlas.service.storage import named_sums


def batch_tables(run_id: int, items: list[tuple[int, BatchResult]]) -> dict[str, pa.Table | pa.RecordBatchReader]:
    """The rows of every statistics table (and windows, documents, the ledger's ``batches``) for
    ``items`` ([(batch_id, BatchResult)], one run's, stored in one transaction) of run
    ``run_id``, one Arrow table per table (``csm_bins``: a stream of record batches, read once):
    the sums of all the items, per key."""
    if not items:
        return {}
    results = [res for _, res in items]
    label = min(b for b, _ in items)  # the batch_id of the summed rows
    # a column left out of an insert is NULL ("unavailable"): a payload made before the per-distance
    # within-sentence counts existed must not make the others' sum look whole
    with_sentence = all(res.rep_same_sentence_hist is not None for res in results)
    # the declared sums (service.metrics) that every payload carries; one made before a sum
    # existed leaves its column NULL for the whole insert
    head_sums = [k for k in HEAD_SUMS if all(k in res.rep_heads for res in results)]
    run_sums = [k for k in CHANCE_SUMS if all(k in res.rep_chance for res in results)]
    # every additive sum is stored per replicate group (column rep, SPEC §5b)
    reps = np.unique(np.concatenate([np.asarray(res.reps) for res in results]))
    where = [np.searchsorted(reps, res.reps) for res in results]  # each batch's groups among reps
    n_reps = reps.size
    n_layers, n_heads = results[0].rep_heads["high_pairs"].shape[1:]
    tables: dict[str, pa.Table | pa.RecordBatchReader] = {}

    def full(n: int, value) -> np.ndarray:
        return np.full(n, value, dtype=np.int64)

    # --- per head: head_stats, run_chance ---
    rep, layer, head = (a.ravel() for a in np.indices((n_reps, n_layers, n_heads)))
    tables["head_stats"] = pa.table(
        {
            "run_id": full(rep.size, run_id),
            "batch_id": full(rep.size, label),
            "rep": reps[rep],
            "layer": layer,
            "head": head,
            **{
                k: _summed(results, where, (n_reps, n_layers, n_heads), lambda r, k=k: r.rep_heads[k]).ravel()
                for k in head_sums
            },
        }
    )
    # the head sums that are no column of head_stats (a plugin measure's "<measure>.<sum>"): by name
    by_name = named_sums.named_rows(
        run_id,
        label,
        reps,
        (n_reps, n_layers, n_heads),
        results,
        lambda k: _summed(results, where, (n_reps, n_layers, n_heads), lambda r: r.rep_heads[k]),
    )
    if by_name is not None:
        tables[named_sums.TABLE] = by_name
    chance = {k: _summed(results, where, (n_reps,), lambda r, k=k: r.rep_chance[k]) for k in run_sums}
    tables["run_chance"] = pa.table(
        {
            "run_id": full(n_reps, run_id),
            "batch_id": full(n_reps, label),
            "rep": reps,
            **chance,
            "csm_windows": _summed(
                results, where, (n_reps,), lambda r: np.asarray(r.rep_chance["windows"]) * ("csm" in r.measures)
            ),
        }
    )

    # --- per distance: dist_hist, pair_hist (cells with pairs; the other sums of a batch's empty
    # cells were never stored, and are left out of the sums here alike) ---
    n_dist = max(res.rep_dist_hist.shape[-1] for res in results)
    shape = (n_reps, n_layers, n_heads, n_dist)
    count = _summed(results, where, shape, lambda r: r.rep_dist_hist)
    attended = _summed(results, where, shape, lambda r: r.rep_attended_hist, within=lambda r: r.rep_dist_hist)
    cells = np.nonzero(count)
    sentence = {}
    if with_sentence:
        same = _summed(results, where, shape, lambda r: r.rep_same_sentence_hist, within=lambda r: r.rep_dist_hist)
        sentence = {"same_sentence": same[cells]}
    gi, li, hi, di = cells
    tables["dist_hist"] = pa.table(
        {
            "run_id": full(li.size, run_id),
            "batch_id": full(li.size, label),
            "rep": reps[gi],
            "layer": li,
            "head": hi,
            "distance": di,
            "count": count[cells],
            "attended": attended[cells],
            **sentence,
        }
    )
    n_pair = max(res.rep_pair_hist["pairs"].shape[-1] for res in results)
    pairs = {
        k: _summed(
            results,
            where,
            (n_reps, n_pair),
            lambda r, k=k: r.rep_pair_hist[k],
            within=lambda r: r.rep_pair_hist["pairs"],
        )
        for k in PAIR_HISTS
    }
    gp, dp = np.nonzero(pairs["pairs"])
    tables["pair_hist"] = pa.table(
        {
            "run_id": full(dp.size, run_id),
            "batch_id": full(dp.size, label),
            "rep": reps[gp],
            "distance": dp,
            "count": pairs["pairs"][gp, dp],
            **{k: pairs[k][gp, dp] for k in PAIR_HISTS if k != "pairs"},
        }
    )

    # --- the averaged similarity matrices: cells holding pairs (the upper triangle, few cells of H) ---
    with_csm = [res.measures["csm"] for res in results if "csm" in res.measures]
    if with_csm:
        tables["csm_bins"] = csm_rows(run_id, label, with_csm, n_layers, n_heads)

    # --- anchors: one row per anchored (window, head); their sums per token and per layer ---
    vocab: dict[int, str] = {}
    for res in results:
        vocab.update(res.vocab)
    anchor_token = np.concatenate([res.anchor_token for res in results])
    anchor_count = np.concatenate([res.anchor_count for res in results])
    high_count = np.concatenate([res.high_count for res in results])
    anchor_frequent = np.concatenate([res.anchor_frequent for res in results])
    window_ids = np.array([w for res in results for w in res.window_ids], dtype=object)
    wi, la, he = np.nonzero(anchor_token >= 0)
    token_ids = anchor_token[wi, la, he]
    high = high_count[wi, la, he]
    endpoint = anchor_count[wi, la, he]
    share = endpoint / np.maximum(2 * high, 1)
    tables["anchors"] = pa.table(
        {
            "run_id": full(wi.size, run_id),
            "window_id": _strings(window_ids, wi),
            "layer": la,
            "head": he,
            "token_id": token_ids,
            "token": token_column(token_ids, vocab),
            "endpoint_count": endpoint,
            "high_pairs": high,
            "anchor_share": share,
            "anchor_is_frequent": anchor_frequent[wi, la, he],
        }
    )
    tok_layer, tok_head, tok_id, tok_windows, tok_share = anchor_token_sums(anchor_token, la, he, wi, share)
    tables["anchor_tokens"] = pa.table(
        {
            "run_id": full(tok_id.size, run_id),
            "batch_id": full(tok_id.size, label),
            "layer": tok_layer,
            "head": tok_head,
            "token_id": tok_id,
            "token": token_column(tok_id, vocab),
            "windows": tok_windows,
            "share_sum": tok_share,
        }
    )
    lay_windows, lay_distinct, lay_anchors, lay_heads = anchor_layer_sums(anchor_token)
    tables["anchor_layers"] = pa.table(
        {
            "run_id": full(n_layers, run_id),
            "batch_id": full(n_layers, label),
            "layer": np.arange(n_layers),
            "windows": lay_windows,
            "distinct_windows": lay_distinct,
            "distinct_anchor_sum": lay_anchors,
            "anchored_head_sum": lay_heads,
        }
    )

    # --- per window and per batch: what the run has stored (resuming it), windows, documents ---
    tables["run_windows"] = pa.table(
        {
            "run_id": full(window_ids.size, run_id),
            "window_id": pa.array(window_ids.tolist(), type=pa.string()),
            "batch_id": np.concatenate([full(len(res.window_ids), b) for b, res in items]),
        }
    )
    tables["batches"] = pa.table(
        {
            "run_id": full(len(items), run_id),
            "batch_id": np.array([b for b, _ in items], dtype=np.int64),
            "n_windows": np.array([len(res.window_ids) for res in results], dtype=np.int64),
            "compute_s": np.array([res.compute_s for res in results], dtype=np.float64),
        }
    )
    windows = [w for res in results for w in res.windows]
    tables["windows"] = pa.table(
        {
            "window_id": pa.array([w["window_id"] for w in windows], type=pa.string()),
            "doc_id": pa.array([w["doc_id"] for w in windows], type=pa.string()),
            "window_index": np.array([w["window_index"] for w in windows], dtype=np.int64),
            "n_tokens": np.array([w["n_tokens"] for w in windows], dtype=np.int64),
        }
    )
    docs = [d for res in results for d in res.documents]
    tables["documents"] = pa.table(
        {
            "doc_id": pa.array([d["doc_id"] for d in docs], type=pa.string()),
            "source": pa.array([d["source"] for d in docs], type=pa.string()),
            "line": np.array([d["line"] for d in docs], dtype=np.int64),
            "n_chars": np.array([d["n_chars"] for d in docs], dtype=np.int64),
            "preview": pa.array([d["preview"] for d in docs], type=pa.string()),
        }
    )
    return tables


def _summed(results, where, shape, value, within=None) -> np.ndarray:
    """The sum over ``results`` of ``value(res)`` (``[group, …]``), each batch's groups added at
    their place among the group's replicate groups (``where``) and its trailing axes at the start
    of ``shape``'s (a shorter batch's histogram fills the first distances). ``within``: a batch's
    cells where it is zero are left out (they were never stored)."""
    arrays = [np.asarray(value(res)) for res in results]
    kind = np.result_type(*arrays).kind
    acc = np.zeros(shape, dtype=np.float64 if kind in "fc" else np.int64)
    for res, at, arr in zip(results, where, arrays):
        if within is not None:
            arr = np.where(np.asarray(within(res)) != 0, arr, 0)
        place = (at,) + tuple(slice(0, n) for n in arr.shape[1:])
        acc[place] += arr
    return acc


def _strings(values: np.ndarray, index: np.ndarray) -> pa.Array:
    """``values[index]`` (strings) as a dictionary-encoded Arrow column: each string converted once."""
    return pa.DictionaryArray.from_arrays(pa.array(index.astype(np.int32)), pa.array(values.tolist(), type=pa.string()))


def token_column(token_ids: np.ndarray, vocab: dict[int, str]) -> pa.Array:
    """The text of each token id (the id itself where ``vocab`` lacks it), as a dictionary-encoded
    Arrow column: a group's anchors name a few hundred tokens tens of thousands of times, each
    looked up and converted once."""
    distinct, where = distinct_ids(token_ids)
    texts = pa.array([vocab.get(int(t), str(t)) for t in distinct], type=pa.string())
    return pa.DictionaryArray.from_arrays(pa.array(where.astype(np.int32)), texts)


def distinct_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` for non-negative integer ids (token ids), in
    linear time: a group's anchors hold hundreds of thousands of ids of a vocabulary's range."""
    ids = np.asarray(ids).ravel()
    if ids.size == 0:
        return ids.astype(np.int64), np.zeros(0, dtype=np.int64)
    seen = np.zeros(int(ids.max()) + 1, dtype=bool)
    seen[ids] = True
    return np.flatnonzero(seen), (np.cumsum(seen) - 1)[ids]


def anchor_token_sums(anchor_token: np.ndarray, layer, head, window, share):
    """Per (layer, head, token): windows where it is the anchor, and the sum of anchor_share.

    anchor_token: ``[window, layer, head]``; layer/head/window/share: the anchored entries.
    """
    n_layers, n_heads = anchor_token.shape[1:]
    tokens, token = distinct_ids(anchor_token[window, layer, head])
    n_tokens = max(tokens.size, 1)
    key = (layer.astype(np.int64) * n_heads + head) * n_tokens + token
    cells = n_layers * n_heads * n_tokens
    windows = np.bincount(key, minlength=cells)
    share_sum = np.bincount(key, weights=share, minlength=cells)
    uniq = np.flatnonzero(windows)  # the (layer, head, token) cells with an anchor, in that order
    cell = uniq // n_tokens
    return cell // n_heads, cell % n_heads, tokens[uniq % n_tokens], windows[uniq], share_sum[uniq]


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


CSM_ROWS_PER_BATCH = 1 << 20  # rows of csm_bins per Arrow record batch (about 70 MB)
CSM_SCHEMA = pa.schema(
    [
        ("run_id", pa.int64()),
        ("batch_id", pa.int64()),
        ("layer", pa.int64()),
        ("head", pa.int64()),
        ("kind", pa.dictionary(pa.int32(), pa.string())),
        ("bin_i", pa.int64()),
        ("bin_j", pa.int64()),
        ("sim_sum", pa.float64()),
        ("pairs", pa.int64()),
    ]
)


def csm_rows(
    run_id: int, label: int, with_csm: list[dict[str, np.ndarray]], n_layers: int, n_heads: int
) -> pa.RecordBatchReader:
    """The ``csm_bins`` rows of the batches' averaged similarity matrices (``measures["csm"]``:
    ``sum``, ``count`` ``[kind, layer, head, bin, bin]``): one per (kind, layer, head, bin_i,
    bin_j) cell holding pairs, its pairs and sum over the batches (float64), in that order. Made
    one (kind, layer) at a time and handed over in record batches of ``CSM_ROWS_PER_BATCH`` rows,
    read as DuckDB inserts them: a 4,096-token window of SmolLM2 (512 × 512 bins, 30 layers of 9
    heads) has some 43 million such cells, and its dense float64 sums and counts with their
    indexes and columns had taken over 10 GB."""
    n_bins = max(csm["count"].shape[-1] for csm in with_csm)
    kinds = pa.array(CSM_KINDS)

    def batches():
        for kind in range(len(CSM_KINDS)):
            for layer in range(n_layers):
                pairs = np.zeros((n_heads, n_bins, n_bins), dtype=np.int64)
                sums = np.zeros((n_heads, n_bins, n_bins), dtype=np.float64)
                for csm in with_csm:
                    count = csm["count"]
                    if kind >= count.shape[0] or layer >= count.shape[1]:
                        continue
                    c = count[kind, layer]
                    part = tuple(slice(0, n) for n in c.shape)
                    pairs[part] += c
                    sums[part] += np.where(c != 0, csm["sum"][kind, layer].astype(np.float64), 0.0)
                hc, bi, bj = np.nonzero(pairs)
                for start in range(0, hc.size, CSM_ROWS_PER_BATCH):
                    h, i, j = (a[start : start + CSM_ROWS_PER_BATCH] for a in (hc, bi, bj))
                    yield pa.record_batch(
                        [
                            np.full(h.size, run_id, dtype=np.int64),
                            np.full(h.size, label, dtype=np.int64),
                            np.full(h.size, layer, dtype=np.int64),
                            h,
                            pa.DictionaryArray.from_arrays(pa.array(np.full(h.size, kind, dtype=np.int32)), kinds),
                            i,
                            j,
                            sums[h, i, j],
                            pairs[h, i, j],
                        ],
                        schema=CSM_SCHEMA,
                    )

    return pa.RecordBatchReader.from_batches(CSM_SCHEMA, batches())
