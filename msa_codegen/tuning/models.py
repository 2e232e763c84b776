"""SQLAlchemy ORM models of the tuning database.

Two tables, both prefixed ``msa_`` so that Optuna's tables (the tuner keeps its studies in
the same SQLite file) never collide with them:

``msa_schema``   one row: which application wrote the file and its schema version.
``msa_tuning``   one row per key (GPU, capability, pattern, direction, dtype, head dim, GQA
                 group, sequence bucket, Triton version, kernel hash): the winning launch
                 parameters of that direction and how they were measured.
"""
from __future__ import annotations

import datetime

from sqlalchemy import JSON, DateTime, Float, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

APP = "msa-codegen-tuning"
#: 2: rows keyed by the kernel hash without comments (``migrations``: 1 -> 2 re-keys them);
#: 3: the column ``template_hash`` named ``kernel_hash``, rows re-keyed for the renamed kernels (2 -> 3)
SCHEMA_VERSION = 3


class Base(DeclarativeBase):
    pass


class SchemaInfo(Base):
    __tablename__ = "msa_schema"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)          # always 1
    app: Mapped[str] = mapped_column(String(64))                        # APP
    version: Mapped[int] = mapped_column(Integer)                       # SCHEMA_VERSION
    updated_at: Mapped[datetime.datetime] = mapped_column(DateTime)     # UTC


class TuningRow(Base):
    __tablename__ = "msa_tuning"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # ---- key
    gpu: Mapped[str] = mapped_column(String(64))               # normalized name: h200, cpu-interpreter, ...
    capability: Mapped[str] = mapped_column(String(16))        # "9.0"; "cpu" for the interpreter
    pattern: Mapped[str] = mapped_column(Text)                 # canonical pattern string
    direction: Mapped[str] = mapped_column(String(3))          # "fwd" | "bwd"
    dtype: Mapped[str] = mapped_column(String(16))             # "bfloat16" | "float16" | "float32"
    head_dim: Mapped[int] = mapped_column(Integer)
    gqa_group: Mapped[int] = mapped_column(Integer)            # query heads per key/value head
    bucket: Mapped[int] = mapped_column(Integer)               # power of two >= N, at least 1024
    triton_version: Mapped[str] = mapped_column(String(32))
    kernel_hash: Mapped[str] = mapped_column(String(32))   # kernels.render.kernel_hash of the pattern
    # ---- value
    config: Mapped[dict] = mapped_column(JSON)                 # the direction's LaunchConfig fields
    median_ms: Mapped[float] = mapped_column(Float)
    spread_ms: Mapped[float] = mapped_column(Float)            # interquartile range of the measurements
    tflops: Mapped[float | None] = mapped_column(Float, nullable=True)       # effective (visible pairs only)
    default_ms: Mapped[float | None] = mapped_column(Float, nullable=True)   # heuristic default, same run
    trials: Mapped[int] = mapped_column(Integer)               # completed trials of the study
    # the problem that was measured (the representative shape of the bucket)
    batch: Mapped[int] = mapped_column(Integer)
    heads: Mapped[int] = mapped_column(Integer)
    kv_heads: Mapped[int] = mapped_column(Integer)
    seqlen: Mapped[int] = mapped_column(Integer)
    library_version: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime)   # UTC
    provenance: Mapped[str] = mapped_column(Text)              # who/where/how, free text

    __table_args__ = (
        UniqueConstraint("gpu", "capability", "pattern", "direction", "dtype", "head_dim", "gqa_group", "bucket",
                         "triton_version", "kernel_hash", name="uq_msa_tuning_key"),
        Index("ix_msa_tuning_lookup", "capability", "pattern", "dtype", "head_dim", "gqa_group"),
    )


KEY_COLUMNS = ("gpu", "capability", "pattern", "direction", "dtype", "head_dim", "gqa_group", "bucket",
               "triton_version", "kernel_hash")
VALUE_COLUMNS = ("config", "median_ms", "spread_ms", "tflops", "default_ms", "trials", "batch", "heads",
                 "kv_heads", "seqlen", "library_version", "created_at", "provenance")
