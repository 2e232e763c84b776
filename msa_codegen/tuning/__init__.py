"""The tuning database and the run-time lookup of launch configurations.

    keys.py     what a row is keyed by (bucket, versions); no SQLAlchemy
    models.py   the SQLAlchemy ORM models (msa_schema, msa_tuning)
    database.py engines (WAL, busy timeout), schema check / migration, TuningDB
    lookup.py   user db -> shipped db -> same capability -> nearest bucket -> heuristic, cached

SQLAlchemy is imported only when a database file is opened.
"""
from .keys import DIRECTIONS, TuningKey, bucket, dtype_name
from .lookup import (HEURISTIC, Choice, Resolution, clear_cache, explain, resolve, resolve_for_device,
                     shipped_db_path, user_db_path)

__all__ = ["DIRECTIONS", "TuningKey", "bucket", "dtype_name", "HEURISTIC", "Choice", "Resolution", "clear_cache",
           "explain", "resolve", "resolve_for_device", "shipped_db_path", "user_db_path"]
