"""Templates -> Triton source on disk -> loaded module; the kernel hash of tuning rows.

A KernelPlan renders one forward and one backward source from ``msa_codegen/templates/``. Each
file is named by a hash of what shaped it (plan, ``templates_digest()``: the template sources
and library version), carries the SHA-256 of its body in its first line, and is written
atomically; a file whose digest does not match (corrupt, half written, edited) is rendered
again. Loaded modules are kept in memory per (plan, direction, interpreter).

``kernel_hash(pattern)`` keys the tuning rows: a hash of the pattern's rendered kernels (and of
MSA's kernel module for an ``msa=T`` head group).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import io
import os
import sys
import tempfile
import threading
import tokenize
from pathlib import Path

import jinja2
import triton
import triton.language as tl

from ..pattern.lowering import KernelPlan, lower
from ..pattern.spec import parse
from ..version import __version__

# the templates stay at msa_codegen/templates/: their first line names that path in every
# generated file (template content, not this module's to change)
TEMPLATE_DIR = Path(__file__).parent.parent / "templates"
DIRECTIONS = ("fwd", "bwd")
#: the Triton source of MSA's kernels (msa=T head groups): one module for every msa pattern,
#: specialised by constexprs; read as text here, since kernels never import the layers above
MSA_KERNELS = Path(__file__).parent.parent / "msa" / "kernels.py"
_DIGEST_PREFIX = "# msa-codegen-digest: "
_lock = threading.Lock()
_modules: dict[tuple[KernelPlan, str, bool], object] = {}


def home() -> Path:
    """``$MSA_CODEGEN_HOME``, default ``~/.cache/msa_codegen``."""
    return Path(os.environ.get("MSA_CODEGEN_HOME") or Path.home() / ".cache" / "msa_codegen")


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


@functools.lru_cache(maxsize=1)
def templates_digest() -> str:
    """Hash of every template source and the library version: part of the kernel files' names
    and of their header line."""
    h = hashlib.sha256(__version__.encode())
    for path in sorted(TEMPLATE_DIR.glob("*.jinja")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1024)
def kernel_hash(pattern: str) -> str:
    """Hash of the generated kernel code of a pattern (every head group, both directions).

    The key of tuning rows: a row stays valid while the kernels it was measured on are the same
    code, whatever else changes in the templates. Left out: the first line (it names the
    templates' digest and the library version), comments and blank lines (``code_only``), so
    that a comment edit in a template keeps the rows. Any spelling of a pattern gives its
    canonical form's hash. An ``msa=T`` group adds MSA's kernel module (``MSA_KERNELS``, its code
    only): those kernels are not rendered. A change of the code that keeps every instruction (a rename) still
    moves the hash: ``tuning.migrations`` then re-keys the stored rows (schema 1 hashed the text
    with comments; schema 2's kernels spelled some names differently).
    """
    h = hashlib.sha256(b"msa-codegen kernels v2")
    for g in parse(pattern).groups:
        if g.spec.msa:
            # an msa group runs MSA's kernel module, the same source for every msa pattern
            h.update(b"msa\0")
            h.update(code_only(MSA_KERNELS.read_text()).encode())
            h.update(b"\0")
            continue
        plan = lower(g.spec)
        for direction in DIRECTIONS:
            h.update(code_only(render(plan, direction).partition("\n")[2]).encode())
            h.update(b"\0")
    return h.hexdigest()[:16]


def code_only(source: str) -> str:
    """Python source without its comments, trailing blanks and blank lines (Python's tokenizer
    finds the comments, so a ``#`` inside a string stays)."""
    comment_at: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.start[1]
    lines = []
    for number, line in enumerate(source.splitlines(), 1):
        if number in comment_at:
            line = line[:comment_at[number]]
        line = line.rstrip()
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


def render(plan: KernelPlan, direction: str) -> str:
    """The Triton source of one direction ('fwd' or 'bwd') of a plan."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    meta = {"templates_digest": templates_digest(), "version": __version__}
    return _env().get_template(f"{direction}.py.jinja").render(plan=plan, meta=meta)


def _file_for(plan: KernelPlan, direction: str) -> Path:
    key = hashlib.sha256(f"{plan.key()}/{direction}/{templates_digest()}".encode()).hexdigest()[:20]
    return home() / "kernels" / f"msa_{direction}_{key}.py"


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def _read_valid(path: Path) -> bool:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    first, sep, body = text.partition("\n")
    return bool(sep) and first.startswith(_DIGEST_PREFIX) and first[len(_DIGEST_PREFIX):] == _digest(body)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def kernel_file(plan: KernelPlan, direction: str) -> Path:
    """Path of the rendered source, rendering and writing it first when missing or damaged."""
    path = _file_for(plan, direction)
    if not _read_valid(path):
        body = render(plan, direction)
        _write_atomic(path, f"{_DIGEST_PREFIX}{_digest(body)}\n{body}")
    return path


def interpreting() -> bool:
    """True when Triton's interpreter runs kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def interpreter_compat() -> tuple[str, ...]:
    """Make older Tritons' interpreters evaluate the generated kernels as their compilers do.

    Two quirks of the interpreter, not of the compiler (checked 2026-12-01 with Triton 3.6.0,
    3.8.0 and 3.9.0, NumPy 2.4):
    - ``constexpr_tensor`` (before 3.9): a module-level ``tl.constexpr`` on the left of an
      arithmetic operator with a tensor on the right, ``PREFIX - r``, gives a constexpr that
      wraps the tensor, and builtins such as ``tl.maximum`` reject it ("cannot convert [64] of
      type tensor to tensor"); 3.9's builtins unwrap it. Here those operators return the tensor.
    - ``index_squeeze`` (before 3.7): ``range(lo, hi)`` over scalar tensors converts their
      one-element arrays with ``int()``, which NumPy 2.4 refuses ("only 0-dimensional arrays can
      be converted to Python scalars"); 3.7 squeezes the array first, and so does this.

    Applied once per process, only while interpreting; returns the names of the fixes applied.
    """
    if not interpreting():
        return ()
    applied = []
    version = _version(triton.__version__)
    if version < (3, 9):
        def unwrapping(op):
            def run(self, *args):
                out = op(self, *args)
                return out.value if isinstance(out.value, tl.tensor) else out
            return run

        for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor", "lshift", "rshift"):
            for dunder in (f"__{name}__", f"__r{name}__"):
                op = getattr(tl.constexpr, dunder, None)
                if op is not None:
                    setattr(tl.constexpr, dunder, unwrapping(op))
        applied.append("constexpr_tensor")
    if version < (3, 7):
        from triton.runtime import interpreter

        patch_tensor = interpreter._patch_lang_tensor

        def patch_tensor_squeezing(tensor, scope):
            # the interpreter patches tl.tensor anew for every launch, and restores it after
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        interpreter._patch_lang_tensor = patch_tensor_squeezing
        applied.append("index_squeeze")
    return tuple(applied)


def load_kernels(name: str, package: str):
    """A module of hand-written ``@triton.jit`` kernels, imported on first use (``TRITON_INTERPRET``
    is read when kernels are defined), after the interpreter fixes above."""
    interpreter_compat()
    return importlib.import_module(name, package)


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as '3.8.0' or '3.6.0+git1234'."""
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def loaded_modules() -> dict:
    """A copy of the loaded kernel modules, keyed by (KernelPlan, direction, interpreter): tests
    compare it before and after calls to see that nothing was loaded again."""
    with _lock:
        return dict(_modules)


def load(plan: KernelPlan, direction: str):
    """The loaded module of one direction of a plan (cached in memory)."""
    key = (plan, direction, interpreting())
    mod = _modules.get(key)
    if mod is not None:
        return mod
    interpreter_compat()
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            path = kernel_file(plan, direction)
            mod = _modules[key] = import_file(f"msa_codegen_kernels.{path.stem}{'_interp' if key[2] else ''}", path)
    return mod


def import_file(name: str, path: Path):
    """Import a generated kernel file as module ``name`` (registered in sys.modules: Triton's
    JIT reads a kernel's module globals through it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
