"""attn_implementation="msa" in Hugging Face transformers (msa_codegen.integrations.transformers).

Tiny models (hidden 64, 2 layers, 4 heads, 2 KV heads, head dim 16, vocab 100) in fp32: the same
weights run with "msa" and with the model's own masked attention ("eager" / "sdpa"); logits,
loss and every parameter gradient must agree. Without CUDA the kernels run in Triton's
interpreter (conftest), so the sequences are short.
"""
import copy
import logging
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import msa_codegen.integrations.transformers as msa_hf  # noqa: E402
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-4   # relative, per tensor; fp32 runs land near 1e-7
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=100, use_cache=False)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    msa_hf.register()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def pair(model_cls, cfg, ref_impl="eager", seed=0, **msa_attrs):
    """(msa model, reference model) with the same weights; msa_attrs go on the msa model's config only."""
    torch.manual_seed(seed)
    ref = model_cls._from_config(copy.deepcopy(cfg), attn_implementation=ref_impl).to(DEV)
    mcfg = copy.deepcopy(cfg)
    for k, v in msa_attrs.items():
        setattr(mcfg, k, v)
    model = model_cls._from_config(mcfg, attn_implementation="msa").to(DEV)
    model.load_state_dict(ref.state_dict())
    assert model.config._attn_implementation == "msa" and ref.config._attn_implementation == ref_impl
    return model, ref


def tokens(b, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (b, n), generator=g).to(DEV)


def check_training_step(model, ref, x, attention_mask=None, labels=None, valid=None):
    """One forward/backward of both: logits (on valid positions), loss and every gradient."""
    labels = x if labels is None else labels
    out = model(x, attention_mask=attention_mask, labels=labels)
    out_ref = ref(x, attention_mask=attention_mask, labels=labels)
    out.loss.backward()
    out_ref.loss.backward()
    la, lb = out.logits, out_ref.logits
    if valid is not None:
        la, lb = la[valid], lb[valid]
    assert rel(la, lb) < TOL
    assert abs(out.loss.item() - out_ref.loss.item()) < TOL * abs(out_ref.loss.item())
    names = 0
    for (name, p), (name_ref, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == name_ref
        assert p.grad is not None and p_ref.grad is not None, name
        assert rel(p.grad, p_ref.grad) < TOL, (name, rel(p.grad, p_ref.grad))
        names += 1
    assert names == len(list(ref.parameters()))


# ---- no kernels ---------------------------------------------------------------------------------

def test_core_does_not_import_transformers():
    code = ("import sys, msa_codegen, msa_codegen.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'imported too early'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__))] + sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    # register() (the module fixture ran it) put both hooks into transformers' global tables
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert AttentionInterface._global_mapping["msa"] is msa_hf.attention_forward
    assert AttentionMaskInterface._global_mapping["msa"] is msa_hf.mask_forward


def test_layer_patterns():
    assert msa_hf.layer_patterns(LlamaConfig(**TINY)) == ["causal", "causal"]
    assert msa_hf.layer_patterns(MistralConfig(**TINY, sliding_window=24)) == ["window=24", "window=24"]
    assert msa_hf.layer_patterns(MistralConfig(**TINY, sliding_window=None)) == ["causal", "causal"]
    qc = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert qc.layer_types == ["full_attention", "sliding_attention"]
    assert msa_hf.layer_patterns(qc) == ["causal", "window=16"]
    # use_sliding_window=False: Qwen2 drops the window, so do we
    assert msa_hf.layer_patterns(Qwen2Config(**TINY, sliding_window=16)) == ["causal", "causal"]
    cfg = LlamaConfig(**TINY)
    cfg.msa_pattern = "window=64,sink=4"
    assert msa_hf.layer_patterns(cfg) == ["window=64,sink=4"] * 2
    cfg.msa_pattern = ["causal", "0-1:window=8;2-3:causal"]
    assert msa_hf.layer_patterns(cfg) == ["causal", "0-1:window=8;2-3:causal"]
    cfg.msa_pattern = ["causal"]
    with pytest.raises(ValueError, match="one per layer"):
        msa_hf.layer_patterns(cfg)
    cfg.msa_pattern = "window=oops"
    with pytest.raises(ValueError):
        msa_hf.layer_patterns(cfg)
    cfg = LlamaConfig(**TINY)
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        msa_hf.layer_patterns(cfg)


def test_errors_are_clear():
    # dropout in training
    model, _ = pair(LlamaForCausalLM, LlamaConfig(**TINY, attention_dropout=0.1))
    x = tokens(1, 16)
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(x)
    # a ready-made 4D mask
    model.eval()
    with pytest.raises(ValueError, match="4D"):
        model(x, attention_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool, device=DEV))
    # a promise of no packing broken by packed position ids (eager mode reads them)
    model, _ = pair(LlamaForCausalLM, LlamaConfig(**TINY), msa_packed_sequences=False)
    pos = torch.cat([torch.arange(8), torch.arange(8)])[None].to(DEV)
    with pytest.raises(ValueError, match="msa_packed_sequences"):
        model(x, position_ids=pos)


def test_context_parallel_registration_errors():
    # the Gloo run of a model over 3 ranks is tests/distributed/test_context_parallel.py::P3-hf_*
    with pytest.raises(ValueError, match="mesh_dim"):
        msa_hf.register("msa_cp_test", mesh_dim=0)
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="no padding"):   # checked before any collective
        msa_hf.context_parallel_forward(torch.nn.Module(), q, k, k, torch.ones(1, 8, dtype=torch.bool), group=None)


# ---- parity with the model's own attention --------------------------------------------------------

def test_llama_matches_eager():
    model, ref = pair(LlamaForCausalLM, LlamaConfig(**TINY), "eager")
    check_training_step(model, ref, tokens(1, 96))


def test_mistral_sliding_window_matches_sdpa():
    # window 24 < N: the band's far edge is inside the sequence (HF: 0 <= i - j < 24, msa window=24)
    model, ref = pair(MistralForCausalLM, MistralConfig(**TINY, sliding_window=24), "sdpa")
    check_training_step(model, ref, tokens(1, 96))


def test_qwen2_mixed_layer_types_matches_eager():
    cfg = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    model, ref = pair(Qwen2ForCausalLM, cfg, "eager")
    check_training_step(model, ref, tokens(1, 64))


def test_gemma3_local_global_layers_match_eager():
    """Gemma 3: a sliding layer then a global one, with its own scaling (query_pre_attn_scalar)."""
    cfg = Gemma3TextConfig(**TINY, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                           query_pre_attn_scalar=24)
    assert msa_hf.layer_patterns(cfg) == ["window=16", "causal"]
    model, ref = pair(Gemma3ForCausalLM, cfg, "eager")
    x = tokens(1, 48)
    with torch.no_grad():
        assert rel(model(x).logits, ref(x).logits) < TOL
    # Gemma 2 softcaps its attention logits: refused, not ignored
    model, _ = pair(Gemma2ForCausalLM, Gemma2Config(**TINY, sliding_window=16))
    with pytest.raises(ValueError, match="softcap"):
        model(x)


def test_padding_any_layout_matches_eager():
    """Right padding, left padding and a hole: exact on the valid tokens, loss and gradients."""
    model, ref = pair(MistralForCausalLM, MistralConfig(**TINY, sliding_window=16), "eager")
    x = tokens(3, 40)
    am = torch.ones(3, 40, dtype=torch.long, device=DEV)
    am[0, 27:] = 0      # right
    am[1, :9] = 0       # left
    am[2, 18:23] = 0    # hole
    valid = am.bool()
    # the loss reads logits[t] against labels[t + 1]: leave out pairs that touch padding, whose
    # outputs are unspecified (a query that sees no key: transformers' eager gives the mean of V, msa zeros)
    keep = valid.clone()
    keep[:, 1:] &= valid[:, :-1]
    labels = x.masked_fill(~keep, -100)
    check_training_step(model, ref, x, attention_mask=am, labels=labels, valid=valid)


def test_all_ones_mask_takes_the_plain_path():
    model, ref = pair(LlamaForCausalLM, LlamaConfig(**TINY), "eager")
    x = tokens(2, 32)
    am = torch.ones_like(x)
    assert msa_hf.mask_forward(2, 32, 32, mask_function=transformers.masking_utils.causal_mask_function,
                               attention_mask=am.bool()) is None
    with torch.no_grad():
        assert rel(model(x, attention_mask=am).logits, ref(x, attention_mask=am).logits) < TOL


def test_packed_sequences_position_ids_and_cu_seq_lens():
    model, ref = pair(MistralForCausalLM, MistralConfig(**TINY, sliding_window=16), "eager")
    x = tokens(1, 48)
    pos = torch.cat([torch.arange(20), torch.arange(28)])[None].to(DEV)
    cu = torch.tensor([0, 20, 48], dtype=torch.int32, device=DEV)
    with torch.no_grad():
        want = ref(x, position_ids=pos).logits
        got = model(x, position_ids=pos).logits
        got_cu = model(x, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=28,
                       max_length_k=28).logits
        unpacked = ref(x, position_ids=torch.arange(48, device=DEV)[None]).logits
    assert rel(got, want) < TOL
    assert rel(got_cu, want) < TOL
    assert rel(unpacked, want) > 1e-3    # the packing matters here


def test_generate_with_cache_and_left_padding():
    cfg = MistralConfig(**{**TINY, "use_cache": True}, sliding_window=8)
    model, ref = pair(MistralForCausalLM, cfg, "eager")
    model.eval()
    ref.eval()
    x = tokens(2, 20)
    am = torch.ones_like(x)
    am[1, :6] = 0
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(x, output_logits=True, return_dict_in_generate=True, **kw)
        out_ref = ref.generate(x, output_logits=True, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, out_ref.sequences)
    for a, b in zip(out.logits, out_ref.logits):
        assert rel(a, b) < TOL


def test_msa_pattern_string_and_list():
    # one string: a Llama told "window=16" is Mistral with sliding_window=16
    torch.manual_seed(0)
    ref = MistralForCausalLM._from_config(MistralConfig(**TINY, sliding_window=16), attn_implementation="eager").to(DEV)
    cfg = LlamaConfig(**TINY)
    cfg.msa_pattern = "window=16"
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="msa").to(DEV)
    model.load_state_dict(ref.state_dict())
    dense = LlamaForCausalLM._from_config(LlamaConfig(**TINY), attn_implementation="eager").to(DEV)
    dense.load_state_dict(ref.state_dict())
    x = tokens(1, 48)
    with torch.no_grad():
        got, want = model(x).logits, ref(x).logits
        assert rel(got, want) < TOL
        assert rel(got, dense(x).logits) > 1e-3   # the window is not a no-op at this length
    # a list: a Qwen2 whose own layers are all full attention, told ["causal", "window=16"], is the
    # Qwen2 whose second layer slides
    ref_cfg = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    model, ref = pair(Qwen2ForCausalLM, ref_cfg, "eager")
    mcfg = Qwen2Config(**TINY)
    mcfg.msa_pattern = ["causal", "window=16"]
    model = Qwen2ForCausalLM._from_config(mcfg, attn_implementation="msa").to(DEV)
    model.load_state_dict(ref.state_dict())
    assert mcfg.layer_types == ["full_attention", "full_attention"]
    with torch.no_grad():
        assert rel(model(x).logits, ref(x).logits) < TOL


def test_logs_patterns_once(caplog):
    model, _ = pair(Qwen2ForCausalLM, Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16,
                                                  max_window_layers=1))
    x = tokens(1, 16)
    with caplog.at_level(logging.INFO, logger="msa_codegen"), torch.no_grad():
        model(x)
        model(x)
    recs = [r for r in caplog.records if r.name == "msa_codegen" and "patterns" in r.getMessage()]
    assert len(recs) == 1
    assert "layer 0: causal; layer 1: window=16" in recs[0].getMessage()


def test_training_steps_match_reference():
    model, ref = pair(MistralForCausalLM, MistralConfig(**TINY, sliding_window=16), "eager")
    x = tokens(1, 32)
    losses = {}
    for name, m in (("msa", model), ("ref", ref)):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        losses[name] = []
        for _ in range(3):
            loss = m(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses["msa"])))
    assert losses["msa"][-1] < losses["msa"][0]
    for a, b in zip(losses["msa"], losses["ref"]):
        assert abs(a - b) < 1e-4 * abs(b)


# ---- torch.compile -----------------------------------------------------------------------------

def test_compile_fullgraph_no_graph_breaks():
    """With no padding (and config.msa_packed_sequences=False) the whole model is one graph, the
    attention is msa's custom op, and the compiled loss/gradients are the eager ones."""
    model, _ = pair(MistralForCausalLM, MistralConfig(**TINY, sliding_window=16), msa_packed_sequences=False)
    x = tokens(1, 32)
    torch._dynamo.reset()
    exp = torch._dynamo.explain(model)(x, labels=x)
    assert exp.graph_break_count == 0 and exp.graph_count == 1, exp.break_reasons
    assert any("msa_codegen" in str(g.code) for g in exp.graphs)
    loss = model(x, labels=x).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss_c = compiled(x, labels=x).loss
    loss_c.backward()
    assert abs(loss_c.item() - loss.item()) < TOL * abs(loss.item())
    for g, p in zip(grads, model.parameters()):
        assert rel(p.grad, g) < TOL
    torch._dynamo.reset()
