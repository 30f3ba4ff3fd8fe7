"""Tokens shown as the text they stand for (SPEC §5b, byte-level vocabularies).

A byte-level BPE vocabulary (GPT-2, SmolLM2, Llama 3, Qwen) writes each byte of a token's text as
one printable character: ``Ġ`` is a space, ``Ċ`` a newline, ``Ã`` the first byte of a two-byte
letter. Figures, anchors and tables show what the token reads as instead: ``Ġthe`` → ``the`` (the
leading space of a word is how the vocabulary marks a word's start, not something to read), a
token of white space alone made visible (``Ġ`` → ``␣``, ``Ċ`` → ``\\n``, ``ĠĠ`` → ``␣␣``), and a
lone byte of a longer character as its byte (``\\xe2``). This is the map of GPT-2's
``bytes_to_unicode`` that every byte-level tokenizer shares (``tokenizer.convert_tokens_to_string``
reads it the same way), so stored rows are shown without loading their tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

VISIBLE = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


@cache
def _byte_of() -> dict[str, int]:
    """The byte each character of a byte-level vocabulary stands for (GPT-2's bytes_to_unicode, inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def is_byte_level_text(tokens: Iterable[str]) -> bool:
    """Whether stored token strings come from a byte-level vocabulary: one of them starts with the
    space marker ``Ġ`` or is the newline ``Ċ`` (a run's anchors always hold a few such tokens;
    WordPiece and SentencePiece vocabularies write neither)."""
    return any(t.startswith("Ġ") or t == "Ċ" for t in tokens if t)


def byte_level_text(token: str) -> str:
    """What a byte-level vocabulary string decodes to (bytes it cannot map kept as they are)."""
    table = _byte_of()
    if not all(ch in table for ch in token):
        return token
    return bytes(table[ch] for ch in token).decode("utf-8", errors="backslashreplace")


def shown(text: str) -> str:
    """A token's text as a label: a word without its leading space, white space made visible."""
    if text and not text.strip():
        return "".join(VISIBLE.get(ch, ch) for ch in text)
    text = text[1:] if text.startswith(" ") and len(text) > 1 else text
    return "".join(VISIBLE.get(ch, ch) if ch != " " else ch for ch in text)


def token_label(token: str, byte_level: bool) -> str:
    """The label of one stored token string (``byte_level``: its run's vocabulary is byte-level)."""
    return shown(byte_level_text(token)) if byte_level else token


def running_text(token: str) -> str:
    """A decoded token as it reads in running text (a window's token strip): its leading space
    kept (``Ġactors`` → `` actors``), other white space made visible (``Ċ`` → ``\\n``), a token
    of spaces alone as ``␣``."""
    if token and not token.strip(" "):
        return "␣" * len(token)
    return "".join(ch if ch == " " else VISIBLE.get(ch, ch) for ch in token)


def window_tokens(tokens: list[str]) -> list[str]:
    """A window's tokens as text: a byte-level vocabulary's strings decoded (``running_text``),
    others (WordPiece, SentencePiece) as the tokenizer wrote them."""
    if not is_byte_level_text(tokens):
        return list(tokens)
    return [running_text(byte_level_text(t)) for t in tokens]
