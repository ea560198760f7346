"""NF4 storage of one 3-D expert weight stack, in bitsandbytes' format.

Format (bitsandbytes ``functional.quantize_4bit(w, quant_type="nf4")`` of the whole 3-D tensor, as
``bitsandbytes.nn.parametrize.replace_parameter_4bit`` stores 3-D experts; NF4 and double
quantisation from QLoRA, arXiv 2305.14314):

Legend: E experts, ``(a, b)`` one expert's matrix as the parameter stores it, ``n = E*a*b`` elements
in row-major order, ``bs`` the blocksize, ``nb = n / bs`` absmax blocks, ``nb2 = ceil(nb / 256)``.

- ``data [n/2, 1] uint8``: element ``2i`` in the high nibble of byte ``i``, element ``2i+1`` in the low
  nibble; a nibble indexes the NF4 table ``code [16] float32``.
- block ``j`` (elements ``j*bs .. (j+1)*bs - 1``) has scale ``absmax[j]``: ``[nb] float32``, or with
  ``compress_statistics`` (double quantisation) ``[nb] uint8`` decoded as the float32 value
  ``fl(fl(code2[absmax[j]] * absmax2[j // 256]) + offset)`` with ``code2 [256] float32`` (bitsandbytes'
  dynamic map), ``absmax2 [nb2] float32`` and ``offset [] float32`` (the mean of the float absmax).
- ``w[k] = fl(code[q[k]] * absmax[k // bs])`` in float32, then rounded to the compute dtype.

``bs`` divides ``a*b``, so an expert owns whole blocks: expert ``e`` is bytes ``[e*a*b/2, (e+1)*a*b/2)``
and blocks ``[e*a*b/bs, (e+1)*a*b/bs)``, and dequantising some experts gives exactly the rows a
whole-tensor dequantisation gives.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ._bnb import BLOCKSIZES, NESTED_BLOCKSIZE, bnb_functional, nf4_code
from .dequant import decoded_absmax, dequantize

Tensor = torch.Tensor
_BUFFERS = ("data", "absmax", "absmax2", "code2", "offset", "code")


class NF4Experts(nn.Module):
    """An ``[E, a, b]`` expert weight stack stored as NF4 (4 bits per weight), frozen.

    Every tensor is a buffer (``data``, ``absmax``, ``code`` and, with double quantisation,
    ``absmax2``, ``code2``, ``offset``; module docstring: the format), so ``state_dict()`` and
    safetensors carry it; ``.to(device)`` moves it; ``.to(dtype)`` / ``.half()`` keep the stored dtypes
    (uint8 / float32) and change only the compute dtype.

    Build with :meth:`from_float` (quantises with bitsandbytes) or :meth:`empty` (a structure to
    ``load_state_dict`` into). Read with :meth:`dequantize` (selective, no host sync) or
    :meth:`quant_state` (a bitsandbytes ``QuantState``).

    Attributes:
        shape: ``torch.Size([E, a, b])``, the weight's shape as the parameter stored it.
        dtype: compute dtype (what :meth:`dequantize` returns).
        blocksize: elements per absmax block.
    """

    def __init__(self, shape, *, dtype: torch.dtype, blocksize: int, compress_statistics: bool, device=None):
        super().__init__()
        shape = torch.Size(shape)
        check_layout(shape, blocksize)
        check_compute_dtype(dtype)
        n = math.prod(shape)
        nb = n // blocksize
        self.shape, self.dtype, self.blocksize = shape, dtype, blocksize
        kw = {"device": device}
        self.register_buffer("data", torch.zeros(n // 2, 1, dtype=torch.uint8, **kw))
        self.register_buffer(
            "absmax", torch.zeros(nb, dtype=torch.uint8 if compress_statistics else torch.float32, **kw)
        )
        nested = {
            "absmax2": torch.zeros(-(-nb // NESTED_BLOCKSIZE), dtype=torch.float32, **kw),
            "code2": torch.zeros(256, dtype=torch.float32, **kw),
            "offset": torch.zeros((), dtype=torch.float32, **kw),
        }
        for name, t in nested.items():
            self.register_buffer(name, t if compress_statistics else None)
        self.register_buffer("code", nf4_code(device))

    # ------------------------------------------------------------------ construction

    @classmethod
    def empty(
        cls, shape, *, dtype: torch.dtype, blocksize: int = 64, compress_statistics: bool = True, device=None
    ) -> NF4Experts:
        """A zero-filled structure of the right buffer shapes, to ``load_state_dict`` into (needs no
        bitsandbytes). Raises as :meth:`from_float`."""
        return cls(shape, dtype=dtype, blocksize=blocksize, compress_statistics=compress_statistics, device=device)

    @classmethod
    def from_float(cls, weight: Tensor, *, blocksize: int = 64, compress_statistics: bool = True) -> NF4Experts:
        """Quantise ``weight [E, a, b]`` (float16, bfloat16 or float32, any device bitsandbytes runs on)
        with ``bitsandbytes.functional.quantize_4bit(weight, quant_type="nf4", blocksize=blocksize,
        compress_statistics=compress_statistics)``; the compute dtype is ``weight.dtype``.

        Raises:
            TypeError: ``weight`` is not a float16 / bfloat16 / float32 tensor.
            ValueError: ``weight`` is not 3-D, ``blocksize`` is not one bitsandbytes accepts (32 ... 4096,
                powers of two) or does not divide one expert's ``a*b`` elements.
            ImportError: bitsandbytes is missing.
        """
        if not isinstance(weight, Tensor):
            raise TypeError(f"weight: expected a tensor, got {type(weight).__name__}")
        check_compute_dtype(weight.dtype, "weight")
        check_layout(weight.shape, blocksize)
        F = bnb_functional()
        w = weight.detach().contiguous()
        data, state = F.quantize_4bit(w, quant_type="nf4", blocksize=blocksize, compress_statistics=compress_statistics)
        self = cls(
            w.shape, dtype=w.dtype, blocksize=blocksize, compress_statistics=compress_statistics, device=w.device
        )
        with torch.no_grad():
            self.data.copy_(data.view(torch.uint8).reshape(self.data.shape))
            self.absmax.copy_(state.absmax)
            self.code.copy_(state.code)
            if compress_statistics:
                self.absmax2.copy_(state.state2.absmax)
                self.code2.copy_(state.state2.code)
                self.offset.copy_(state.offset)
        return self

    def select(self, start: int, stop: int) -> NF4Experts:
        """Experts ``[start, stop)`` as storage of their own (copies: nothing of the other experts is
        kept), dequantising to exactly the same weights (an expert-parallel rank's block).

        The blocks of those experts are whole (``bs`` divides ``a*b``): ``data`` and ``absmax`` are
        sliced. With double quantisation the ``absmax2`` groups of 256 blocks are sliced too when the
        first block starts a group (``start * a*b / bs`` a multiple of 256, e.g. every real model's
        expert, ``a*b / bs`` = 98304 at Qwen3-235B-A22B); otherwise the block scales are stored
        decoded, in float32 (``compress_statistics`` False: 3 more bytes per block, values unchanged).

        Raises:
            ValueError: not ``0 <= start < stop <= E`` (ints).
        """
        E, a, b = self.shape
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)) or not 0 <= start < stop <= E:
            raise ValueError(f"start, stop: expected ints with 0 <= start < stop <= {E}, got {start!r}, {stop!r}")
        per, bs = a * b, self.blocksize
        b0, b1 = start * per // bs, stop * per // bs
        nested = self.compress_statistics and b0 % NESTED_BLOCKSIZE == 0
        out = NF4Experts(
            (stop - start, a, b), dtype=self.dtype, blocksize=bs, compress_statistics=nested, device=self.device
        )
        with torch.no_grad():
            out.data.copy_(self.data[start * per // 2 : stop * per // 2])
            out.code.copy_(self.code)
            if nested:
                out.absmax.copy_(self.absmax[b0:b1])
                out.absmax2.copy_(self.absmax2[b0 // NESTED_BLOCKSIZE : -(-b1 // NESTED_BLOCKSIZE)])
                out.code2.copy_(self.code2)
                out.offset.copy_(self.offset)
            else:
                out.absmax.copy_(decoded_absmax(self)[b0:b1])
        return out

    # ------------------------------------------------------------------ tensor-like properties

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def requires_grad(self) -> bool:
        """Always False: the stored weights are frozen (train adapters beside them)."""
        return False

    @property
    def compress_statistics(self) -> bool:
        """True when the absmax is double-quantised (``absmax`` uint8 plus ``absmax2``/``code2``/``offset``)."""
        return self.absmax2 is not None

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def dim(self) -> int:
        return 3

    def memory_bytes(self) -> int:
        """Bytes held by the stored tensors (every buffer): about ``n/2 + n/bs`` with double quantisation
        (0.258x of bfloat16 at ``bs = 64``), ``n/2 + 4*n/bs`` without (0.281x), plus ~1 KiB of tables."""
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False))

    @property
    def nbytes(self) -> int:
        """Same as :meth:`memory_bytes`."""
        return self.memory_bytes()

    # ------------------------------------------------------------------ reading

    def quant_state(self):
        """A ``bitsandbytes.functional.QuantState`` over this storage's buffers (no copies), so that
        ``bitsandbytes.functional.dequantize_4bit(storage.data, storage.quant_state())`` gives the
        ``[E, a, b]`` weights in the compute dtype.

        Raises:
            ImportError: bitsandbytes is missing.
        """
        QuantState = bnb_functional().QuantState
        state2 = None
        if self.compress_statistics:
            state2 = QuantState(absmax=self.absmax2, code=self.code2, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        return QuantState(
            absmax=self.absmax,
            shape=self.shape,
            code=self.code,
            blocksize=self.blocksize,
            quant_type="nf4",
            dtype=self.dtype,
            offset=self.offset,
            state2=state2,
        )

    def dequantize(self, active: Tensor | None = None, *, out: Tensor | None = None) -> Tensor:
        """Dequantise the experts marked in ``active`` (all when None) into ``[E, a, b]``.

        See :func:`moeyard.quant.dequantize` (shapes, what inactive rows hold, errors, no host sync).
        """
        return dequantize(self, active, out=out)

    # ------------------------------------------------------------------ nn.Module plumbing

    def _apply(self, fn, recurse=True):
        """Apply ``fn`` (``.to``, ``.cuda``, ``.half``, ...) to the buffers for their device only: the
        stored dtypes stay (uint8 / float32, or the format breaks); a cast of every float to one dtype
        (``.to(torch.bfloat16)``, ``.half()``, ``.float()``) sets the compute dtype instead, when it is
        float16, bfloat16 or float32 (others, e.g. ``.double()``, leave it)."""
        for name, buf in self._buffers.items():
            if buf is not None:
                moved = fn(buf)
                self._buffers[name] = moved if moved.dtype == buf.dtype else buf.to(moved.device)
        targets = {fn(torch.zeros((), dtype=d, device=self.device)).dtype for d in (torch.float16, torch.float32)}
        if len(targets) == 1 and (target := targets.pop()) in (torch.float16, torch.bfloat16, torch.float32):
            self.dtype = target
        return self  # no parameters or submodules of its own

    def extra_repr(self) -> str:
        return (
            f"shape={tuple(self.shape)}, dtype={self.dtype}, blocksize={self.blocksize}, "
            f"compress_statistics={self.compress_statistics}, bytes={self.memory_bytes()}"
        )


def check_compute_dtype(dtype: torch.dtype, name: str = "dtype") -> None:
    """Raise TypeError unless ``dtype`` is one bitsandbytes' NF4 quantises (float16, bfloat16, float32)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: NF4 (bitsandbytes) needs float16, bfloat16 or float32 weights, got {dtype}")


def check_layout(shape, blocksize: int) -> None:
    """Raise ValueError unless ``shape`` is ``[E, a, b]`` and ``blocksize`` is valid and divides ``a*b``."""
    if len(shape) != 3:
        raise ValueError(f"weight: expected a 3-D expert stack [E, a, b], got shape {tuple(shape)}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize: expected one of {BLOCKSIZES} (bitsandbytes' 4-bit block sizes), got {blocksize}")
    per_expert = shape[1] * shape[2]
    if per_expert % blocksize:
        raise ValueError(
            f"blocksize: {blocksize} must divide each expert's element count a*b = {shape[1]}*{shape[2]} "
            f"= {per_expert}, so that no block straddles two experts; pick a smaller blocksize"
        )
