"""The state in SQL, written once for every backend: ``SqlState`` (base.py) and one mixin per concern,
run through a ``Dialect`` (dialect.py) that says what SQLite and PostgreSQL spell differently.

The backends (store/state.py for SQLite, store/postgres.py for PostgreSQL) only open connections, run
transactions and choose the dialect; the schema and its migrations are in schema.py.
"""
