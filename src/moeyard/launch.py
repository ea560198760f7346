"""Triton launches with less host work.

``kernel[grid](*args)`` does more on the host than launch the kernel: ``JITFunction.run`` binds and
specialises each of the kernel's 9-44 arguments, builds the cache key, reads Triton's knobs and builds the
launch metadata for its hooks, then calls the compiled kernel's launcher. At few tokens per call a layer's
step is paced by the host, and a training step makes 12 launches in bf16, 23 under ``fp8_rowwise_gw_hp``.

:func:`run` keeps, per kernel, the compiled kernel of each argument signature it has launched, keyed by a
superset of what Triton specialises on (tensors: dtype, whether on CUDA, 16-byte alignment of the data
pointer; tensor descriptors: their base tensor's, with shape, strides, block shape, layout and padding;
constexprs and launch options by type and value; other arguments by value, floats by type), and calls that
kernel's launcher directly on a hit. A miss goes through ``kernel[grid]``, which compiles if needed, and its
compiled kernel is kept. Triton's own path is taken as well under the CPU interpreter, with launch hooks registered
(e.g. a profiler's), for a kernel with pre-run hooks, for an argument that cannot be hashed, while ``torch.compile``
traces, and with ``MOEYARD_FAST_LAUNCH=0`` (read at import; :func:`set_enabled` at run time). What the direct path
skips: Triton's check that the module globals a kernel read have not changed since it compiled (moeyard's kernels
read globals only as ``tl.constexpr``: ``tests/test_kernel_globals.py``) and ``TRITON_DEBUG`` toggled after a
kernel's first launch. Should the compiled kernel's launcher not take the arguments this Triton version is expected
to pass (``TypeError`` or ``AttributeError`` before the launch), the direct path turns itself off for
the process and the launch goes through Triton's path.

Measured on an H200 machine (Triton 3.6, ``benchmarks/NOTES.md``, round 54; ``benchmarks/launch_probe.py``), host ms
of an eager forward + backward, direct / Triton's path, median (min) of 160 steps, the two interleaved:
qwen3-30b-a3b's sizes, bf16, 64 tokens 4.079 (2.854) / 4.110 (2.905), 4096 tokens 3.992 (3.243) / 3.931 (3.286);
sonic-7b's, 256 tokens, ``fp8_rowwise_gw_hp``, 6.067 (4.856) / 6.217 (5.087). The gain is small: most of a launch's
host time is the compiled launcher itself (12-60 µs each at qwen3-30b-a3b's, more for more arguments and TMA
descriptors), which both paths call.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch

ENV = "MOEYARD_FAST_LAUNCH"
MAX_ENTRIES = 256  # compiled kernels kept per kernel; a full cache is emptied (argument values that never repeat)

_enabled = os.environ.get(ENV, "1") not in ("0", "false", "False")


def cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` for host code, ``ceil(x / y)`` for ``y > 0``: Triton 3.6's is a constexpr function, 2.7 µs
    of host time a call against 0.15 on an H200 machine's host (``benchmarks/NOTES.md``, round 58), and an FP8
    step's launches ask for some fifty. ``y = 0`` raises ZeroDivisionError."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (as :func:`cdiv`), by the same bit operations: the least power of
    two ``>= n`` for ``1 <= n <= 2**64``, 0 for ``n = 0``."""
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


def enabled() -> bool:
    """Whether launches take the direct path (module docstring)."""
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn the direct path on or off for this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


_Tensor = torch.Tensor


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.dtype, t.is_cuda, t.data_ptr() % 16 == 0)  # Compiled.key writes this out for a plain tensor


def _arg_key(a):
    """What Triton could specialise a non-constexpr argument on (a superset): module docstring."""
    t = type(a)
    if t is int or a is None:
        return a
    if isinstance(a, torch.Tensor):
        return _tensor_key(a)
    if t is float:  # Triton passes a float argument as fp32 whatever its value
        return float
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(a, "block_shape"):  # a host tensor descriptor
        extra = tuple(getattr(a, name, None) for name in ("layout", "padding", "round_f32_to_tf32"))
        return (t, _tensor_key(base), tuple(a.shape), tuple(a.strides), tuple(a.block_shape), extra)
    return (t, a)  # bool, str, a dtype, ...: by value (TypeError when not hashable)


class _Compiled:
    """One kernel's parameters and its compiled kernels by argument key."""

    def __init__(self, kernel):
        signature = list(kernel.signature.parameters.values())
        self.names = [p.name for p in signature]
        self.constexpr = [p.is_constexpr for p in kernel.params]
        self.defaults = [p.default for p in signature]
        self.const_of = dict(zip(self.names, self.constexpr, strict=True))
        self.by_key: dict = {}

    def key(self, args: Sequence, kwargs: dict) -> tuple:
        """Constexprs (and launch options such as ``num_warps``) by type and value, other arguments by
        :func:`_arg_key` (its int and plain tensor cases written out: no call per argument)."""
        pos = tuple(
            [
                (type(a), a)
                if c
                else a
                if type(a) is int
                else (a.dtype, a.is_cuda, a.data_ptr() % 16 == 0)
                if type(a) is _Tensor
                else _arg_key(a)
                for a, c in zip(args, self.constexpr, strict=False)  # fewer args: defaults
            ]
        )
        if not kwargs:
            return pos
        const = self.const_of
        return pos, tuple((k, (type(v), v) if const.get(k, True) else _arg_key(v)) for k, v in kwargs.items())

    def values(self, args: Sequence, kwargs: dict) -> list:
        """Every parameter's value in order (keyword arguments, then defaults, after the positional ones)."""
        n = len(args)
        return list(args) + [
            kwargs.get(name, default) for name, default in zip(self.names[n:], self.defaults[n:], strict=True)
        ]

    def keep(self, key, compiled) -> None:
        if len(self.by_key) >= MAX_ENTRIES:
            self.by_key.clear()
        self.by_key[key] = compiled


_kernels: dict[int, tuple[object, _Compiled]] = {}
_counts = {"direct": 0, "triton": 0}


def counts() -> dict[str, int]:
    """Launches through :func:`run` so far: ``direct`` (the compiled kernel's launcher) and ``triton``
    (Triton's path: misses, fallbacks)."""
    return dict(_counts)


_has_cuda: list[bool] = []  # torch.cuda.is_available(), asked once


def _device() -> int | None:
    """The current CUDA device, or None without CUDA (then Triton's path, e.g. another GPU backend's)."""
    if not _has_cuda:
        _has_cuda.append(torch.cuda.is_available())
    return torch.cuda.current_device() if _has_cuda[0] else None


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's own launches ask


def _stream(device: int) -> int:
    """The current CUDA stream's handle on ``device`` (without making a ``torch.cuda.Stream``)."""
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def _compiled_of(kernel) -> _Compiled:
    entry = _kernels.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        entry = _kernels[id(kernel)] = (kernel, _Compiled(kernel))
    return entry[1]


@functools.cache
def _triton_types():
    """``(JITFunction, knobs)``, imported once (this module is imported without Triton too)."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    return JITFunction, knobs


def _hooked(kernel) -> bool:
    """Whether Triton would run hooks around this launch (then it takes Triton's path)."""
    knobs = _triton_types()[1]
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # an empty HookChain calls nothing
            return True
    return bool(getattr(kernel, "pre_run_hooks", None))


def run(kernel, grid, args: Sequence, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel's launcher when this argument
    signature has been launched before (module docstring). Returns what ``kernel[grid]`` returns (the
    compiled kernel)."""
    if not _enabled or torch.compiler.is_compiling() or not isinstance(kernel, _triton_types()[0]):
        return _triton(kernel, grid, args, kwargs)
    device = _device()
    if device is None:
        return _triton(kernel, grid, args, kwargs)
    state = _compiled_of(kernel)
    try:
        key = (device, state.key(args, kwargs))
        compiled = state.by_key.get(key)
    except TypeError:  # an argument that cannot be hashed
        return _triton(kernel, grid, args, kwargs)
    if compiled is None or _hooked(kernel):
        out = _triton(kernel, grid, args, kwargs)
        if out is not None and compiled is None:
            state.keep(key, out)
        return out
    values = state.values(args, kwargs)
    if callable(grid):
        grid = grid(dict(zip(state.names, values, strict=True)))
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = _stream(key[0])
    try:
        launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return _give_up(kernel, grid, args, kwargs)
    try:
        launcher(grid[0], g1, g2, stream, function, metadata, None, None, None, *values)
    except TypeError:  # the launcher's arguments differ in this Triton version: raised before launching
        return _give_up(kernel, grid, args, kwargs)
    _counts["direct"] += 1
    return compiled


def _triton(kernel, grid, args, kwargs):
    _counts["triton"] += 1
    return kernel[grid](*args, **kwargs)


def _give_up(kernel, grid, args, kwargs):
    set_enabled(False)
    return _triton(kernel, grid, args, kwargs)


class Cached:
    """A Triton (or Gluon) kernel whose ``kernel[grid](...)`` launches go through :func:`run`; every
    other attribute is the kernel's (``fn``, ``params``, ...). Made by :func:`cached`."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid) -> Callable[..., object]:
        if torch.compiler.is_compiling():  # Dynamo traces the kernel's own launch (its Triton kernel support)
            return self.kernel[grid]
        return lambda *args, **kwargs: run(self.kernel, grid, args, kwargs)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def cached(kernel) -> Cached:
    """Decorator over ``@triton.jit`` (or ``@gluon.jit``) for a kernel launched from the host: its launches
    take :func:`run`'s direct path. Not for a function other kernels call."""
    return Cached(kernel)
