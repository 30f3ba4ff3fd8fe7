"""A metric derived from sums headatlas stores already: no sums of its own, so no column and no
migration; its view column is built into head_metrics and layer_metrics (and their replicate
rows, so `--ci` intervals follow) by the next `headatlas db upgrade`, or when a database is created."""

from headatlas.service.metrics import SHARE, Column, Metric

ATTENDED_SHARE = Metric(
    "attended_share",
    "§3, §5",
    "share of the high-similarity pairs that attention connects (they pass the attention gate)",
    "",
    (Column("attended_share", "attended_high / nullif(high_pairs, 0)", "attended_high / high_pairs", bounds=SHARE),),
)
