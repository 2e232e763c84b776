"""Run-time sparsity inputs: validation and normalisation, shared by the kernels and the oracle.

The keyword arguments of ``attention`` / ``mask`` / ``reference_attention`` that choose what
to attend to from the data (issue 5):

- ``cu_seqlens``: int32 ``(num_docs + 1,)`` offsets of packed documents (batch size 1). A token
  sees only tokens of its own document, and the pattern's positions are relative to the
  document's start (``sink=4``: the first 4 tokens of every document).
- ``q_pos`` / ``k_pos``: integer ``(B, Hq, Nq)`` / ``(B, Hkv, Nk)``, or anything that broadcasts
  to it (``(Nq,)``, ``(1, 1, Nq)``, ...): the original positions of a compacted sequence. The
  pattern is evaluated on these positions; Nq may differ from Nk.
- ``q_bucket`` / ``k_bucket``: integer, shaped like the positions: a query sees a key only if
  their buckets are equal (and the pattern shows it).
- ``block_indices``: int32 ``(B, Hkv, ceil(Nq / block), K)`` key-block ids of the ``topk=K`` term.

All of them reduce to one form the kernels read (``Dynamic``): per query row and per key row a
*segment* (document id, bucket, or nothing) and a *position*. Two rows can only see each other
inside one segment; the pattern's element predicate is evaluated on the positions. The
block-granular terms (``random``, ``topk``) are blocks of tensor rows (``row // block``), not
of positions: the blocks ``block_indices`` names are blocks of the tensors as passed.

The kernels find each tile's key (query) range by a search over the (segment, position) keys,
so they need the rows sorted by (segment, position) along the sequence; ``check_sorted`` says
so when they are not. The dense oracle needs no order. The values are checked on the host (a
few syncs), so under torch.compile the call breaks the graph before the custom op.

Those checks run once per tensor *version*: ``attention`` calls them through ``prepare``, and a
check that passed on a tensor is not repeated while the same tensor object keeps its version counter,
data pointer, shape and strides (``_Checked``). A training step that hands one ``cu_seqlens`` to
every layer syncs once, not once per layer and direction. In-place writes through torch bump
the version and re-check; writes that bypass the counter (``t.data``, a custom kernel) are not
seen. The derived tensors (document ids, int32 copies) are rebuilt every call, never cached.
"""
from __future__ import annotations

import collections
import dataclasses
import weakref

import torch

from ..pattern.lowering import MAX_SEQLEN

_INT_DTYPES = (torch.int32, torch.int64)
#: positions and buckets must fit the kernels' int32 arithmetic with room for a window span
MAX_POSITION = MAX_SEQLEN - 1
MAX_BUCKET = 2**31 - 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class Dynamic:
    """Normalised run-time inputs. Tensors are int32 (or None), broadcast views, never copies of q/k/v.

    ``q_pos`` ``(B|1, Hq|1, Nq)``, ``k_pos`` ``(B|1, Hkv|1, Nk)``, ``q_seg`` / ``k_seg`` likewise or None;
    ``block_indices`` ``(B, Hkv, nqb, K)`` or None. ``bucket_keys``: with hash buckets, the mean
    number of keys per bucket of a key row (``Nk`` x rows / distinct (row, bucket) pairs), which
    picks the launch default (``heuristics.SHORT_BUCKET_KEYS``); 0 without buckets.
    """

    nq: int
    nk: int
    q_pos: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    q_seg: torch.Tensor | None = None
    k_seg: torch.Tensor | None = None
    block_indices: torch.Tensor | None = None
    bucket_keys: float = 0.0
    what: str = ""   # which inputs were given, for messages
    #: the caller's position/bucket tensors per side, whose order ``check_sorted`` checks (empty
    #: for cu_seqlens and for arange positions: sorted by construction)
    q_sources: tuple = ()
    k_sources: tuple = ()

    @property
    def positional(self) -> bool:
        """True when rows carry positions/segments (cu_seqlens, positions or buckets)."""
        return self.q_pos is not None


def _check_int_tensor(name: str, t, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on the device of q, k and v ({device}), got {t.device}")
    return t


def _broadcast(name: str, t: torch.Tensor, b: int, h: int, n: int, hname: str) -> torch.Tensor:
    """A view of ``t`` as ``(B|1, H|1, n)`` (no copy); errors say the expected shape."""
    want = f"({b}, {h}, {n}) or a shape that broadcasts to it, e.g. ({n},)"
    if t.dim() == 0 or t.dim() > 3 or t.shape[-1] != n:
        raise ValueError(f"{name} must have shape (B, {hname}, N) = {want}; got {tuple(t.shape)}")
    t3 = t.reshape((1,) * (3 - t.dim()) + tuple(t.shape))
    if t3.shape[0] not in (1, b) or t3.shape[1] not in (1, h):
        raise ValueError(f"{name} must have shape (B, {hname}, N) = {want}; got {tuple(t.shape)}")
    return t3


class TensorLRU:
    """Values kept per key and the exact tensors that key was made from; bounded LRU. A key holds
    ids, so a hit also needs each kept weakref to still point at the given tensor (an id can be
    reused by a new tensor once the old one is freed)."""

    def __init__(self, size: int):
        self.size = size
        self._seen: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, tensors):
        """The value kept under ``key`` for exactly these tensors, else None."""
        hit = self._seen.get(key)
        if hit is None:
            return None
        refs, value = hit
        if not all(r() is t for r, t in zip(refs, tensors)):
            return None
        self._seen.move_to_end(key)
        return value

    def put(self, key, tensors, value) -> None:
        self._seen[key] = (tuple(weakref.ref(t) for t in tensors), value)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)

    def clear(self) -> None:
        self._seen.clear()


class _Checked(TensorLRU):
    """Checks that passed, keyed by (check, parameters, tensor identity and version)."""

    def __init__(self):
        super().__init__(64)
        self.enabled = False   # set by ``prepare`` for the duration of one call

    @staticmethod
    def _sig(t: torch.Tensor):
        try:
            version = t._version
        except RuntimeError:   # inference-mode tensors keep no version counter: never remembered
            return None
        return (id(t), version, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)

    def run(self, what: tuple, tensors: tuple, check) -> None:
        """Call ``check()`` unless it already passed on exactly these tensor versions."""
        key = None
        if self.enabled and not torch.compiler.is_compiling():
            sigs = tuple(self._sig(t) for t in tensors)
            if None not in sigs:
                key = (what, sigs)
                if self.get(key, tensors):
                    return
        check()
        if key is not None:
            self.put(key, tensors, True)


CHECKED = _Checked()


def _values_in(name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    def check():
        if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
            raise ValueError(f"{name} values must lie in {lo}..{hi}, got min {int(t.min())}, max {int(t.max())}")
    CHECKED.run(("range", name, lo, hi), (t,), check)


def _row_pair(what: str, q_rows, k_rows, limit: int, b, hq, hkv, nq, nk, device):
    """``q_<what>`` / ``k_<what>`` checked, broadcast to (B, H, N) and made int32."""
    out = []
    for side, t, h, n, hname in (("q", q_rows, hq, nq, "Hq"), ("k", k_rows, hkv, nk, "Hkv")):
        name = f"{side}_{what}"
        x = _broadcast(name, _check_int_tensor(name, t, device), b, h, n, hname)
        _values_in(name, t, 0, limit)   # the caller's tensor, not the view: that is what is remembered
        out.append(x.to(torch.int32))
    return tuple(out)


def check_doc_offsets(cu: torch.Tensor, n: int) -> torch.Tensor:
    """``cu_seqlens`` as int64 after checking its shape and values: 0, non-decreasing, up to N.

    The value checks synchronise with the device; they run once per tensor version (``CHECKED``).
    Shared by ``attention`` (``normalize``) and ``msa_attention``.
    """
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape (num_docs + 1,) with at least 2 entries, got {tuple(cu.shape)}")
    cu64 = cu.to(torch.int64)

    def check_offsets():
        if int(cu64[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu64[0])}")
        if int(cu64.max()) > n:
            raise ValueError(f"cu_seqlens has offsets past N={n} (max {int(cu64.max())})")
        if int(cu64[-1]) != n:
            raise ValueError(f"cu_seqlens must end at N={n}, got {int(cu64[-1])}")
        if bool((cu64[1:] < cu64[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing (sorted document offsets)")
    CHECKED.run(("cu_seqlens", n), (cu,), check_offsets)
    return cu64


def normalize(groups, b: int, hq: int, hkv: int, nq: int, nk: int, device=None, *, cu_seqlens=None,
            q_pos=None, k_pos=None, q_bucket=None, k_bucket=None, block_indices=None) -> Dynamic:
    """Validate the run-time inputs against the shapes and the pattern's head groups.

    ``groups``: ``[(h0, h1, spec), ...]`` (``Pattern.head_groups``). Raises ValueError / TypeError
    naming what was expected and what was given. Costs O(N) device work and a few host syncs.
    """
    dyn = Dynamic(nq=nq, nk=nk)
    given = []
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos must be given together (got only "
                         f"{'q_pos' if k_pos is None else 'k_pos'})")
    if (q_bucket is None) != (k_bucket is None):
        raise ValueError("q_bucket and k_bucket must be given together (got only "
                         f"{'q_bucket' if k_bucket is None else 'k_bucket'})")
    if cu_seqlens is not None:
        if q_pos is not None or q_bucket is not None:
            raise ValueError("cu_seqlens cannot be combined with q_pos/k_pos or q_bucket/k_bucket: "
                             "give positions relative to each document and a bucket per document instead")
        cu = _check_int_tensor("cu_seqlens", cu_seqlens, device)
        if cu.dtype != torch.int32:
            raise TypeError(f"cu_seqlens must be an int32 tensor, got {cu.dtype}")
        if b != 1:
            raise ValueError(f"cu_seqlens packs documents along N and needs batch size 1, got B={b}")
        if nq != nk:
            raise ValueError(f"cu_seqlens needs q and k of one length, got Nq={nq}, Nk={nk}")
        cu64 = check_doc_offsets(cu, nq)
        rows = torch.arange(nq, device=cu.device, dtype=torch.int64)
        doc = torch.searchsorted(cu64[1:], rows, right=True)   # document of each row
        pos = rows - cu64[doc]
        dyn.q_pos = dyn.k_pos = pos.to(torch.int32).view(1, 1, nq)
        dyn.q_seg = dyn.k_seg = doc.to(torch.int32).view(1, 1, nq)
        given.append("cu_seqlens")
    if q_pos is not None:
        dyn.q_pos, dyn.k_pos = _row_pair("pos", q_pos, k_pos, MAX_POSITION, b, hq, hkv, nq, nk, device)
        dyn.q_sources, dyn.k_sources = (q_pos,), (k_pos,)
        given.append("q_pos/k_pos")
    elif nq != nk:
        raise ValueError(f"q has N={nq} rows but k and v have N={nk}: different lengths need q_pos and k_pos")
    if q_bucket is not None:
        dyn.q_seg, dyn.k_seg = _row_pair("bucket", q_bucket, k_bucket, MAX_BUCKET, b, hq, hkv, nq, nk, device)
        dyn.q_sources += (q_bucket,)
        dyn.k_sources += (k_bucket,)
        ks = dyn.k_seg
        rows = ks.shape[0] * ks.shape[1]
        changes = int((ks[..., 1:] != ks[..., :-1]).sum()) if nk > 1 else 0   # one host sync
        dyn.bucket_keys = rows * nk / (rows + changes)
        if dyn.q_pos is None:
            dyn.q_pos = torch.arange(nq, device=dyn.q_seg.device, dtype=torch.int32).view(1, 1, nq)
            dyn.k_pos = torch.arange(nk, device=dyn.k_seg.device, dtype=torch.int32).view(1, 1, nk)
        given.append("q_bucket/k_bucket")

    topk_specs = [s for _, _, s in groups if s.topk]
    if block_indices is not None and not topk_specs:
        raise ValueError("block_indices given but the pattern has no topk=K term (add e.g. 'topk=16')")
    if topk_specs:
        if block_indices is None:
            raise ValueError(f"the pattern's topk={topk_specs[0].topk} term needs block_indices "
                             f"(int32 (B, Hkv, ceil(N / block), K), e.g. from msa_codegen.select_blocks)")
        if len({(s.topk, s.block) for s in topk_specs}) > 1:
            raise ValueError("every head group with a topk term must use the same topk and block "
                             "(they share one block_indices tensor)")
        kk, blk = topk_specs[0].topk, topk_specs[0].block
        bi = _check_int_tensor("block_indices", block_indices, device)
        nqb, nkb = _cdiv(nq, blk), _cdiv(nk, blk)
        want = (b, hkv, nqb, kk)
        if tuple(bi.shape) != want:
            raise ValueError(f"block_indices must have shape (B, Hkv, ceil(N / block), K) = {want} "
                             f"for topk={kk}, block={blk}; got {tuple(bi.shape)}")
        _values_in("block_indices", bi, -1, nkb - 1)
        dyn.block_indices = bi.to(torch.int32)
        given.append("block_indices")
    dyn.what = ", ".join(given)
    return dyn


def check_sorted(dyn: Dynamic) -> None:
    """The kernels find key ranges by binary search: rows must be sorted by (segment, position)."""
    if not dyn.positional:
        return
    for side, pos, seg, sources in (("q", dyn.q_pos, dyn.q_seg, dyn.q_sources),
                                    ("k", dyn.k_pos, dyn.k_seg, dyn.k_sources)):
        if not sources:
            continue

        def check(side=side, pos=pos, seg=seg):
            key = pos.to(torch.int64)
            if seg is not None:
                key = torch.broadcast_tensors(key, seg)[0] + (seg.to(torch.int64) << 32)
            if key.shape[-1] > 1 and bool((key[..., 1:] < key[..., :-1]).any()):
                if seg is None:
                    raise ValueError(f"{side}_pos must be non-decreasing along the sequence (sorted positions), "
                                     "as the kernels skip blocks by position ranges")
                raise ValueError(f"{side}_bucket/{side}_pos must be sorted along the sequence by (bucket, position), "
                                 "as the kernels skip blocks by bucket ranges: sort the rows (msa_codegen.hash_sort does)")
        CHECKED.run(("sorted", side), sources, check)


#: ``prepare``'s results, keyed like ``CHECKED``'s entries (shapes, heads, the pattern's head
#: groups and every run-time tensor's identity and version). A layer after the first of a step
#: passes the same, unmodified tensors: it gets the same ``Dynamic`` back without the Python of
#: ``normalize`` and without its device work (int32 copies, cu_seqlens' searchsorted: kernel
#: launches on every call). An entry holds its derived tensors and the caller's run-time tensors
#: (small: O(N) integers each) until it leaves the LRU.
PREPARED = TensorLRU(16)

_INPUT_NAMES = ("cu_seqlens", "q_pos", "k_pos", "q_bucket", "k_bucket", "block_indices")


def prepare(groups, b: int, hq: int, hkv: int, nq: int, nk: int, device, **inputs) -> Dynamic:
    """``normalize`` + ``check_sorted`` for the kernels, each check remembered per tensor version.

    The first call with a set of tensors pays the host syncs; later calls with the same,
    unmodified tensors (every layer of a step) skip them, and get the first call's ``Dynamic``
    (``PREPARED``). Never used by the dense oracle.
    """
    key = tensors = None
    if not torch.compiler.is_compiling():
        tensors = tuple(t for t in (inputs.get(n) for n in _INPUT_NAMES) if isinstance(t, torch.Tensor))
        sigs = tuple(_Checked._sig(t) for t in tensors)
        if None not in sigs:
            given = tuple(n for n in _INPUT_NAMES if inputs.get(n) is not None)
            key = (tuple(groups), b, hq, hkv, nq, nk, str(device), given, sigs)
            dyn = PREPARED.get(key, tensors)
            if dyn is not None:
                return dyn
    CHECKED.enabled = True
    try:
        dyn = normalize(groups, b, hq, hkv, nq, nk, device, **inputs)
        check_sorted(dyn)
    finally:
        CHECKED.enabled = False
    if key is not None:
        PREPARED.put(key, tensors, dyn)
    return dyn
