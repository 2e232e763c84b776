"""``attn_implementation="msa"`` for Hugging Face transformers.

    import msa_codegen.integrations.transformers as msa_hf
    msa_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="msa")

``register()`` adds an attention function and a mask function under the name ``"msa"`` through
transformers' public ``AttentionInterface`` / ``AttentionMaskInterface``. Every attention layer
then calls ``msa_codegen.attention`` with its own pattern (``layer_patterns`` says which):

1. ``config.msa_pattern``: one pattern string for every layer, or a list with one per layer;
2. otherwise the config's local attention: ``sliding_window`` with ``layer_types``
   (``"sliding_attention"`` -> ``window=W``, ``"full_attention"`` -> ``causal``), or on every
   layer when the config has no ``layer_types`` (Mistral). transformers' sliding window lets
   query i see key j iff ``0 <= i - j < W``, which is msa's ``window=W``;
3. otherwise dense ``causal``.

Masks: the mask function returns ``None`` when there is nothing beyond the pattern (no padding,
no packed sequences, no cache offsets); the attention then runs the pattern alone, with no
data-dependent Python, so ``torch.compile(model, fullgraph=True)`` keeps one graph. Otherwise it
returns an ``MsaMask`` that the attention function turns into msa's run-time inputs:

- a 2D padding mask (any layout: right, left, holes): keys at padding positions go to a second
  bucket (``k_bucket``), the keys are reordered (stable) so that the valid ones come first, and
  the pattern is evaluated on the original positions (``q_pos`` / ``k_pos``). Every query row
  gets exactly what transformers' own mask gives it (a query row that sees no key gets zeros);
- sequences packed along one row through ``position_ids`` (transformers detects them when there
  is no attention mask): one bucket per sequence, positions from ``position_ids``;
- ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments (``DataCollatorWithFlattening``),
  batch size 1: passed as ``cu_seqlens``;
- a KV cache (generation): the queries' and keys' positions from the cache offsets.

Anything else (mask overlays of multimodal models, chunked attention, a ready-made 4D mask,
softcapping, attention sinks, dropout in training, bidirectional attention) raises an error
that says what is supported: never a silent wrong answer in eager mode (under torch.compile one
overlay is not seen: docs/transformers.md, "torch.compile").

Under ``torch.compile`` transformers cannot tell packed ``position_ids`` from plain ones
without reading them, so it always builds its packed-sequence mask there; this integration
then takes the packed route (exact, but msa's checks of run-time inputs break the graph). Set
``config.msa_packed_sequences = False`` to promise that ``position_ids`` never pack several
sequences into one row: the unpadded path is then the pattern alone, in one graph. In eager
mode transformers reads the position ids itself and no setting is needed.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import NamedTuple

import torch

import msa_codegen

logger = logging.getLogger("msa_codegen")

NAME = "msa"

_INSTALL_HINT = ("msa_codegen.integrations.transformers needs Hugging Face transformers: "
                 "pip install msa-codegen[hf]  (or: pip install 'transformers>=5.4')")
#: the mask hook's keyword arguments (q_length, q_offset, use_vmap, ...) are those of 5.4 and newer
MIN_TRANSFORMERS = (5, 4)


def _transformers():
    try:
        import transformers
    except ImportError as e:   # pragma: no cover - exercised only without transformers
        raise ImportError(_INSTALL_HINT) from e
    from packaging.version import Version

    if Version(transformers.__version__).release[:2] < MIN_TRANSFORMERS:
        raise ImportError(f"msa_codegen.integrations.transformers needs transformers>=5.4 (its attention-mask hook "
                          f"API), found {transformers.__version__}: pip install msa-codegen[hf]")
    return transformers


def register(name: str = NAME, *, context_parallel_group=None, mesh_dim=None) -> None:
    """Register ``attn_implementation=name`` (default ``"msa"``) with transformers. Idempotent.

    ``context_parallel_group``: run every attention layer of models with this implementation as
    ``msa_codegen.context_parallel_attention`` over that group (a ProcessGroup,
    ``torch.distributed.group.WORLD``, a DeviceMesh with ``mesh_dim``, or a ``(DeviceMesh, dim)``
    pair). Each rank then feeds the model its contiguous slice of the sequence, with
    ``position_ids`` holding the slice's global positions; see ``context_parallel_forward``.
    Register under another name (``"msa_cp"``) to keep the plain ``"msa"`` as well.
    """
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if context_parallel_group is None:
        if mesh_dim is not None:
            raise ValueError("msa: mesh_dim is only meaningful with a context_parallel_group")
        AttentionInterface.register(name, attention_forward)
    else:
        group = msa_codegen.distributed.resolve_group(context_parallel_group, mesh_dim)
        AttentionInterface.register(name, functools.partial(context_parallel_forward, group=group))
    AttentionMaskInterface.register(name, mask_forward)


# ---- patterns --------------------------------------------------------------------------------

def _num_layers(config) -> int:
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"msa: the config ({type(config).__name__}) has no integer num_hidden_layers")
    return n


def layer_patterns(config) -> list[str]:
    """The msa pattern of every attention layer of a model with this (text) config."""
    n = _num_layers(config)
    explicit = getattr(config, "msa_pattern", None)
    if explicit is not None:
        if isinstance(explicit, str):
            pats = [explicit] * n
        elif isinstance(explicit, (list, tuple)):
            if len(explicit) != n or not all(isinstance(p, str) for p in explicit):
                raise ValueError(f"msa: config.msa_pattern must be one pattern string or a list of {n} strings "
                                 f"(one per layer), got {explicit!r}")
            pats = list(explicit)
        else:
            raise TypeError(f"msa: config.msa_pattern must be a str or a list of str, got {type(explicit).__name__}")
        for p in set(pats):
            if msa_codegen.parse(p).msa_groups:   # parse raises PatternError naming a bad term
                raise ValueError(f"msa: config.msa_pattern {p!r} has an msa=T term, which needs proxy heads "
                                 f"(q_proxy, k_proxy) that this integration does not provide; call "
                                 f"msa_codegen.attention with them in the model's attention instead")
        return pats
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        types = list(types)
        if len(types) != n:
            raise ValueError(f"msa: config.layer_types has {len(types)} entries for {n} layers")
        pats = []
        for i, t in enumerate(types):
            if t == "full_attention":
                pats.append("causal")
            elif t == "sliding_attention":
                if not isinstance(window, int) or window < 1:
                    raise ValueError(f"msa: layer {i} is a sliding_attention layer but config.sliding_window is "
                                     f"{window!r}")
                pats.append(f"window={window}")
            else:
                raise ValueError(f"msa: layer {i} has layer type {t!r}; only 'full_attention' and "
                                 f"'sliding_attention' map onto msa patterns (set config.msa_pattern to choose one)")
        return pats
    if window is not None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"msa: config.sliding_window must be a positive int, got {window!r}")
        return [f"window={window}"] * n
    return ["causal"] * n


_logged: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def _log_once(config, pats: list[str]) -> None:
    """Log a model's patterns the first time one of its layers runs (not while compiling)."""
    key = id(config)
    try:
        if _logged.get(key) is config:
            return
        _logged[key] = config
    except TypeError:   # a config that cannot be weakly referenced: log every time rather than never
        pass
    source = "config.msa_pattern" if getattr(config, "msa_pattern", None) is not None else (
        "config.sliding_window/layer_types" if getattr(config, "sliding_window", None) is not None else "default")
    runs, prev = [], None
    for i, p in enumerate(pats):   # group consecutive equal layers: "layers 0-3: window=4096"
        if p == prev:
            runs[-1][1] = i
        else:
            runs.append([i, i, p])
            prev = p
    text = "; ".join(f"layer{'s' if a != b else ''} {a}{'-' + str(b) if a != b else ''}: {p}" for a, b, p in runs)
    logger.info("msa attention patterns for %s (from %s): %s", type(config).__name__, source, text)


def _module_pattern(module, kwargs) -> str:
    config = module.config
    pats = layer_patterns(config)
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int) or not 0 <= idx < len(pats):
        if len(set(pats)) != 1:
            raise ValueError(f"msa: the attention module {type(module).__name__} has no usable layer_idx "
                             f"({idx!r}), and the layers' patterns differ")
        idx = 0
    pat = pats[idx]
    if getattr(config, "msa_pattern", None) is None and "sliding_window" in kwargs:
        # the layer says itself whether it is local: it must agree with what the config gave
        w = kwargs["sliding_window"]
        want = "causal" if w is None else f"window={w}"
        if want != pat:
            raise ValueError(f"msa: layer {idx} of {type(module).__name__} runs sliding_window={w!r}, but its "
                             f"config gives the pattern {pat!r}; set config.msa_pattern to choose explicitly")
    if not torch.compiler.is_compiling():
        _log_once(config, pats)
    return pat


# ---- masks -----------------------------------------------------------------------------------

class MsaMask(NamedTuple):
    """What the ``"msa"`` mask function hands the attention layers when the pattern alone is not
    enough. ``key_valid``: bool ``(B, kv_length)``, True where a key may be seen (None: all);
    ``packed``: sequences packed along a row through ``position_ids``; the offsets: absolute
    positions of the first query and key (a cache)."""
    key_valid: torch.Tensor | None
    packed: bool
    q_offset: int | torch.Tensor
    kv_offset: int
    q_length: int
    kv_length: int


_KNOWN_LEAVES = ("causal_mask_function", "sliding_window_overlay.<locals>.inner_mask")


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in (fn.__closure__ or ()))))


def _inspect_mask_function(fn) -> bool:
    """Eager mode: read transformers' mask function and say whether it packs sequences; raise for
    anything that is not causal / sliding window (+ packed sequences)."""
    name = getattr(fn, "__qualname__", repr(fn))
    if name in _KNOWN_LEAVES:
        return False
    if name == "and_masks.<locals>.and_mask":
        return any([_inspect_mask_function(f) for f in _closure(fn)["mask_functions"]])
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        _inspect_mask_function(_closure(fn)["mask_function"])
        return True
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return True
    raise ValueError(f"msa: the model builds its attention mask with {name}, which msa cannot reproduce exactly "
                     f"(supported: causal and sliding-window masks, padding, packed sequences). Use another "
                     f"attn_implementation for this model")


def mask_forward(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, allow_is_causal_skip: bool = True,
                 use_vmap: bool = False, config=None, **kwargs):
    """transformers' mask hook for ``"msa"``: ``None`` (the pattern alone) or an ``MsaMask``."""
    # plain attribute access: under dynamo, getattr(fn, "__qualname__", default) gives the descriptor
    name = mask_function.__qualname__ if mask_function is not None else ""
    if use_vmap or name.startswith("or_masks"):
        raise ValueError("msa: this model adds its own terms to the attention mask (or_mask_function / "
                         "and_mask_function / block_sequence_ids, e.g. bidirectional image tokens); msa runs "
                         "causal and sliding-window patterns with padding and packed sequences only. Use another "
                         "attn_implementation for this model")
    if name in ("bidirectional_mask_function", "sliding_window_bidirectional_overlay.<locals>.inner_mask") or \
            name.startswith("chunked"):
        raise ValueError(f"msa: unsupported attention mask kind ({name or mask_function!r}): only causal and "
                         f"sliding-window decoder attention is supported")
    compiling = torch.compiler.is_compiling()
    if compiling:
        # transformers adds its packed-sequence terms whenever it cannot read position_ids (always
        # while compiling, with no attention mask and no cache): take them as packed unless the
        # config promises otherwise
        packed = (not allow_is_causal_skip and attention_mask is None and isinstance(q_offset, int)
                  and q_offset == 0 and kv_offset == 0 and q_length == kv_length
                  and getattr(config, "msa_packed_sequences", None) is not False)
    else:
        packed = _inspect_mask_function(mask_function) if mask_function is not None else False
        if packed and getattr(config, "msa_packed_sequences", None) is False:
            raise ValueError("msa: config.msa_packed_sequences is False, but position_ids pack several "
                             "sequences into one row")
    key_valid = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"msa: expected a 2D padding mask, got shape {tuple(attention_mask.shape)}")
        valid = attention_mask.to(torch.bool)
        if valid.shape[-1] < kv_offset + kv_length:   # as transformers does: missing columns are not padding
            valid = torch.nn.functional.pad(valid, (0, kv_offset + kv_length - valid.shape[-1]))
        key_valid = valid[:, kv_offset:kv_offset + kv_length]
        if not compiling and bool(key_valid.all()):
            key_valid = None
    if isinstance(q_offset, torch.Tensor) and not compiling:
        q_offset = int(q_offset)
    plain = (key_valid is None and not packed and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
             and q_length == kv_length)
    if plain:
        return None
    return MsaMask(key_valid, packed, q_offset, kv_offset, q_length, kv_length)


# ---- attention -------------------------------------------------------------------------------

def _segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Sequence ids of packed rows, as transformers defines them: a new sequence starts wherever
    the position does not go up by one."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def _refuse_unsupported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """What neither attention hook supports: dropout, soft-capping, attention sinks (``s_aux``),
    bidirectional layers."""
    if dropout:
        raise ValueError(f"msa: attention dropout ({dropout}) is not supported; set the config's attention_dropout "
                         f"to 0 for training with attn_implementation='msa' (it is only applied in training mode)")
    for kw in ("softcap", "s_aux"):
        if kwargs.get(kw) is not None:
            raise ValueError(f"msa: {kw} is not supported (this model's attention needs it)")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError("msa: bidirectional (non-causal) attention layers are not supported")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention hook for ``"msa"``: q ``(B, Hq, N, D)``, k/v ``(B, Hkv, Nk, D)``;
    returns ``((B, N, Hq, D), None)``."""
    _refuse_unsupported(module, dropout, kwargs)
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"msa: value head dim {value.shape[-1]} differs from the query/key head dim "
                         f"{query.shape[-1]}")
    pattern = _module_pattern(module, kwargs)
    run = dict(scale=scaling)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")

    if attention_mask is None:
        if cu_q is not None or cu_k is not None:
            if cu_k is not None and cu_q is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k):
                raise ValueError("msa: cu_seq_lens_q and cu_seq_lens_k differ (only self-attention is supported)")
            run["cu_seqlens"] = (cu_q if cu_q is not None else cu_k).to(torch.int32)
        elif query.shape[2] != key.shape[2]:
            raise ValueError(f"msa: {query.shape[2]} queries and {key.shape[2]} keys without a mask from the 'msa' "
                             f"mask function (is the mask function registered? call register())")
    elif isinstance(attention_mask, MsaMask):
        m = attention_mask
        b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
        if (nq, nk) != (m.q_length, m.kv_length):
            raise ValueError(f"msa: the mask was made for {m.q_length} queries and {m.kv_length} keys, "
                             f"the layer has {nq} and {nk}")
        if m.packed:
            pos = kwargs.get("position_ids")
            if pos is None:
                raise ValueError("msa: packed sequences need the position_ids keyword argument in the attention "
                                 "layer, and this model does not pass it")
            pos = pos.expand(b, -1)
            seg = _segments(pos)
            run.update(q_pos=pos[:, None, :], k_pos=pos[:, None, :], q_bucket=seg[:, None, :],
                       k_bucket=seg[:, None, :])
        else:
            qp = torch.arange(nq, device=query.device) + m.q_offset
            kp = torch.arange(nk, device=query.device) + m.kv_offset
            if m.key_valid is None:
                run.update(q_pos=qp, k_pos=kp)
            else:
                pad = (~m.key_valid.to(query.device)).to(torch.int32)           # (B, Nk): 0 valid, 1 padding
                order = torch.sort(pad, dim=-1, stable=True).indices            # valid keys first, in order
                idx = order[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
                key, value = key.gather(2, idx), value.gather(2, idx)
                run.update(q_pos=qp, k_pos=kp[order][:, None, :], q_bucket=torch.zeros_like(qp),
                           k_bucket=pad.gather(1, order)[:, None, :])
    else:
        raise ValueError(f"msa: unsupported attention mask {type(attention_mask).__name__} "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}: pass a 2D padding mask (or none); "
                         f"ready-made 4D masks are not supported")

    out = msa_codegen.attention(query, key, value, pattern, **run)
    return out.transpose(1, 2), None


def context_parallel_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, dropout: float = 0.0, scaling: float | None = None, *, group,
                             **kwargs):
    """transformers' attention hook for a name registered with ``context_parallel_group``.

    q ``(B, Hq, n_r, D)``, k/v ``(B, Hkv, n_r, D)``: this rank's contiguous slice of the sequence
    (rank r of ``group`` holds the r-th slice); returns ``((B, n_r, Hq, D), None)``, this rank's rows
    of the layer's pattern over the whole sequence. Training and full-sequence forwards only: the
    model must be called with ``position_ids`` = the slice's global positions (``arange(start,
    end)``: rotary embeddings use them, and a model called without them numbers every slice from
    0) and without an attention mask, packed sequences or a KV cache, which raise.
    """
    _refuse_unsupported(module, dropout, kwargs)
    if attention_mask is not None or kwargs.get("cu_seq_lens_q") is not None \
            or kwargs.get("cu_seq_lens_k") is not None or query.shape[2] != key.shape[2]:
        raise ValueError("msa (context parallel): only whole sequences split in slices are supported: no padding "
                         "mask, packed sequences (position_ids that restart, cu_seq_lens_*) or KV cache. Under "
                         "torch.compile set config.msa_packed_sequences = False (transformers cannot read "
                         "position_ids while compiling and would otherwise ask for the packed route)")
    pattern = _module_pattern(module, kwargs)
    out = msa_codegen.context_parallel_attention(query, key, value, pattern, group=group, scale=scaling)
    return out.transpose(1, 2), None
