"""Corpus input: resolve a corpus spec to files and stream its documents.

A spec is one of:

- a ``.txt`` file: documents separated by one or more blank lines; the lines of a document
  are joined with ``"\\n"``;
- a ``.jsonl`` file: one JSON object per line, the text in field ``text_field``; blank lines
  are skipped;
- a ``.csv`` file: a header row, then one document per row, the text in column ``text_field``;
- a directory: every ``*.txt``, ``*.jsonl`` and ``*.csv`` file below it (recursively, hidden
  files and folders skipped), sorted by relative path;
- a glob pattern such as ``data/*.txt`` (``**`` recurses), matches sorted;
- ``-``: standard input, read as ``.txt``.

Stdin can be read only once, so callers that need more than one pass over it (fingerprint,
size, then documents) first copy it to a file with :func:`spool_stdin` and use that path as
the spec; the CLI does this. :func:`iter_documents` also reads ``-`` directly, in one pass.

Everything streams: files are read line by line, never whole. A problem raises
:class:`~service.errors.CorpusError` with a one-line message ``FILE[:LINE]: problem; fix``.
This module is pure Python on purpose: no torch, Celery, Typer or SQLAlchemy.
"""

from __future__ import annotations

import codecs
import csv
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from headatlas.service.errors import CorpusError, Param, Placeholder

STDIN_SPEC = "-"
STDIN_SOURCE = "<stdin>"
SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".csv")
_SUPPORTED = ", ".join(SUPPORTED_SUFFIXES)
# A NUL byte this early means a binary file (text encodings compatible with ASCII have none).
_SNIFF_BYTES = 8192
_CHUNK_BYTES = 1 << 20
_ENCODING_FIX = ("re-encode as UTF-8 or pass ", Param("encoding"), " (e.g. ", Param("encoding", "latin-1"), ")")
_FIELD_FIX = ("pass ", Param("text_field", Placeholder("NAME")))
# Half of a UTF-16 surrogate pair: JSON may escape one alone ("\\ud800"), which no UTF-8 text holds.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SPEC_FIX = f"pass a {_SUPPORTED} file, a directory, a glob such as 'data/*.txt', or - for stdin"


@dataclass(frozen=True, slots=True)
class Document:
    """One document of a corpus, with where it came from."""

    doc_id: str  # content address: first 32 hex chars of sha256(text as UTF-8)
    source: str  # file path as given or resolved; "<stdin>" for stdin
    index: int  # 0-based position among the documents of its source
    line: int  # 1-based line where the document starts in its source
    text: str  # stripped, holds a visible character (has_text)


# Characters that carry no text: format (zero-width space and joiners, BOM), control, combining
# marks on nothing. A document of only these has no token to analyse.
_INVISIBLE = frozenset(("Cf", "Cc", "Mn", "Me", "Zs", "Zl", "Zp"))


def has_text(text: str) -> bool:
    """Whether ``text`` holds a visible character (not only whitespace or zero-width ones)."""
    return any(not ch.isspace() and unicodedata.category(ch) not in _INVISIBLE for ch in text)


def document_id(text: str) -> str:
    """Content address of a document: the same text always gets the same id (32 hex chars)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def demo_corpus_path() -> Path:
    """The shipped demo corpus: six Wikipedia articles, ~29 KB (see data/ATTRIBUTION.md)."""
    return Path(__file__).resolve().parents[1] / "data" / "wiki_excerpt.txt"


# --- resolving a spec to files -------------------------------------------------------------


def corpus_files(spec: str) -> list[Path]:
    """Files of a corpus spec in reading order; ``[]`` for stdin (``-``)."""
    spec = os.fspath(spec)
    if spec == STDIN_SPEC:
        return []
    if not spec.strip():  # Path("") is the current folder: never analyse that by accident
        raise CorpusError(f"the corpus is empty (''); {_SPEC_FIX}")
    path = Path(spec)
    if path.exists() and not path.is_file() and not path.is_dir():
        raise CorpusError(f"{spec}: not a regular file (a pipe, socket or device); {_SPEC_FIX}")
    if path.is_file():
        _check_suffix(path, spec)
        return [path]
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if _is_corpus_file(p, path)),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise CorpusError(f"{spec}: directory holds no {_SUPPORTED} file; {_SPEC_FIX}")
        return files
    if any(char in spec for char in "*?["):
        files = [Path(match) for match in sorted(glob.glob(spec, recursive=True))]
        files = [p for p in files if p.is_file()]
        if not files:
            raise CorpusError(f"{spec}: glob matches no file; check the pattern or {_SPEC_FIX}")
        for file in files:
            _check_suffix(file, spec)
        return files
    if is_symlink_loop(path):
        raise CorpusError(f"{spec}: a symbolic link loop (the link leads back to itself); point it at the corpus")
    raise CorpusError(f"{spec}: no such file or directory; {_SPEC_FIX}")


def is_symlink_loop(path: Path) -> bool:
    """Whether ``path`` cannot be followed because its links loop (``Path.exists`` says False)."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def corpus_size_bytes(spec: str) -> int:
    """Total size of the corpus files in bytes (for progress bars); 0 for stdin (unknown)."""
    return sum(path.stat().st_size for path in corpus_files(spec))


def corpus_fingerprint(spec: str) -> str:
    """sha256 hex over each file's name (relative to their common folder), size and bytes.

    A corpus of one file is identified by its content and how it is read: its suffix stands for
    its name (``corpus.txt`` holding the demo's text is the demo corpus; ``corpus.csv`` is not,
    being read otherwise). Where there are several files their relative paths are kept: they are
    the corpus's layout, ordering the files and naming each document's source. Same files with the
    same names give the same fingerprint wherever the corpus lies.
    Stdin cannot be fingerprinted: it would be consumed; spool it first.
    """
    if os.fspath(spec) == STDIN_SPEC:
        raise CorpusError(
            f"{STDIN_SOURCE}: cannot fingerprint stdin without consuming it; "
            "copy it to a file with spool_stdin() and pass that path"
        )
    files = corpus_files(spec)
    base = os.path.commonpath([str(path.parent.absolute()) for path in files])
    digest = hashlib.sha256()
    for path in files:
        name = path.suffix.lower() if len(files) == 1 else Path(os.path.relpath(path.absolute(), base)).as_posix()
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as stream:
            for chunk in iter(lambda: stream.read(_CHUNK_BYTES), b""):
                digest.update(chunk)
    return digest.hexdigest()


def legacy_corpus_fingerprint(spec: str) -> str | None:
    """The fingerprint a corpus of one file had before it was identified by content and suffix
    (its file name hashed with its bytes), or None where the two rules agree (several files).
    Runs stored under the earlier rule keep their keys: ``runner.stored_run_key`` still finds
    them from the same file."""
    files = corpus_files(spec)
    if len(files) != 1:
        return None
    path = files[0]
    digest = hashlib.sha256()
    digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def spool_stdin(stream: BinaryIO | None = None) -> Path:
    """Copy stdin (or *stream*) to ``stdin.txt`` in a new temporary folder and return its path.

    The path then works as a normal spec for every function here; pass ``label=STDIN_SOURCE``
    so that documents and errors name ``<stdin>``. The fingerprint of one file depends on its
    content and suffix alone: the same text piped twice, or saved as any ``.txt`` file, is the
    same corpus. The caller owns the folder: delete it when done
    (:func:`remove_spool`). Raises CorpusError if the input is empty.
    """
    source = sys.stdin.buffer if stream is None else getattr(stream, "buffer", stream)
    path = Path(tempfile.mkdtemp(prefix="headatlas-stdin-")) / "stdin.txt"
    try:
        with path.open("wb") as out:
            shutil.copyfileobj(source, out, _CHUNK_BYTES)
        if path.stat().st_size == 0:
            raise CorpusError(f"{STDIN_SOURCE}: no input; pipe a corpus in (… - < corpus.txt)")
    except BaseException:
        remove_spool(path)
        raise
    return path


def remove_spool(path: Path) -> None:
    """Delete a copy of stdin made by :func:`spool_stdin`, and its folder."""
    shutil.rmtree(path.parent, ignore_errors=True)


def _is_corpus_file(path: Path, root: Path) -> bool:
    hidden = any(part.startswith(".") for part in path.relative_to(root).parts)
    return not hidden and path.suffix.lower() in SUPPORTED_SUFFIXES and path.is_file()


def _check_suffix(path: Path, spec: str) -> None:
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        matched = f" (matched by {spec!r})" if str(path) != spec else ""
        raise CorpusError(
            f"{path}: unsupported file type {path.suffix or '(none)'!r}{matched}; "
            f"supported: {_SUPPORTED} — rename the file or narrow the pattern"
        )


# --- streaming documents -------------------------------------------------------------------


def iter_documents(
    spec: str, *, text_field: str = "text", encoding: str = "utf-8", label: str | None = None
) -> Iterator[Document]:
    """Stream the documents of a corpus spec, validating as it goes.

    Documents whose text is empty, whitespace or zero-width characters are skipped. Errors (including a missing
    path, raised on the first ``next()``) are CorpusError naming file, line and fix.
    ``label``: the name documents and errors give a one-file spec (``<stdin>`` for a spool).
    """
    spec = os.fspath(spec)
    if not text_field:
        raise CorpusError(f"{spec}: the text field name is empty", hint=_FIELD_FIX)
    codec, ascii_compatible = _resolve_encoding(encoding)
    count = 0
    if spec == STDIN_SPEC:
        stdin = sys.stdin.buffer
        for doc in _file_documents(stdin, STDIN_SOURCE, ".txt", text_field, codec, ascii_compatible):
            count += 1
            yield doc
    files = corpus_files(spec)
    for path in files:
        source = label if label is not None and len(files) == 1 else str(path)
        with path.open("rb") as stream:
            suffix = path.suffix.lower()
            for doc in _file_documents(stream, source, suffix, text_field, codec, ascii_compatible):
                count += 1
                yield doc
    if count == 0:
        raise CorpusError(
            f"{STDIN_SOURCE if spec == STDIN_SPEC else label or spec}: corpus has no document with text "
            "(only blank or zero-width characters)",
            hint=("check ", Param("text_field"), f" (now {text_field!r}) or add text"),
        )


def _file_documents(
    stream: BinaryIO, source: str, suffix: str, text_field: str, codec: str, ascii_compatible: bool
) -> Iterator[Document]:
    lines = _decoded_lines(stream, source, codec, ascii_compatible)
    parse = _PARSERS[suffix]
    documents = ((line, text) for line, text in parse(lines, source, text_field) if has_text(text))
    for index, (line, text) in enumerate(documents):
        yield Document(document_id(text), source, index, line, text)


def _resolve_encoding(encoding: str) -> tuple[str, bool]:
    """Codec name, and whether lines can be split on b"\\n" before decoding."""
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        raise CorpusError(
            f"unknown encoding {encoding!r}",
            hint=("pass ", Param("encoding"), " with a Python codec name such as utf-8, latin-1 or utf-16"),
        ) from None
    if name in ("utf-8", "utf-8-sig"):
        return "utf-8", True  # a leading BOM is stripped either way
    try:
        ascii_compatible = "\n a".encode(name) == b"\n a"
    except UnicodeError:
        ascii_compatible = False
    return name, ascii_compatible


def _decoded_lines(stream: BinaryIO, source: str, codec: str, ascii_compatible: bool) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line with its line ending); raises if empty or binary."""
    has_text = False
    size = 0
    if ascii_compatible:
        head = stream.read(_SNIFF_BYTES)
        nul = head.find(b"\0")
        for bom, name in (
            (codecs.BOM_UTF32_LE, "utf-32"),
            (codecs.BOM_UTF32_BE, "utf-32"),
            (codecs.BOM_UTF16_LE, "utf-16"),
            (codecs.BOM_UTF16_BE, "utf-16"),
        ):
            if nul >= 0 and head.startswith(bom):
                raise CorpusError(
                    f"{source}: {name.upper()} text (it starts with a {name.upper()} byte order mark)",
                    hint=("pass ", Param("encoding", name)),
                )
        if nul >= 0:
            raise CorpusError(f"{source}: binary file (NUL byte at offset {nul}); pass a text corpus ({_SUPPORTED})")
        lines = _decode_each_line(_raw_lines(head, stream), source, codec)
    else:
        lines = _decode_chunks(stream, source, codec)
    for lineno, line in lines:
        size += len(line)
        has_text = has_text or bool(line.strip())
        yield lineno, line
    if not has_text:
        problem = "file is empty" if size == 0 else "file holds only whitespace"
        raise CorpusError(f"{source}: {problem}; add text or remove it from the corpus")


def _raw_lines(head: bytes, stream: BinaryIO) -> Iterator[bytes]:
    """Lines of the already-read *head* followed by the rest of *stream*, as bytes."""
    pending = b""
    for raw in head.splitlines(keepends=True):
        if raw.endswith(b"\n"):
            yield raw
        else:
            pending = raw  # only the last piece of head can lack its line ending
    for raw in stream:
        if pending:
            raw, pending = pending + raw, b""
        yield raw
    if pending:
        yield pending


def _decode_each_line(raws: Iterable[bytes], source: str, codec: str) -> Iterator[tuple[int, str]]:
    offset = 0
    for lineno, raw in enumerate(raws, 1):
        start = 0
        if lineno == 1 and codec == "utf-8" and raw.startswith(codecs.BOM_UTF8):
            start = len(codecs.BOM_UTF8)
        try:
            line = raw[start:].decode(codec)
        except UnicodeDecodeError as exc:
            bad = raw[start + exc.start : start + exc.start + 1].hex()
            raise CorpusError(
                f"{source}:{lineno}: invalid {codec} byte 0x{bad} at byte offset {offset + start + exc.start} of the file",
                hint=_ENCODING_FIX,
            ) from None
        offset += len(raw)
        yield lineno, line


# Codecs that read the byte order from a BOM; without one Python silently assumes little-endian.
_BOMS = {"utf-16": (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE), "utf-32": (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)}


def _decode_chunks(stream: BinaryIO, source: str, codec: str) -> Iterator[tuple[int, str]]:
    """Lines of an encoding not compatible with ASCII (UTF-16, UTF-32): decode, then split."""
    decoder = codecs.getincrementaldecoder(codec)(errors="strict")
    lineno, offset, pending = 0, 0, ""
    first = True
    while True:
        chunk = stream.read(_CHUNK_BYTES)
        if first and chunk and codec in _BOMS and not chunk.startswith(_BOMS[codec]):
            # decoding would go on in the wrong byte order and turn text into other text
            raise CorpusError(
                f"{source}: no byte order mark, so {codec} cannot tell the byte order",
                hint=("pass ", Param("encoding", f"{codec}-le"), f" or {codec}-be (or utf-8 if the file is UTF-8)"),
            )
        first = False
        buffered, flag = decoder.getstate()
        try:
            pending += decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as exc:
            # exc.start counts from the decoder's buffered bytes; decode up to it to find the line.
            before = codecs.getincrementaldecoder(codec)(errors="replace")
            before.setstate((b"", flag))
            text = pending + before.decode((buffered + chunk)[: exc.start])
            offset -= len(buffered)
            line = lineno + text.count("\n") + 1
            raise CorpusError(
                f"{source}:{line}: cannot decode as {codec} (byte offset {offset + exc.start} of the file)",
                hint=_ENCODING_FIX,
            ) from None
        offset += len(chunk)
        *complete, pending = pending.split("\n")
        for text in complete:
            lineno += 1
            yield lineno, text + "\n"
        if not chunk:
            break
    if pending:
        yield lineno + 1, pending


# --- formats: (numbered lines, source, text field) -> (start line, stripped text) ----------

Parsed = Iterator[tuple[int, str]]


def _parse_txt(lines: Iterable[tuple[int, str]], source: str, text_field: str) -> Parsed:
    start = 0
    block: list[str] = []
    for lineno, line in lines:
        content = line.rstrip("\r\n")
        if content.strip():
            if not block:
                start = lineno
            block.append(content)
        elif block:
            yield start, "\n".join(block).strip()
            block = []
    if block:
        yield start, "\n".join(block).strip()


def _parse_jsonl(lines: Iterable[tuple[int, str]], source: str, text_field: str) -> Parsed:
    for lineno, line in lines:
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            record = json.loads(line)
        except RecursionError:
            raise CorpusError(f"{where}: JSON nested too deeply to read; write one flat JSON object per line") from None
        except json.JSONDecodeError as exc:
            raise CorpusError(
                f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); write one JSON object per line"
            ) from None
        except ValueError as exc:  # an integer beyond Python's int-string limit
            if "integer string conversion" not in str(exc):
                raise
            raise CorpusError(
                f"{where}: a JSON number of more than {sys.get_int_max_str_digits():,} digits; "
                "store it as a JSON string (in quotes), or leave it out"
            ) from None
        if not isinstance(record, dict):
            raise CorpusError(
                f"{where}: expected a JSON object, found {_json_type(record)}; "
                f'write one JSON object per line, e.g. {{"{text_field}": "..."}}'
            )
        if text_field not in record:
            raise _missing_field(where, "JSON object has no field", text_field, list(record))
        value = record[text_field]
        if not isinstance(value, str):
            raise CorpusError(
                f"{where}: field {text_field!r} is {_json_type(value)}, not a string",
                hint=("store the text as a JSON string or ", *_FIELD_FIX),
            )
        lone = _LONE_SURROGATE.search(value)
        if lone is not None:
            raise CorpusError(
                f"{where}: field {text_field!r} holds a lone surrogate ({ascii(lone.group())[1:-1]} at character "
                f"{lone.start() + 1}), half of a character that no UTF-8 text holds; fix the text's encoding "
                "(a character beyond U+FFFF escaped as a pair, e.g. \\ud83d\\ude00, or written as itself)"
            )
        if value.strip():
            yield lineno, value.strip()


def _parse_csv(lines: Iterable[tuple[int, str]], source: str, text_field: str) -> Parsed:
    # One document may be a whole book; the default limit (128 KiB) is for spreadsheets.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    # strict: a stray quote is an error to report, not text to guess at.
    reader = csv.reader((line for _, line in lines), strict=True)
    try:
        header = next((row for row in reader if any(cell.strip() for cell in row)), None)
        if header is None:
            return  # no rows: the line reader has already reported the empty file
        columns = [cell.strip() for cell in header]
        if text_field not in columns:
            where = f"{source}:{reader.line_num}"
            raise _missing_field(where, "CSV header has no column", text_field, columns)
        column = columns.index(text_field)
        previous_end = reader.line_num
        for row in reader:
            start, previous_end = previous_end + 1, reader.line_num
            if not any(cell.strip() for cell in row):
                continue
            if len(row) <= column:
                raise CorpusError(
                    f"{source}:{start}: row has {len(row)} field(s) but column {text_field!r} "
                    f"is field {column + 1}; fix the row (quote fields that contain commas)"
                )
            if row[column].strip():
                yield start, row[column].strip()
    except csv.Error as exc:
        raise CorpusError(f"{source}:{reader.line_num}: malformed CSV ({exc}); fix the quoting of this row") from None


_PARSERS: dict[str, Callable[[Iterable[tuple[int, str]], str, str], Parsed]] = {
    ".txt": _parse_txt,
    ".jsonl": _parse_jsonl,
    ".csv": _parse_csv,
}


def _missing_field(where: str, problem: str, field: str, present: list[str]) -> CorpusError:
    shown = ", ".join(repr(name) for name in present[:20]) or "none"
    if len(present) > 20:
        shown += f", … ({len(present)} in all)"
    return CorpusError(f"{where}: {problem} {field!r} (present: {shown})", hint=_FIELD_FIX)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
