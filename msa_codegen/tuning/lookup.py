"""Which launch configuration runs, and where it came from.

Order, per direction (forward and backward are separate rows):

1. the user database (``--db``, else ``$MSA_CODEGEN_HOME/tuning.db``), this GPU, this bucket;
2. the shipped database (``msa_codegen/data/tuning.db``, read-only), this GPU, this bucket;
3. another GPU of the same compute capability, this bucket (user database first);
4. the nearest bucket: this GPU, else the same capability (ties: the larger bucket, user
   database first);
5. the heuristic default (``heuristics.default_config``).

A call with short hash buckets (``q_bucket`` / ``k_bucket``, ``heuristics.SHORT_BUCKET_KEYS``) takes
the heuristic default of short buckets and no database row: the tuner measures a pattern without
buckets, whose rows are longer. Longer buckets are looked up as the pattern.

An msa pattern (one group ``msa=T[,block=B]``, what ``msa_attention`` runs) is looked up the same
way; its rows hold the fields of ``msa.launch.MsaConfig`` (``keys.MSA_FIELDS``: fwd the selection's
and the forward's, bwd the backward's), its ``group`` / ``gqa_group`` is H / Hp (query heads per
proxy head: what MSA's tiles depend on) and its ``.config`` is a dict of those fields; the heuristic
default is the empty dict (each field's default in ``msa.launch``).

Only rows of the running Triton version and kernel hash (``kernels.render.kernel_hash`` of the
pattern: its rendered kernel sources without comments) are considered: a row tuned for other
kernels never runs. A database that cannot be read (damaged, locked, foreign, newer schema) is
reported once per path as a ``RuntimeWarning`` and skipped.

The core asks through ``lookup`` only (``plan.py``, once per call key; ``explain``); it never
sees the database layer. Answers are kept in memory until ``reload()``: the tuner calls it after
it writes a row; call it after another process wrote the user database or after changing
``MSA_CODEGEN_HOME`` / ``MSA_CODEGEN_SHIPPED_DB``. ``reload()`` also empties the plans of calls
(``plan.clear``), which hold the configurations looked up here. No file is ``stat``-ed per call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
import warnings
from pathlib import Path

import torch

from .. import heuristics
from ..config import BwdConfig, FwdConfig, LaunchConfig
from ..kernels.render import home, kernel_hash
from . import gpu as _gpu
from .keys import bucket as _bucket
from .keys import MSA_FIELDS, canonical_pattern, dtype_name, is_msa_pattern, row_config, triton_version

SHIPPED_DB = Path(__file__).resolve().parent.parent / "data" / "tuning.db"
HEURISTIC = "heuristic default"
OVERRIDE = "use_config override"

_warned: set[str] = set()
_warn_lock = threading.Lock()


def user_db_path(explicit: str | os.PathLike | None = None) -> Path:
    """The user database: the explicit path, else ``$MSA_CODEGEN_HOME/tuning.db``."""
    if explicit:
        return Path(explicit).expanduser().absolute()
    return _default_user_db(os.environ.get("MSA_CODEGEN_HOME"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _default_user_db(_home_env, _user_home) -> Path:
    # cached per value of the variables home() reads
    return (home() / "tuning.db").absolute()


def shipped_db_path() -> Path:
    """The shipped database (``MSA_CODEGEN_SHIPPED_DB`` overrides it, for tests and builds)."""
    return _shipped(os.environ.get("MSA_CODEGEN_SHIPPED_DB"))


@functools.lru_cache(maxsize=8)
def _shipped(override) -> Path:
    return Path(override).expanduser().absolute() if override else SHIPPED_DB


@dataclasses.dataclass(frozen=True)
class Choice:
    """The configuration of one direction and where it came from."""

    config: FwdConfig | BwdConfig | dict   # a dict of MsaConfig fields for an msa pattern
    source: str
    row: dict | None = dataclasses.field(default=None, compare=False)   # the stored row, when from a database


def _fmt_config(cfg) -> str:
    if isinstance(cfg, dict):
        return " ".join(f"{k}={v}" for k, v in cfg.items()) or "the MsaConfig defaults (msa_codegen.msa.launch)"
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())


def _config_dict(cfg) -> dict:
    return dict(cfg) if isinstance(cfg, dict) else dataclasses.asdict(cfg)


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What ``attention`` will run for one problem: per direction, the config and its source."""

    gpu: str
    capability: str
    pattern: str
    dtype: str
    head_dim: int
    gqa_group: int       # query heads per key/value head; for an msa pattern H / Hp (per proxy head)
    seqlen: int
    bucket: int
    fwd: Choice
    bwd: Choice

    @property
    def msa(self) -> bool:
        return is_msa_pattern(self.pattern)

    @functools.cached_property
    def config(self) -> LaunchConfig | dict:
        """The ``LaunchConfig``; for an msa pattern the dict of MsaConfig fields (both directions)."""
        if isinstance(self.fwd.config, dict):
            return {**self.fwd.config, **self.bwd.config}
        return LaunchConfig(self.fwd.config, self.bwd.config)

    @functools.cached_property
    def source(self) -> str:
        if self.fwd.source == self.bwd.source:
            return self.fwd.source
        return f"fwd: {self.fwd.source}; bwd: {self.bwd.source}"

    def __str__(self) -> str:
        group = f"{self.gqa_group} heads per proxy head" if self.msa else f"GQA group {self.gqa_group}"
        lines = [
            f"pattern {self.pattern!r}, {self.dtype}, head dim {self.head_dim}, {group}, "
            f"seqlen {self.seqlen} (bucket {self.bucket}) on {self.gpu} (capability {self.capability})",
            f"  fwd: {_fmt_config(self.fwd.config)}",
            f"       from {self.fwd.source}",
            f"  bwd: {_fmt_config(self.bwd.config)}",
            f"       from {self.bwd.source}",
        ]
        for name, ch in (("fwd", self.fwd), ("bwd", self.bwd)):
            r = ch.row
            if r:
                tf = f", {r['tflops']:.3g} TFLOP/s" if r.get("tflops") else ""
                lines.append(f"  {name} row: {r['median_ms']:.4g} ms median (spread {r['spread_ms']:.2g} ms){tf}, "
                             f"{r['trials']} trials, measured {str(r['created_at'])[:10]} on "
                             f"B={r['batch']} H={r['heads']}/{r['kv_heads']} N={r['seqlen']}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        out = {f: getattr(self, f) for f in ("gpu", "capability", "pattern", "dtype", "head_dim", "gqa_group",
                                            "seqlen", "bucket")}
        for name in ("fwd", "bwd"):
            ch = getattr(self, name)
            out[name] = {"config": _config_dict(ch.config), "source": ch.source}
        return out


# ---- reading the databases -------------------------------------------------------------------

def _warn_once(path: Path, exc: BaseException) -> None:
    key = str(path)
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    from .database import describe_failure

    warnings.warn(f"msa_codegen: tuning database {path} is {describe_failure(exc)}; it is bypassed and the next "
                  f"source is used (user db -> shipped db -> same capability -> nearest bucket -> heuristic)",
                  RuntimeWarning, stacklevel=4)


def _read_rows(path: Path, mode: str, query: dict) -> list[dict] | None:
    """Candidate rows of one database; None when the file is missing or unusable (reported once).

    A user database of an older schema is migrated here, once (a writable open re-keys its rows,
    ``migrations``); the shipped database is opened read-only and must ship migrated."""
    if not path.exists():
        return None
    try:
        # SQLAlchemy is imported only when a database file exists (about 0.1 s)
        from .database import SchemaOutdated, TuningDB, read_timeout_s

        try:
            db = TuningDB(path, mode=mode, timeout=read_timeout_s(), write=False)
        except SchemaOutdated:
            if mode == "ro":
                raise
            TuningDB(path, mode="rw", timeout=read_timeout_s()).close()   # migrates the file
            db = TuningDB(path, mode=mode, timeout=read_timeout_s(), write=False)
        try:
            return db.candidates(**query)
        finally:
            db.close()
    except Exception as exc:   # damaged, locked, foreign: reported, never fatal to training
        _warn_once(path, exc)
        return None


def _databases(user: Path, shipped: Path, query: dict) -> list[tuple[str, Path, list[dict]]]:
    """(label, path, candidate rows) of the user, then the shipped database, those with rows."""
    dbs = []
    for label, path, mode in (("user", user, "rw"), ("shipped", shipped, "ro")):
        rows = _read_rows(path, mode, query)
        if rows:
            dbs.append((label, path, rows))
    return dbs


def _log_distance(a: int, b: int) -> float:
    return abs(math.log2(a) - math.log2(b))


def _choose(direction: str, gpu: str, capability: str, want_bucket: int, dbs: list[tuple[str, Path, list[dict]]],
            default) -> Choice:
    usable = []   # (db order, label, path, row, config)
    for order, (label, path, rows) in enumerate(dbs):
        for row in rows:
            if row["direction"] != direction:
                continue
            try:
                cfg = row_config(row["pattern"], direction, row["config"], row["kernel_hash"], row["head_dim"])
            except (TypeError, ValueError):
                continue   # a hand-edited or damaged row never runs
            usable.append((order, label, path, row, cfg))

    def pick(rows, note):
        order, label, path, row, cfg = rows[0]
        return Choice(cfg, f"{label} db {path} ({note(row)})", row)

    # 1-2: exact, user then shipped
    exact = [u for u in usable if u[3]["gpu"] == gpu and u[3]["bucket"] == want_bucket]
    if exact:
        return pick(sorted(exact, key=lambda u: u[0]), lambda r: f"{gpu}, bucket {want_bucket}")
    # 3: same capability, another GPU, this bucket
    other = sorted((u for u in usable if u[3]["gpu"] != gpu and u[3]["bucket"] == want_bucket),
                   key=lambda u: (u[0], u[3]["gpu"]))
    if other:
        return pick(other, lambda r: f"measured on {r['gpu']}, same capability {capability}, bucket {want_bucket}")
    # 4: nearest bucket, this GPU first, then the same capability
    for same_gpu in (True, False):
        near = [u for u in usable if (u[3]["gpu"] == gpu) == same_gpu]
        if near:
            near.sort(key=lambda u: (_log_distance(u[3]["bucket"], want_bucket), -u[3]["bucket"], u[0], u[3]["gpu"]))
            return pick(near, lambda r: f"nearest bucket {r['bucket']} for {want_bucket}, measured on {r['gpu']}"
                        + ("" if same_gpu else f", same capability {capability}"))
    return Choice(default, HEURISTIC)


@dataclasses.dataclass(frozen=True)
class _MsaDefault:
    """An msa pattern's heuristic default per direction: no field set (``msa.launch`` picks each)."""
    fwd: dict = dataclasses.field(default_factory=dict)
    bwd: dict = dataclasses.field(default_factory=dict)


@functools.lru_cache(maxsize=4096)
def _lookup_cached(gpu: str, capability: str, cuda: bool, pattern: str, dtype: str, head_dim: int, group: int,
                   seqlen: int, user: Path, shipped: Path, tv: str, kh: str, buckets: bool = False) -> Resolution:
    canon = canonical_pattern(pattern)
    b = _bucket(seqlen)
    if is_msa_pattern(canon):
        # MSA's defaults live in msa.launch (each None field): the empty dict
        default = _MsaDefault()
    else:
        default = heuristics.default_config(torch.device("cuda" if cuda else "cpu"), head_dim,
                                            getattr(torch, dtype), capability if cuda else None, canon, buckets)
    query = dict(capability=capability, pattern=canon, dtype=dtype, head_dim=head_dim, gqa_group=group,
                 triton_version=tv, kernel_hash=kh)
    dbs = [] if buckets else _databases(user, shipped, query)
    return Resolution(gpu, capability, canon, dtype, head_dim, group, seqlen, b,
                      _choose("fwd", gpu, capability, b, dbs, default.fwd),
                      _choose("bwd", gpu, capability, b, dbs, default.bwd))


def lookup_for_gpu(gpu: str, capability: str, pattern, head_dim: int, dtype, group: int, seqlen: int, *,
                   cuda: bool | None = None, db: str | os.PathLike | None = None,
                   buckets: bool = False) -> Resolution:
    """The configuration per direction for a problem on a named GPU, and where it came from.

    ``cuda`` selects the heuristic family (default: any GPU but ``cpu-interpreter``); ``db``
    is the user database (default ``$MSA_CODEGEN_HOME/tuning.db``); ``buckets``: a call with
    short hash buckets (their heuristic default, no row). Kept until ``reload()``.
    """
    if cuda is None:
        cuda = gpu != _gpu.INTERPRETER
    return _lookup_cached(str(gpu), str(capability), bool(cuda), str(pattern), dtype_name(dtype), int(head_dim),
                          int(group), int(seqlen), user_db_path(db), shipped_db_path(), triton_version(),
                          kernel_hash(pattern), bool(buckets))


def lookup(device, pattern, head_dim: int, dtype, group: int, seqlen: int, buckets: bool = False) -> Resolution:
    """What a call on ``device`` runs: the one question the core asks of the tuning database.

    ``group``: query heads per key/value head; for an msa pattern (``msa_attention``), query heads
    per proxy head, H / Hp. ``buckets``: the call's hash buckets are short (``plan.plan_for``).

    Returns a ``Resolution``: ``.fwd`` / ``.bwd`` (``Choice``: ``.config`` and ``.source``),
    ``.config`` (the ``LaunchConfig``) and ``.source``. Kept until ``reload()``."""
    device = torch.device(device)
    name, cap = _gpu.gpu_of(device)
    return lookup_for_gpu(name, cap, pattern, head_dim, dtype, group, seqlen, cuda=device.type == "cuda",
                          buckets=buckets)


# ---- the Gluon family's rows ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GluonResolution:
    """The Gluon family's knobs for one call key, per direction (``.fwd`` / ``.bwd``: a ``Choice``
    whose config is a dict of ``kernels.gluon.FIELDS``; {} where no row serves: the heuristic's
    values). Rows are keyed as the Triton family's, with the kernel hash of the call's Gluon
    kernels of that direction (``kernels.gluon.kernel_hash``), so the two families never read
    each other's rows."""

    bucket: int
    fwd: Choice
    bwd: Choice

    def __str__(self) -> str:
        lines = [f"Gluon kernels' knobs where they run (bucket {self.bucket}):"]
        for name in ("fwd", "bwd"):
            ch = getattr(self, name)
            cfg = " ".join(f"{k}={v}" for k, v in ch.config.items()) or "the heuristic's knobs"
            lines.append(f"  gluon {name}: {cfg}")
            lines.append(f"       from {ch.source}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=1024)
def _gluon_cached(gpu: str, capability: str, pattern: str, dtype: str, head_dim: int, group: int, seqlen: int,
                  user: Path, shipped: Path, tv: str, hashes: tuple) -> GluonResolution:
    b = _bucket(seqlen)
    choices = {}
    for direction, kh in zip(("fwd", "bwd"), hashes):
        dbs = [] if kh is None else _databases(user, shipped, dict(
            capability=capability, pattern=pattern, dtype=dtype, head_dim=head_dim, gqa_group=group,
            triton_version=tv, kernel_hash=kh))
        choices[direction] = _choose(direction, gpu, capability, b, dbs, {})
    return GluonResolution(b, choices["fwd"], choices["bwd"])


def gluon_lookup(device, pattern, head_dim: int, dtype, group: int, seqlen: int,
                 hashes: tuple[str | None, str | None]) -> GluonResolution:
    """The Gluon family's knobs for a call on ``device`` (the order of the sources as ``lookup``'s,
    its heuristic default {}). ``hashes``: the call's Gluon kernel hashes (fwd, bwd; None where
    the family cannot run that direction). ``plan.AttentionPlan.gluon_resolution`` asks, once per
    call key. Kept until ``reload()``."""
    name, cap = _gpu.gpu_of(torch.device(device))
    return gluon_lookup_for_gpu(name, cap, pattern, head_dim, dtype, group, seqlen, hashes)


def gluon_lookup_for_gpu(gpu: str, capability: str, pattern, head_dim: int, dtype, group: int, seqlen: int,
                         hashes: tuple[str | None, str | None], *, db: str | os.PathLike | None = None
                         ) -> GluonResolution:
    """``gluon_lookup`` for a named GPU (``msa-codegen which``); ``db`` as ``lookup_for_gpu``'s."""
    return _gluon_cached(str(gpu), str(capability), canonical_pattern(pattern), dtype_name(dtype), int(head_dim),
                         int(group), int(seqlen), user_db_path(db), shipped_db_path(), triton_version(),
                         tuple(hashes))


_reload_listeners: list = []


def on_reload(callback) -> None:
    """Call ``callback()`` at every ``reload()``: how the plans of calls (``plan.clear``), which
    hold looked-up configurations, learn that they are out of date."""
    _reload_listeners.append(callback)


def reload(*, warnings_too: bool = False) -> None:
    """Read the databases again at the next lookup: forget every answer (and every call plan that
    holds one); with ``warnings_too``, also which databases were reported as unusable."""
    _lookup_cached.cache_clear()
    _gluon_cached.cache_clear()
    for callback in _reload_listeners:
        callback()
    if warnings_too:
        with _warn_lock:
            _warned.clear()
