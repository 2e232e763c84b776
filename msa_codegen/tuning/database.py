"""The tuning database: SQLite through SQLAlchemy.

Every connection is opened with a busy timeout, and writable ones in WAL mode (an engine
``connect`` listener), so that several ``msa-tune`` processes and any number of training
processes share one file. Writing transactions start with ``BEGIN IMMEDIATE`` (an engine
``begin`` listener): a read-then-write never fails half way on a lock upgrade.

Opening a file checks what it is: an empty file (or one with only Optuna's tables) gets the
schema; a file of this application with an older schema version is migrated (writable
opens only); a newer version, or an SQLite file of another application, raises
``SchemaError`` with a message that says so.
"""
from __future__ import annotations

import datetime
import os
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Iterable

from sqlalchemy import Connection, create_engine, delete, event, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from .keys import DIRECTIONS, DTYPE_NAMES, is_current, row_config
from .migrations import MIGRATIONS, upgrade_row
from .models import APP, KEY_COLUMNS, SCHEMA_VERSION, VALUE_COLUMNS, Base, SchemaInfo, TuningRow

EXPORT_FORMAT = "msa-codegen-tuning"
WRITE_TIMEOUT_S = 60.0

# Tables another writer of the same file may have made: Optuna's RDBStorage (the tuner keeps
# its studies in the tuning database) and SQLite's own.
_OPTUNA_TABLES = frozenset({
    "studies", "study_directions", "study_system_attributes", "study_user_attributes", "trial_heartbeats",
    "trial_intermediate_values", "trial_params", "trial_system_attributes", "trial_user_attributes",
    "trial_values", "trials", "version_info", "alembic_version",
})
_OUR_TABLES = frozenset(Base.metadata.tables)



class SchemaError(RuntimeError):
    """The file is not a tuning database this version can use (foreign, newer, unmigratable)."""


class SchemaOutdated(SchemaError):
    """A tuning database of an older schema opened without writing: a writable open migrates it."""


class DatabaseUnusable(RuntimeError):
    """A tuning database that cannot be opened (damaged, locked), with its path in the message."""


def open_db(path, **kw) -> "TuningDB":
    """``TuningDB(path, **kw)``; driver errors become ``DatabaseUnusable`` naming the path and why."""
    try:
        return TuningDB(path, **kw)
    except (SchemaError, FileNotFoundError, PermissionError):
        raise
    except Exception as e:
        if getattr(e, "orig", None) is None and not type(e).__module__.startswith(("sqlalchemy", "sqlite3")):
            raise
        raise DatabaseUnusable(f"tuning database {Path(path).expanduser().absolute()} is {describe_failure(e)}") \
            from None


def describe_failure(exc: BaseException) -> str:
    """Why a database could not be used, in a few words (locked, damaged, unreadable, the schema)."""
    if isinstance(exc, SchemaError):
        return str(exc)
    msg = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    low = msg.lower()
    if "locked" in low or "busy" in low:
        return f"locked by another process ({msg})"
    if "not a database" in low or "malformed" in low or "corrupt" in low:
        return f"damaged: not a readable SQLite database ({msg})"
    return f"unreadable ({type(exc).__name__}: {msg})"




def read_timeout_s() -> float:
    """Busy timeout of the lookups on the training path (``MSA_CODEGEN_DB_TIMEOUT``, default 2 s)."""
    try:
        return max(0.0, float(os.environ.get("MSA_CODEGEN_DB_TIMEOUT", "2")))
    except ValueError:
        return 2.0


def make_engine(path: str | os.PathLike, *, mode: str = "rwc", timeout: float = WRITE_TIMEOUT_S,
                write: bool = True) -> Engine:
    """An engine on one SQLite file.

    mode: ``"rwc"`` read-write, create the file if missing; ``"rw"`` read-write, the file must
    exist; ``"ro"`` read-only (sqlite URI ``mode=ro``, for the shipped database). ``write``:
    transactions take the write lock up front (``BEGIN IMMEDIATE``); without it they are
    deferred, so that a lookup never waits for a writer (WAL readers are not blocked).
    """
    if mode not in ("rwc", "rw", "ro"):
        raise ValueError(f"mode must be rwc, rw or ro, got {mode!r}")
    path = Path(path).expanduser().absolute()
    readonly = mode == "ro"
    # read-only opens are of the shipped database, a package file nobody writes while it is in
    # use: immutable=1 reads it without locks or a -shm file (an installed package directory
    # may not be writable, and a WAL-mode file would otherwise need one)
    uri = f"file:{urllib.parse.quote(str(path))}?mode={mode}" + ("&immutable=1" if readonly else "")
    immediate = write and not readonly

    def creator():
        # isolation_level=None: the driver leaves transactions to us (the begin listener)
        return sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None, check_same_thread=False)

    engine = create_engine("sqlite+pysqlite://", creator=creator, poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_con, _record):
        cur = dbapi_con.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            if readonly:
                cur.execute("PRAGMA query_only = ON")
            else:
                cur.execute("PRAGMA journal_mode = WAL")
                cur.execute("PRAGMA synchronous = NORMAL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _tables(conn: Connection) -> set[str]:
    rows = conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {r[0] for r in rows if not r[0].startswith("sqlite_")}


def check_schema(conn: Connection, path, *, writable: bool) -> bool:
    """Check (and on writable opens create or migrate) the schema. False: an empty file, no rows."""
    tables = _tables(conn)
    if "msa_schema" not in tables:
        foreign = tables - _OPTUNA_TABLES
        if foreign:
            raise SchemaError(
                f"{path} is not an msa-codegen tuning database (an SQLite file with other tables: "
                f"{', '.join(sorted(foreign)[:5])}); use another --db path")
        if not writable:
            return False
        Base.metadata.create_all(conn)
        conn.execute(SchemaInfo.__table__.insert().values(
            id=1, app=APP, version=SCHEMA_VERSION, updated_at=_now()))
        return True
    info = conn.execute(select(SchemaInfo.app, SchemaInfo.version).where(SchemaInfo.id == 1)).first()
    if info is None or info.app != APP:
        raise SchemaError(f"{path} is not an msa-codegen tuning database (its msa_schema table names "
                          f"{info.app if info else 'nothing'!r}); use another --db path")
    version = int(info.version)
    if version > SCHEMA_VERSION:
        raise SchemaError(f"{path} has tuning-database schema version {version}, newer than this msa-codegen "
                          f"understands ({SCHEMA_VERSION}): upgrade msa-codegen or use another --db path")
    if version < SCHEMA_VERSION:
        missing = [v for v in range(version, SCHEMA_VERSION) if v not in MIGRATIONS]
        if missing:
            raise SchemaError(f"{path} has tuning-database schema version {version}, which this msa-codegen "
                              f"cannot migrate to {SCHEMA_VERSION}: export it with the older version, or clear it")
        if not writable:
            raise SchemaOutdated(f"{path} has tuning-database schema version {version} (current {SCHEMA_VERSION}); "
                              f"it is migrated by any command that writes it (e.g. msa-codegen db list --db {path})")
        for v in range(version, SCHEMA_VERSION):
            MIGRATIONS[v](conn)
        conn.execute(SchemaInfo.__table__.update().where(SchemaInfo.id == 1).values(
            version=SCHEMA_VERSION, updated_at=_now()))
    missing_tables = _OUR_TABLES - tables
    if missing_tables:
        if not writable:
            raise SchemaError(f"{path} lacks the tables {sorted(missing_tables)}")
        Base.metadata.create_all(conn)
    return True


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None, microsecond=0)


def row_dict(row: TuningRow) -> dict:
    return {c: getattr(row, c) for c in KEY_COLUMNS + VALUE_COLUMNS}


def _json_ready(d: dict) -> dict:
    out = dict(d)
    if isinstance(out.get("created_at"), datetime.datetime):
        out["created_at"] = out["created_at"].isoformat(timespec="seconds") + "Z"
    return out


_INT_FIELDS = ("head_dim", "gqa_group", "bucket", "trials", "batch", "heads", "kv_heads", "seqlen")
_FLOAT_FIELDS = ("median_ms", "spread_ms")
_OPTIONAL_FLOAT = ("tflops", "default_ms")
_STR_FIELDS = ("gpu", "capability", "pattern", "triton_version", "kernel_hash", "library_version", "provenance")


def validate_row(d: dict, where: str = "row") -> dict:
    """A clean copy of one row (dict), or ValueError naming the field and what was expected."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object, got {type(d).__name__}")
    out = {}
    for f in KEY_COLUMNS + VALUE_COLUMNS:
        if f not in d and f not in _OPTIONAL_FLOAT and f != "created_at":
            raise ValueError(f"{where}: missing field {f!r}")
    for f in _INT_FIELDS:
        v = d[f]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {f} must be a positive integer, got {v!r}")
        out[f] = v
    for f in _FLOAT_FIELDS:
        v = d[f]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"{where}: {f} must be a number >= 0, got {v!r}")
        out[f] = float(v)
    for f in _OPTIONAL_FLOAT:
        v = d.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{where}: {f} must be a number or null, got {v!r}")
        out[f] = None if v is None else float(v)
    for f in _STR_FIELDS:
        if not isinstance(d[f], str) or (not d[f] and f != "provenance"):
            raise ValueError(f"{where}: {f} must be a non-empty string, got {d[f]!r}")
        out[f] = d[f]
    if d["direction"] not in DIRECTIONS:
        raise ValueError(f"{where}: direction must be one of {DIRECTIONS}, got {d['direction']!r}")
    out["direction"] = d["direction"]
    if d["dtype"] not in DTYPE_NAMES:
        raise ValueError(f"{where}: dtype must be one of {DTYPE_NAMES}, got {d['dtype']!r}")
    out["dtype"] = d["dtype"]
    try:   # the config must build a FwdConfig / BwdConfig (msa patterns: MsaConfig fields; Gluon rows: its knobs)
        row_config(d["pattern"], d["direction"], d["config"], d["kernel_hash"], d["head_dim"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: config {d['config']!r} is not a valid {d['direction']} config: {e}") from None
    out["config"] = dict(d["config"])
    created = d.get("created_at")
    if created is None:
        out["created_at"] = _now()
    elif isinstance(created, datetime.datetime):
        out["created_at"] = created
    else:
        try:
            out["created_at"] = datetime.datetime.fromisoformat(str(created).rstrip("Z")).replace(tzinfo=None)
        except ValueError:
            raise ValueError(f"{where}: created_at must be an ISO date, got {created!r}") from None
    return out


def write_shipped_copy(src: str | os.PathLike, dst: str | os.PathLike) -> int:
    """Copy a tuning database to a file fit to ship in the package (``msa_codegen/data/tuning.db``):
    only the tuning tables (no Optuna studies), rollback-journal mode, vacuumed. Returns the rows."""
    dst = Path(dst).expanduser().absolute()
    if dst.exists():
        dst.unlink()
    with TuningDB(src, mode="rw") as db:
        rows = db.rows()
    with TuningDB(dst) as out:
        out.put_many(rows)
    con = sqlite3.connect(dst, isolation_level=None)
    try:
        con.execute("PRAGMA journal_mode = DELETE")
        con.execute("VACUUM")
    finally:
        con.close()
    return len(rows)


class TuningDB:
    """One tuning database file.

    ``TuningDB(path)`` opens (creating the file and schema if needed) for reading and
    writing; ``TuningDB(path, mode="ro")`` opens read-only (the shipped database);
    ``mode="rw"`` requires the file to exist; ``write=False`` opens for lookups only (no
    schema change, no write lock). Raises ``SchemaError`` for a file that is not a tuning
    database this version can use, and SQLAlchemy's ``OperationalError`` / ``DatabaseError``
    for a locked or damaged one.
    """

    def __init__(self, path: str | os.PathLike, *, mode: str = "rwc", timeout: float | None = None,
                 write: bool = True):
        self.path = Path(path).expanduser().absolute()
        self.mode = mode
        self.writable = write and mode != "ro"
        if mode == "rwc":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif not self.path.exists():
            raise FileNotFoundError(2, "no tuning database", str(self.path))
        self.engine = make_engine(self.path, mode=mode, timeout=WRITE_TIMEOUT_S if timeout is None else timeout,
                                  write=self.writable)
        try:
            with self.engine.begin() as conn:
                self.has_schema = check_schema(conn, self.path, writable=self.writable)
        except BaseException:
            self.engine.dispose()
            raise

    # ---- context manager
    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reads
    def rows(self, **filters) -> list[dict]:
        """Every row (dicts), optionally filtered by column equality, in key order."""
        if not self.has_schema:
            return []
        stmt = select(TuningRow).filter_by(**filters).order_by(
            TuningRow.gpu, TuningRow.pattern, TuningRow.dtype, TuningRow.head_dim, TuningRow.gqa_group,
            TuningRow.bucket, TuningRow.direction)
        with Session(self.engine) as s:
            return [row_dict(r) for r in s.scalars(stmt)]

    def candidates(self, *, capability: str, pattern: str, dtype: str, head_dim: int, gqa_group: int,
                   triton_version: str, kernel_hash: str) -> list[dict]:
        """Rows usable for a problem on a GPU of this capability (any GPU name, bucket, direction):
        only those of the running Triton version and kernels (kernel hash)."""
        return self.rows(capability=capability, pattern=pattern, dtype=dtype, head_dim=head_dim,
                         gqa_group=gqa_group, triton_version=triton_version, kernel_hash=kernel_hash)

    def count(self) -> int:
        if not self.has_schema:
            return 0
        with self.engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM msa_tuning")).scalar_one())

    # ---- writes
    def put(self, row: dict, *, keep_faster: bool = False) -> bool:
        """Insert or replace the row of its key. With ``keep_faster``, a stored row of the same
        measured shape with a lower median is kept. Returns True when the row was written."""
        self._need_writable()
        row = validate_row(row)
        key = {c: row[c] for c in KEY_COLUMNS}
        with Session(self.engine) as s, s.begin():
            old = s.scalars(select(TuningRow).filter_by(**key)).one_or_none()
            if old is not None:
                same_shape = all(getattr(old, c) == row[c] for c in ("batch", "heads", "kv_heads", "seqlen"))
                if keep_faster and same_shape and old.median_ms <= row["median_ms"]:
                    return False
                for c in VALUE_COLUMNS:
                    setattr(old, c, row[c])
            else:
                s.add(TuningRow(**row))
        return True

    def put_many(self, rows: Iterable[dict]) -> int:
        self._need_writable()
        rows = [validate_row(r, f"row {i}") for i, r in enumerate(rows)]
        with Session(self.engine) as s, s.begin():
            for row in rows:
                key = {c: row[c] for c in KEY_COLUMNS}
                old = s.scalars(select(TuningRow).filter_by(**key)).one_or_none()
                if old is None:
                    s.add(TuningRow(**row))
                else:
                    for c in VALUE_COLUMNS:
                        setattr(old, c, row[c])
        return len(rows)

    def clear(self, *, stale_only: bool = False) -> int:
        """Delete every row (or, with ``stale_only``, the rows that do not run on this
        installation: another Triton version or changed kernels, ``keys.is_current``). Returns
        how many."""
        self._need_writable()
        if not self.has_schema:
            return 0
        stmt = delete(TuningRow)
        if stale_only:
            with Session(self.engine) as s:
                keys = s.execute(select(TuningRow.id, TuningRow.pattern, TuningRow.triton_version,
                                        TuningRow.kernel_hash)).all()
            stale = [i for i, pattern, rtv, rth in keys if not is_current(pattern, rtv, rth)]
            if not stale:
                return 0
            stmt = stmt.where(TuningRow.id.in_(stale))
        with Session(self.engine) as s, s.begin():
            return int(s.execute(stmt).rowcount or 0)

    def export(self) -> dict:
        return {"format": EXPORT_FORMAT, "schema_version": SCHEMA_VERSION,
                "exported_at": _now().isoformat(timespec="seconds") + "Z",
                "rows": [_json_ready(r) for r in self.rows()]}

    def import_(self, data) -> int:
        """Insert the rows of an ``export()`` document (replacing rows of the same keys)."""
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise ValueError(f"not an msa-codegen tuning export (expected an object with format {EXPORT_FORMAT!r})")
        version = data.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ValueError(f"export has schema version {version!r}; this msa-codegen reads up to {SCHEMA_VERSION}")
        rows = data.get("rows")
        if not isinstance(rows, list):
            raise ValueError("export has no 'rows' list")
        if version < SCHEMA_VERSION:   # older rows: renamed and re-keyed as the file migration does
            rows = [upgrade_row(r, version) for r in rows]
        return self.put_many(rows)

    def integrity_check(self) -> str:
        with self.engine.connect() as conn:
            return str(conn.exec_driver_sql("PRAGMA integrity_check").scalar_one())

    def _need_writable(self) -> None:
        if not self.writable:
            raise PermissionError(f"{self.path} is opened read-only")
