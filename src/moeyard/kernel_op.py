"""Kernel launchers registered as ``torch.library`` custom ops, called directly in eager mode.

moeyard's kernels write into outputs their wrappers allocate, through launchers registered with
``torch.library.custom_op`` (with a fake, so ``torch.compile`` traces them as opaque ops). Calling the
registered op costs the host tens of microseconds per call (80 µs with an empty body on a desktop CPU,
torch 2.13: schema default filling, the Autograd and ADInplaceOrView dispatch keys, the
``torch._dynamo.disable`` wrapper), and a layer's forward and backward make about ten such calls: at
small shapes the step becomes host-bound (``benchmarks/host_time.py``). So :func:`kernel_op` registers
the op and returns a callable that goes through it only while ``torch.compile`` traces
(``torch.compiler.is_compiling()``) and calls the Python launcher directly otherwise. What eager mode
skips is the op's bookkeeping: the outputs it mutates are buffers private to the wrappers, never seen
by autograd, so their version counters do not matter.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence

import torch

_HAVE_TRITON = importlib.util.find_spec("triton") is not None  # looked up at import: a constant under torch.compile


def have_triton() -> bool:
    """Whether Triton is installed (looked up once, at import; the kernels' modules import it lazily)."""
    return _HAVE_TRITON


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def records_graph(*tensors) -> bool:
    """Whether autograd records a graph through ``tensors`` (None entries skipped): grad mode on and one of
    them requiring grad. Without one, a launcher's autograd function is only host time (its kernels can run
    directly)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class KernelOp:
    """A launcher ``fn`` and its registered custom op ``op`` (see the module docstring).

    Attributes:
        op: the ``torch.library.custom_op`` (``op.register_fake`` etc.).
        fn: the Python launcher, called directly in eager mode.
    """

    def __init__(self, name: str, mutates_args: Sequence[str], fn: Callable[..., None]):
        self.fn = fn
        self.op = torch.library.custom_op(name, mutates_args=tuple(mutates_args))(fn)
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.op(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def register_fake(self, fake: Callable[..., None]) -> Callable[..., None]:
        """Register ``fake`` as the op's fake (meta) implementation; returns it (usable as a decorator)."""
        self.op.register_fake(fake)
        return fake


def kernel_op(name: str, *, mutates_args: Sequence[str]) -> Callable[[Callable[..., None]], KernelOp]:
    """Decorator: ``@kernel_op("moeyard::name", mutates_args=("out",))`` over a launcher returning None.

    The launcher's signature is the op's schema (type annotations as ``torch.library.custom_op``
    requires). Raises what ``torch.library.custom_op`` raises for a bad name or annotation.
    """
    return lambda fn: KernelOp(name, mutates_args, fn)
