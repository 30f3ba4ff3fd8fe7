"""A metric with a sum of its own: of the high-similarity pairs H, those whose two tokens are both
punctuation. Its measure puts the per-head count in the batch result as the head sum
``"punct_pairs.both_punct"``; headatlas stores it by name (table ``named_head_sums``, no migration
of the plugin's) and the views read it as a column of that name, after the next
`headatlas db upgrade` (or when a database is created)."""

from headatlas.service.metrics import SHARE, Column, Metric, Shown, head_int

BOTH_PUNCT = Metric(
    "both_punct",
    "§5",
    "share of the high-similarity pairs whose two tokens are both punctuation",
    "",
    (
        Column(
            "both_punct_share",
            '"punct_pairs.both_punct" / nullif(high_pairs, 0)',  # its own sum beside headatlas's
            "share of H with both tokens punctuation",
            bounds=SHARE,
            shown=Shown.PAGE,  # in the head tables of the web page and the report
        ),
        Column(
            "word_pairs_share",
            "1 - both_punct_share",  # its own earlier column
            "share of H with a token that is not punctuation",
            bounds=SHARE,
        ),
        Column(
            "both_punct_per_window",
            '"punct_pairs.both_punct" / nullif(windows, 0)',
            "pairs of H both punctuation, per window",
            interval=False,
            layers=False,
        ),
    ),
    sums=(head_int("punct_pairs.both_punct"),),
)
