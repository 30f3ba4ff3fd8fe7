"""The built-in measures (service/engine/measure_contract.py): the head statistics, the averaged
similarity matrices, mixing and attribution, the causal effects, the synthetic probe and the
heads' top examples. The registry loads this module by name, as it loads a plugin's
(``DEFAULT_MEASURES``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from headatlas.service.engine.measure_contract import (
    ATTN_PATTERN,
    ATTN_Z,
    EMBED,
    RESID_PRE,
    UNEMBED,
    BatchContext,
    Measure,
)
from headatlas.service.errors import Param, Part, Placeholder

if TYPE_CHECKING:
    import torch

    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.engine.probe import ProbeSpec
    from headatlas.service.engine.windows import Window
    from headatlas.service.params import AnalysisParams


class HeadStatistics(Measure):
    """The per-head statistics of every window (SPEC §3-5): summed as each layer finishes."""

    name = "heads"
    reads = (ATTN_PATTERN, ATTN_Z)
    qualified = False

    @property
    def sums(self) -> tuple[str, ...]:  # type: ignore[override]
        from headatlas.service.engine.results import CHANCE_SUMS, HEAD_SUMS

        return (*HEAD_SUMS, *CHANCE_SUMS)

    def requested(self, params: AnalysisParams) -> bool:
        return True

    def on_layer(self, ctx: BatchContext, layer: int, context: torch.Tensor, attn: torch.Tensor) -> None:
        import torch

        from headatlas.service.engine.pair_selection import head_vectors
        from headatlas.service.engine.stats import head_statistics

        model, params = ctx.model, ctx.params
        # statistics in full precision
        with torch.autocast(model.device.type, enabled=False):
            w_o = model.adapter.output_weight(model.blocks[layer]) if params.vectors == "post_wo" else None
            z = head_vectors(context, model.n_heads, w_o)
            stats = head_statistics(
                z,
                attn,
                ctx.feats,
                select=params.select,
                gate=params.gate,
                seq_len=params.seq_len,
                csm_bin=params.csm_bin,  # the averaged CSM's pairs are summed in the same pass
            )
            if "csm_sum" in stats:
                _keep_csm(ctx, layer, stats.pop("csm_sum"), stats.pop("csm_count"))
            ctx.per_layer.append(stats)

    def collect(self, ctx: BatchContext, count: int) -> None:
        import torch

        from headatlas.service.engine.chance import chance_statistics
        from headatlas.service.engine.results import CHANCE_SUMS, HEAD_SUMS, PAIR_HISTS, sum_dtype

        feats = ctx.feats
        with torch.inference_mode():
            chance = chance_statistics(feats, seq_len=ctx.params.seq_len)
            # per layer [group, ...] -> [group, layer, ...]
            stacked = {key: torch.stack([s[key] for s in ctx.per_layer], dim=1) for key in ctx.per_layer[0]}
            anchor_pos = stacked["anchor_pos"]  # [window, layer, head]
            high_count = stacked["high_count"]
            anchor_token = ctx.input_ids.gather(1, anchor_pos.flatten(1)).view_as(anchor_pos)
            anchored = high_count > 0
            anchor_token = torch.where(anchored, anchor_token, torch.full_like(anchor_token, -1))
            frequent = anchored & (anchor_token == feats.frequent_token[:, None, None])
            stacked["anchor_frequent"] = feats.reduce(frequent.long())
            stacked["anchored_windows"] = feats.reduce(anchored.long())
        ctx.stacked = stacked
        anchor_np = anchor_token.cpu().numpy().astype(np.int64)
        anchor_ids = [int(t) for t in np.unique(anchor_np) if t >= 0]
        for key in HEAD_SUMS:
            ctx.heads[key] = stacked[key].cpu().numpy().astype(sum_dtype(key))
        ctx.run.update({k: chance[k].cpu().numpy().astype(sum_dtype(k)) for k in CHANCE_SUMS})
        ctx.fields.update(
            rep_dist_hist=stacked["dist_hist"].cpu().numpy().astype(np.int64),
            rep_attended_hist=stacked["attended_hist"].cpu().numpy().astype(np.int64),
            rep_pair_hist={k: chance[f"hist.{k}"].cpu().numpy().astype(np.int64) for k in PAIR_HISTS},
            anchor_token=anchor_np,
            anchor_count=stacked["anchor_count"].cpu().numpy().astype(np.int32),
            high_count=high_count.cpu().numpy().astype(np.int32),
            anchor_frequent=frequent.cpu().numpy(),
            vocab=dict(zip(anchor_ids, ctx.model.tokenizer.convert_ids_to_tokens(anchor_ids))),
            rep_same_sentence_hist=stacked["same_sentence_hist"].cpu().numpy().astype(np.int64),
        )


class AveragedCsm(Measure):
    """The corpus-averaged similarity matrices (SPEC §5c), in bins of ``csm_bin`` positions: summed
    by the head statistics' pass (they share its pairs), batch totals ``[kind, layer, head, bin, bin]``
    in ``BatchResult.measures["csm"]`` (``sum``, ``count``, and the ``bin`` they were made with)."""

    name = "csm"
    sums = ("sum", "count")
    reads = (ATTN_PATTERN, ATTN_Z)
    qualified = False

    def requested(self, params: AnalysisParams) -> bool:
        return bool(params.csm_bin)

    def collect(self, ctx: BatchContext, count: int) -> None:
        held = ctx.state.pop(self.name)  # the head statistics' pass filled it layer by layer (_keep_csm)
        ctx.measures[self.name] = {"bin": np.array(ctx.params.csm_bin, dtype=np.int64), **held}


def _keep_csm(ctx: BatchContext, layer: int, sums: torch.Tensor, counts: torch.Tensor) -> None:
    """Layer ``layer``'s averaged-CSM sums and counts ``[kind, head, bin, bin]`` (float64, int64),
    put at once in the batch's payload arrays ``[kind, layer, head, bin, bin]``: float32 sums (a
    batch's share of a picture needs no more, and they are most of its payload) and int32 counts,
    as ``AveragedCsm`` hands them over. Kept per layer in their own precision, and as views of the
    scatter's buffers, 30 layers of 512 × 512 bins (4,096 tokens) held 4.5 GB."""
    held = ctx.state.get(AveragedCsm.name)
    if held is None:
        shape = (sums.shape[0], ctx.model.n_layers, *sums.shape[1:])
        held = ctx.state[AveragedCsm.name] = {"sum": np.zeros(shape, np.float32), "count": np.zeros(shape, np.int32)}
    held["sum"][:, layer] = sums.cpu().numpy().astype(np.float32)
    held["count"][:, layer] = counts.cpu().numpy().astype(np.int32)


class Mixing(Measure):
    """The mixing measures and attribution (SPEC §6), on the run's first ``attribution_windows``
    windows: per method, sums per head and layer, in ``BatchResult.measures["mixing"]`` as
    ``"<method>.<sum>"`` (``results.mixing_key``) beside ``windows`` (how many of the batch's first
    windows it took) and ``rows`` (their valid query rows); absent where it took none."""

    name = "mixing"
    reads = (EMBED, RESID_PRE, ATTN_PATTERN, ATTN_Z)
    qualified = False

    @property
    def sums(self) -> tuple[str, ...]:  # type: ignore[override]
        from headatlas.service.engine.results import MIX_SUMS

        return (*MIX_SUMS, "dist")

    def requested(self, params: AnalysisParams) -> bool:
        return params.mixes

    def quota(self, params: AnalysisParams) -> int | None:
        return params.attribution_windows

    def windows_stored(self, store: Any, run_id: int) -> int | None:
        return store.mixing_windows(run_id)  # counted across resumes, as stored

    def single_first(self, model: LoadedModel, params: AnalysisParams, left: int) -> int:
        if not params.attribution:
            return 0
        from headatlas.service.measures.attribution import vmapped_on

        return 0 if vmapped_on(model) else left

    def has_estimate(self, params: AnalysisParams) -> bool:
        return params.attribution  # the forward-only methods cost a few forward passes

    def estimate(
        self,
        model: LoadedModel,
        params: AnalysisParams,
        windows: list[Window],
        *,
        pad_id: int,
        batch_size: int = 32,
        chunk_size: int = 2048,
    ) -> tuple[Part, ...] | None:
        """``--attribution``'s cost (attribution.py ``estimate``: passes timed on the longest window)."""
        if not params.attribution:
            return None
        from headatlas.service.engine.windows import collate
        from headatlas.service.measures.attribution import duration, estimate

        if not windows:
            return ("attribution: no window left to attribute",)
        longest = max(windows, key=lambda w: len(w.input_ids))
        ids = collate([longest], pad_id).input_ids
        cost = estimate(
            model,
            ids,
            [len(w.input_ids) for w in windows],
            batch_windows=min(batch_size, len(windows)),
            chunk_size=chunk_size,
        )
        count = len(windows)
        left = (
            f"; {params.attribution_windows - count:,} of the run's {params.attribution_windows:,} done"
            if count < params.attribution_windows
            else ""
        )
        return (
            f"{cost.describe()}{left}. Ctrl-C stops it, keeping every finished window (the same command resumes); ",
            Param("attribution_windows", Placeholder("N")),
            f" changes how many windows get it (about {duration(cost.seconds / max(1, len(windows)))} each)",
        )

    def collect(self, ctx: BatchContext, count: int) -> None:
        if not count:
            return
        import torch

        from headatlas.service.engine.features import window_features
        from headatlas.service.engine.results import mixing_key
        from headatlas.service.measures.mixing import mixing_sums

        model, params, batch = ctx.model, ctx.params, ctx.batch
        sub_ids, sub_mask = batch.input_ids[:count], batch.attention_mask[:count]
        with torch.inference_mode():
            sub_feats = window_features(
                sub_ids.to(model.device),
                sub_mask.to(model.device),
                ctx.tokens,
                include_special=params.include_special,
                sentence=None if ctx.sentence is None else ctx.sentence[:count],
                causal=model.causal,
            )
        mixing = mixing_sums(
            model,
            sub_ids,
            sub_mask,
            sub_feats,
            methods=params.mixing,
            attribution=params.attribution,
            seq_len=params.seq_len,
            chunk_size=ctx.attribution_chunk,
        )
        ctx.measures[self.name] = {
            "windows": np.array(count, dtype=np.int64),
            "rows": np.array(int(sub_mask.sum()), dtype=np.int64),
            **{mixing_key(method, k): v for method, sums in mixing.items() for k, v in sums.items()},
        }


class Effects(Measure):
    """The causal effects (SPEC §9) on ``effect_windows`` windows of the run, spread over its
    replicate groups (``effect_spread``; runs stored before: its first): per head, the change of
    the objective when the head is ablated (zero, mean) and gradient importance."""

    name = "effects"
    reads = (EMBED, RESID_PRE, ATTN_Z, UNEMBED)
    edits = (ATTN_Z,)
    qualified = False

    @property
    def sums(self) -> tuple[str, ...]:  # type: ignore[override]
        from headatlas.service.metrics import EFFECT_SUM_NAMES

        return tuple(EFFECT_SUM_NAMES)

    def requested(self, params: AnalysisParams) -> bool:
        return bool(params.effects)

    def quota(self, params: AnalysisParams) -> int | None:
        return params.effect_windows

    def spreads(self, params: AnalysisParams) -> bool:
        return params.effect_spread == "groups"

    def single_first(self, model: LoadedModel, params: AnalysisParams, left: int) -> int:
        return left if model.device.type == "cpu" else 0  # each stored as soon as it is done

    def check(self, model: LoadedModel, params: AnalysisParams) -> None:
        from headatlas.service.measures.effect_batch import check_effects

        check_effects(model, params)

    def check_spec(self, spec: str, params: AnalysisParams) -> None:
        from headatlas.service.measures.effect_batch import check_effects_spec

        check_effects_spec(spec, params)

    def has_estimate(self, params: AnalysisParams) -> bool:
        return True

    def estimate(
        self,
        model: LoadedModel,
        params: AnalysisParams,
        windows: list[Window],
        *,
        pad_id: int,
        batch_size: int = 32,
        chunk_size: int = 2048,
    ) -> tuple[Part, ...] | None:
        """``--effects``' cost (``effect_batch.estimate``: passes timed on the longest window)."""
        from headatlas.service.engine.effect_spread import groups_held
        from headatlas.service.measures.attribution import duration
        from headatlas.service.measures.effect_batch import estimate

        if not windows:
            return ("effects: no window left to measure",)
        cost = estimate(model, params, windows, len(windows), pad_id)
        return (
            f"{cost.describe()}; {groups_held(params.replicates, windows)}. Ctrl-C stops it, keeping every finished window "
            "(the same command resumes); ",
            Param("effect_windows", Placeholder("N")),
            f" changes how many windows get them (about {duration(cost.per_window)} each)",
        )

    def collect(self, ctx: BatchContext, count: int) -> None:
        from headatlas.service.engine.windows import collate
        from headatlas.service.measures.effect_batch import effect_sums

        taken = ctx.taken[self.name]  # its windows of the batch: spread over the groups, not its first
        heads, run, meta = effect_sums(
            ctx.model,
            collate([ctx.batch.windows[i] for i in taken], ctx.tokens.pad_id) if len(taken) else ctx.batch,
            ctx.params,
            count=len(taken),
            group=ctx.group[taken],
            n_groups=ctx.n_groups,
            means=ctx.effect_means,
            pad_id=ctx.tokens.pad_id,
        )
        ctx.heads.update(heads)
        if meta:
            ctx.run.update(run)
        ctx.fields["effects"] = meta


class Probe(Measure):
    """The synthetic probe (SPEC §8): every head scored on repeated random tokens, once per run,
    on no window of the corpus (``run_once``)."""

    name = "probe"
    reads = (ATTN_PATTERN,)
    per_batch = False
    qualified = False

    @property
    def sums(self) -> tuple[str, ...]:  # type: ignore[override]
        from headatlas.service.engine.probe import SCORES

        return SCORES

    def run_once(self, model: LoadedModel, spec: ProbeSpec) -> dict[str, np.ndarray]:
        """The scores by name, ``[layer, head]``."""
        from headatlas.service.engine.probe import run_probe

        return {name: v.numpy() for name, v in run_probe(model, spec).items()}


class HeadExamples(Measure):
    """Each head's top examples (service/measures/examples.py): per kind (anchor, pair, attention)
    the ``examples`` windows where it is strongest, with the positions of the tokens. Read from the
    head statistics' pass as each layer finishes (the anchors and the top pair of H) and from the
    layer's attention map; a batch's reservoir travels in ``BatchResult.measures["examples"]``
    (its arrays, the example windows' token ids and their text), and the store keeps the top k of
    the batches' tops (not a sum: ``Reservoir.merge``)."""

    name = "examples"
    sums = ("score", "value", "window", "pos_i", "pos_j")  # the reservoir's arrays, [kind, layer, head, k]
    reads = (ATTN_PATTERN, ATTN_Z)
    qualified = False

    def requested(self, params: AnalysisParams) -> bool:
        return params.examples > 0

    def on_layer(self, ctx: BatchContext, layer: int, context: torch.Tensor, attn: torch.Tensor) -> None:
        import torch

        from headatlas.service.measures.examples import attention_buffer, attention_weight, layer_candidates

        # the head statistics measure ran first on this layer (the registry's order)
        whole = attn if isinstance(attn, torch.Tensor) else None  # row blocks: no whole map to search
        weight = buffer = None
        if whole is not None:  # the weights made once per batch, one buffer for every layer's products
            # (a batch of long windows, whose attention comes in row blocks, makes neither: each is
            # as large as one head's map of the batch)
            weight = ctx.state.get(f"{self.name}.weight")
            if weight is None:
                weight = ctx.state[f"{self.name}.weight"] = attention_weight(ctx.feats)
            buffer = ctx.state.get(f"{self.name}.buffer")
            if buffer is None or buffer.shape[1:] != whole.shape[1:] or buffer.dtype != whole.dtype:
                buffer = ctx.state[f"{self.name}.buffer"] = attention_buffer(whole)
        ctx.state.setdefault(self.name, []).append(
            layer_candidates(ctx.per_layer[-1], whole, ctx.feats, weight, buffer)
        )

    def collect(self, ctx: BatchContext, count: int) -> None:
        import torch

        from headatlas.service.measures.examples import KINDS, Reservoir, text_array

        layers = ctx.state.get(self.name) or []
        if not layers:
            return

        def stacked(kind: str, field: int) -> np.ndarray:  # [window, layer, head]
            parts = []
            for found in layers:
                if kind in found:
                    parts.append(found[kind][field])
                else:  # no candidate of this kind in the layer
                    like = found["anchor"][field]
                    parts.append(torch.full_like(like, float("-inf") if field == 0 else -1))
            return torch.stack(parts, dim=1).cpu().numpy()

        arrays = [np.stack([stacked(kind, field) for kind in KINDS]) for field in range(4)]
        window_ids = ctx.batch.window_ids
        reservoir = Reservoir.of_windows(ctx.params.examples, window_ids, *arrays)
        where = {w: i for i, w in enumerate(window_ids)}
        shown = np.array([where[w] for w in reservoir.window_ids()], dtype=np.int64)
        ids = ctx.batch.input_ids[shown].numpy().astype(np.int32)
        ids[~ctx.batch.attention_mask[shown].numpy().astype(bool)] = -1
        vocab = np.unique(ids[ids >= 0])
        texts = ctx.model.tokenizer.convert_ids_to_tokens(vocab.tolist())
        ctx.measures[self.name] = {
            **reservoir.payload(window_ids),
            "token_windows": shown,  # the example windows, by index into the batch
            "tokens": ids,  # [example window, pos] their token ids, -1 past the window
            "vocab_ids": vocab,
            "vocab_text": text_array([t or "" for t in texts]),  # their text, a JSON list as UTF-8 bytes
        }
