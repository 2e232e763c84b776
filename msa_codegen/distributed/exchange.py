"""Moving rows between ranks: a differentiable fetch over torch.distributed point-to-point ops.

``fetch(tensors, plans, starts, comm)`` gives rank ``comm.rank``, for every ``(B, H, n_local, D)``
tensor, a tensor of the rows its plan names, in row order, each taken from the rank that owns it
(``halo.exchange_plan``). One batch of ``isend``/``irecv`` per direction moves them: one message
per peer, holding the pieces of every tensor back to back. The backward is the mirror image:
the gradients of the fetched rows go back to their owners, which add them to their own.

Every rank computes every rank's plan from the same inputs, so both ends of a message agree on
its size and layout without asking. Traffic is counted here (``last_traffic``) so that tests can
hold it against the halo formula.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .halo import Segment


@dataclasses.dataclass
class Comm:
    """A process group, this rank's index in it, and the global ranks P2P ops address."""

    group: object
    rank: int
    size: int
    global_ranks: list[int]


def make_comm(group) -> Comm:
    """``group`` (a ProcessGroup, or None for the default group) as a ``Comm``."""
    if group is None:
        group = dist.group.WORLD
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    return Comm(group, rank, size, list(ranks))


#: bytes this rank moved in its latest context-parallel call, per direction (see ``last_traffic``)
_TRAFFIC = {"forward_sent": 0, "forward_received": 0, "backward_sent": 0, "backward_received": 0}


def last_traffic() -> dict[str, int]:
    """Bytes this rank sent and received in the forward and the backward of its latest call.

    The forward counters are reset by each call; the backward ones by the call's forward and
    set when its backward runs.
    """
    return dict(_TRAFFIC)


def _pieces_between(plans, src: int, dst: int):
    """The pieces ``dst`` fetches from ``src``: ``(tensor index, lo, hi)`` (global rows) in message order."""
    return [(i, lo, hi) for i, plan in enumerate(plans) for owner, lo, hi in plan[dst] if owner == src]


def _swap(comm: Comm, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
    """Post every send and receive in one batch and wait for all of them."""
    ops = [dist.P2POp(dist.isend, t, comm.global_ranks[p], comm.group) for p, t in sends.items() if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, comm.global_ranks[p], comm.group) for p, t in recvs.items() if t.numel()]
    if not ops:
        return
    for req in dist.batch_isend_irecv(ops):
        req.wait()


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, *tensors):
        plans, starts, comm = spec
        me = comm.rank
        shapes = [(t.shape[0], t.shape[1], t.shape[3]) for t in tensors]
        ref = tensors[0]

        def take(i, lo, hi):   # rows [lo, hi) (global) of this rank's tensor i, flattened
            s = starts[me]
            return tensors[i][:, :, lo - s:hi - s].reshape(-1)

        def numel(pieces):
            return sum(shapes[i][0] * shapes[i][1] * shapes[i][2] * (hi - lo) for i, lo, hi in pieces)

        sends, recvs = {}, {}
        for p in range(comm.size):
            if p == me:
                continue
            out_pieces = _pieces_between(plans, me, p)
            if out_pieces:
                sends[p] = torch.cat([take(*x) for x in out_pieces])
            in_pieces = _pieces_between(plans, p, me)
            if in_pieces:
                recvs[p] = ref.new_empty(numel(in_pieces))
        _swap(comm, sends, recvs)
        _TRAFFIC.update(forward_sent=sum(t.numel() for t in sends.values()) * ref.element_size(),
                        forward_received=sum(t.numel() for t in recvs.values()) * ref.element_size(),
                        backward_sent=0, backward_received=0)

        # unpack: per tensor, its received pieces by (owner, lo)
        got = {}
        for p, buf in recvs.items():
            at = 0
            for i, lo, hi in _pieces_between(plans, p, me):
                b, h, d = shapes[i]
                size = b * h * d * (hi - lo)
                got[(i, lo)] = buf[at:at + size].view(b, h, hi - lo, d)
                at += size
        outs = []
        for i, plan in enumerate(plans):
            parts = [tensors[i][:, :, lo - starts[me]:hi - starts[me]] if owner == me else got[(i, lo)]
                     for owner, lo, hi in plan[me]]
            b, h, d = shapes[i]
            outs.append(torch.cat(parts, dim=2) if parts else tensors[i].new_empty(b, h, 0, d))
        ctx.spec = spec
        ctx.shapes = shapes
        ctx.lengths = [t.shape[2] for t in tensors]
        ctx.dtype, ctx.device = ref.dtype, ref.device
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        plans, starts, comm = ctx.spec
        me = comm.rank
        shapes = ctx.shapes
        dtype, device = ctx.dtype, ctx.device
        own = [torch.zeros(b, h, n, d, dtype=dtype, device=device) for (b, h, d), n in zip(shapes, ctx.lengths)]
        # where each segment sits in the fetched tensor
        at_row = []
        for i, plan in enumerate(plans):
            rows, pos = {}, 0
            for owner, lo, hi in plan[me]:
                rows[lo] = pos
                pos += hi - lo
            at_row.append(rows)

        def grad_of(i, lo, hi):
            g = grads[i]
            b, h, d = shapes[i]
            if g is None:
                return torch.zeros(b * h * (hi - lo) * d, dtype=dtype, device=device)
            r = at_row[i][lo]
            return g[:, :, r:r + hi - lo].reshape(-1)

        for i, plan in enumerate(plans):   # gradients of this rank's own rows stay here
            if grads[i] is None:
                continue
            for owner, lo, hi in plan[me]:
                if owner == me:
                    r = at_row[i][lo]
                    own[i][:, :, lo - starts[me]:hi - starts[me]] += grads[i][:, :, r:r + hi - lo]
        sends, recvs = {}, {}
        for p in range(comm.size):
            if p == me:
                continue
            back = _pieces_between(plans, p, me)     # rows fetched from p: their grads go back
            if back:
                sends[p] = torch.cat([grad_of(*x) for x in back]).contiguous()
            mine = _pieces_between(plans, me, p)     # rows p fetched from here
            if mine:
                recvs[p] = torch.empty(sum(shapes[i][0] * shapes[i][1] * shapes[i][2] * (hi - lo)
                                           for i, lo, hi in mine), dtype=dtype, device=device)
        _swap(comm, sends, recvs)
        esize = torch.empty((), dtype=dtype).element_size()
        _TRAFFIC.update(backward_sent=sum(t.numel() for t in sends.values()) * esize,
                        backward_received=sum(t.numel() for t in recvs.values()) * esize)
        for p, buf in recvs.items():
            at = 0
            for i, lo, hi in _pieces_between(plans, me, p):
                b, h, d = shapes[i]
                size = b * h * d * (hi - lo)
                own[i][:, :, lo - starts[me]:hi - starts[me]] += buf[at:at + size].view(b, h, hi - lo, d)
                at += size
        return (None, *own)


def fetch(tensors: list[torch.Tensor], plans: list[list[list[Segment]]], starts: list[int], comm: Comm):
    """Per tensor ``(B, H, n_me, D)``, the rows ``plans[i][comm.rank]`` names, fetched from their owners.

    ``plans[i]``: per rank, its segments ``(owner, lo, hi)`` in row order (``halo.exchange_plan``);
    ``starts``: the first global row of every rank. Collective: every rank of the group calls it
    with the same plans, and every rank must run the backward when one does.
    """
    return _Fetch.apply((plans, starts, comm), *tensors)
