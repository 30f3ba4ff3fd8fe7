"""Alembic environment for the headatlas schema, on an embedded DuckDB file or on a lake.

Migrations are hand-written SQL: duckdb-engine's reflection does not support autogenerate or
batch_alter_table. Run through ``headatlas db upgrade`` (service.storage.db.upgrade), which
passes an open connection in ``config.attributes["connection"]``.

On a lake (DuckLake) every statement goes through ``lake_ddl``: no sequences, PRIMARY KEY or
UNIQUE, only literal defaults, and alembic_version without its primary key; each migration
commits on its own. The migrations themselves are the same for both backends, and a file's DDL
is never rewritten.

The metric views are derived objects, not migrations: an upgrade that ends at the head revision
rebuilds them from the metric declarations (``service.storage.views``) in its own transaction,
so a new database gets them and a new metric's columns appear with the migration of its sums.
"""

from alembic import context
from alembic.ddl.impl import DefaultImpl
from sqlalchemy import create_engine, text


class AlembicDuckDBImpl(DefaultImpl):
    """Teach Alembic the DuckDB dialect name; DuckDB runs DDL inside transactions."""

    __dialect__ = "duckdb"
    transactional_ddl = True

    def execute(self, sql, execution_options=None) -> None:
        if isinstance(sql, str) and not _keys(self.connection):
            from headatlas.service.storage.backends.lake_ddl import lake_ddl

            rewritten = lake_ddl(sql)
            if rewritten is None:
                return
            sql = rewritten
        super().execute(sql, execution_options)


def _keys(connection) -> bool:
    """Whether the database takes keys and sequences (an embedded file; not a lake)."""
    given = context.config.attributes.get("keys")
    if given is not None:
        return bool(given)
    began = connection.in_transaction()
    kind = connection.execute(
        text("SELECT type FROM duckdb_databases() WHERE database_name = current_database()")
    ).scalar()
    if not began and connection.in_transaction():
        connection.commit()  # the question's own transaction: alembic begins the migrations' own
    context.config.attributes["keys"] = kind != "ducklake"
    return kind != "ducklake"


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        url = context.config.get_main_option("sqlalchemy.url")
        if url is None:
            raise RuntimeError("alembic: set sqlalchemy.url or pass a connection (see service/storage/db.py upgrade)")
        with create_engine(url).connect() as conn:
            _run(conn)
    else:
        _run(connection)


def _run(connection) -> None:
    keys = _keys(connection)
    context.configure(
        connection=connection,
        target_metadata=None,
        transactional_ddl=True,
        version_table_pk=keys,
        # a lake: one transaction per migration (DuckLake 0.3 loses a table created earlier in a
        # transaction when a view created in that same transaction is dropped, and 0006 drops
        # 0001's views); an upgrade that fails stops at the last migration committed
        transaction_per_migration=not keys,
    )
    with context.begin_transaction():
        context.run_migrations()
        if set(context.get_context().get_current_heads()) == set(context.script.get_heads()):
            from headatlas.service.storage import run_results
            from headatlas.service.storage.views import rebuild_views

            rebuild_views(connection)
            run_results.rebuild_views(connection)


run_migrations_online()
