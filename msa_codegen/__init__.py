"""msa-codegen: sparse attention patterns compiled to Triton kernels.

    >>> import msa_codegen as msa
    >>> out = msa.attention(q, k, v, "window=4096,dilation=2,sink=64")   # doctest: +SKIP

Layout: ``api`` (attention, explain) -> ``autograd`` -> ``kernels.launch`` with the call's
``plan`` (the one per-call cache) -> ``kernels.render`` / ``pattern`` / ``sparsity``; the tuning
database and tuner (``tuning``) sit on top and the core asks them only ``tuning.lookup``.
"""
from .version import __version__
from .pattern.spec import Pattern, PatternError, Spec, parse
from .pattern.reference import mask, reference_attention
from .api import attention, explain
from .sparsity.selection import hash_sort, select_blocks
from .msa import msa_attention, msa_select, reference_msa
from .distributed import context_parallel_attention
from .config import BwdConfig, FwdConfig, LaunchConfig, use_config
from .tuning import auto as _autotune   # installs attention(..., autotune=True)'s tuner  # noqa: F401

__all__ = [
    "attention", "msa_attention", "msa_select", "reference_msa", "context_parallel_attention", "parse", "mask",
    "reference_attention", "select_blocks", "hash_sort", "Pattern", "PatternError", "Spec",
    "LaunchConfig", "FwdConfig", "BwdConfig", "use_config", "explain", "__version__",
]
