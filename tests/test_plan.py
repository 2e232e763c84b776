"""The plan of a call (msa_codegen.plan): built once per call key, one dictionary hit after,
emptied by tuning.reload(); use_config wins over it without invalidating anything."""
import torch

import msa_codegen as msa
from msa_codegen import plan as plan_mod
from msa_codegen import tuning
from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig
from msa_codegen.kernels import launch


def _qkv(device, n=40, hq=2, hkv=1, d=16):
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(1, h, n, d, generator=g).to(device) for h in (hq, hkv, hkv))


def _count(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_one_plan_per_key(device):
    tuning.reload()
    a = plan_mod.plan_for("window=8", device, torch.float32, 16, 2, 1, 40)
    assert plan_mod.plan_for("window=8", device, torch.float32, 16, 2, 1, 40) is a
    assert plan_mod.plan_for("window=8", device, torch.float32, 16, 2, 1, 1000) is a     # same length bucket
    assert plan_mod.plan_for("window=8", device, torch.float32, 16, 2, 1, 5000) is not a  # another bucket
    assert plan_mod.plan_for("window=8", device, torch.float32, 16, 2, 1, 40, positional=True) is not a
    assert a.pattern_text == "window=8" and [(g.h0, g.h1) for g in a.groups] == [(0, 2)]
    assert a.config == a.resolution.config and a.source == "heuristic default"


def test_calls_after_the_first_resolve_nothing(device, monkeypatch):
    """The second and later calls of a key build no plan and ask no database."""
    tuning.reload()
    q, k, v = _qkv(device)
    msa.attention(q, k, v, "window=8,dilation=2")
    builds = _count(monkeypatch, plan_mod, "_build")
    lookups = _count(monkeypatch, tuning.lookup, "lookup")
    for n in (40, 17, 63):
        q, k, v = _qkv(device, n=n)
        msa.attention(q, k, v, "window=8,dilation=2")
    assert builds == [] and lookups == []
    tuning.reload()   # a database changed: plans are built again, once
    for _ in range(2):
        msa.attention(q, k, v, "window=8,dilation=2")
    assert len(builds) == 1 and len(lookups) == 1


def test_use_config_wins_over_the_plan(device, monkeypatch):
    q, k, v = _qkv(device)
    msa.attention(q, k, v, "window=8")
    seen = []
    real = launch.forward

    def spy(q, k, v, plan, scale, cfg, *rest):
        seen.append(cfg)
        return real(q, k, v, plan, scale, cfg, *rest)

    monkeypatch.setattr(launch, "forward", spy)
    forced = LaunchConfig(FwdConfig(16, 16, 4, 1), BwdConfig(16, 16, 4, 1, 16, 16, 4, 1))
    with msa.use_config(forced):
        msa.attention(q, k, v, "window=8")
    msa.attention(q, k, v, "window=8")
    planned = plan_mod.plan_for("window=8", device, torch.float32, 16, 2, 1, 40).config
    assert seen == [forced, planned] and planned != forced
