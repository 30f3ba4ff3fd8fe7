"""What is read from a whole vocabulary (its fingerprint, its word tokens, whether it is byte-level)
is derived once per tokenizer object (service/engine/fingerprints.per_tokenizer), equal to deriving
it afresh, derived again when the vocabulary grows, and never shared between callers' copies."""

from __future__ import annotations

import copy

import pytest
import torch


@pytest.fixture()
def tokenizer(real_model):
    return copy.deepcopy(real_model.tokenizer)  # this test adds a token: a copy of its own


def test_derived_once_per_tokenizer_and_equal_to_deriving_afresh(tokenizer):
    from headatlas.service.engine import fingerprints, windows

    fresh_mask = windows._judge_words(tokenizer)
    fresh_print = fingerprints.tokenizer_fingerprint.__wrapped__(tokenizer)
    first = windows.word_token_mask(tokenizer)
    assert torch.equal(first, fresh_mask)
    assert fingerprints.tokenizer_fingerprint(tokenizer) == fresh_print
    assert windows._word_token_mask(tokenizer) is windows._word_token_mask(tokenizer)  # kept, not derived again
    first[:] = False  # a caller's copy: changing it changes no one else's
    assert torch.equal(windows.word_token_mask(tokenizer), fresh_mask)


def test_a_token_added_derives_them_again(tokenizer):
    from headatlas.service.engine import fingerprints, windows

    before_print = fingerprints.tokenizer_fingerprint(tokenizer)
    before_mask = windows.word_token_mask(tokenizer)
    tokenizer.add_tokens(["qqzzword"])
    after_mask = windows.word_token_mask(tokenizer)
    assert fingerprints.tokenizer_fingerprint(tokenizer) != before_print
    assert after_mask.shape[0] == before_mask.shape[0] + 1 and bool(after_mask[-1])
    assert torch.equal(after_mask, windows._judge_words(tokenizer))


def test_the_same_vocabulary_loaded_again_is_judged_once(tokenizer, monkeypatch):
    """A second object of the same tokenizer (a model loaded again) reuses the judged mask; one whose
    vocabulary differs (a token added) is judged afresh."""
    from headatlas.service.engine import fingerprints, windows

    judged = []
    judge = windows._judge_words
    # each object on its own here, not by the files it was read from (the test below)
    monkeypatch.setattr(fingerprints, "_source_key", lambda tokenizer, size: None)
    monkeypatch.setattr(windows, "_judge_words", lambda t: judged.append(t) or judge(t))
    monkeypatch.setattr(windows, "_MASKS", {})
    first = windows.word_token_mask(tokenizer)
    again = copy.deepcopy(tokenizer)  # another object, the same vocabulary
    assert torch.equal(windows.word_token_mask(again), first) and judged == [tokenizer]
    again.add_tokens(["qqzzother"])
    grown = windows.word_token_mask(again)
    assert judged == [tokenizer, again] and grown.shape[0] == first.shape[0] + 1
    assert torch.equal(grown, judge(again))


def test_a_tokenizer_loaded_again_from_its_files_is_not_derived_again(tmp_path, monkeypatch):
    """A second load of the same files (a model loaded again; every ``random:`` model reads the
    default model's tokenizer) takes what the first derived; a copy of the files changed on disk
    is derived afresh."""
    import shutil

    from transformers import AutoTokenizer

    from headatlas.service.engine import fingerprints
    from headatlas.service.engine.model import default_model_dir

    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "config.json"):
        if (default_model_dir() / name).is_file():
            shutil.copy(default_model_dir() / name, folder / name)
    derived = []
    fingerprint = fingerprints.per_tokenizer(
        lambda t: derived.append(t) or fingerprints.tokenizer_fingerprint.__wrapped__(t)
    )
    first, again = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert fingerprint(first) == fingerprint(again) == fingerprints.tokenizer_fingerprint.__wrapped__(again)
    assert derived == [first]
    grown = AutoTokenizer.from_pretrained(folder)
    grown.add_tokens(["qqzzloaded"])
    assert fingerprint(grown) != fingerprint(first) and derived == [first, grown]
    vocab = folder / "vocab.txt"  # the files changed on disk: another vocabulary
    vocab.write_text(vocab.read_text(encoding="utf-8").replace("\nthe\n", "\nthee\n", 1), encoding="utf-8")
    (folder / "tokenizer.json").unlink()
    changed = AutoTokenizer.from_pretrained(folder)
    assert fingerprint(changed) == fingerprints.tokenizer_fingerprint.__wrapped__(changed) != fingerprint(first)
    assert derived == [first, grown, changed]
