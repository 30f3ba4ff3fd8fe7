"""Tokens shown as text: a byte-level vocabulary's strings (Ġthe, Ċ) as what they read as, in
anchors, tables and inspect's axis labels (service/reports/tokens.py); known answers."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        ("Ġthe", "the"),  # a word: its leading space marks a word start
        ("Ġ", "␣"),  # white space alone: visible
        ("ĠĠ", "␣␣"),
        ("Ċ", "\\n"),
        ("ĊĊ", "\\n\\n"),
        ("ĉ", "\\t"),
        (",", ","),
        ("the", "the"),
        ("ĠcafÃ©", "café"),  # two bytes, one letter
        ("âĢ", "\\xe2\\x80"),  # the first bytes of a three-byte character, alone
        ("ĠNew", "New"),
    ],
)
def test_byte_level_strings_read_as_their_text(stored, shown):
    from headatlas.service.reports.tokens import token_label

    assert token_label(stored, True) == shown


def test_other_vocabularies_are_shown_as_stored():
    from headatlas.service.reports.tokens import is_byte_level_text, token_label

    wordpiece = ["[CLS]", "the", "##ing", ",", "ā", "[SEP]"]
    assert not is_byte_level_text(wordpiece)
    assert [token_label(t, False) for t in wordpiece] == wordpiece
    assert is_byte_level_text(["<|endoftext|>", "Ġthe", ","])


def test_anchor_lists_of_a_byte_level_run_read_as_text():
    from headatlas.service.reports.queries import anchors_as_text
    from headatlas.service.reports.report import split_anchors

    assert anchors_as_text("Ġthe 63%, Ġ 12%, Ċ 5%") == "the 63%, ␣ 12%, \\n 5%"
    assert anchors_as_text(", 30%, Ġ, 12%") == ", 30%, , 12%"
    assert split_anchors(anchors_as_text("Ġthe 63%, , 12%")) == ["the 63%", ", 12%"]
    assert anchors_as_text(None) is None


def test_inspect_axis_labels_of_byte_level_tokens():
    from headatlas.service.reports.matrix_plots import token_labels

    assert token_labels(["<|im_start|>", "The", "Ġcat", "Ġsat", ".", "Ċ", "ĠĠ"]) == [
        "<|im_start|>",
        "The",
        "cat",
        "sat",
        ".",
        "\\n",
        "␣␣",
    ]
    assert token_labels(["[CLS]", "the", "cat", "[SEP]"]) == ["[CLS]", "the", "cat", "[SEP]"]


def test_a_windows_tokens_read_as_running_text():
    """The head page's example window: a byte-level window's tokens decoded, each word's leading
    space kept and a newline made visible; a WordPiece window's as its tokenizer wrote them."""
    from headatlas.service.reports.tokens import window_tokens

    smollm2 = ["<|im_start|>", "Ġactors", "ĠMark", "Ċ", "Ġ", "ĠcafÃ©", "."]
    assert window_tokens(smollm2) == ["<|im_start|>", " actors", " Mark", "\\n", "␣", " café", "."]
    wordpiece = ["[CLS]", "the", "##ing", ",", "[SEP]"]
    assert window_tokens(wordpiece) == wordpiece
