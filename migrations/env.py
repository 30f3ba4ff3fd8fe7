"""Alembic environment for the headatlas DuckDB schema.

Migrations are hand-written SQL: duckdb-engine's reflection does not support autogenerate or
batch_alter_table. Run through ``headatlas db upgrade`` (service.storage.db.upgrade), which
passes an open connection in ``config.attributes["connection"]``.

The metric views are derived objects, not migrations: an upgrade that ends at the head revision
rebuilds them from the metric declarations (``service.storage.views``) in its own transaction,
so a new database gets them and a new metric's columns appear with the migration of its sums.
"""

from alembic import context
from alembic.ddl.impl import DefaultImpl
from sqlalchemy import create_engine


class AlembicDuckDBImpl(DefaultImpl):
    """Teach Alembic the DuckDB dialect name; DuckDB runs DDL inside transactions."""

    __dialect__ = "duckdb"
    transactional_ddl = True


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
    context.configure(connection=connection, target_metadata=None, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
        if set(context.get_context().get_current_heads()) == set(context.script.get_heads()):
            from headatlas.service.storage.views import rebuild_views

            rebuild_views(connection)


run_migrations_online()
