"""The kernels read module globals only as ``tl.constexpr``: a plain int or float global inside an ``@triton.jit``
(or Gluon) function runs under the CPU interpreter but fails to compile on a GPU ("Cannot access global variable
... from within @jit'ed function"), so the interpreter tests alone would not catch it."""

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest

triton = pytest.importorskip("triton")

import moeyard  # noqa: E402
from moeyard.launch import Cached  # noqa: E402

OPTIONAL = ("moeyard.jax", "moeyard.integrations", "moeyard.bench")  # other dependencies; no kernels
# what @triton.jit (and Gluon's) makes: a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction
try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # another Triton layout: only compiled kernels
    InterpretedFunction = triton.runtime.jit.JITFunction
KERNELS = (triton.runtime.jit.JITFunction, InterpretedFunction)


def _kernels(module):
    """``(name, kernel)`` of each kernel a module defines at top level (a :class:`~moeyard.launch.Cached` one
    unwrapped)."""
    for name, v in vars(module).items():
        v = v.kernel if isinstance(v, Cached) else v
        if isinstance(v, KERNELS):
            yield name, v


def _kernel_modules():
    for info in pkgutil.walk_packages(moeyard.__path__, "moeyard."):
        if info.name.startswith(OPTIONAL) or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        if any(True for _ in _kernels(module)):
            yield module


def _plain_globals(fn) -> list[str]:
    """Names a jit function reads from its module that hold a plain number (not a constexpr)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local:
            value = fn.fn.__globals__.get(n.id)
            if isinstance(value, (bool, int, float)):
                found.append(n.id)
    return sorted(set(found))


def test_kernels_read_globals_as_constexpr():
    modules = list(_kernel_modules())
    assert len(modules) >= 5  # the walk found the kernel modules
    bad = {
        f"{m.__name__}.{name}": names
        for m in modules
        for name, v in _kernels(m)
        if v.fn.__module__ == m.__name__ and (names := _plain_globals(v))
    }
    assert not bad, f"module globals read inside kernels must be tl.constexpr: {bad}"


def test_the_check_finds_a_plain_global():
    # the check itself: a kernel reading a plain int global is reported
    assert _plain_globals(_reads_plain) == ["_PLAIN"] and _plain_globals(_reads_constexpr) == []


_PLAIN = 64
_CONSTEXPR = triton.language.constexpr(64)


@triton.jit
def _reads_plain(x_ptr):
    triton.language.store(x_ptr, _PLAIN)


@triton.jit
def _reads_constexpr(x_ptr):
    triton.language.store(x_ptr, _CONSTEXPR)
