"""Documents → windows → batches (SPEC §1).

A window is ``[CLS] + up to seq_len-2 word pieces + [SEP]``. Window ids are content-addressed
(document id, window index, tokenizer, seq_len, windowing) so that resuming a run or delivering a
batch twice can be recognised.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from service.params import AnalysisParams

if TYPE_CHECKING:
    from service.corpus import Document


@dataclass(frozen=True)
class Window:
    window_id: str
    doc_id: str
    index: int  # 0-based window index within its document
    input_ids: tuple[int, ...]  # with the special tokens, unpadded; n = len(input_ids)


@dataclass(frozen=True)
class TokenClasses:
    """Token ids that the statistics treat specially, read once from the tokenizer."""

    cls_id: int
    sep_id: int
    pad_id: int
    special_ids: frozenset[int]
    sentence_end_ids: frozenset[int]  # . ! ?  (end their sentence, SPEC §1)
    punct_ids: frozenset[int]  # . ,  (the separators of the paper, SPEC §4)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenClasses":
        def ids(tokens: Iterable[str]) -> frozenset[int]:
            out = set()
            unk = tokenizer.unk_token_id
            for tok in tokens:
                idx = tokenizer.convert_tokens_to_ids(tok)
                if idx is not None and idx != unk:
                    out.add(idx)
            return frozenset(out)

        return cls(
            cls_id=tokenizer.cls_token_id,
            sep_id=tokenizer.sep_token_id,
            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            special_ids=frozenset(tokenizer.all_special_ids),
            sentence_end_ids=ids([".", "!", "?", "Ġ.", "Ġ!", "Ġ?", "▁.", "▁!", "▁?"]),
            punct_ids=ids([".", ",", "Ġ.", "Ġ,", "▁.", "▁,"]),
        )


def window_key(doc_id: str, index: int, tokenizer_key: str, params: AnalysisParams) -> str:
    blob = f"{doc_id}|{index}|{tokenizer_key}|{params.seq_len}|{params.windowing}".encode()
    return hashlib.sha256(blob).hexdigest()[:24]


# A document is tokenised this many characters at a time: a fast tokenizer's output for a 20 MB
# line (offsets, strings, ids for every piece) takes gigabytes; a slice's takes megabytes.
SLICE_CHARS = 1 << 16


def document_windows(
    doc: "Document", tokenizer, tokens: TokenClasses, tokenizer_key: str, params: AnalysisParams
) -> list[Window]:
    return list(iter_document_windows(doc, tokenizer, tokens, tokenizer_key, params))


def iter_document_windows(
    doc: "Document", tokenizer, tokens: TokenClasses, tokenizer_key: str, params: AnalysisParams,
    *, slice_chars: int = SLICE_CHARS,
) -> Iterator[Window]:
    """The document's windows in order, tokenised slice by slice (memory follows a slice, not
    the document)."""
    body = params.seq_len - 2
    chunk: list[int] = []
    k = 0
    for piece in _pieces(doc.text, tokenizer, slice_chars):
        chunk.append(piece)
        if len(chunk) == body:
            yield _window(doc, k, chunk, tokens, tokenizer_key, params)
            if params.windowing == "first":
                return
            chunk, k = [], k + 1
    if chunk:
        yield _window(doc, k, chunk, tokens, tokenizer_key, params)


def _window(doc, k: int, chunk: list[int], tokens: TokenClasses, tokenizer_key: str, params: AnalysisParams) -> Window:
    return Window(window_id=window_key(doc.doc_id, k, tokenizer_key, params), doc_id=doc.doc_id, index=k,
                  input_ids=(tokens.cls_id, *chunk, tokens.sep_id))


def _pieces(text: str, tokenizer, slice_chars: int) -> Iterator[int]:
    """Token ids of ``text`` without special tokens, tokenised in slices cut just before the last
    whitespace ahead of a word: BERT-family pre-tokenizers split there anyway (a byte-level BPE
    attaches the space to the following word, which the next slice then starts with), so the
    ids equal those of the whole text. Only a run of more than ``slice_chars`` characters without
    whitespace is cut inside (such a word is unknown to the vocabulary either way)."""
    start, n = 0, len(text)
    while start < n:
        end = n if n - start <= slice_chars else _cut(text, start, start + slice_chars)
        yield from tokenizer(text[start:end], add_special_tokens=False, truncation=False)["input_ids"]
        start = end


def _cut(text: str, start: int, end: int) -> int:
    for i in range(end, start, -1):
        if text[i].isspace() and not text[i - 1].isspace():
            # i starts a whitespace run: cut before its last character
            j = i
            while j + 1 < len(text) and text[j + 1].isspace():
                j += 1
            return j if j > start else i
    return end


def iter_windows(
    docs: Iterable["Document"], tokenizer, tokens: TokenClasses, tokenizer_key: str, params: AnalysisParams
) -> Iterator[tuple["Document", list[Window]]]:
    for doc in docs:
        yield doc, document_windows(doc, tokenizer, tokens, tokenizer_key, params)


@dataclass
class Batch:
    """Windows padded to the longest one in the batch.

    input_ids, attention_mask: ``[batch, pos]`` int64.
    """

    windows: list[Window]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def window_ids(self) -> list[str]:
        return [w.window_id for w in self.windows]


def collate(windows: list[Window], pad_id: int) -> Batch:
    longest = max(len(w.input_ids) for w in windows)
    input_ids = torch.full((len(windows), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(windows), longest), dtype=torch.long)
    for row, w in enumerate(windows):
        input_ids[row, : len(w.input_ids)] = torch.tensor(w.input_ids)
        attention_mask[row, : len(w.input_ids)] = 1
    return Batch(windows=list(windows), input_ids=input_ids, attention_mask=attention_mask)
