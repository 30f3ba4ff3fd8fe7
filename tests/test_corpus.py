"""Corpus input: formats, specs, stable ids, line numbers and every user-facing error."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from headatlas.service.engine.corpus import (
    Document,
    corpus_files,
    corpus_fingerprint,
    corpus_size_bytes,
    demo_corpus_path,
    document_id,
    iter_documents,
    spool_stdin,
)
from headatlas.service.errors import CorpusError


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", newline="")
    return path


def docs(spec: Path | str, **kwargs) -> list[Document]:
    return list(iter_documents(str(spec), **kwargs))


def corpus_error(spec: Path | str, **kwargs) -> str:
    with pytest.raises(CorpusError) as info:
        docs(spec, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- formats ---------------------------------------------------------------------------------


def test_txt_documents_split_on_blank_lines_with_start_lines(tmp_path):
    path = write(tmp_path / "c.txt", "\n\nFirst para.\nSecond line.\n\n \n\nNext doc  \n\n\nLast")
    result = docs(path)
    assert [(d.index, d.line, d.text) for d in result] == [
        (0, 3, "First para.\nSecond line."),
        (1, 8, "Next doc"),
        (2, 11, "Last"),
    ]
    assert {d.source for d in result} == {str(path)}


def test_txt_crlf_and_utf8_bom(tmp_path):
    path = write(tmp_path / "c.txt", b"\xef\xbb\xbfOne\r\ntwo\r\n\r\nthree\r\n")
    assert [(d.line, d.text) for d in docs(path)] == [(1, "One\ntwo"), (4, "three")]


def test_jsonl_field_line_numbers_and_empty_texts_skipped(tmp_path):
    lines = [
        json.dumps({"text": "  alpha  ", "id": 1}),
        "",
        json.dumps({"text": ""}),
        json.dumps({"body": "beta", "text": "gamma"}),
    ]
    path = write(tmp_path / "c.jsonl", "\n".join(lines) + "\n")
    result = docs(path)
    assert [(d.index, d.line, d.text) for d in result] == [(0, 1, "alpha"), (1, 4, "gamma")]


def test_jsonl_custom_text_field(tmp_path):
    path = write(tmp_path / "c.jsonl", '{"body": "beta"}\n{"body": "delta"}\n')
    assert [d.text for d in docs(path, text_field="body")] == ["beta", "delta"]


def test_csv_header_quoted_multiline_and_start_lines(tmp_path):
    content = 'id,text\n1,"hello, world"\n2,"multi\nline"\n\n3,plain\n4,\n'
    path = write(tmp_path / "c.csv", content)
    assert [(d.index, d.line, d.text) for d in docs(path)] == [
        (0, 2, "hello, world"),
        (1, 3, "multi\nline"),
        (2, 6, "plain"),
    ]


def test_csv_long_field_beyond_default_limit(tmp_path):
    long_text = "word " * 40_000  # 200 KB, over csv's default 128 KiB field limit
    path = write(tmp_path / "c.csv", f'text\n"{long_text}"\n')
    assert docs(path)[0].text == long_text.strip()


def test_other_encoding_via_flag(tmp_path):
    path = write(tmp_path / "c.txt", "café au lait\n".encode("latin-1"))
    assert docs(path, encoding="latin-1")[0].text == "café au lait"
    path16 = write(tmp_path / "d.txt", "one\n\ntwo\n".encode("utf-16"))
    assert [(d.line, d.text) for d in docs(path16, encoding="utf-16")] == [(1, "one"), (3, "two")]


# --- specs: directory, glob, stdin -----------------------------------------------------------


def test_directory_recursive_sorted_supported_only(tmp_path):
    write(tmp_path / "b.txt", "bee\n")
    write(tmp_path / "a" / "z.jsonl", '{"text": "zed"}\n')
    write(tmp_path / "c.csv", "text\nsea\n")
    write(tmp_path / "notes.md", "ignored\n")
    write(tmp_path / ".hidden" / "x.txt", "ignored\n")
    files = corpus_files(str(tmp_path))
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["a/z.jsonl", "b.txt", "c.csv"]
    assert [d.text for d in docs(tmp_path)] == ["zed", "bee", "sea"]
    assert [d.index for d in docs(tmp_path)] == [0, 0, 0]
    assert corpus_size_bytes(str(tmp_path)) == sum(p.stat().st_size for p in files)


def test_glob_pattern(tmp_path):
    write(tmp_path / "one.txt", "1\n")
    write(tmp_path / "two.txt", "2\n")
    write(tmp_path / "three.jsonl", '{"text": "3"}\n')
    assert [d.text for d in docs(tmp_path / "*.txt")] == ["1", "2"]
    assert [d.text for d in docs(tmp_path / "**" / "t*")] == ["3", "2"]


def test_stdin_spooled_to_temp_txt(tmp_path):
    path = spool_stdin(io.BytesIO(b"from stdin\n\nsecond\n"))
    try:
        assert path.suffix == ".txt"
        assert [d.text for d in docs(path)] == ["from stdin", "second"]
        assert corpus_fingerprint(str(path)) == corpus_fingerprint(
            str(write(tmp_path / path.name, b"from stdin\n\nsecond\n"))
        )
    finally:
        path.unlink()


def test_spool_empty_stdin_is_an_error():
    with pytest.raises(CorpusError, match="<stdin>: no input"):
        spool_stdin(io.BytesIO(b""))


def test_dash_reads_stdin_directly(monkeypatch):
    fake = io.TextIOWrapper(io.BytesIO(b"alpha\n\nbeta\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", fake)
    result = docs("-")
    assert [(d.source, d.line, d.text) for d in result] == [("<stdin>", 1, "alpha"), ("<stdin>", 3, "beta")]
    assert corpus_files("-") == []
    assert corpus_size_bytes("-") == 0


def test_fingerprint_of_stdin_needs_spooling():
    with pytest.raises(CorpusError, match="spool_stdin"):
        corpus_fingerprint("-")


def test_fingerprint_of_one_file_tracks_its_content_and_suffix_not_its_name(tmp_path):
    one = write(tmp_path / "one" / "c.txt", "same\n")
    two = write(tmp_path / "two" / "c.txt", "same\n")
    assert corpus_fingerprint(str(one)) == corpus_fingerprint(str(two))
    renamed = write(tmp_path / "three" / "d.TXT", "same\n")  # a copy under another name: the same corpus
    assert corpus_fingerprint(str(renamed)) == corpus_fingerprint(str(one))
    as_csv = write(tmp_path / "four" / "c.csv", "same\n")  # read as CSV: another corpus
    assert corpus_fingerprint(str(as_csv)) != corpus_fingerprint(str(one))
    write(one, "changed\n")
    assert corpus_fingerprint(str(one)) != corpus_fingerprint(str(two))


def test_fingerprint_of_several_files_keeps_their_names(tmp_path):
    write(tmp_path / "a" / "x.txt", "first\n")
    write(tmp_path / "a" / "y.txt", "second\n")
    write(tmp_path / "b" / "x.txt", "first\n")
    write(tmp_path / "b" / "z.txt", "second\n")
    write(tmp_path / "c" / "x.txt", "first\n")
    write(tmp_path / "c" / "y.txt", "second\n")
    assert corpus_fingerprint(str(tmp_path / "a")) == corpus_fingerprint(str(tmp_path / "c"))
    assert corpus_fingerprint(str(tmp_path / "a")) != corpus_fingerprint(str(tmp_path / "b"))


# --- ids -------------------------------------------------------------------------------------


def test_doc_ids_are_content_addressed(tmp_path):
    a = docs(write(tmp_path / "a.txt", "same text\n\nother text\n"))
    b = docs(write(tmp_path / "b.jsonl", '{"text": "same text"}\n'))
    assert a[0].doc_id == b[0].doc_id == document_id("same text")
    assert a[0].doc_id != a[1].doc_id
    assert len(a[0].doc_id) == 32 and int(a[0].doc_id, 16) >= 0


# --- errors: each names the file (and line) and the fix --------------------------------------


def test_missing_path(tmp_path):
    message = corpus_error(tmp_path / "nope.txt")
    assert "nope.txt" in message and "no such file" in message and "- for stdin" in message


def test_glob_matching_nothing(tmp_path):
    message = corpus_error(tmp_path / "*.txt")
    assert "*.txt" in message and "glob matches no file" in message


def test_directory_without_corpus_files(tmp_path):
    write(tmp_path / "readme.md", "x\n")
    assert "directory holds no .txt, .jsonl, .csv file" in corpus_error(tmp_path)


@pytest.mark.parametrize("name", ["c.md", "c.json", "noext"])
def test_unsupported_extension(tmp_path, name):
    message = corpus_error(write(tmp_path / name, "text\n"))
    assert name in message and "supported: .txt, .jsonl, .csv" in message


def test_glob_matching_unsupported_file(tmp_path):
    write(tmp_path / "a.txt", "x\n")
    write(tmp_path / "b.md", "x\n")
    message = corpus_error(tmp_path / "*")
    assert "b.md" in message and "narrow the pattern" in message


@pytest.mark.parametrize("content", [b"", b"  \n\n\t\n"])
@pytest.mark.parametrize("name", ["c.txt", "c.jsonl", "c.csv"])
def test_empty_file(tmp_path, name, content):
    message = corpus_error(write(tmp_path / name, content))
    assert name in message and ("file is empty" in message or "only whitespace" in message)
    assert "add text" in message


def test_empty_file_in_directory_named_after_earlier_documents(tmp_path):
    write(tmp_path / "a.txt", "fine\n")
    write(tmp_path / "b.txt", "")
    stream = iter_documents(str(tmp_path))
    assert next(stream).text == "fine"
    with pytest.raises(CorpusError, match=r"b\.txt: file is empty"):
        next(stream)


def test_binary_file_detected_before_any_document(tmp_path):
    path = write(tmp_path / "c.txt", b"looks fine\n\n" + b"\x00\x01\x02" * 10)
    message = corpus_error(path)
    assert "c.txt" in message and "binary file" in message and "offset 12" in message


def test_invalid_utf8_names_line_and_offset(tmp_path):
    path = write(tmp_path / "c.txt", b"ok line\n\nbad \xff here\n")
    message = corpus_error(path)
    assert f"{path}:3:" in message
    assert "0xff" in message and "byte offset 13" in message
    assert "re-encode as UTF-8 or pass --encoding" in message


def test_invalid_utf16_names_line(tmp_path):
    path = write(tmp_path / "c.txt", "one\ntwo\n".encode("utf-16-le") + b"\x00\xdc")  # lone surrogate
    message = corpus_error(path, encoding="utf-16-le")
    assert f"{path}:3:" in message and "re-encode as UTF-8 or pass --encoding" in message


def test_unknown_encoding(tmp_path):
    message = corpus_error(write(tmp_path / "c.txt", "x\n"), encoding="nope-8")
    assert "'nope-8'" in message and "--encoding" in message


def test_jsonl_invalid_json(tmp_path):
    path = write(tmp_path / "c.jsonl", '{"text": "ok"}\n{"text": oops}\n')
    message = corpus_error(path)
    assert f"{path}:2:" in message and "not valid JSON" in message and "one JSON object per line" in message


def test_jsonl_not_an_object(tmp_path):
    path = write(tmp_path / "c.jsonl", '{"text": "ok"}\n\n["text"]\n')
    message = corpus_error(path)
    assert f"{path}:3:" in message and "expected a JSON object, found an array" in message


def test_jsonl_missing_field(tmp_path):
    path = write(tmp_path / "c.jsonl", '{"body": "x", "id": 3}\n')
    message = corpus_error(path)
    assert f"{path}:1:" in message and "'text'" in message
    assert "present: 'body', 'id'" in message and "pass --text-field NAME" in message


@pytest.mark.parametrize(("value", "kind"), [("null", "null"), ("3", "a number"), ('["a"]', "an array")])
def test_jsonl_field_not_a_string(tmp_path, value, kind):
    path = write(tmp_path / "c.jsonl", '{"text": "ok"}\n{"text": ' + value + "}\n")
    message = corpus_error(path)
    assert f"{path}:2:" in message and f"'text' is {kind}, not a string" in message
    assert "--text-field" in message


def test_csv_missing_column(tmp_path):
    path = write(tmp_path / "c.csv", "id,body\n1,hello\n")
    message = corpus_error(path)
    assert f"{path}:1:" in message and "no column 'text'" in message
    assert "present: 'id', 'body'" in message and "pass --text-field NAME" in message


def test_csv_short_row(tmp_path):
    path = write(tmp_path / "c.csv", "id,text\n1,ok\n2\n")
    message = corpus_error(path)
    assert f"{path}:3:" in message and "fix the row" in message


def test_csv_malformed_row(tmp_path):
    path = write(tmp_path / "c.csv", 'text\n"ok"\n"bad"x"\n')
    message = corpus_error(path)
    assert f"{path}:3:" in message and "malformed CSV" in message


def test_corpus_without_any_text(tmp_path):
    path = write(tmp_path / "c.jsonl", '{"text": ""}\n{"text": "   "}\n')
    message = corpus_error(path)
    assert str(path) in message and "no document with text" in message and "--text-field" in message


# --- shipped demo corpus ---------------------------------------------------------------------


def test_demo_corpus_loads():
    path = demo_corpus_path()
    result = docs(path)
    assert len(result) >= 6
    assert len({d.doc_id for d in result}) == len(result)
    assert 25_000 <= path.stat().st_size <= 35_000
    assert (path.parent / "ATTRIBUTION.md").is_file()


def test_module_stays_pure():
    code = (
        "import sys, headatlas.service.engine.corpus; "
        "bad = {'torch', 'celery', 'typer', 'sqlalchemy'} & {m.split('.')[0] for m in sys.modules}; "
        "sys.exit(sorted(bad) or 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
