"""MSA, MiniMax Sparse Attention: proxy-selected per-query top-k block attention with a KL teaching signal."""
from .api import msa_attention, msa_select
from .groups import MsaResolution   # also installs attention's route of msa patterns
from .reference import reference_msa, reference_select

__all__ = ["msa_attention", "msa_select", "reference_msa", "reference_select", "MsaResolution"]
