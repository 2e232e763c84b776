"""The benchmark's own arithmetic, checked on the CPU: the peer's mask and the pair count."""
import pytest
import torch

import msa_codegen as msa
from msa_codegen.bench import _mask_mod, attended_pairs


@pytest.mark.parametrize("pattern", ["causal", "causal=false", "window=7", "window=7,dilation=2",
                                     "window=5,dilation=3,sink=4", "window=4,sink=6", "causal=false,window=5",
                                     "causal=false,window=4,dilation=3,sink=2", "window=1,sink=60"])
@pytest.mark.parametrize("n", [1, 37, 64])
def test_peer_mask_and_pair_count_match_the_contract(pattern, n):
    spec = msa.parse(pattern).groups[0].spec
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = msa.mask(pattern, n)[0]
    assert torch.equal(_mask_mod(spec)(0, 0, i, j).expand(n, n), ref)
    assert attended_pairs(spec, n) == int(ref.sum())
