"""Catalog: the SQLite schema, migrations and every SQL statement."""
