"""Alembic environment for the headatlas DuckDB schema.

Migrations are hand-written SQL: duckdb-engine's reflection does not support autogenerate or
batch_alter_table. Run through ``headatlas db upgrade`` (service.storage.db.upgrade), which
passes an open connection in ``config.attributes["connection"]``.
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


run_migrations_online()
