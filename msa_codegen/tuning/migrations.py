"""Schema migrations of the tuning database, version v -> v + 1 (``MIGRATIONS``).

A row is keyed by the hash of the kernels it was measured on. Each schema changed how that
hash is taken or what the kernels' text is, never their instructions, so each migration re-keys
the rows measured on the running kernels: a row whose stored hash is what its schema would key
the running kernels by (``OLD_KEYS``) gets the current ``kernels.render.kernel_hash``. A row
whose hash matches nothing (already stale: other kernels, or a pattern that no longer parses)
keeps its hash and stays stale (``msa-codegen db list`` shows it, ``db clear --stale`` removes
it). A row re-keyed by an earlier step already holds the current hash, which no later step's
old key equals, so the steps chain.

1 -> 2: schema 1 hashed the rendered kernel text with its comments (``kernel_hash_v1``), so a
comment edit in a template orphaned every row; schema 2 leaves comments and blank lines out.

2 -> 3: the column ``template_hash`` is renamed ``kernel_hash`` (what it holds), and the
kernels' code text changed without changing an instruction: names that say what they are
(``GLOB`` -> ``GLOBAL``, ``grow`` -> ``global_rows``, ``pre`` -> ``prefix_keys``, the query-block
bounds of the dk/dv kernel ``k_lo``/``k_hi`` -> ``qb_lo``/``qb_hi``, ``_band``'s ``inner_lo``/
``inner_hi``, ``_hide_t`` -> ``_hide_transposed``) and the constants no kernel read (``CAUSAL``,
``DENSE``, ``TOPK``) are gone. ``kernel_hash_v2`` spells the running kernels' code back as
schema 2 wrote it and hashes that, which is the key schema 2 gave them.

Writable opens migrate a file (``database.check_schema``); the lookup on the training path
opens an older user database writable once to migrate it (``lookup._read_rows``); the shipped
database is migrated before it ships. Exports of older schemas are upgraded row by row on
import (``upgrade_row``).
"""
from __future__ import annotations

import functools
import hashlib
import re
from typing import Callable

from sqlalchemy import Connection, text

from ..kernels.render import DIRECTIONS, code_only, kernel_hash, render
from ..pattern.lowering import KernelPlan, lower
from ..pattern.spec import PatternError, parse

#: the column of the kernel hash before schema 3
OLD_COLUMN = "template_hash"
COLUMN = "kernel_hash"


@functools.lru_cache(maxsize=256)
def kernel_hash_v1(pattern: str) -> str:
    """Schema 1's key of the running kernels of a pattern: their rendered text after the first
    line, comments included."""
    h = hashlib.sha256(b"msa-codegen kernels v1")
    for g in parse(pattern).groups:
        plan = lower(g.spec)
        for direction in DIRECTIONS:
            h.update(render(plan, direction).partition("\n")[2].encode())
    return h.hexdigest()[:16]


#: names schema 3's kernels spell differently, as schema 2's kernels spelled them. Every new
#: name is absent from schema 2's kernels (tests/tuning checks the round trip against the keys
#: schema 2 gave), so spelling them back is a plain substitution.
SCHEMA_2_NAMES = {
    "GLOBAL": "GLOB",
    "global_rows": "grow",
    "prefix_keys": "pre",
    "inner_lo": "k_lo", "inner_hi": "k_hi",
    "qb_lo": "k_lo", "qb_hi": "k_hi",
    "_hide_transposed": "_hide_t",
}
_SCHEMA_2_NAME = re.compile(r"\b(" + "|".join(SCHEMA_2_NAMES) + r")\b")


def schema_2_code(code: str, plan: KernelPlan) -> str:
    """Kernel code (``code_only``) of the running templates as schema 2's templates wrote it:
    the old names, and the module constants no kernel read."""
    code = _SCHEMA_2_NAME.sub(lambda m: SCHEMA_2_NAMES[m.group(1)], code)
    head = "import triton.language as tl\n"
    code = code.replace(head, f"{head}CAUSAL = tl.constexpr({plan.causal})\nDENSE = tl.constexpr({plan.dense})\n", 1)
    if plan.topk:
        code = code.replace("\nNSLOT = ", f"\nTOPK = tl.constexpr({plan.topk})\nNSLOT = ", 1)
    return code


@functools.lru_cache(maxsize=256)
def kernel_hash_v2(pattern: str) -> str:
    """Schema 2's key of the running kernels of a pattern: ``kernel_hash`` of their code as
    schema 2 spelled it (``schema_2_code``)."""
    h = hashlib.sha256(b"msa-codegen kernels v2")
    for g in parse(pattern).groups:
        plan = lower(g.spec)
        for direction in DIRECTIONS:
            h.update(schema_2_code(code_only(render(plan, direction).partition("\n")[2]), plan).encode())
            h.update(b"\0")
    return h.hexdigest()[:16]


#: schema v -> its key of the running kernels of a pattern
OLD_KEYS: dict[int, Callable[[str], str]] = {1: kernel_hash_v1, 2: kernel_hash_v2}


def new_key(pattern: str, stored_hash: str, version: int) -> str | None:
    """The current hash of a row that schema ``version`` stored under ``stored_hash``, or None
    when the row matches no kernels of the running templates (it stays as it is: stale)."""
    try:
        if stored_hash != OLD_KEYS[version](pattern):
            return None
        return kernel_hash(pattern)
    except (PatternError, ValueError):
        return None


def upgrade_row(row: dict, version: int) -> dict:
    """A row (a dict, as exported) of schema ``version`` as the current schema has it: the
    kernel hash under its current name, re-keyed where it matches."""
    if not isinstance(row, dict):
        return row
    row = dict(row)
    if version < 3 and OLD_COLUMN in row:
        row[COLUMN] = row.pop(OLD_COLUMN)
    for v in range(version, max(OLD_KEYS) + 1):
        new = new_key(row.get("pattern", ""), row.get(COLUMN, ""), v)
        if new is not None:
            row[COLUMN] = new
    return row


def _rekey(conn: Connection, column: str, version: int) -> None:
    rows = conn.execute(text(f"SELECT id, pattern, {column} FROM msa_tuning")).fetchall()
    for row_id, pattern, stored in rows:
        new = new_key(pattern, stored, version)
        if new is not None and new != stored:
            conn.execute(text(f"UPDATE msa_tuning SET {column} = :h WHERE id = :i"), {"h": new, "i": row_id})


def _rekey_1_to_2(conn: Connection) -> None:
    _rekey(conn, OLD_COLUMN, 1)


def _rename_and_rekey_2_to_3(conn: Connection) -> None:
    # SQLite >= 3.25 renames the column in the unique key constraint too
    conn.execute(text(f"ALTER TABLE msa_tuning RENAME COLUMN {OLD_COLUMN} TO {COLUMN}"))
    _rekey(conn, COLUMN, 2)


#: version v -> function upgrading a connection (inside the open transaction) from v to v + 1
MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _rekey_1_to_2, 2: _rename_and_rekey_2_to_3}
