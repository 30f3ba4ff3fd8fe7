"""The Python API for notebooks: the functions behind the CLI, returning tables.

    import headatlas
    run = headatlas.analyze("corpus.txt", db="atlas.duckdb", model="default")
    run                                     # <Run 1 'corpus-4794be' done, 52 windows>
    run.heads(ci=True).df()                 # a pandas DataFrame (pip install 'headatlas[pandas]')
    run.layers().arrow                      # the Arrow table, always there
    run.sql("SELECT layer, head, within_sentence_lift_dm FROM head_metrics ORDER BY 3 DESC LIMIT 5")
    atlas = headatlas.connect("atlas.duckdb")
    atlas.runs()
    atlas.run("corpus-4794be").layers()
    atlas.run("corpus-4794be").roles()     # the head atlas: each head's roles and their evidence
    headatlas.compare("atlas.duckdb", "corpus-4794be")   # against its random-weights controls
    one = headatlas.inspect("The cat sat on the mat.", model="smollm2")   # one text, no database
    one.attention[3, 5], one.z[3, 5], one.csm(3, 5)                        # numpy

Column names are the SPEC's, exactly as ``headatlas query … --format json`` prints them; layers
and heads are 0-based. Reads open the database read-only for the duration of one call, so a
notebook never holds the file's lock between cells.

Errors are the library's own (``headatlas.service.errors``) and the built-in exceptions a Python
caller expects: a bad value raises ``ValueError``, an unknown run ``LookupError``, a missing
database ``FileNotFoundError``; their messages name keyword arguments (``layer=7``), not the
CLI's flags.
"""

from headatlas.service.api.analysis import analyze, analyze_series, quiet_notebook_bars
from headatlas.service.api.comparison import compare
from headatlas.service.api.inspection import effects, inspect
from headatlas.service.api.tables import Table, table
from headatlas.service.api.views import Atlas, IntervalWarning, RunView, connect

__all__ = [
    "Atlas",
    "IntervalWarning",
    "RunView",
    "Table",
    "analyze",
    "analyze_series",
    "compare",
    "connect",
    "effects",
    "inspect",
    "table",
]

quiet_notebook_bars()  # before transformers, whose import picks tqdm's notebook bar in a kernel
