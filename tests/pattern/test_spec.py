"""Tests for msa_codegen.pattern.spec: pattern grammar, validation, canonical form, head groups."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the repository

from msa_codegen.pattern.spec import MAX_VALUE, HeadGroup, Pattern, PatternError, Spec, parse  # noqa: E402

# ---------------------------------------------------------------------------------------
# Valid patterns and their canonical form
# ---------------------------------------------------------------------------------------

VALID = [
    ("causal", "causal"),
    ("causal=true", "causal"),
    ("causal=false", "causal=false"),
    ("  causal = false  ", "causal=false"),
    ("window=8", "window=8"),
    ("window=1", "window=1"),
    ("dilation=1,window=8", "window=8"),
    ("sink=64, window=4096,dilation=2", "window=4096,dilation=2,sink=64"),
    ("window=4096,dilation=2,sink=64", "window=4096,dilation=2,sink=64"),
    ("causal,window=16", "window=16"),
    ("window=16,causal=false", "causal=false,window=16"),
    ("sink=4", "sink=4"),
    ("global=4,causal=false", "causal=false,global=4"),
    ("causal=false,global=2,window=3,sink=1", "causal=false,window=3,sink=1,global=2"),
    ("random=3", "random=3"),
    ("random=3,seed=0", "random=3"),
    ("seed=7,random=3", "random=3,seed=7"),
    ("random=3,block=128", "random=3"),
    ("block=64,random=2,seed=1", "random=2,seed=1,block=64"),
    ("window=007", "window=7"),
    (f"window={MAX_VALUE}", f"window={MAX_VALUE}"),
    (f"random=1,seed={MAX_VALUE}", f"random=1,seed={MAX_VALUE}"),
    ("\twindow\t=\t4\n", "window=4"),
    ("0-15:window=512", "0-15:window=512"),
    ("0-7:window=512;8-15:window=8192,dilation=8", "0-7:window=512;8-15:window=8192,dilation=8"),
    ("8-15:window=8192,dilation=8;0-7:window=512", "0-7:window=512;8-15:window=8192,dilation=8"),
    (" 8 - 15 : sink=4 ; 0 - 7 : causal ", "0-7:causal;8-15:sink=4"),
    ("3:causal", "3-3:causal"),
    ("3-3:causal", "3-3:causal"),
    ("0:causal=false,global=1;1-2:window=4", "0-0:causal=false,global=1;1-2:window=4"),
    ("4-7:window=2;0-1:sink=1", "0-1:sink=1;4-7:window=2"),  # gaps parse; head_groups rejects
    ("msa=2048", "msa=2048"),
    ("msa=2048,block=128", "msa=2048"),
    ("block=64,msa=128", "msa=128,block=64"),
    ("causal, msa=256", "msa=256"),
    ("causal=true,msa=64,block=64", "msa=64,block=64"),
    ("4-7:window=32;0-3:block=64,msa=128", "0-3:msa=128,block=64;4-7:window=32"),
    ("0-3:msa=128;4-7:msa=256", "0-3:msa=128;4-7:msa=256"),  # parses; attention allows one msa group
]


@pytest.mark.parametrize("text,canonical", VALID, ids=[v[0].strip() or repr(v[0]) for v in VALID])
def test_valid_canonical(text: str, canonical: str) -> None:
    p = parse(text)
    assert isinstance(p, Pattern)
    assert str(p) == canonical
    assert parse(str(p)) == p
    assert str(parse(str(p))) == canonical


def test_spec_fields() -> None:
    spec = parse("sink=64, window=4096,dilation=2").groups[0].spec
    assert spec == Spec(window=4096, dilation=2, sink=64)
    assert spec.causal is True and not spec.dense
    spec = parse("causal=false,global=8,random=2,seed=5,block=64").groups[0].spec
    assert spec == Spec(causal=False, global_=8, random=2, seed=5, block=64)


@pytest.mark.parametrize(
    "text,dense",
    [
        ("causal", True),
        ("causal=false", True),
        ("window=1", False),
        ("sink=1", False),
        ("causal=false,global=1", False),
        ("random=1", False),
    ],
)
def test_dense(text: str, dense: bool) -> None:
    assert parse(text).groups[0].spec.dense is dense


def test_ungrouped_structure() -> None:
    p = parse("window=4")
    assert p.groups == (HeadGroup(0, None, Spec(window=4)),)
    assert p.groups[0].last is None


def test_grouped_structure_sorted() -> None:
    p = parse("8-15:window=2;0-7:sink=3")
    assert p.groups == (HeadGroup(0, 7, Spec(sink=3)), HeadGroup(8, 15, Spec(window=2)))
    assert isinstance(p.groups, tuple)


def test_default_spec_str() -> None:
    assert str(Spec()) == "causal"
    assert str(Spec(causal=False)) == "causal=false"
    assert Spec().dense


def test_parse_passes_pattern_through() -> None:
    p = parse("window=4")
    assert parse(p) is p


def test_parse_is_cached() -> None:
    assert parse("window=12345,sink=3") is parse("window=12345,sink=3")


@pytest.mark.parametrize(
    "bad", [None, 3, b"window=4", ["window=4"], Spec()], ids=lambda b: type(b).__name__
)
def test_parse_rejects_non_str(bad: object) -> None:
    with pytest.raises(PatternError):
        parse(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Rejections
# ---------------------------------------------------------------------------------------

# (id, pattern, text that must appear in the message)
INVALID = [
    ("empty", "", "empty pattern"),
    ("blank", "   ", "empty pattern"),
    ("empty-term", "window=4,,sink=2", "empty term"),
    ("trailing-comma", "window=4,", "empty term"),
    ("leading-comma", ",window=4", "empty term"),
    ("trailing-semicolon", "0-7:window=4;", "empty head group"),
    ("empty-group", "0-3:window=4;;4-7:sink=1", "empty head group"),
    ("empty-group-terms", "0-7:", "empty term list"),
    ("unknown-term", "windw=4", "windw"),
    ("unknown-lists-known", "topq=4", "known terms: causal, window, dilation"),
    ("uppercase-term", "Window=4", "Window"),
    ("duplicate", "window=4,window=8", "window=8"),
    ("duplicate-causal", "causal,causal=false", "causal=false"),
    ("duplicate-causal-true", "causal=true,causal", "duplicate"),
    ("window-zero", "window=0,sink=4", "window=0"),
    ("window-negative", "window=-4", "window=-4"),
    ("window-plus", "window=+4", "window=+4"),
    ("window-float", "window=4.0", "window=4.0"),
    ("window-underscore", "window=4_096", "window=4_096"),
    ("window-hex", "window=0x10", "window=0x10"),
    ("window-inner-space", "window=4 096", "window=4 096"),
    ("window-unicode-digit", "window=\u0664", "window"),
    ("window-superscript", "window=\u00b2", "window"),
    ("window-empty-value", "window=", "window="),
    ("window-no-value", "window", "needs a value"),
    ("window-too-large", f"window={MAX_VALUE + 1}", "2**31-1"),
    ("window-huge", "window=" + "9" * 5000, "2**31-1"),
    ("dilation-zero", "window=4,dilation=0", "dilation=0"),
    ("sink-zero", "sink=0", "sink=0"),
    ("global-zero", "causal=false,global=0", "global=0"),
    ("random-zero", "random=0", "random=0"),
    ("block-zero", "random=1,block=0", "block=0"),
    ("seed-negative", "random=1,seed=-1", "seed=-1"),
    ("seed-too-large", f"random=1,seed={MAX_VALUE + 1}", "2**31-1"),
    ("causal-yes", "causal=yes", "causal=yes"),
    ("causal-True", "causal=True", "causal=True"),
    ("causal-1", "causal=1", "causal=1"),
    ("causal-empty", "causal=", "causal="),
    ("dilation-without-window", "dilation=2", "dilation=2"),
    ("dilation-without-window-msg", "sink=4,dilation=2", "needs a window"),
    ("global-causal", "global=4", "add causal=false"),
    ("global-causal-true", "causal=true,global=4", "global=4"),
    ("seed-without-random", "window=4,seed=3", "seed=3"),
    ("block-without-random", "window=4,block=64", "block=64"),
    ("block-without-random-msg", "block=64", "block-granular"),
    ("msa-zero", "msa=0", "msa=0"),
    ("msa-no-value", "msa", "needs a value"),
    ("msa-not-multiple", "msa=100", "multiple of block=128"),
    ("msa-not-multiple-64", "msa=96,block=64", "multiple of block=64"),
    ("msa-below-block", "msa=64", "'msa=64'"),
    ("msa-block-32", "msa=128,block=32", "block 64 or 128"),
    ("msa-block-256", "msa=256,block=256", "'block=256'"),
    ("msa-bidirectional", "msa=128,causal=false", "'causal=false'"),
    ("msa-bidirectional-msg", "causal=false,msa=128", "msa attention is causal"),
    ("msa-window", "msa=128,window=4", "window does not combine with 'msa=128'"),
    ("msa-dilation", "msa=128,dilation=2", "'dilation=2'"),
    ("msa-sink", "sink=4,msa=128", "sink does not combine"),
    ("msa-global", "msa=128,global=4", "global does not combine"),
    ("msa-global-bidirectional", "causal=false,msa=128,global=4", "global does not combine"),
    ("msa-random", "msa=128,random=2", "random does not combine"),
    ("msa-seed", "msa=128,seed=2", "'seed=2'"),
    ("msa-topk", "msa=128,topk=2", "topk does not combine"),
    ("msa-in-group", "0-3:msa=128,window=4;4-7:causal", "'0-3:msa=128,window=4'"),
    ("double-equals", "window==4", "window==4"),
    ("overlap", "0-7:window=4;4-11:sink=2", "overlap"),
    ("overlap-names-ranges", "0-7:window=4;7-11:sink=2", "'7-11'"),
    ("overlap-same", "3:window=4;3:sink=2", "overlap"),
    ("range-reversed", "7-0:window=4", "'7-0'"),
    ("range-negative", "-1-3:window=4", "-1-3"),
    ("range-letters", "a-b:window=4", "a-b"),
    ("range-open", "3-:window=4", "3-"),
    ("range-float", "1.5:window=4", "1.5"),
    ("range-too-large", f"0-{MAX_VALUE + 1}:window=4", "2**31-1"),
    ("missing-range-first", "window=4;8-15:sink=2", "missing head range"),
    ("missing-range-second", "0-7:window=4;sink=2", "'sink=2'"),
    ("empty-range", ":window=4", "missing head range"),
    ("two-colons", "0-7:window=4:sink=2", "more than one ':'"),
    ("semicolon-only", ";", "empty head group"),
    ("group-bad-term", "0-7:window=0", "window=0"),
    ("group-bad-term-names-group", "0-7:window=0", "0-7:window=0"),
]


@pytest.mark.parametrize("text,needle", [(t, n) for _, t, n in INVALID], ids=[i for i, _, _ in INVALID])
def test_rejects(text: str, needle: str) -> None:
    with pytest.raises(PatternError) as info:
        parse(text)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert needle in msg, msg
    assert "\n" not in msg


def test_error_message_example() -> None:
    with pytest.raises(PatternError) as info:
        parse("window=0,sink=4")
    msg = str(info.value)
    assert "'window=0'" in msg and "'window=0,sink=4'" in msg and "positive integer" in msg


def test_error_message_one_line_for_control_chars() -> None:
    with pytest.raises(PatternError) as info:
        parse("win\ndow=4")
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------
# Direct construction is validated too
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window=0),
        dict(window=True),
        dict(window=4.0),
        dict(dilation=2),
        dict(sink=-1),
        dict(global_=2),
        dict(seed=1),
        dict(block=64),
        dict(random=1, block=0),
        dict(causal=1),
        dict(window=MAX_VALUE + 1),
        dict(msa=-1),
        dict(msa=100),
        dict(msa=128, block=32),
        dict(msa=128, causal=False),
        dict(msa=128, window=4),
        dict(msa=128, sink=4),
        dict(msa=128, random=1),
        dict(msa=128, topk=1),
    ],
    ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_spec_constructor_validates(kwargs: dict) -> None:
    with pytest.raises(PatternError):
        Spec(**kwargs)


def test_pattern_constructor_validates() -> None:
    with pytest.raises(PatternError):
        Pattern(())
    with pytest.raises(PatternError):
        Pattern((HeadGroup(0, 7, Spec()), HeadGroup(7, 8, Spec())))
    with pytest.raises(PatternError):
        Pattern((HeadGroup(0, None, Spec()), HeadGroup(8, 9, Spec())))
    with pytest.raises(PatternError):
        HeadGroup(3, 2, Spec())
    with pytest.raises(PatternError):
        HeadGroup(1, None, Spec())
    # Unsorted groups are sorted on construction, so equality is canonical.
    p = Pattern((HeadGroup(8, 9, Spec()), HeadGroup(0, 7, Spec())))
    assert [g.first for g in p.groups] == [0, 8]
    assert p == parse("0-7:causal;8-9:causal")


# ---------------------------------------------------------------------------------------
# head_groups
# ---------------------------------------------------------------------------------------


def test_head_groups_ungrouped() -> None:
    p = parse("window=4")
    assert p.head_groups(16) == [(0, 16, Spec(window=4))]
    assert p.head_groups(1) == [(0, 1, Spec(window=4))]


def test_head_groups_covered() -> None:
    p = parse("8-15:window=8192,dilation=8;0-7:window=512")
    assert p.head_groups(16) == [
        (0, 8, Spec(window=512)),
        (8, 16, Spec(window=8192, dilation=8)),
    ]


def test_head_groups_single_heads() -> None:
    p = parse("0:sink=1;1:window=2;2-3:causal")
    assert p.head_groups(4) == [(0, 1, Spec(sink=1)), (1, 2, Spec(window=2)), (2, 4, Spec())]


def test_head_groups_input_has_more_heads() -> None:
    p = parse("0-7:window=512")
    with pytest.raises(ValueError) as info:
        p.head_groups(16)
    msg = str(info.value)
    assert "'0-7:window=512'" in msg and "16 query heads" in msg and "8-15 uncovered" in msg


def test_head_groups_gap() -> None:
    p = parse("0-3:window=4;8-15:sink=2")
    with pytest.raises(ValueError) as info:
        p.head_groups(16)
    assert "4-7 uncovered" in str(info.value)


def test_head_groups_gap_at_start_and_single_head() -> None:
    p = parse("1-3:window=4;5-7:sink=2")
    with pytest.raises(ValueError) as info:
        p.head_groups(8)
    assert "0,4 uncovered" in str(info.value)


def test_head_groups_input_has_fewer_heads() -> None:
    p = parse("0-7:window=512;8-15:window=64")
    with pytest.raises(ValueError) as info:
        p.head_groups(8)
    msg = str(info.value)
    assert "15" in msg and "8 query heads" in msg


@pytest.mark.parametrize("n", [0, -1, True, 2.0])
def test_head_groups_bad_num_heads(n: object) -> None:
    with pytest.raises(ValueError):
        parse("window=4").head_groups(n)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Hashable, frozen
# ---------------------------------------------------------------------------------------


def test_hashable_and_frozen() -> None:
    p = parse("0-7:window=512;8-15:sink=4")
    q = parse(" 8-15 : sink=4 ; 0-7 : window=512 ")
    assert p == q and hash(p) == hash(q)
    d = {p: "a"}
    assert d[q] == "a"
    assert len({p, q, parse("window=4")}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.groups = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.groups[0].spec.window = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.groups[0].first = 1  # type: ignore[misc]


# ---------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------

_small = st.integers(1, 10_000)
_any_pos = st.one_of(_small, st.integers(1, MAX_VALUE))


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), _any_pos))
    dilation = draw(_any_pos) if window is not None and draw(st.booleans()) else 1
    sink = draw(st.one_of(st.just(0), _any_pos))
    global_ = 0 if causal else draw(st.one_of(st.just(0), _any_pos))
    random = draw(st.one_of(st.just(0), _any_pos))
    seed = draw(st.integers(0, MAX_VALUE)) if random else 0
    block = draw(st.one_of(st.just(128), _any_pos)) if random else 128
    if draw(st.integers(0, 5)) == 0:   # msa: only with block and the default causal
        block = draw(st.sampled_from([64, 128]))
        return Spec(msa=block * draw(st.integers(1, 64)), block=block)
    return Spec(
        causal=causal,
        window=window,
        dilation=dilation,
        sink=sink,
        global_=global_,
        random=random,
        seed=seed,
        block=block,
    )


@st.composite
def patterns(draw: st.DrawFn) -> Pattern:
    if draw(st.booleans()):
        return Pattern((HeadGroup(0, None, draw(specs())),))
    n = draw(st.integers(1, 6))
    groups = []
    head = draw(st.integers(0, 3))
    for _ in range(n):
        width = draw(st.integers(1, 8))
        groups.append(HeadGroup(head, head + width - 1, draw(specs())))
        head += width + draw(st.sampled_from([0, 0, 1, 5]))  # contiguous or gapped
    if draw(st.booleans()):
        groups.reverse()  # constructor sorts
    return Pattern(tuple(groups))


@settings(max_examples=300, deadline=None)
@given(patterns())
def test_roundtrip(p: Pattern) -> None:
    s = str(p)
    q = parse(s)
    assert q == p
    assert str(q) == s
    assert hash(q) == hash(p)
    if p.groups[0].last is None:
        assert p.head_groups(5) == [(0, 5, p.groups[0].spec)]
    else:
        contiguous = all(b.first == a.last + 1 for a, b in zip(p.groups, p.groups[1:]))
        top = p.groups[-1].last + 1
        if p.groups[0].first == 0 and contiguous:
            hg = p.head_groups(top)
            assert [(a, b) for a, b, _ in hg] == [(g.first, g.last + 1) for g in p.groups]
        else:
            with pytest.raises(ValueError):
                p.head_groups(top)
        with pytest.raises(ValueError):
            p.head_groups(top - 1) if top > 1 else p.head_groups(0)


@settings(max_examples=300, deadline=None)
@given(patterns())
def test_canonical_idempotent_with_noise(p: Pattern) -> None:
    # Re-spell the canonical form with whitespace and shuffled terms: same Pattern back.
    s = str(p)
    noisy = " ; ".join(
        (f" {g.split(':')[0].replace('-', ' - ')} : " if ":" in g else " ")
        + " , ".join(reversed(g.split(":")[-1].split(",")))
        for g in reversed(s.split(";"))
    )
    assert parse(noisy) == p
    assert str(parse(noisy)) == s


_tokens = st.sampled_from(
    [
        "window", "dilation", "sink", "global", "random", "seed", "block", "causal", "msa", "topk",
        "causal=false", "causal=true", "=", ",", ";", "-", ":", " ", "0", "1", "7", "42",
        "128", "2147483647", "2147483648", "99999999999", "-1", "x", "true", "false", "\n",
        "\u0664", "_", ".",
    ]
)
_grammarish = st.lists(_tokens, max_size=25).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(), _grammarish))
def test_fuzz_only_pattern_error(text: str) -> None:
    try:
        p = parse(text)
    except PatternError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(p, Pattern)
    assert parse(str(p)) == p
    assert str(parse(str(p))) == str(p)


# ---------------------------------------------------------------------------------------
# msa=T
# ---------------------------------------------------------------------------------------


def test_msa_spec_fields() -> None:
    spec = parse("msa=2048").groups[0].spec
    assert spec == Spec(msa=2048) and spec.block == 128 and spec.causal and not spec.dense
    assert parse("block=64,msa=128").groups[0].spec == Spec(msa=128, block=64)
    assert str(Spec(msa=512, block=64)) == "msa=512,block=64"
    mixed = parse("0-3:msa=128,block=64;4-7:window=32")
    assert [g.heads for g in mixed.msa_groups] == ["0-3"]
    assert parse("window=4").msa_groups == ()
    assert mixed.head_groups(8) == [(0, 4, Spec(msa=128, block=64)), (4, 8, Spec(window=32))]
