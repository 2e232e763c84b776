"""msa-codegen: sparse attention patterns compiled to Triton kernels.

    >>> import msa_codegen as msa
    >>> out = msa.attention(q, k, v, "window=4096,dilation=2,sink=64")   # doctest: +SKIP
"""
__version__ = "0.1.0"

from .pattern.spec import Pattern, PatternError, Spec, parse  # noqa: E402
from .pattern.reference import mask, reference_attention  # noqa: E402
from .ops import attention  # noqa: E402
from .sparsity.selection import hash_sort, select_blocks  # noqa: E402
from .config import BwdConfig, FwdConfig, LaunchConfig, use_config  # noqa: E402
from .tuning.lookup import explain  # noqa: E402

__all__ = [
    "attention", "parse", "mask", "reference_attention", "select_blocks", "hash_sort", "Pattern", "PatternError", "Spec",
    "LaunchConfig", "FwdConfig", "BwdConfig", "use_config", "explain", "__version__",
]
