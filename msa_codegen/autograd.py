"""Two routes into the launchers with one autograd rule.

- The custom ops ``msa_codegen::attention_fwd`` / ``attention_bwd`` with fake implementations:
  what torch.compile traces (their schema is checked by ``torch.library.opcheck``). They carry
  the canonical pattern string and the launch configuration as an int list, and find the
  call's plan by its key (one dictionary hit).
- ``_EagerAttention``: the eager route, the same launchers without the dispatcher, handed the
  plan and the configuration directly. Measured on a CPU with the kernels stubbed out: the
  custom op costs ~100 us of host time per forward with autograd against ~13 us for the
  launcher alone, and a call whose kernels take a few hundred microseconds is timed by its
  host path.

``run`` picks the route. No gradient flows into positions, segments or block indices.
"""
from __future__ import annotations

import torch

from .config import LaunchConfig, from_list
from .kernels import launch
from .plan import AttentionPlan, plan_for


def _plan_of(pattern: str, q, k, q_pos, q_seg, index_classes) -> AttentionPlan:
    b, hq, n, d = q.shape
    return plan_for(pattern, q.device, q.dtype, d, hq, k.shape[1], n, positional=q_pos is not None,
                    segments=q_seg is not None, classes=index_classes)


# ---- custom ops ---------------------------------------------------------------------------

@torch.library.custom_op("msa_codegen::attention_fwd", mutates_args=())
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: str, scale: float,
                     config: list[int], q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                     q_seg: torch.Tensor | None = None, k_seg: torch.Tensor | None = None,
                     block_indices: torch.Tensor | None = None, index_classes: bool = False,
                     deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic: the backward's (read by the autograd rule), not the forward's
    plan = _plan_of(pattern, q, k, q_pos, q_seg, index_classes)
    return launch.forward(q, k, v, plan, scale, from_list(config), q_pos, k_pos, q_seg, k_seg, block_indices)


@attention_fwd_op.register_fake
def _(q, k, v, pattern, scale, config, q_pos=None, k_pos=None, q_seg=None, k_seg=None, block_indices=None,
      index_classes=False, deterministic=True):
    b, hq, n, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, hq, n), dtype=torch.float32)


@torch.library.custom_op("msa_codegen::attention_bwd", mutates_args=())
def attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, dlse: torch.Tensor | None, pattern: str, scale: float,
                     config: list[int], q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                     q_seg: torch.Tensor | None = None, k_seg: torch.Tensor | None = None,
                     block_indices: torch.Tensor | None = None, index_classes: bool = False,
                     deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = _plan_of(pattern, q, k, q_pos, q_seg, index_classes)
    return launch.backward(do, q, k, v, o, lse, dlse, plan, scale, from_list(config), q_pos, k_pos, q_seg, k_seg,
                           block_indices, deterministic)


@attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, dlse, pattern, scale, config, q_pos=None, k_pos=None, q_seg=None, k_seg=None,
      block_indices=None, index_classes=False, deterministic=True):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, q, k, v, o, lse, run_time: list) -> None:
    """What both routes' backward needs: the inputs, the output and LSE, the run-time tensors
    that were given (a plain call saves five tensors: no placeholder is allocated per call)."""
    given = [t for t in run_time if t is not None]
    ctx.save_for_backward(q, k, v, o, lse, *given)
    ctx.has_run_time = [t is not None for t in run_time] if given else None


def _saved(ctx):
    q, k, v, o, lse, *given = ctx.saved_tensors
    if ctx.has_run_time is None:
        return q, k, v, o, lse, [None] * 5
    it = iter(given)
    return q, k, v, o, lse, [next(it) if has else None for has in ctx.has_run_time]


def _setup_context(ctx, inputs, output):
    q, k, v, pattern, scale, config, *run_time = inputs
    run_time = run_time + [None] * (7 - len(run_time))
    run_time, classes, deterministic = run_time[:5], bool(run_time[5]), run_time[6] is None or bool(run_time[6])
    o, lse = output
    _save(ctx, q, k, v, o, lse, run_time)
    ctx.pattern, ctx.scale, ctx.config, ctx.classes, ctx.deterministic = pattern, scale, config, classes, deterministic


def _backward(ctx, do, dlse):
    q, k, v, o, lse, run_time = _saved(ctx)
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = attention_bwd_op(do, q, k, v, o, lse, dlse, ctx.pattern, ctx.scale, ctx.config, *run_time,
                                  ctx.classes, ctx.deterministic)
    # no gradient into positions, segments, block indices or the flags
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("msa_codegen::attention_fwd", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager route of ``attention``: the launchers with the plan and config in hand."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale, config, q_pos, k_pos, q_seg, k_seg, block_indices, deterministic):
        o, lse = launch.forward(q, k, v, plan, scale, config, q_pos, k_pos, q_seg, k_seg, block_indices)
        _save(ctx, q, k, v, o, lse, [q_pos, k_pos, q_seg, k_seg, block_indices])
        ctx.plan, ctx.scale, ctx.config, ctx.deterministic = plan, scale, config, deterministic
        ctx.set_materialize_grads(False)   # an unused output (the LSE, mostly) gets None, not zeros
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, run_time = _saved(ctx)
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = launch.backward(do, q, k, v, o, lse, dlse, ctx.plan, ctx.scale, ctx.config, *run_time,
                                     deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def run(q, k, v, plan: AttentionPlan, scale: float, config: LaunchConfig, q_pos=None, k_pos=None, q_seg=None,
        k_seg=None, block_indices=None, deterministic: bool = True):
    """(out, lse) through the eager Function (see the module docstring for the compiled route);
    ``deterministic``: the backward's (``launch.backward``)."""
    return _EagerAttention.apply(q, k, v, plan, scale, config, q_pos, k_pos, q_seg, k_seg, block_indices,
                                 deterministic)


def run_compiled(q, k, v, pattern_text: str, scale: float, config_list: list[int], q_pos=None, k_pos=None,
                 q_seg=None, k_seg=None, block_indices=None, index_classes: bool = False, deterministic: bool = True):
    """(out, lse) through the custom op: what torch.compile traces."""
    return attention_fwd_op(q, k, v, pattern_text, scale, config_list, q_pos, k_pos, q_seg, k_seg, block_indices,
                            index_classes, deterministic)
