"""Sentence ids of word pieces from a sentence-boundary library (SPEC §5b, ``sentences = segmenter``).

The library finds sentence spans on the document's text ("Mr." and "3.14" do not end a
sentence); the tokenizer's character offsets place each word piece in the span that holds its
first character. ``punct`` (SPEC §1) needs none of this: it is computed from token ids in
``service.engine.features.sentence_ids``.

Pure Python: imports neither torch, Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from headatlas.service.errors import Param, ParameterError


def sentence_starts(text: str) -> list[int]:
    """Character offset (Python ``str`` index) where each sentence of ``text`` starts, ascending.

    The spans are contiguous: each runs up to the next start, trailing spaces included.
    syntok's rules are English (abbreviations, initials, numbers, quotes); the corpus language is
    not a run parameter, so they apply to every corpus. It was chosen over sentencex, whose
    quotation rule let one stray apostrophe glue up to 28,000 characters of Wikipedia into one
    "sentence" (23 % of 1,067 windows became a single sentence), and over blingfire, whose wheel
    carries x86-64 binaries only; see benchmarks/sentences.py.
    """
    from syntok.segmenter import analyze

    starts = [sentence[0].offset for paragraph in analyze(text) for sentence in paragraph if sentence]
    return starts or [0]


def piece_sentences(text: str, offsets: Sequence[Sequence[int]], starts: Sequence[int] | None = None) -> list[int]:
    """Sentence index (0-based, over the whole document) of each word piece.

    ``offsets``: the tokenizer's ``(start, end)`` character span of each piece in ``text``
    (``return_offsets_mapping=True``). A piece belongs to the sentence whose span holds its
    first character. ``starts``: the sentence starts of ``text`` where the caller has them
    (``sentence_starts``), else found here.
    """
    if starts is None:
        starts = sentence_starts(text)
    return [max(0, bisect_right(starts, start) - 1) for start, _end in offsets]


def encode_with_sentences(tokenizer, text: str, starts: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """Word pieces of ``text`` (no special tokens) and the sentence index of each (``starts``: as
    ``piece_sentences``)."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, truncation=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ParameterError(
            Param("sentences", "segmenter"),
            f": the tokenizer {type(tokenizer).__name__} gives no character offsets (it is not a fast tokenizer)",
            hint=("use a model folder with tokenizer.json or pass ", Param("sentences", "punct")),
        ) from None
    return list(encoded["input_ids"]), piece_sentences(text, encoded["offset_mapping"], starts)


def window_sentence_ids(sentences: Sequence[int], *, opened: bool = True, closed: bool = True) -> tuple[int, ...]:
    """Sentence ids of one window's pieces, renumbered from 0 (ids compare only within a window),
    with -1 for the special before them (``opened``: [CLS], a decoder's BOS) and the one after them
    (``closed``: [SEP]). A piece given -1 (a special token such as [UNK] inside the text) keeps it."""
    first = next((s for s in sentences if s >= 0), 0)
    body = tuple(s - first if s >= 0 else -1 for s in sentences)
    return (-1,) * opened + body + (-1,) * closed
