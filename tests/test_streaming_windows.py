"""Documents are tokenised slice by slice: the same windows as the whole text, and memory that
does not grow with a document's length."""

from __future__ import annotations

import subprocess
import sys

import pytest

from headatlas.service.engine.corpus import iter_documents
from headatlas.service.engine.windows import TokenClasses, iter_document_windows
from headatlas.service.params import AnalysisParams


def test_slices_give_the_windows_of_the_whole_text(real_model, demo_corpus):
    """Slices of 50 characters (hundreds per document) against one call on the whole text."""
    tokenizer = real_model.tokenizer
    tokens = TokenClasses.from_tokenizer(tokenizer)
    params = AnalysisParams(seq_len=32, sentences="punct")
    checked = 0
    for doc in iter_documents(str(demo_corpus)):
        sliced = list(iter_document_windows(doc, tokenizer, tokens, real_model.tokenizer_key, params, slice_chars=50))
        whole = list(
            iter_document_windows(
                doc, tokenizer, tokens, real_model.tokenizer_key, params, slice_chars=len(doc.text) + 1
            )
        )
        assert sliced == whole
        expected = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        assert [piece for w in sliced for piece in w.input_ids[1:-1]] == expected
        checked += len(sliced)
    assert checked > 100


def test_segmenter_slices_end_at_sentence_starts(real_model, demo_corpus):
    """Under the segmenter a slice ends where its last sentence starts: slices of 1,000
    characters (several per document) give the windows, and the sentence ids, of the whole text."""
    tokenizer = real_model.tokenizer
    tokens = TokenClasses.from_tokenizer(tokenizer)
    params = AnalysisParams(seq_len=32, sentences="segmenter")
    checked = 0
    for doc in iter_documents(str(demo_corpus)):
        assert len(doc.text) > 2_000  # several slices per document
        sliced = list(
            iter_document_windows(doc, tokenizer, tokens, real_model.tokenizer_key, params, slice_chars=1_000)
        )
        whole = list(
            iter_document_windows(
                doc, tokenizer, tokens, real_model.tokenizer_key, params, slice_chars=len(doc.text) + 1
            )
        )
        assert sliced == whole
        checked += sum(max(w.sentence_ids) for w in sliced)
    assert checked > 100  # sentence breaks were compared, not only whole-window sentences


def test_first_windowing_stops_after_one_window(real_model, demo_corpus):
    doc = next(iter(iter_documents(str(demo_corpus))))
    params = AnalysisParams(seq_len=16, windowing="first")
    windows = list(
        iter_document_windows(
            doc,
            real_model.tokenizer,
            TokenClasses.from_tokenizer(real_model.tokenizer),
            real_model.tokenizer_key,
            params,
            slice_chars=40,
        )
    )
    assert len(windows) == 1 and len(windows[0].input_ids) == 16


PEAK = r"""
import resource, sys
from headatlas.service.engine.corpus import iter_documents
from headatlas.service.engine.model import load_model
from headatlas.service.params import AnalysisParams
from headatlas.service.engine.windows import TokenClasses, iter_document_windows

model = load_model("random:tiny", device="cpu")
tokens = TokenClasses.from_tokenizer(model.tokenizer)
doc = next(iter(iter_documents(sys.argv[1])))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = sum(1 for _ in iter_document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, AnalysisParams()))
print(n, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_a_long_line_is_windowed_in_bounded_memory(tmp_path):
    """A 1 MB one-line document: whole-text tokenisation grew the peak by ~160 bytes per character
    (~160 MB here, 800 MB for 5 MB); sliced, it grows by a few tens of MB at most (the windows of a
    batch, the text itself). 1 MB, not 2 as before: it tells the two apart as well, in half the CPU."""
    from tests.conftest import ROOT

    words = ["alpha", "beta", "gamma.", "delta,", "epsilon", "zeta"]
    line = " ".join(words[i % 6] for i in range(170_000))[:1_000_000]
    corpus = tmp_path / "line.txt"
    corpus.write_text(line + "\n", encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(corpus)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    windows, grown_mb = (int(x) for x in out.stdout.split())
    assert windows > 1500
    assert grown_mb < 80, f"peak grew by {grown_mb} MB while windowing a 1 MB line"
