"""Schema migrations of the tuning database, version v -> v + 1 (``MIGRATIONS``).

1 -> 2: rows re-keyed by the new kernel hash. Schema 1 keyed a row by a hash of its pattern's
rendered kernel text, comments included (``kernel_hash_v1`` below), so a comment edit in a
template orphaned every row. Schema 2 keys it by ``kernels.render.kernel_hash``: the same
kernels with comments and blank lines left out. For each row whose stored hash is its pattern's
schema-1 hash under the running templates (the kernels it was measured on are the ones that
run), the hash is replaced by the new one; a row whose hash matches nothing (already stale:
other kernels, or a pattern that no longer parses) keeps its hash and stays stale (``msa-codegen
db list`` shows it, ``db clear --stale`` removes it).

Writable opens migrate a file (``database.check_schema``); the lookup on the training path
opens an older user database writable once to migrate it (``lookup._read_rows``); the shipped
database is migrated before it ships. Exports of schema 1 are re-keyed row by row on import
(``rekey_row``).
"""
from __future__ import annotations

import functools
import hashlib
from typing import Callable

from sqlalchemy import Connection, text

from ..kernels.render import DIRECTIONS, kernel_hash, render
from ..pattern.lowering import lower
from ..pattern.spec import PatternError, parse


@functools.lru_cache(maxsize=256)
def kernel_hash_v1(pattern: str) -> str:
    """Schema 1's key of a pattern's rows: its rendered kernels' text after the first line,
    comments included (what ``kernel_hash`` was before schema 2)."""
    h = hashlib.sha256(b"msa-codegen kernels v1")
    for g in parse(pattern).groups:
        plan = lower(g.spec)
        for direction in DIRECTIONS:
            h.update(render(plan, direction).partition("\n")[2].encode())
    return h.hexdigest()[:16]


def new_key(pattern: str, stored_hash: str) -> str | None:
    """The schema-2 hash of a row stored under schema 1, or None when the row matches no
    kernels of the running templates (it stays as it is: stale)."""
    try:
        if stored_hash != kernel_hash_v1(pattern):
            return None
        return kernel_hash(pattern)
    except (PatternError, ValueError):
        return None


def rekey_row(row: dict) -> dict:
    """A schema-1 row (a dict, as exported) with its kernel hash re-keyed where it matches."""
    new = new_key(row.get("pattern", ""), row.get("template_hash", ""))
    return row if new is None else dict(row, template_hash=new)


def _rekey_1_to_2(conn: Connection) -> None:
    rows = conn.execute(text("SELECT id, pattern, template_hash FROM msa_tuning")).fetchall()
    for row_id, pattern, stored in rows:
        new = new_key(pattern, stored)
        if new is not None and new != stored:
            conn.execute(text("UPDATE msa_tuning SET template_hash = :h WHERE id = :i"), {"h": new, "i": row_id})


#: version v -> function upgrading a connection (inside the open transaction) from v to v + 1
MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _rekey_1_to_2}
