"""The block tables of random and top-k terms (msa_codegen.sparsity.tables)."""
import pytest
import torch

import msa_codegen as msa
from msa_codegen.sparsity import tables


# ---- tables and the dense mask ----------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_random_table(causal):
    spec = msa.parse(("" if causal else "causal=false,") + "random=3,seed=5,block=16").groups[0].spec
    t = tables.random_block_table_cpu(spec, 16 * 40 + 3)
    assert t.shape == (41, 3) and t.dtype == torch.int32
    assert torch.equal(t, tables.random_block_table_cpu(spec, 16 * 40 + 3))    # reproducible
    for qb, row in enumerate(t.tolist()):
        used = [x for x in row if x >= 0]
        assert len(set(used)) == len(used)
        limit = qb + 1 if causal else 41
        assert all(0 <= x < limit for x in used)
        assert len(used) == min(3, limit)
    other = msa.parse(("" if causal else "causal=false,") + "random=3,seed=6,block=16").groups[0].spec
    assert not torch.equal(t, tables.random_block_table_cpu(other, 16 * 40 + 3))


def test_merged_block_tables():
    """Random + top-k table: each id once per row, and the CSR inverse lists exactly its choosers."""
    from msa_codegen.sparsity.tables import merged_block_tables, random_block_table_cpu

    spec = msa.parse("random=2,seed=4,topk=3,block=16").groups[0].spec
    gen = torch.Generator().manual_seed(2)
    n = 150
    nb = -(-n // 16)
    idx = torch.randint(-1, nb, (2, 3, nb, 3), generator=gen, dtype=torch.int32)
    idx[..., 2] = idx[..., 1]
    table, offs, inv = merged_block_tables(spec, n, n, idx)
    assert table.shape == (2, 3, nb, 5)
    rtab = random_block_table_cpu(spec, n)
    for b in range(2):
        for h in range(3):
            for qb in range(nb):
                row = [x for x in table[b, h, qb].tolist() if x >= 0]
                want = {x for x in idx[b, h, qb].tolist() + rtab[qb].tolist() if x >= 0}
                assert sorted(row) == sorted(want)
            for kb in range(nb):
                o = (b * 3 + h) * nb + kb
                got = inv[offs[o]:offs[o + 1]].tolist()
                assert got == [qb for qb in range(nb) if kb in table[b, h, qb].tolist()]
