"""One text through the model, every head's matrices kept: for looking at, never stored.

``read_text`` gives the first window's tensors as numpy arrays (``InspectedText``: token ids,
attention, z before W_O, and the context similarity matrix of any head; what
``headatlas.inspect`` returns). ``inspect_text`` adds what the figures of ``headatlas inspect``
draw from it: the context similarity matrix ``C = z zᵀ`` with ``C_ii = 0`` of each head (SPEC §2),
the high-similarity set H that the stored statistics count (SPEC §3), and the sentence ids of the
tokens (SPEC §1, or §5b with the segmenter). Built from the same pieces as ``analyze_batch``
(windows, forward with hooks, head_vectors, window_features, select_pairs), so what is drawn is
what is counted.

Pure computation: imports neither matplotlib, Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import numpy as np
import torch

from headatlas.service.engine.analysis import batch_sentences, forward
from headatlas.service.engine.corpus import Document, document_id
from headatlas.service.engine.features import window_features
from headatlas.service.engine.hooks import act_name
from headatlas.service.engine.model import LoadedModel
from headatlas.service.engine.pair_selection import head_vectors, select_pairs
from headatlas.service.engine.windows import Batch, TokenClasses, Window, collate, document_windows
from headatlas.service.errors import CorpusError, ParameterError, Phrase
from headatlas.service.params import AnalysisParams


@dataclass(frozen=True, eq=False, repr=False)
class InspectedText:
    """The first window of a text through a model, every head's tensors kept (as TransformerLens's
    ``run_with_cache`` keeps them). n = the window's tokens, specials included ([CLS]/[SEP] for
    an encoder, BOS for a decoder); layers and heads are 0-based.

    attention: ``[layer, head, query, key]`` float32, the model's own probabilities (rows sum to
    1; lower-triangular when ``causal``). z: ``[layer, head, pos, d_head]`` float32, each head's
    output ``z_i = Σ_j A_ij v_j`` before W_O (a grouped-query head reads its key-value group's v).
    ``csm(layer, head)``: ``[n, n]``, ``C = z zᵀ`` with ``C_ii = 0`` (SPEC §2).
    """

    model: str  # the model's resolved name
    causal: bool  # decoder (causal) attention
    token_ids: list[int]
    tokens: list[str]  # as the tokenizer spells them
    attention: np.ndarray  # float32 [layer, head, query, key]
    z: np.ndarray  # float32 [layer, head, pos, d_head]
    n_kv_heads: int  # key-value heads (grouped-query attention; = n_heads without it)
    truncated: bool  # the text had more tokens than one window holds

    @property
    def n_layers(self) -> int:
        """Layers of the model."""
        return self.z.shape[0]

    @property
    def n_heads(self) -> int:
        """Attention heads per layer."""
        return self.z.shape[1]

    @property
    def d_head(self) -> int:
        """Size of a head's output z."""
        return self.z.shape[3]

    def csm(self, layer: int, head: int) -> np.ndarray:
        """The context similarity matrix of one head, ``[n, n]`` float32: ``C_ij = z_i · z_j``,
        ``C_ii = 0``; exactly symmetric."""
        if not 0 <= layer < self.n_layers:
            raise ParameterError(f"layer {layer}: the model has layers 0..{self.n_layers - 1} (0-based)")
        if not 0 <= head < self.n_heads:
            raise ParameterError(f"head {head}: the model has heads 0..{self.n_heads - 1} (0-based)")
        z = self.z[layer, head]
        upper = np.triu(z @ z.T, k=1)  # each product once, mirrored: symmetric to the bit
        return upper + upper.T

    def context(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s z as the attention module hands it to W_O: ``[1, pos, head·d_head]``."""
        z = torch.from_numpy(self.z[layer])  # [head, pos, d_head]
        return z.transpose(0, 1).reshape(1, z.shape[1], -1)

    def __repr__(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        cut = ", truncated" if self.truncated else ""
        return (
            f"InspectedText(model={self.model!r}, {len(self.tokens)} tokens, {self.n_layers} layers × "
            f"{self.n_heads} heads, d_head {self.d_head}, {kind}{cut})"
        )


@dataclass
class Inspection:
    """Matrices of one window. Shapes: ``[layer, head, pos, key]`` for csm, attention, high;
    ``[pos]`` for the token arrays (pos = n valid tokens, [CLS] and [SEP] included)."""

    model_name: str
    params: AnalysisParams
    tokens: list[str]  # token text as the tokenizer spells it
    token_ids: np.ndarray  # int64
    sentence: np.ndarray  # int64 sentence id, -1 for special tokens (SPEC §1, §5b: params.sentences)
    in_pairs: np.ndarray  # bool, tokens that form the pair universe P
    csm: np.ndarray  # float32, C_ij = z_i · z_j, C_ii = 0
    attention: np.ndarray  # float32, rows are queries
    high: np.ndarray  # bool, (i, j) and (j, i) marked for each pair in H
    truncated: bool  # the text had more word pieces than one window holds
    text: InspectedText  # the tensors the matrices above are computed from
    window_id: str = ""  # the window's id, as a run that analysed the text would store it

    @property
    def n_layers(self) -> int:
        return self.csm.shape[0]

    @property
    def n_heads(self) -> int:
        return self.csm.shape[1]

    def sentence_starts(self) -> list[int]:
        """Positions where a new sentence begins after an earlier one (for boundary lines)."""
        s = self.sentence
        return [p for p in range(1, len(s)) if s[p] >= 0 and s[p - 1] >= 0 and s[p] != s[p - 1]]


def _first_window(model: LoadedModel, text: str, params: AnalysisParams, index: int = 0) -> tuple[list[Window], Batch]:
    """The text's windows (chunks, so that a second one tells us the text was cut) and a batch
    of the one at ``index`` (the first by default)."""
    text = text.strip()
    if not text:
        raise CorpusError("inspect: the text is empty; ", Phrase("pass some text or --file FILE", "pass some text"))
    tokens = TokenClasses.for_model(model)
    doc = Document(doc_id=document_id(text), source="<inspect>", index=0, line=1, text=text)
    windows = document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, replace(params, windowing="chunks"))
    if not windows:
        raise CorpusError("inspect: the text has no word pieces; pass some words")
    if not 0 <= index < len(windows):
        raise ParameterError(f"window {index}: the text has windows 0..{len(windows) - 1} (0-based)")
    return windows[index:], collate(windows[index : index + 1], tokens.pad_id)


def _activations(model: LoadedModel, windows: list[Window], batch: Batch) -> InspectedText:
    acts = forward(model, batch)
    z, attention = [], []
    for layer in range(model.n_layers):
        context = acts[act_name("z", layer)][0].float()  # [pos, head·d_head]
        z.append(context.view(context.shape[0], model.n_heads, -1).transpose(0, 1))  # [head, pos, d_head]
        attention.append(acts[act_name("pattern", layer)][0].float())  # [head, query, key]
    ids = list(windows[0].input_ids)
    return InspectedText(
        model=model.name,
        causal=model.causal,
        token_ids=[int(t) for t in ids],
        # a list of ids gives a list of tokens (the base class declares no overloads)
        tokens=cast(list[str], model.tokenizer.convert_ids_to_tokens(ids)),
        attention=torch.stack(attention).cpu().numpy(),
        z=torch.stack(z).contiguous().cpu().numpy(),
        n_kv_heads=model.n_kv_heads,
        truncated=len(windows) > 1,
    )


def read_text(model: LoadedModel, text: str, params: AnalysisParams) -> InspectedText:
    """The first window of ``text`` (``params.seq_len`` tokens at most) through ``model``, every
    head's attention and z kept. ``params.windowing`` is ignored: one window, from the start."""
    return _activations(model, *_first_window(model, text, params))


def inspect_text(model: LoadedModel, text: str, params: AnalysisParams, *, window: int = 0) -> Inspection:
    """Analyse the first window of ``text`` (``params.seq_len`` tokens at most) and keep every
    head's matrices. ``params.windowing`` is ignored: one window, from the start of the text;
    ``window``: the window at that index of the text's chunks instead (what ``analyze`` stored as
    the document's window ``window``)."""
    windows, batch = _first_window(model, text, params, window)
    seen = _activations(model, windows, batch)
    tokens = TokenClasses.for_model(model)
    blocks = model.blocks
    with torch.inference_mode():
        input_ids = batch.input_ids.to(model.device)
        feats = window_features(
            input_ids,
            batch.attention_mask.to(model.device),
            tokens,
            include_special=params.include_special,
            sentence=batch_sentences(model, batch, params),
        )
        sentence = feats.sentence  # the ids the stored statistics count with
        csm, high = [], []
        for layer in range(model.n_layers):
            w_o = model.adapter.output_weight(blocks[layer]) if params.vectors == "post_wo" else None
            context = seen.context(layer).to(model.device)  # [batch, pos, head·d_head]
            z = head_vectors(context, model.n_heads, w_o).float()  # [batch, head, pos, d]
            sim = torch.matmul(z, z.transpose(2, 3))  # [batch, head, pos, key]
            sim.diagonal(dim1=2, dim2=3).zero_()  # C_ii = 0 (SPEC §2)
            csm.append(sim[0])
            high.append(_high_set(sim, feats, params)[0])
    return Inspection(
        model_name=model.name,
        params=params,
        tokens=seen.tokens,
        token_ids=np.asarray(seen.token_ids, dtype=np.int64),
        sentence=sentence[0].cpu().numpy(),
        in_pairs=feats.in_pairs[0].cpu().numpy(),
        csm=torch.stack(csm).cpu().numpy(),
        attention=seen.attention,
        high=torch.stack(high).cpu().numpy(),
        truncated=seen.truncated,
        text=seen,
        window_id=windows[0].window_id,
    )


def _high_set(sim: torch.Tensor, feats, params: AnalysisParams) -> torch.Tensor:
    """H as a symmetric bool matrix ``[batch, head, pos, key]``, chosen exactly as the stored
    statistics choose it (``select_pairs``: same ranking, same tie rule)."""
    batch, heads, n_pos, _ = sim.shape
    # the same masking as pair_selection.masked_similarity: -inf outside P
    flat = sim.reshape(batch, heads, n_pos * n_pos) + feats.pair_bias(heads, sim.dtype).view(batch, heads, -1)
    _values, index, chosen = select_pairs(flat, feats, params.select)
    marks = torch.zeros(batch, heads, n_pos * n_pos, dtype=torch.bool, device=sim.device)
    marks.scatter_(2, index, chosen)
    marks = marks.view(batch, heads, n_pos, n_pos)
    return marks | marks.transpose(2, 3)


def read_text_file(path: str, *, text_field: str = "text", encoding: str = "utf-8") -> str:
    """The first document of a corpus file (.txt, .jsonl, .csv), as ``analyze`` would read it."""
    from headatlas.service.engine.corpus import iter_documents

    return next(iter(iter_documents(path, text_field=text_field, encoding=encoding))).text
