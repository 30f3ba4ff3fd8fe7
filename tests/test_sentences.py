"""Sentence ids (SPEC §1 punct, §5b segmenter): what each mode does to hard cases, token by token;
punct reproduces earlier runs (numbers and run key); the segmenter's ids travel with the windows
through the queue, inspect and schedules."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from headatlas.service.engine.analysis import analyze_batch
from headatlas.service.engine.corpus import Document, demo_corpus_path, document_id
from headatlas.service.engine.features import window_features
from headatlas.service.engine.sentences import piece_sentences, sentence_starts
from headatlas.service.engine.windows import TokenClasses, Window, collate, document_windows
from headatlas.service.errors import ParameterError
from headatlas.service.params import AnalysisParams

SEGMENTER = AnalysisParams(sentences="segmenter")
# the rules of the runs stored before the segmenter and before groups by document (SPEC §5d)
PUNCT = AnalysisParams(sentences="punct", replicates="window")


def _windows(model, text: str, params: AnalysisParams) -> list[Window]:
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    doc = Document(document_id(text), "<test>", 0, 1, text)
    return document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, params)


def _counted_ids(model, text: str, params: AnalysisParams) -> list[int]:
    """Sentence ids of the first window as the statistics count them (window_features)."""
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    batch = collate(_windows(model, text, params)[:1], tokens.pad_id)
    feats = window_features(batch.input_ids, batch.attention_mask, tokens, sentence=batch.sentence)
    return feats.sentence[0].tolist()


# text, word pieces (default tokenizer), sentence ids under segmenter, under punct
HARD_CASES = {
    "abbreviations": (
        "Mr. Smith met Mrs. Jones. They talked.",
        "[CLS] mr . smith met mrs . jones . they talked . [SEP]",
        [-1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1],
        [-1, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, -1],
    ),
    "quote-inside": (  # "!" inside a quotation does not end the sentence around it
        'She said "Stop!" and left. He stayed.',
        '[CLS] she said " stop ! " and left . he stayed . [SEP]',
        [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1],
        [-1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, -1],
    ),
    "quote-closing": (  # the closing quote belongs to the sentence it closes
        'He said "Go home." She left.',
        '[CLS] he said " go home . " she left . [SEP]',
        [-1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1],
        [-1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1],
    ),
    "quote-of-two-sentences": (  # sentences inside a quotation end; the closing quote joins the last
        'He said: "I came. I saw." Then he left.',
        '[CLS] he said : " i came . i saw . " then he left . [SEP]',
        [-1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, -1],
        [-1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, -1],
    ),
    "ellipsis": (
        "Wait... then go. Fine.",
        "[CLS] wait . . . then go . fine . [SEP]",
        [-1, 0, 0, 0, 0, 0, 0, 0, 1, 1, -1],
        [-1, 0, 0, 1, 2, 3, 3, 3, 4, 4, -1],
    ),
    "decimal": (
        "Pi is 3.14 today. It rose.",
        "[CLS] pi is 3 . 14 today . it rose . [SEP]",
        [-1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1],
        [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, -1],
    ),
    "e.g.": (
        "Use fruit, e.g. apples. Eat them.",
        "[CLS] use fruit , e . g . apples . eat them . [SEP]",
        [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1],
        [-1, 0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 3, -1],
    ),
    "initials": (
        "J. R. R. Tolkien wrote. He died.",
        "[CLS] j . r . r . tolkien wrote . he died . [SEP]",
        [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1],
        [-1, 0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, -1],
    ),
    "special-inside": (  # [UNK] and a literal [SEP] are special tokens: no sentence in either mode
        "Snow ☃ fell. A [SEP] b.",
        "[CLS] snow [UNK] fell . a [SEP] b . [SEP]",
        [-1, 0, -1, 0, 0, 1, -1, 1, 1, -1],
        [-1, 0, -1, 0, 0, 1, -1, 1, 1, -1],
    ),
    # lists without final punctuation: neither mode breaks plain or bulleted lines inside a
    # paragraph (no sentence end is written; a blank line would end the paragraph) — shown here so
    # that a change is noticed
    "list-plain": (
        "Apples\nPears\nPlums",
        "[CLS] apples pear ##s plum ##s [SEP]",
        [-1, 0, 0, 0, 0, 0, -1],
        [-1, 0, 0, 0, 0, 0, -1],
    ),
    "list-bulleted": (
        "Ingredients:\n- flour\n- sugar\nMix well.",
        "[CLS] ingredients : - flour - sugar mix well . [SEP]",
        [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1],
        [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1],
    ),
}


@pytest.mark.parametrize("case", list(HARD_CASES), ids=list(HARD_CASES))
def test_hard_cases_token_by_token(tiny_model, case):
    text, pieces, segmenter, punct = HARD_CASES[case]
    window = _windows(tiny_model, text, SEGMENTER)[0]
    assert " ".join(tiny_model.tokenizer.convert_ids_to_tokens(window.input_ids)) == pieces
    assert _counted_ids(tiny_model, text, SEGMENTER) == segmenter
    assert _counted_ids(tiny_model, text, PUNCT) == punct


def test_a_piece_belongs_to_the_sentence_that_holds_its_first_character():
    text = "Hi there. Bye now."
    assert sentence_starts(text) == [0, 10]
    # (start, end) character spans; "e. B" straddles the boundary and starts in sentence 0
    offsets = [(0, 2), (3, 8), (8, 9), (7, 11), (10, 13), (14, 17), (17, 18)]
    assert piece_sentences(text, offsets) == [0, 0, 0, 0, 1, 1, 1]
    # offsets are str indices (code points), not bytes: accented and astral characters
    text = "Café 😀 crème. Ça va."
    assert sentence_starts(text) == [0, 14]
    assert text[14:] == "Ça va."


def test_ids_are_numbered_per_window_and_special_and_pad_tokens_get_minus_one(tiny_model):
    text = "One two three four. Five six seven eight nine ten. Eleven."
    params = AnalysisParams(sentences="segmenter", seq_len=8)  # six word pieces per window
    windows = _windows(tiny_model, text, params)
    tokens = TokenClasses.from_tokenizer(tiny_model.tokenizer)
    assert [tiny_model.tokenizer.convert_ids_to_tokens(w.input_ids)[1:-1] for w in windows] == [
        ["one", "two", "three", "four", ".", "five"],
        ["six", "seven", "eight", "nine", "ten", "."],
        ["eleven", "."],
    ]
    # the second window continues sentence 1 of the document: it is sentence 0 of its window
    assert [w.sentence_ids for w in windows] == [
        (-1, 0, 0, 0, 0, 0, 1, -1),
        (-1, 0, 0, 0, 0, 0, 0, -1),
        (-1, 0, 0, -1),
    ]
    batch = collate(windows, tokens.pad_id)
    assert batch.sentence.dtype == torch.int64
    assert batch.sentence[2].tolist() == [-1, 0, 0, -1, -1, -1, -1, -1]  # pads: -1
    # punct windows carry nothing: their ids come from the token ids, as before
    assert all(w.sentence_ids is None for w in _windows(tiny_model, text, AnalysisParams(sentences="punct", seq_len=8)))
    with pytest.raises(ParameterError, match="mixes windows with and without sentence ids"):
        collate([windows[0], Window(windows[1].window_id, windows[1].doc_id, 1, windows[1].input_ids)], tokens.pad_id)


def test_a_segmenter_run_refuses_a_batch_without_sentence_ids(tiny_model):
    tokens = TokenClasses.from_tokenizer(tiny_model.tokenizer)
    batch = collate(_windows(tiny_model, "One. Two.", PUNCT), tokens.pad_id)
    with pytest.raises(ParameterError, match="--sentences segmenter: the batch's windows carry no sentence ids"):
        analyze_batch(tiny_model, batch, SEGMENTER, tokens)


# --- parameters, run key, stored schedules ---------------------------------------------------

# AnalysisParams(sentences="punct").key() as computed by the code before --sentences had a choice
PUNCT_PARAMS_KEY = "72ec943fff34a806"


def test_default_is_the_segmenter_and_punct_keeps_its_run_key():
    assert AnalysisParams().sentences == "segmenter"
    assert PUNCT.key() == PUNCT_PARAMS_KEY
    assert PUNCT.to_dict()["sentences"] == "punct"
    assert SEGMENTER.key() != PUNCT.key()
    assert AnalysisParams.from_dict(SEGMENTER.to_dict()) == SEGMENTER
    # the segmenter and its version are recorded: other sentence rules make another run
    from importlib.metadata import version

    assert SEGMENTER.to_dict()["segmenter"] == f"syntok {version('syntok')}"
    assert "segmenter" not in PUNCT.to_dict()
    with pytest.raises(ParameterError, match="--sentences 'spacy': choose one of segmenter, punct"):
        AnalysisParams(sentences="spacy")


def test_parameters_stored_without_the_field_load_as_punct():
    """Stored parameters (a run's, a schedule's) that lack ``sentences`` were made with punct and
    keep it, with the same key."""
    old = PUNCT.to_dict()
    del old["sentences"]
    loaded = AnalysisParams.from_dict(old)
    assert loaded.sentences == "punct" and loaded.key() == PUNCT_PARAMS_KEY


def test_an_old_stored_schedule_fires_with_punct(tmp_path):
    from headatlas.service.schedules import Cadence
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.db import transaction, upgrade

    db = str(tmp_path / "s.duckdb")
    upgrade(db)
    old = PUNCT.to_dict()
    del old["sentences"]
    schedule_store.add(
        db,
        name="old",
        corpus=str(demo_corpus_path()),
        model="random:tiny",
        dtype="float32",
        batch_size=4,
        params=old,
        cadence=Cadence(cron=None, every_s=3600),
        only_new=False,
    )
    schedule_store.add(
        db,
        name="new",
        corpus=str(demo_corpus_path()),
        model="random:tiny",
        dtype="float32",
        batch_size=4,
        params=AnalysisParams().to_dict(),
        cadence=Cadence(cron=None, every_s=3600),
        only_new=False,
    )
    with transaction(db, read_only=True) as conn:
        # what beat does with a schedule's stored parameters (workers/beat.py fire)
        assert AnalysisParams.from_dict(schedule_store.get(conn, "old").params).sentences == "punct"
        assert AnalysisParams.from_dict(schedule_store.get(conn, "new").params).sentences == "segmenter"


def test_every_analysis_command_takes_sentences():
    import typer.main

    from headatlas.cli.main import app

    root = typer.main.get_command(app)
    commands = {
        "analyze": root.commands["analyze"],
        "submit": root.commands["submit"],
        "inspect": root.commands["inspect"],
        "schedule add": root.commands["schedule"].commands["add"],
    }
    for name, command in commands.items():
        option = next((p for p in command.params if "--sentences" in p.opts), None)
        assert option is not None, f"headatlas {name} has no --sentences"
        assert option.default == "segmenter", name


# --- punct reproduces earlier runs -----------------------------------------------------------

# A punct run of the tiny model on the shipped excerpt (seq_len 128, batch size 32), as stored by
# the code before the segmenter existed: run_chance sums (windows, pairs, same_sentence_pairs,
# same_token_pairs) and same_sentence_high per (layer, head). (Its run key then was
# 915f37b26e59bce804759bcb; run keys now also hold the weights' identity, so only the parameters'
# part, PUNCT_PARAMS_KEY, stays as it was.)
EARLIER_CHANCE = [52, 373522, 86035, 5027]
EARLIER_SAME_SENTENCE_HIGH = [1849, 1675, 1685, 1569, 1684, 1808, 1638, 1630]


def _stored_sums(db: str, run_id: int):
    from sqlalchemy import text

    from headatlas.service.storage.db import transaction

    with transaction(db, read_only=True) as conn:
        key = conn.execute(text("SELECT run_key FROM runs WHERE run_id = :r"), {"r": run_id}).scalar()
        chance = conn.execute(
            text(
                "SELECT sum(windows), sum(pairs), sum(same_sentence_pairs), sum(same_token_pairs) "
                "FROM run_chance WHERE run_id = :r"
            ),
            {"r": run_id},
        ).one()
        heads = conn.execute(
            text(
                "SELECT layer, head, sum(same_sentence_high) FROM head_stats WHERE run_id = :r "
                "GROUP BY ALL ORDER BY layer, head"
            ),
            {"r": run_id},
        ).all()
    return key, [int(c) for c in chance], [int(h[2]) for h in heads]


def test_a_punct_run_on_the_excerpt_stores_what_earlier_runs_stored(tiny_model, tmp_path):
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    spec = str(demo_corpus_path())
    summary = survey_corpus(spec)
    db = str(tmp_path / "punct.duckdb")
    run = analyze_corpus(spec, store=Store(db), model=tiny_model, params=PUNCT, corpus=summary, batch_size=32)
    punct_key, chance, heads = _stored_sums(db, run.run_id)
    # The chance sums are integer arithmetic on the sentence ids: equal. Which pairs make a head's
    # top 2% depends on float rounding, which differs between CPUs (AVX-512 and AVX2 sum in another
    # order): a few pairs of ~1,700 per head cross the cut, so the head counts agree within 0.5%.
    assert chance == EARLIER_CHANCE
    assert len(heads) == len(EARLIER_SAME_SENTENCE_HIGH)
    assert all(abs(now - then) <= 0.005 * then for now, then in zip(heads, EARLIER_SAME_SENTENCE_HIGH)), heads
    assert run.params == PUNCT.to_dict() and PUNCT.key() == PUNCT_PARAMS_KEY

    # the segmenter is another run, with fewer false breaks: more pairs share a sentence
    db = str(tmp_path / "segmenter.duckdb")
    run = analyze_corpus(spec, store=Store(db), model=tiny_model, params=SEGMENTER, corpus=summary, batch_size=32)
    key, chance, _heads = _stored_sums(db, run.run_id)
    assert key != punct_key
    assert chance[:2] == EARLIER_CHANCE[:2] and chance[3] == EARLIER_CHANCE[3]
    assert chance[2] > EARLIER_CHANCE[2]


# --- the ids travel: queue, inspect ----------------------------------------------------------


def test_a_queued_batch_carries_the_embedded_sentence_ids(tiny_model, small_corpus):
    """The batch message a worker receives (made by the submitter, through Celery's JSON) gives the
    worker the windows, sentence ids included, that the embedded engine analyses, and the same sums."""
    from headatlas.service.engine.results import BatchResult
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.workers.submit import batch_payloads
    from headatlas.workers.tasks import _analyse

    tokens = TokenClasses.from_tokenizer(tiny_model.tokenizer)
    params = AnalysisParams(sentences="segmenter", seq_len=32)
    embedded = list(iter_batches(str(small_corpus), tiny_model, params, tokens, batch_size=4))
    queued = list(
        batch_payloads(
            str(small_corpus), tiny_model, params, model="random:tiny", dtype="float32", batch_size=4, database_id=""
        )
    )
    assert len(queued) == len(embedded) > 2
    for (batch, docs, _consumed), (_batch_id, _n, payload) in zip(embedded, queued):
        message = json.loads(json.dumps(payload))  # what the worker receives
        received = [Window.from_message(row) for row in message["windows"]]
        assert received == batch.windows
        assert all(w.sentence_ids is not None for w in received)
        assert torch.equal(collate(received, tokens.pad_id).sentence, batch.sentence)
        worker = BatchResult.from_bytes(base64.b64decode(_analyse(tiny_model, message)))
        here = analyze_batch(tiny_model, batch, params, tokens, documents=docs)
        assert worker.chance == here.chance
        assert (worker.heads["same_sentence_high"] == here.heads["same_sentence_high"]).all()
    # punct messages are as before: four fields per window
    punct = next(
        iter(
            batch_payloads(
                str(small_corpus),
                tiny_model,
                AnalysisParams(sentences="punct", seq_len=32),
                database_id="",
                model="random:tiny",
                dtype="float32",
                batch_size=4,
            )
        )
    )[2]
    assert {len(row) for row in punct["windows"]} == {4}


def test_inspect_shows_the_sentences_of_the_chosen_mode(tiny_model):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.reports.inspection import inspect_text

    text, _pieces, segmenter, punct = HARD_CASES["abbreviations"]
    insp = inspect_text(tiny_model, text, build_params())
    assert insp.params.sentences == "segmenter"
    assert insp.sentence.tolist() == segmenter and insp.sentence_starts() == [9]
    insp = inspect_text(tiny_model, text, build_params(sentences="punct"))
    assert insp.sentence.tolist() == punct and insp.sentence_starts() == [3, 7, 9]


def test_a_stray_apostrophe_does_not_glue_a_paragraph_into_one_sentence():
    # Wikipedia writes the possessive of a plural band name as "Beach Boys '": a segmenter that
    # pairs it with a later apostrophe as a quotation (sentencex did) swallows every sentence in
    # between — 23 % of 1,067 Wikipedia windows became a single sentence that way.
    from headatlas.service.engine.sentences import sentence_starts

    middle = " ".join(f"Sentence number {i} ends here." for i in range(30))
    text = (
        'The clip recalls the Beach Boys \' "Surfer Girl" and Presley\'s "Jailhouse Rock". '
        + middle
        + ' It also recalls the Beach Boys \' "Surfer Girl", among others.'
    )
    starts = sentence_starts(text)
    assert len(starts) == 32
    assert text[starts[1] :].startswith("Sentence number 0 ends here.")
    assert text[starts[-1] :].startswith("It also recalls")
