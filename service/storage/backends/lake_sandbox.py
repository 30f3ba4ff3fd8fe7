"""A lake as user SQL (``headatlas sql``) may see it: the table functions a SELECT may call, the
copy of a PostgreSQL catalogue that the sandbox attaches instead of the catalogue itself, and
the confinement of the sandbox's instance to the lake's data path.

The instance that runs a reader's SQL never loads the PostgreSQL extension (its functions do not
exist there, and ``LOAD`` is refused with external access off) and holds no session, no password,
no connection string: it attaches a copy of the catalogue's tables in a private DuckDB file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb

from headatlas.service.storage.backends.base import NO_DOWNLOADS, duckdb_config
from headatlas.service.storage.backends.lake_catalogue import (
    ALIAS,
    bounded_conninfo,
    format_conninfo,
    parse_conninfo,
    sql_literal,
)
from headatlas.service.storage.duckdb_settings import READONLY_CONFIG, SIGNED_EXTENSIONS

# table functions a SELECT may call in the sandbox although their names say ducklake: the results'
# history (snapshots: ids, times, the tables each changed; a table's rows changed between two), whose
# columns carry no path. Not ducklake_list_files (every data file's absolute path, its encryption
# key), ducklake_options (the data path) nor ducklake_table_info (the storage's files, their sizes):
# how the lake is stored is not a result, and a file, which has none of them, refuses them alike
SANDBOX_READS = frozenset(
    {
        "ducklake_snapshots",
        "ducklake_current_snapshot",
        "ducklake_last_committed_snapshot",
        "ducklake_table_changes",
        "ducklake_table_insertions",
        "ducklake_table_deletions",
    }
)


def copy_catalogue(
    conninfo: str, password: str | None, target: Path, failed: Callable[[duckdb.Error], Exception]
) -> None:
    """The catalogue's tables (``ducklake_*``) at ``conninfo`` (given libpq's bounds) into a new DuckDB
    file ``target``, as of one moment: one repeatable-read PostgreSQL transaction, read-only on the
    server too (``default_transaction_read_only``). A DuckDB error is raised as ``failed`` makes it."""
    values = parse_conninfo(bounded_conninfo(conninfo))
    values["options"] = (values.get("options", "") + " -c default_transaction_read_only=on").strip()
    source = duckdb.connect(config=duckdb_config(threads=1))
    try:
        source.execute("LOAD postgres_scanner")
        if password:
            source.execute(f"CREATE TEMPORARY SECRET (TYPE postgres, PASSWORD {sql_literal(password)})")
        source.execute(f"ATTACH {sql_literal(format_conninfo(values))} AS catalogue (TYPE postgres, READ_ONLY)")
        source.execute(f"ATTACH {sql_literal(str(target))} AS copy")
        source.execute("BEGIN")
        names = [
            name
            for (name,) in source.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = 'catalogue' "
                "AND schema_name = 'public' AND starts_with(table_name, 'ducklake_') ORDER BY 1"
            ).fetchall()
        ]
        for name in names:
            quoted = '"' + name.replace('"', '""') + '"'
            source.execute(f"CREATE TABLE copy.main.{quoted} AS SELECT * FROM catalogue.public.{quoted}")
        source.execute("COMMIT")
    except duckdb.Error as exc:
        raise failed(exc) from None
    finally:
        source.close()


def confine(connection: duckdb.DuckDBPyConnection, data_path: str | None) -> None:
    """Confine ``connection`` (the lake attached read-only) to the lake: files readable only under
    its data path (``data_path``, this host's mount, else the one the catalogue recorded), the
    configuration locked."""
    data = data_path
    if data is None:
        row = connection.execute(
            f"SELECT value FROM ducklake_options('{ALIAS}') WHERE option_name = 'data_path'"
        ).fetchone()
        data = row[0] if row else None
    if data and "://" not in data:
        connection.execute(f"SET allowed_directories = [{sql_literal(data)}]")
    for name, value in READONLY_CONFIG.items():
        if name not in NO_DOWNLOADS and name not in SIGNED_EXTENSIONS:  # those set as it started
            connection.execute(f"SET {name} = {str(value).lower()}")
