"""Context parallelism: sparse attention over a sequence sharded across a torch.distributed group.

``halo`` says which key rows each rank needs (pure functions), ``exchange`` moves them with P2P
ops (differentiable), ``context_parallel`` is the public entry point.
"""
from .context_parallel import context_parallel_attention, resolve_group
from .exchange import last_traffic
from .halo import fetched_rows, needed_ranges, traffic_bytes

__all__ = ["context_parallel_attention", "resolve_group", "last_traffic", "fetched_rows", "needed_ranges",
           "traffic_bytes"]
