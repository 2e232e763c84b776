"""Sparsity-pattern strings: parsing, validation and canonical form.

A pattern is either a comma-separated list of terms (one spec for every query head)::

    window=4096,dilation=2,sink=64

or a ``;``-separated list of head groups, each ``HEADS:terms`` where ``HEADS`` is an
inclusive query-head range ``a-b`` or a single head ``a``::

    0-7:window=512;8-15:window=8192,dilation=8

See the "Pattern semantics" section of DESIGN.md for what each term means.  This module
only checks the grammar and the values; everything that leaves it (``Spec``, ``HeadGroup``,
``Pattern``) is frozen, hashable and validated, and ``str()`` of it is the canonical form,
which parses back to an equal object.  Nothing from the user's string survives except
validated integers and booleans.
"""

from __future__ import annotations

import operator
import re
import sys
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["PatternError", "Spec", "HeadGroup", "Pattern", "parse", "msa_split", "MAX_VALUE", "KNOWN_TERMS"]

#: Largest value any term (and any head number) may take: values become int32 constexprs.
MAX_VALUE = 2**31 - 1

#: Every term the grammar knows, in canonical order.
KNOWN_TERMS = ("causal", "window", "dilation", "sink", "global", "random", "seed", "topk", "msa", "block")

_DEFAULT_BLOCK = 128
#: the key-block sizes MSA's kernels take (msa_attention checks the same tuple)
MSA_BLOCKS = (64, 128)
#: the terms an msa term rules out (it combines only with block and the default causal)
_NOT_WITH_MSA = ("window", "dilation", "sink", "global", "random", "seed", "topk")
_DIGITS = re.compile(r"[0-9]+")  # ASCII digits only: no sign, '_', unicode digits, ...
_POSITIVE_TERMS = ("window", "dilation", "sink", "global", "random", "topk", "msa", "block")


class PatternError(ValueError):
    """A sparsity pattern that does not parse or whose values are invalid.

    The message names the offending term (or head range) and says what was expected.
    """


def _q(text: str) -> str:
    """Quote user text for a one-line error message (control characters escaped)."""
    return repr(text)


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; reject it so Spec(window=True) does not sneak through.
    if not isinstance(value, int) or isinstance(value, bool):
        raise PatternError(f"Spec.{name} must be an int (got {value!r})")
    if value < minimum or value > MAX_VALUE:
        what = "a positive integer" if minimum >= 1 else "a non-negative integer"
        raise PatternError(f"Spec.{name} must be {what} <= {MAX_VALUE} (got {value!r})")


# ---------------------------------------------------------------------------------------
# Spec
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """The terms of one head group (see DESIGN.md, "Pattern semantics")."""

    causal: bool = True
    window: int | None = None  # None = no window term
    dilation: int = 1
    sink: int = 0
    global_: int = 0  # the term is spelled `global`
    random: int = 0
    seed: int = 0
    block: int = _DEFAULT_BLOCK
    # top-k block selection: K key blocks per query block, given at call time (block_indices)
    topk: int = 0
    # MiniMax Sparse Attention: top_k in tokens (a multiple of block), selected per query by proxy
    # heads given at call time (q_proxy / k_proxy); runs msa_codegen.msa's kernels
    msa: int = 0

    def __post_init__(self) -> None:
        # Direct construction obeys the same rules as the grammar, so a Spec is always
        # printable to a string that parses back to an equal Spec.
        if not isinstance(self.causal, bool):
            raise PatternError(f"Spec.causal must be a bool (got {self.causal!r})")
        if self.window is not None:
            _check_int("window", self.window, 1)
        _check_int("dilation", self.dilation, 1)
        _check_int("sink", self.sink, 0)
        _check_int("global_", self.global_, 0)
        _check_int("random", self.random, 0)
        _check_int("seed", self.seed, 0)
        _check_int("block", self.block, 1)
        _check_int("topk", self.topk, 0)
        _check_int("msa", self.msa, 0)
        if self.dilation != 1 and self.window is None:
            raise PatternError(f"Spec.dilation={self.dilation} needs a window (dilation is the stride of the window)")
        if self.global_ and self.causal:
            raise PatternError(f"Spec.global_={self.global_}: global is bidirectional only, needs causal=False")
        if self.seed and not self.random:
            raise PatternError(f"Spec.seed={self.seed} needs random > 0 (seed only seeds the random term)")
        if self.msa:
            others = [f"{name}={getattr(self, name)}" for name in ("window", "sink", "global_", "random", "topk")
                      if getattr(self, name)]
            if not self.causal:
                others.insert(0, "causal=False")
            if others:
                raise PatternError(f"Spec.msa={self.msa} combines only with block and the default causal "
                                   f"(got {', '.join(others)})")
            if self.block not in MSA_BLOCKS:
                raise PatternError(f"Spec.msa={self.msa} needs block 64 or 128 (got block={self.block})")
            if self.msa % self.block:
                raise PatternError(f"Spec.msa={self.msa} counts tokens and must be a multiple of "
                                   f"block={self.block}")
        if self.block != _DEFAULT_BLOCK and not (self.random or self.topk or self.msa):
            raise PatternError(
                f"Spec.block={self.block} needs random > 0 or topk > 0, or msa > 0 "
                f"(block only sizes block-granular terms)"
            )

    @property
    def dense(self) -> bool:
        """True iff the spec has no locality term (plain causal or bidirectional attention)."""
        return (self.window is None and self.sink == 0 and self.global_ == 0 and self.random == 0
                and self.topk == 0 and self.msa == 0)

    def __str__(self) -> str:
        terms: list[str] = []
        if not self.causal:
            terms.append("causal=false")
        if self.window is not None:
            terms.append(f"window={self.window}")
            if self.dilation != 1:
                terms.append(f"dilation={self.dilation}")
        if self.sink:
            terms.append(f"sink={self.sink}")
        if self.global_:
            terms.append(f"global={self.global_}")
        if self.random:
            terms.append(f"random={self.random}")
            if self.seed:
                terms.append(f"seed={self.seed}")
        if self.topk:
            terms.append(f"topk={self.topk}")
        if self.msa:
            terms.append(f"msa={self.msa}")
        if (self.random or self.topk or self.msa) and self.block != _DEFAULT_BLOCK:
            terms.append(f"block={self.block}")
        return ",".join(terms) if terms else "causal"


@dataclass(frozen=True)
class HeadGroup:
    """A spec for the inclusive query-head range ``first..last``.

    ``last is None`` only for a pattern written without head ranges (= all heads).
    """

    first: int
    last: int | None
    spec: Spec

    def __post_init__(self) -> None:
        for name in ("first", "last"):
            value = getattr(self, name)
            if value is None and name == "last":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_VALUE:
                raise PatternError(f"HeadGroup.{name} must be an integer in 0..{MAX_VALUE} (got {value!r})")
        if self.last is None and self.first != 0:
            raise PatternError(f"HeadGroup with last=None (all heads) must have first=0 (got {self.first})")
        if self.last is not None and self.first > self.last:
            raise PatternError(f"head range '{self.first}-{self.last}': first head must be <= last head")
        if not isinstance(self.spec, Spec):
            raise PatternError(f"HeadGroup.spec must be a Spec (got {type(self.spec).__name__})")

    @property
    def heads(self) -> str:
        return "all" if self.last is None else f"{self.first}-{self.last}"

    def __str__(self) -> str:
        return str(self.spec) if self.last is None else f"{self.first}-{self.last}:{self.spec}"


@dataclass(frozen=True)
class Pattern:
    """A parsed sparsity pattern: head groups sorted by ``first``, non-overlapping."""

    groups: tuple[HeadGroup, ...]

    def __post_init__(self) -> None:
        groups = self.groups
        if isinstance(groups, HeadGroup) or not isinstance(groups, (tuple, list)):
            raise PatternError(f"Pattern.groups must be a tuple of HeadGroup (got {type(groups).__name__})")
        if not groups:
            raise PatternError("Pattern.groups is empty: a pattern needs at least one head group")
        for g in groups:
            if not isinstance(g, HeadGroup):
                raise PatternError(f"Pattern.groups must hold HeadGroup objects (got {type(g).__name__})")
        groups = tuple(sorted(groups, key=lambda g: g.first))
        if any(g.last is None for g in groups):
            if len(groups) != 1:
                raise PatternError("a HeadGroup without a head range (all heads) must be the only group")
        else:
            for prev, cur in zip(groups, groups[1:]):
                if cur.first <= prev.last:  # type: ignore[operator]
                    raise PatternError(f"head ranges '{prev.heads}' and '{cur.heads}' overlap")
        object.__setattr__(self, "groups", groups)

    @property
    def msa_groups(self) -> tuple[HeadGroup, ...]:
        """The head groups with an ``msa`` term (MSA's kernels, proxies given at call time)."""
        return tuple(g for g in self.groups if g.spec.msa)

    @property
    def grouped(self) -> bool:
        """True when the pattern was written with explicit head ranges."""
        return self.groups[0].last is not None

    def __str__(self) -> str:
        return ";".join(str(g) for g in self.groups)

    def head_groups(self, num_heads: int) -> list[tuple[int, int, Spec]]:
        """``[(h_start, h_stop_exclusive, spec), ...]`` covering ``range(num_heads)`` exactly once."""
        # operator.index accepts int-likes (numpy ints, torch SymInt) but not floats.
        try:
            n = operator.index(num_heads) if not isinstance(num_heads, bool) else None
        except TypeError:
            n = None
        if n is None or n < 1:
            raise ValueError(f"num_heads must be a positive integer (got {num_heads!r})")
        num_heads = int(n)
        if not self.grouped:
            return [(0, num_heads, self.groups[0].spec)]
        covered = ",".join(g.heads for g in self.groups)
        top = self.groups[-1].last
        assert top is not None
        if top >= num_heads:
            raise ValueError(
                f"pattern {_q(str(self))} names query heads up to {top} "
                f"but the input has only {num_heads} query heads (0-{num_heads - 1})"
            )
        gaps: list[str] = []
        nxt = 0
        for g in self.groups:
            if g.first > nxt:
                gaps.append(_range_text(nxt, g.first - 1))
            nxt = g.last + 1  # type: ignore[operator]
        if nxt < num_heads:
            gaps.append(_range_text(nxt, num_heads - 1))
        if gaps:
            raise ValueError(
                f"pattern {_q(str(self))} covers query heads {covered} but the input has "
                f"{num_heads} query heads ({','.join(gaps)} uncovered)"
            )
        return [(g.first, g.last + 1, g.spec) for g in self.groups]  # type: ignore[operator]


def _range_text(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


@lru_cache(maxsize=256)
def msa_split(pattern: str | Pattern, num_heads: int) -> tuple[tuple[int, int, Spec], tuple[tuple[int, int, str], ...]]:
    """A pattern with one ``msa`` head group, cut for its two kinds of kernels.

    Returns ``((h0, h1, spec), runs)``: the msa group's query heads ``h0 <= h < h1`` and its
    Spec, and the runs of the other heads before and after it, each ``(a, b, text)`` with the
    pattern of heads ``a..b-1`` renumbered from head 0 (``"window=32"`` for one group). Raises
    ValueError when the groups do not cover ``num_heads`` or the pattern has no msa group or more
    than one (``attention`` takes one set of proxies per call).
    """
    pat = parse(pattern)
    groups = pat.head_groups(num_heads)
    msa = [(h0, h1, spec) for h0, h1, spec in groups if spec.msa]
    if len(msa) != 1:
        names = ", ".join(f"heads {_range_text(h0, h1 - 1)}: {spec}" for h0, h1, spec in msa)
        raise ValueError(f"pattern {_q(str(pat))} has {len(msa)} msa head groups{f' ({names})' if names else ''}; "
                         f"exactly one msa group is allowed (one set of proxies, q_proxy / k_proxy, per call)")
    h0, h1, spec = msa[0]

    def run(a: int, b: int) -> tuple[int, int, str]:
        inside = [(g0, g1, sp) for g0, g1, sp in groups if a <= g0 and g1 <= b]
        if len(inside) == 1:
            return a, b, str(inside[0][2])
        return a, b, ";".join(f"{g0 - a}-{g1 - 1 - a}:{sp}" for g0, g1, sp in inside)

    runs = tuple(run(a, b) for a, b in ((0, h0), (h1, num_heads)) if b > a)
    return (h0, h1, spec), runs


# ---------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------


def _parse_uint(text: str, what: str, where: str, minimum: int) -> int:
    """Parse plain ASCII decimal digits into an int in ``minimum..MAX_VALUE``."""
    expected = "a positive integer" if minimum >= 1 else "a non-negative integer"
    if not _DIGITS.fullmatch(text):
        raise PatternError(f"{where}: {what} must be {expected} (got {_q(text)})")
    digits = text.lstrip("0") or "0"
    # Check the length before int(): huge digit strings would otherwise hit
    # Python's int-string conversion limit (a plain ValueError) or be slow.
    if len(digits) > len(str(MAX_VALUE)) or int(digits) > MAX_VALUE:
        raise PatternError(f"{where}: {what} must be at most 2**31-1 = {MAX_VALUE} (got {_q(text)})")
    value = int(digits)
    if value < minimum:
        raise PatternError(f"{where}: {what} must be {expected} (got {_q(text)})")
    return value


def _parse_terms(text: str, context: str) -> Spec:
    """Parse a comma-separated term list. ``context`` describes where it sits, for messages."""
    if not text.strip():
        raise PatternError(f"{context}: empty term list (expected terms such as 'window=4096')")
    seen: dict[str, str] = {}  # term name -> term text as written
    values: dict[str, int | bool] = {}
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            raise PatternError(
                f"empty term in {context} (stray or trailing ','; expected terms such as 'window=4096')"
            )
        where = f"term {_q(term)} in {context}"
        if "=" in term:
            name, _, value_text = term.partition("=")
            name, value_text = name.strip(), value_text.strip()
        else:
            name, value_text = term, None
        if name not in KNOWN_TERMS:
            raise PatternError(f"{where}: unknown term {_q(name)} (known terms: {', '.join(KNOWN_TERMS)})")
        if name in seen:
            raise PatternError(f"{where}: duplicate term {_q(name)} (already given as {_q(seen[name])})")
        seen[name] = term
        if name == "causal":
            if value_text is None or value_text == "true":
                values[name] = True
            elif value_text == "false":
                values[name] = False
            else:
                raise PatternError(f"{where}: causal takes no value, 'true' or 'false' (got {_q(value_text)})")
            continue
        if value_text is None:
            raise PatternError(f"{where}: {name} needs a value, e.g. '{name}=128'")
        minimum = 0 if name == "seed" else 1
        values[name] = _parse_uint(value_text, name, where, minimum)

    def need(term: str, requirement: str, why: str) -> None:
        if term in seen and requirement not in seen:
            raise PatternError(f"term {_q(seen[term])} in {context}: {why}")

    if "msa" in seen:
        # checked first: the messages of the other rules (add causal=false, ...) would mislead here
        msa_term = _q(seen["msa"])
        for name in _NOT_WITH_MSA:
            if name in seen:
                raise PatternError(f"term {_q(seen[name])} in {context}: {name} does not combine with "
                                   f"{msa_term} (msa combines only with block and the default causal)")
        if not values.get("causal", True):
            raise PatternError(f"term {_q(seen['causal'])} in {context}: msa attention is causal "
                               f"(msa combines only with block and the default causal)")
        block = values.get("block", _DEFAULT_BLOCK)
        if block not in MSA_BLOCKS:
            raise PatternError(f"term {_q(seen['block'])} in {context}: msa needs block 64 or 128 "
                               f"(got {block})")
        if values["msa"] % block:  # type: ignore[operator]
            raise PatternError(f"term {msa_term} in {context}: msa=T counts tokens and must be a multiple "
                               f"of block={block}")
    need("dilation", "window", "dilation needs a window term (dilation is the stride of the window)")
    need("seed", "random", "seed needs a random term (seed only seeds the random blocks)")
    if "block" in seen and "random" not in seen and "topk" not in seen and "msa" not in seen:
        raise PatternError(
            f"term {_q(seen['block'])} in {context}: block needs a random or topk term, or msa "
            f"(block only sizes block-granular terms)"
        )
    if "global" in seen and values.get("causal", True):
        raise PatternError(
            f"term {_q(seen['global'])} in {context}: global is bidirectional only, add causal=false"
        )
    return Spec(
        causal=bool(values.get("causal", True)),
        window=values.get("window"),  # type: ignore[arg-type]
        dilation=int(values.get("dilation", 1)),
        sink=int(values.get("sink", 0)),
        global_=int(values.get("global", 0)),
        random=int(values.get("random", 0)),
        seed=int(values.get("seed", 0)),
        block=int(values.get("block", _DEFAULT_BLOCK)),
        topk=int(values.get("topk", 0)),
        msa=int(values.get("msa", 0)),
    )


def _parse_heads(text: str, group: str) -> tuple[int, int]:
    heads = text.strip()
    where = f"head range {_q(heads)} in group {_q(group)}"
    if not heads:
        raise PatternError(f"group {_q(group)}: missing head range before ':' (expected 'a-b' or 'a')")
    parts = heads.split("-")
    if len(parts) > 2:
        raise PatternError(f"{where}: expected 'a-b' or 'a' with plain non-negative head numbers")
    nums = []
    for part in parts:
        part = part.strip()
        if not _DIGITS.fullmatch(part):
            raise PatternError(
                f"{where}: head numbers must be plain non-negative integers (got {_q(part)}; expected 'a-b' or 'a')"
            )
        nums.append(_parse_uint(part, "head number", where, 0))
    first, last = nums[0], nums[-1]
    if first > last:
        raise PatternError(f"{where}: first head {first} is greater than last head {last} (expected a <= b)")
    return first, last


@lru_cache(maxsize=1024)
def _parse_str(text: str) -> Pattern:
    if not text.strip():
        raise PatternError("empty pattern (expected terms such as 'window=4096' or groups such as '0-7:window=512')")
    whole = _q(text.strip())
    if ";" not in text and ":" not in text:
        return Pattern((HeadGroup(0, None, _parse_terms(text, whole)),))
    groups: list[HeadGroup] = []
    for raw in text.split(";"):
        group = raw.strip()
        if not group:
            raise PatternError(f"empty head group in {whole} (stray or trailing ';'; expected 'HEADS:terms')")
        if ":" not in group:
            raise PatternError(
                f"group {_q(group)} in {whole}: missing head range (expected 'HEADS:terms' such as "
                f"'0-7:window=512'; once ';' or ':' is used every group needs a head range)"
            )
        heads_text, _, terms = group.partition(":")
        if ":" in terms:
            raise PatternError(f"group {_q(group)} in {whole}: more than one ':' (expected 'HEADS:terms')")
        first, last = _parse_heads(heads_text, group)
        spec = _parse_terms(terms, f"group {_q(group)}")
        groups.append(HeadGroup(first, last, spec))
    ordered = sorted(groups, key=lambda g: g.first)
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.first <= prev.last:  # type: ignore[operator]
            raise PatternError(
                f"head ranges '{prev.heads}' and '{cur.heads}' in {whole} overlap "
                f"(every query head must be in at most one group)"
            )
    return Pattern(tuple(ordered))


def parse(pattern: str | Pattern) -> Pattern:
    """Parse a pattern string into a validated :class:`Pattern`; a ``Pattern`` passes through."""
    if isinstance(pattern, Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise PatternError(f"a pattern must be a str or Pattern (got {type(pattern).__name__})")
    torch = sys.modules.get("torch")   # not imported here: the pattern language has no torch in it
    if torch is not None and torch.compiler.is_compiling():
        # Dynamo traces through an lru_cache wrapper and warns that it does; parsing is pure, so
        # the traced call runs the parser itself, with the same result
        return _parse_str.__wrapped__(pattern)
    return _parse_str(pattern)
