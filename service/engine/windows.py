"""Documents → windows → batches (SPEC §1).

An encoder's window is ``[CLS] + up to seq_len-2 word pieces + [SEP]``; a decoder's is ``[BOS] + up
to seq_len-1 tokens`` (no BOS where the tokenizer has none), with no closing special (SPEC §8): the
model's adapter names the two specials (``TokenClasses.for_model``). Window ids are content-addressed
(document id, window index, tokenizer, seq_len, windowing) so that resuming a run or delivering a
batch twice can be recognised.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from headatlas.service.engine.fingerprints import per_tokenizer, tokenizer_fingerprint
from headatlas.service.engine.sentences import encode_with_sentences, sentence_starts, window_sentence_ids
from headatlas.service.errors import ParameterError
from headatlas.service.params import AnalysisParams

if TYPE_CHECKING:
    from headatlas.service.engine.corpus import Document
    from headatlas.service.engine.model import ModelInfo

NO_TOKEN = -1  # an absent special (a decoder's closing one, a BOS the tokenizer lacks): matches no id


@dataclass(frozen=True)
class Window:
    window_id: str
    doc_id: str
    index: int  # 0-based window index within its document
    input_ids: tuple[int, ...]  # with the special tokens, unpadded; n = len(input_ids)
    # one per input id, -1 for special tokens, numbered from 0 within the window; None when the
    # run's sentences come from token ids (punct) and nothing needs to travel with the window
    sentence_ids: tuple[int, ...] | None = None

    def to_message(self) -> list:
        """The window as a JSON-ready list for a queued batch (``from_message`` reads it back)."""
        row = [self.window_id, self.doc_id, self.index, list(self.input_ids)]
        return row if self.sentence_ids is None else [*row, list(self.sentence_ids)]

    @classmethod
    def from_message(cls, row: list) -> Window:
        window_id, doc_id, index, input_ids, *rest = row
        sentences = tuple(int(s) for s in rest[0]) if rest else None
        return cls(
            window_id=window_id,
            doc_id=doc_id,
            index=int(index),
            input_ids=tuple(int(t) for t in input_ids),
            sentence_ids=sentences,
        )


@dataclass(frozen=True)
class TokenClasses:
    """Token ids that the statistics treat specially, read once from the tokenizer.

    ``cls_id`` and ``sep_id`` are a window's first and last special tokens: ``[CLS]`` and ``[SEP]``
    for an encoder; a decoder's BOS and NO_TOKEN (SPEC §8), NO_TOKEN where there is none."""

    cls_id: int
    sep_id: int
    pad_id: int
    special_ids: frozenset[int]
    sentence_end_ids: frozenset[int]  # . ! ?  (end their sentence, SPEC §1)
    punct_ids: frozenset[int]  # . ,  (the separators of the paper, SPEC §4)
    # [vocab] bool: the token's text (without a word-piece prefix; a byte-level token's decoded text)
    # holds a letter or digit (SPEC §5b)
    is_word: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, dtype=torch.bool), compare=False, hash=False, repr=False
    )

    @property
    def first_id(self) -> int | None:
        """The special token that opens each window, if any."""
        return None if self.cls_id == NO_TOKEN else self.cls_id

    @property
    def last_id(self) -> int | None:
        """The special token that closes each window, if any."""
        return None if self.sep_id == NO_TOKEN else self.sep_id

    @property
    def layout(self) -> str:
        """The window layout, for window ids: empty for the encoder's ``[CLS] … [SEP]`` (the ids of
        earlier runs), else the two specials."""
        if self.first_id is not None and self.last_id is not None:
            return ""
        return f"first={self.first_id} last={self.last_id}"

    @classmethod
    def for_model(cls, model: ModelInfo) -> TokenClasses:
        """The token classes of ``model``'s windows: its adapter names the first and last specials."""
        return cls.from_tokenizer(model.tokenizer, specials=model.adapter.window_specials(model.tokenizer))

    @classmethod
    def from_tokenizer(cls, tokenizer, *, specials: tuple[int | None, int | None] | None = None) -> TokenClasses:
        """``specials``: (first, last) special ids of a window; default the encoder's ``[CLS]``, ``[SEP]``."""

        def ids(tokens: Iterable[str]) -> frozenset[int]:
            out = set()
            unk = tokenizer.unk_token_id
            for tok in tokens:
                idx = tokenizer.convert_tokens_to_ids(tok)
                if idx is not None and idx != unk:
                    out.add(idx)
            return frozenset(out)

        first, last = (tokenizer.cls_token_id, tokenizer.sep_token_id) if specials is None else specials
        return cls(
            cls_id=NO_TOKEN if first is None else first,
            sep_id=NO_TOKEN if last is None else last,
            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            special_ids=frozenset(tokenizer.all_special_ids),
            sentence_end_ids=ids([".", "!", "?", "Ġ.", "Ġ!", "Ġ?", "▁.", "▁!", "▁?"]),
            punct_ids=ids([".", ",", "Ġ.", "Ġ,", "▁.", "▁,"]),
            is_word=word_token_mask(tokenizer),
        )


WORD_PIECE_PREFIXES = ("##", "Ġ", "▁")
# How a tokenizer's word tokens are judged (SPEC §5b), recorded in the run key where it is not the
# vocabulary string: a run made under another rule is another run, not one to resume.
DECODED_WORDS = "decoded"


def is_word_token(text: str) -> bool:
    """A *word* token (SPEC §5b): after removing a word-piece prefix, its text holds at least
    one letter or digit (Unicode categories L* or N*)."""
    for prefix in WORD_PIECE_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    return holds_letter_or_digit(text)


def holds_letter_or_digit(text: str) -> bool:
    return any(unicodedata.category(ch)[0] in "LN" for ch in text)


@per_tokenizer
def is_byte_level(tokenizer) -> bool:
    """Whether the vocabulary is byte-level BPE (GPT-2, SmolLM2): its strings spell bytes as
    stand-in characters (``Ċ`` is a newline, ``Ã`` half of a two-byte letter), not text (read from
    the tokenizer's serialised form, once per tokenizer)."""
    if getattr(tokenizer, "byte_decoder", None):  # a slow (Python) byte-level tokenizer
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return False
    return _names_byte_level(json.loads(backend.to_str()).get("decoder"))


def _names_byte_level(decoder) -> bool:
    """Whether a tokenizer.json decoder (possibly a Sequence of decoders) holds a ByteLevel one."""
    if isinstance(decoder, dict):
        return decoder.get("type") == "ByteLevel" or any(_names_byte_level(v) for v in decoder.values())
    if isinstance(decoder, list):
        return any(_names_byte_level(v) for v in decoder)
    return False


def word_rule(tokenizer) -> str:
    """How word tokens are judged: ``""`` on the vocabulary string (WordPiece, SentencePiece: the
    rule of every earlier run), ``DECODED_WORDS`` on the text the token decodes to (byte-level BPE)."""
    return DECODED_WORDS if is_byte_level(tokenizer) else ""


def word_token_mask(tokenizer) -> torch.Tensor:
    """``[vocab]`` bool, True for word tokens; special tokens are never words. A byte-level
    vocabulary's tokens are judged on the text each decodes to (a lone byte of a longer UTF-8
    character decodes to U+FFFD, no letter), with no prefix to remove: its leading space is a
    space; other vocabularies' on their string. Judged once per tokenizer (``per_tokenizer``);
    each caller gets its own copy."""
    return _word_token_mask(tokenizer).clone()


@per_tokenizer
def _word_token_mask(tokenizer) -> torch.Tensor:
    """The mask of ``tokenizer``, also kept by what it is judged from (the vocabulary's fingerprint,
    its size, its special ids and the word rule): a process that loads the same tokenizer again (an
    analysis, a worker's every task, each run of a random model) judges its 30,000-150,000 strings
    once, not at every load (about 0.1-0.2 s of CPU each)."""
    key = (
        tokenizer_fingerprint(tokenizer),
        len(tokenizer),
        tuple(sorted(tokenizer.all_special_ids)),
        word_rule(tokenizer),
    )
    mask = _MASKS.get(key)
    if mask is None:
        mask = _MASKS[key] = _judge_words(tokenizer)
        while len(_MASKS) > _MASKS_KEPT:
            _MASKS.pop(next(iter(_MASKS)))
    return mask


_MASKS: dict[tuple, torch.Tensor] = {}
_MASKS_KEPT = 8  # vocabularies whose masks a process keeps (a mask is one byte per token)


def _judge_words(tokenizer) -> torch.Tensor:
    vocab = tokenizer.get_vocab()
    if word_rule(tokenizer) == DECODED_WORDS:
        words = {idx: holds_letter_or_digit(tokenizer.convert_tokens_to_string([text])) for text, idx in vocab.items()}
    else:
        words = {idx: is_word_token(text) for text, idx in vocab.items()}
    size = max(len(tokenizer), max(words, default=-1) + 1)
    mask = torch.zeros(size, dtype=torch.bool)
    for idx, word in words.items():
        mask[idx] = word
    for idx in tokenizer.all_special_ids:
        if 0 <= idx < size:
            mask[idx] = False
    return mask


def window_key(doc_id: str, index: int, tokenizer_key: str, params: AnalysisParams, layout: str = "") -> str:
    blob = f"{doc_id}|{index}|{tokenizer_key}|{params.seq_len}|{params.windowing}"
    if layout:  # a decoder's windows: not the encoder's window of the same text
        blob += f"|{layout}"
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


# A document is tokenised this many characters at a time: a fast tokenizer's output for a 20 MB
# line (offsets, strings, ids for every piece) takes gigabytes; a slice's takes megabytes.
SLICE_CHARS = 1 << 16


def document_windows(
    doc: Document, tokenizer, tokens: TokenClasses, tokenizer_key: str, params: AnalysisParams
) -> list[Window]:
    return list(iter_document_windows(doc, tokenizer, tokens, tokenizer_key, params))


def iter_document_windows(
    doc: Document,
    tokenizer,
    tokens: TokenClasses,
    tokenizer_key: str,
    params: AnalysisParams,
    *,
    slice_chars: int = SLICE_CHARS,
) -> Iterator[Window]:
    """The document's windows in order, tokenised slice by slice (memory follows a slice, not
    the document). Under ``--sentences segmenter`` each piece carries its sentence index."""
    body = params.seq_len - (tokens.first_id is not None) - (tokens.last_id is not None)
    if params.sentences == "segmenter":
        items: Iterable[tuple[int, int]] = _pieces_with_sentences(doc.text, tokenizer, tokens, slice_chars)
    else:
        items = ((piece, -1) for piece in _pieces(doc.text, tokenizer, slice_chars))
    chunk: list[tuple[int, int]] = []
    k = 0
    for item in items:
        chunk.append(item)
        if len(chunk) == body:
            yield _window(doc, k, chunk, tokens, tokenizer_key, params)
            if params.windowing == "first":
                return
            chunk, k = [], k + 1
    if chunk:
        yield _window(doc, k, chunk, tokens, tokenizer_key, params)


def _window(
    doc, k: int, chunk: list[tuple[int, int]], tokens: TokenClasses, tokenizer_key: str, params: AnalysisParams
) -> Window:
    pieces = [piece for piece, _ in chunk]
    sentences = None
    if params.sentences == "segmenter":
        sentences = window_sentence_ids(
            [s for _, s in chunk], opened=tokens.first_id is not None, closed=tokens.last_id is not None
        )
    return Window(
        window_id=window_key(doc.doc_id, k, tokenizer_key, params, tokens.layout),
        doc_id=doc.doc_id,
        index=k,
        input_ids=(*_one(tokens.first_id), *pieces, *_one(tokens.last_id)),
        sentence_ids=sentences,
    )


def _one(token: int | None) -> tuple[int, ...]:
    return () if token is None else (token,)


def _slices(text: str, slice_chars: int) -> Iterator[tuple[int, int]]:
    start, n = 0, len(text)
    while start < n:
        end = n if n - start <= slice_chars else _cut(text, start, start + slice_chars)
        yield start, end
        start = end


def _pieces(text: str, tokenizer, slice_chars: int) -> Iterator[int]:
    """Token ids of ``text`` without special tokens, tokenised in slices cut just before the last
    whitespace ahead of a word: WordPiece pre-tokenizers split there anyway (a byte-level BPE
    attaches the space to the following word, which the next slice then starts with), so the
    ids equal those of the whole text. Only a run of more than ``slice_chars`` characters without
    whitespace is cut inside (such a word is unknown to the vocabulary either way)."""
    for start, end in _slices(text, slice_chars):
        yield from tokenizer(text[start:end], add_special_tokens=False, truncation=False)["input_ids"]


def _pieces_with_sentences(text: str, tokenizer, tokens: TokenClasses, slice_chars: int) -> Iterator[tuple[int, int]]:
    """(token id, sentence index) of ``text``, slice by slice; sentence indices run on across
    slices. A slice ends where its last sentence starts (that sentence goes whole into the next
    slice), so the sentences equal those of the whole text; only a sentence longer than
    ``slice_chars`` is cut, and counts as two. Special tokens inside the text ([UNK], a literal
    "[SEP]") get no sentence (-1), as under punct."""
    first = 0
    for start, end, starts in _sentence_slices(text, slice_chars):
        pieces, sentences = encode_with_sentences(tokenizer, text[start:end], starts)
        for piece, sentence in zip(pieces, sentences):
            yield piece, -1 if piece in tokens.special_ids else first + sentence
        first += max(sentences, default=-1) + 1


def _sentence_slices(text: str, slice_chars: int) -> Iterator[tuple[int, int, list[int] | None]]:
    """(start, end, the slice's sentence starts where they are known, else None): a slice cut
    where its last sentence starts keeps the starts before it, found as it was cut, so that no
    character is segmented twice (the segmenter is pure Python, most of windowing a long
    document: benchmarks/long_document.py)."""
    start, n = 0, len(text)
    while start < n:
        if n - start <= slice_chars:
            yield start, n, None
            return
        starts = sentence_starts(text[start : start + slice_chars])
        if len(starts) > 1 and starts[-1] > 1:
            end = start + starts[-1]
            if text[end - 1].isspace():
                end -= 1  # as _cut: the whitespace before a word goes with the word
            yield start, end, starts[:-1]
        else:
            end = _cut(text, start, start + slice_chars)
            yield start, end, None
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
    docs: Iterable[Document], tokenizer, tokens: TokenClasses, tokenizer_key: str, params: AnalysisParams
) -> Iterator[tuple[Document, list[Window]]]:
    for doc in docs:
        yield doc, document_windows(doc, tokenizer, tokens, tokenizer_key, params)


@dataclass
class Batch:
    """Windows padded to the longest one in the batch.

    input_ids, attention_mask: ``[batch, pos]`` int64. sentence: ``[batch, pos]`` int64, -1 for
    special and pad tokens, when the windows carry sentence ids (``sentences = segmenter``).
    """

    windows: list[Window]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    sentence: torch.Tensor | None = None

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
    carried = [w.sentence_ids is not None for w in windows]
    if any(carried) and not all(carried):
        raise ParameterError(
            "a batch mixes windows with and without sentence ids: make all its windows with the same "
            "--sentences (segmenter or punct)"
        )
    sentence = None
    if all(carried):
        sentence = torch.full((len(windows), longest), -1, dtype=torch.long)
        for row, w in enumerate(windows):
            assert w.sentence_ids is not None  # all(carried)
            sentence[row, : len(w.sentence_ids)] = torch.tensor(w.sentence_ids)
    return Batch(windows=list(windows), input_ids=input_ids, attention_mask=attention_mask, sentence=sentence)
