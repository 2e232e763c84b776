"""The tuning database, its lookup, and the tuner.

    lookup.py      the one question the core asks: ``lookup.lookup(device, pattern, ...)`` -> configs and
                   sources (user db -> shipped db -> same capability -> nearest bucket -> heuristic);
                   ``reload()`` after a database changed
    keys.py        what a row is keyed by (bucket, versions, kernel hash); no SQLAlchemy
    models.py      the SQLAlchemy ORM models (msa_schema, msa_tuning)
    database.py    engines (WAL, busy timeout), schema check and migrations, TuningDB
    migrations.py  the schema migrations (1 -> 2: rows re-keyed by the comment-free kernel hash)
    gpu.py         GPU names as rows key them
    space.py       the knobs per direction, the search space and the prune filter
    measure.py     a problem's inputs, the correctness check and the timing of a candidate
    search.py      the Optuna study per key (shared through the database file) and the winner
    precompile.py  candidates compiled in worker processes before they are timed
    grid.py        the shipped grid (``python -m msa_codegen.tuner.grid``)
    auto.py        ``attention(..., autotune=True)``

This package sits above the core: it imports the core, the core imports only ``lookup``.
SQLAlchemy is imported only when a database file is opened; Optuna only when tuning starts.
Importing the package itself loads only ``lookup`` (and what it needs).
"""
from . import lookup
from .lookup import reload

__all__ = ["lookup", "reload"]
