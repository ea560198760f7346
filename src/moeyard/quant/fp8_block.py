"""FP8 storage of one 3-D expert weight stack with 128 x 128 block scales: the checkpoint format of
DeepSeek-V3/R1 and the Qwen3 FP8 models.

Format (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.3, fine-grained quantization:
weights are grouped and scaled on a 128 x 128 block basis; the checkpoints' ``quantization_config``
is ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme":
"dynamic"}``):

Legend: E experts, ``(a, b)`` one expert's matrix as the parameter stores it (``[out, in]`` in the
standard layout, ``[in, out]`` in gpt-oss's transposed one), ``Ra = ceil(a / 128)``, ``Rb = ceil(b / 128)``.

- ``weight [E, a, b] float8_e4m3fn``: the stored values ``q``.
- ``weight_scale_inv [E, Ra, Rb] float32``: one scale per block of 128 rows by 128 columns (the
  last block of a row or column holds what is left); element ``(e, i, j)`` dequantises to
  ``w = q[e, i, j] * weight_scale_inv[e, i // 128, j // 128]`` (float32 product, then the compute
  dtype). This is DeepSeek-V3's ``weight_dequant`` (``inference/kernel.py``: ``y = x * s`` over
  128 x 128 tiles) and transformers' FineGrainedFP8 (``Fp8Dequantize``, ``_dequantize_fp8_weight``:
  ``weight.to(dtype) * weight_scale_inv`` repeated over each block). The name says what the value is
  the inverse of: the quantisation scale ``448 / amax`` the weights were multiplied by.
- Quantising (:meth:`FP8BlockExperts.from_float`) uses :func:`moeyard.quant.fp8.quantize` with
  ``Blocks(128, 128)`` and scale mode ``"float"``: ``weight_scale_inv = amax / 448`` per block, ``q =
  clamp(w / weight_scale_inv, -448, 448)`` rounded to e4m3 (a block of zeros gets scale 1).

Row segments: checkpoints store an expert's ``gate_proj`` and ``up_proj`` as separate matrices, each
blocked from its own first row, and transformers concatenates them (scales too) into ``gate_up_proj``.
When ``I`` is a multiple of 128 that is the grid above; otherwise the two halves' blocks restart at
row ``I``. ``row_segments = (I, I)`` describes that: rows are blocked per segment, ``Ra`` is the sum
of ``ceil(segment / 128)``. A grid that equals the plain one is stored as the plain one.

Square blocks mean the transposed layout needs nothing special: the blocks of ``w.mT`` are the
transposes of the blocks of ``w``, so a gpt-oss ``[E, H, 2I]`` stack is stored as it is, its scales
``[E, ceil(H / 128), ceil(2I / 128)]``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .dequant import write_active
from .fp8 import E4M3, quantize
from .fp8_block_grid import BLOCK, BLOCKS, grid_shape, normalize_segments, row_block_ids, scale_rows

Tensor = torch.Tensor
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements the torch path dequantises per step (bounds its float32 temporaries to ~12 bytes per element).
TORCH_CHUNK = 1 << 22


class FP8BlockExperts(nn.Module):
    """An ``[E, a, b]`` expert weight stack stored as e4m3 with float32 128 x 128 block scales, frozen.

    Two buffers (module docstring: the format), so ``state_dict()`` and safetensors carry them as
    ``<name>.weight`` and ``<name>.weight_scale_inv``; ``.to(device)`` moves them; ``.to(dtype)`` /
    ``.half()`` keep the stored dtypes and change only the compute dtype.

    Build with :meth:`from_float` (quantises), :meth:`from_fp8` (adopts a checkpoint's tensors, no
    copy) or :meth:`empty` (a structure to ``load_state_dict`` into). Read with :meth:`dequantize`
    (selective, no host sync). About 0.5x the bytes of bfloat16 (plus 4 bytes per 16384 weights).

    Attributes:
        shape: ``torch.Size([E, a, b])``, the weight's shape as the parameter stored it.
        dtype: compute dtype (what :meth:`dequantize` returns): float16, bfloat16, float32 or float64.
        row_segments: the row segments blocked separately (module docstring); ``(a,)`` normally.
    """

    def __init__(self, shape, *, dtype: torch.dtype, row_segments=None, device=None):
        super().__init__()
        shape = torch.Size(shape)
        check_shape(shape)
        check_compute_dtype(dtype)
        self.shape, self.dtype = shape, dtype
        self.row_segments = normalize_segments(row_segments, shape[1])
        E, _, b = shape
        self.register_buffer("weight", torch.zeros(shape, dtype=E4M3, device=device))
        self.register_buffer(
            "weight_scale_inv",
            torch.ones(E, scale_rows(self.row_segments), -(-b // BLOCK), dtype=torch.float32, device=device),
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def empty(cls, shape, *, dtype: torch.dtype, row_segments=None, device=None) -> FP8BlockExperts:
        """Zero weights and unit scales of the right shapes, to ``load_state_dict`` into. Raises as
        :meth:`from_fp8`."""
        return cls(shape, dtype=dtype, row_segments=row_segments, device=device)

    @classmethod
    def from_float(cls, weight: Tensor, *, row_segments=None) -> FP8BlockExperts:
        """Quantise ``weight [E, a, b]`` (float16, bfloat16, float32 or float64; any device) with
        :func:`moeyard.quant.fp8.quantize` (``Blocks(128, 128)``, scale mode ``"float"``) on its device
        (no host sync), a few experts at a time (float32 temporaries of about :data:`TORCH_CHUNK`
        elements); the compute dtype is ``weight.dtype``.

        Raises:
            TypeError: ``weight`` is not a tensor of one of those dtypes.
            ValueError: ``weight`` is not 3-D; bad ``row_segments``.
        """
        if not isinstance(weight, Tensor):
            raise TypeError(f"weight: expected a tensor, got {type(weight).__name__}")
        check_compute_dtype(weight.dtype, "weight")
        check_shape(weight.shape, "weight")
        self = cls(weight.shape, dtype=weight.dtype, row_segments=row_segments, device=weight.device)
        w = weight.detach()
        E, a, b = w.shape
        step = max(1, TORCH_CHUNK // max(1, a * b))  # bounds the cast's float32 temporaries
        with torch.no_grad():
            for e0 in range(0, E, step):
                start, srow = 0, 0
                for size in self.row_segments:
                    q, scale = quantize(w[e0 : e0 + step, start : start + size], BLOCKS, "float")
                    self.weight[e0 : e0 + step, start : start + size] = q
                    self.weight_scale_inv[e0 : e0 + step, srow : srow + scale.shape[1]] = scale
                    start, srow = start + size, srow + scale.shape[1]
        return self

    @classmethod
    def from_fp8(
        cls, weight: Tensor, weight_scale_inv: Tensor, *, dtype: torch.dtype, row_segments=None
    ) -> FP8BlockExperts:
        """Adopt stored tensors (a checkpoint's): ``weight [E, a, b]`` float8_e4m3fn and
        ``weight_scale_inv [E, Ra, Rb]`` (float32; another float dtype is converted to float32),
        both on one device. No copy of ``weight``; ``dtype`` is the compute dtype.

        Raises:
            TypeError: ``weight`` is not float8_e4m3fn, ``weight_scale_inv`` not floating point, or
                ``dtype`` not float16 / bfloat16 / float32 / float64.
            ValueError: ``weight`` is not 3-D, ``weight_scale_inv``'s shape is not the block grid of
                ``weight`` (the message gives the expected shape), the devices differ, bad ``row_segments``.
        """
        for name, t in (("weight", weight), ("weight_scale_inv", weight_scale_inv)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if weight.dtype != E4M3:
            raise TypeError(f"weight: expected a {E4M3} tensor, got {weight.dtype}")
        if not weight_scale_inv.is_floating_point() or weight_scale_inv.element_size() < 2:
            raise TypeError(f"weight_scale_inv: expected a float32 tensor, got {weight_scale_inv.dtype}")
        check_shape(weight.shape, "weight")
        check_compute_dtype(dtype)
        segments = normalize_segments(row_segments, weight.shape[1])
        want = grid_shape(weight.shape, segments)
        if tuple(weight_scale_inv.shape) != want:
            raise ValueError(
                f"weight_scale_inv: expected shape {want} (one scale per 128 x 128 block of weight "
                f"{tuple(weight.shape)}), got {tuple(weight_scale_inv.shape)}"
            )
        if weight_scale_inv.device != weight.device:
            raise ValueError(
                f"weight_scale_inv: expected device {weight.device} (the weight's), got {weight_scale_inv.device}"
            )
        # a copy only of a weight that is not contiguous, or of scales not in float32
        return cls.adopt(
            weight.detach().contiguous(),
            weight_scale_inv.detach().to(torch.float32).contiguous(),
            dtype=dtype,
            row_segments=segments,
        )

    @classmethod
    def adopt(
        cls, weight: Tensor, weight_scale_inv: Tensor, *, dtype: torch.dtype, row_segments: tuple[int, ...]
    ) -> FP8BlockExperts:
        """The storage over these very tensor objects, unchecked (:meth:`from_fp8` checks, then calls
        this): ``weight`` contiguous float8_e4m3fn, ``weight_scale_inv`` contiguous float32 of the grid
        of normalised ``row_segments``. Given ``nn.Parameter`` s, the storage follows them when a module
        moves them (``param.data`` replaced by ``.to(device)``)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.shape, self.dtype, self.row_segments = weight.shape, dtype, row_segments
        self._buffers["weight"] = weight
        self._buffers["weight_scale_inv"] = weight_scale_inv
        return self

    # ------------------------------------------------------------------ tensor-like properties

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def requires_grad(self) -> bool:
        """Always False: the stored weights are frozen (train adapters beside them)."""
        return False

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def dim(self) -> int:
        return 3

    def memory_bytes(self) -> int:
        """Bytes held by the two buffers: ``n + 4 * n / 16384`` for ``n`` weights (less than 0.51x bfloat16)."""
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False))

    @property
    def nbytes(self) -> int:
        """Same as :meth:`memory_bytes`."""
        return self.memory_bytes()

    # ------------------------------------------------------------------ reading

    def dequantize(self, active: Tensor | None = None, *, out: Tensor | None = None) -> Tensor:
        """Dequantise the experts marked in ``active`` (all when None) into ``[E, a, b]``: each value is
        ``float32(q) * weight_scale_inv`` of its block, rounded to the compute dtype. A Triton kernel
        on CUDA, torch elsewhere; both give the same bits. No autograd, no host sync.

        Args:
            active: ``[E]`` bool, or integer (``> 0`` means active), on the storage's device; None: all.
            out: optional caller-owned workspace ``[E, a, b]``, contiguous, in the compute dtype, on
                the storage's device. Rows of inactive experts are left untouched.
        Returns:
            ``out`` when given, else a new tensor whose inactive experts' rows are zero.
        Raises:
            TypeError: ``active`` is not a bool/integer tensor, or ``out`` has another dtype.
            ValueError: ``active`` / ``out`` have the wrong shape or device, or ``out`` is not contiguous.
        """
        from .dequant import output, use_triton

        out, fresh = output(self, active, out)
        with torch.no_grad():
            if use_triton(self.device):
                from .triton_fp8_block import dequantize_triton

                dequantize_triton(self, active, out, zero_inactive=fresh)
            else:
                dequantize_torch(self, active, out, zero_inactive=fresh)
        return out

    def row_block_ids(self) -> Tensor:
        """``[a]`` int64: the block row of ``weight_scale_inv`` each row of ``weight`` reads."""
        return row_block_ids(self.row_segments, self.device)

    # ------------------------------------------------------------------ nn.Module plumbing

    def _apply(self, fn, recurse=True):
        """Apply ``fn`` (``.to``, ``.cuda``, ``.half``, ...) to the buffers for their device only: the
        stored dtypes stay (float8_e4m3fn / float32); a cast of every float to one dtype
        (``.to(torch.bfloat16)``, ``.half()``, ``.float()``, ``.double()``) sets the compute dtype instead."""
        for name, buf in self._buffers.items():
            if buf is not None:
                moved = fn(buf)
                self._buffers[name] = moved if moved.dtype == buf.dtype else buf.to(moved.device)
        targets = {fn(torch.zeros((), dtype=d, device=self.device)).dtype for d in (torch.float16, torch.float32)}
        if len(targets) == 1 and (target := targets.pop()) in COMPUTE_DTYPES:
            self.dtype = target
        return self  # no parameters or submodules of its own

    def extra_repr(self) -> str:
        segments = f", row_segments={self.row_segments}" if len(self.row_segments) > 1 else ""
        return f"shape={tuple(self.shape)}, dtype={self.dtype}{segments}, bytes={self.memory_bytes()}"


# ---------------------------------------------------------------------- the torch path


def dequantize_torch(storage: FP8BlockExperts, active: Tensor | None, out: Tensor, zero_inactive: bool = False) -> None:
    """The torch implementation of :meth:`FP8BlockExperts.dequantize` (any device): every expert in
    chunks of about :data:`TORCH_CHUNK` elements, the active ones written (a ``torch.where`` keeps
    the inactive rows of ``out``, or zeroes them with ``zero_inactive``), so its work does not shrink
    with fewer active experts; static shapes, no host sync."""
    E, a, b = storage.shape
    rows = storage.row_block_ids()
    cols = torch.arange(b, device=storage.device) // BLOCK
    step = max(1, TORCH_CHUNK // max(1, a * b))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        scale = storage.weight_scale_inv[e0:e1].index_select(1, rows).index_select(2, cols)
        vals = (storage.weight[e0:e1].float() * scale).to(out.dtype)
        write_active(out[e0:e1], vals, None if active is None else active[e0:e1], zero_inactive)


def dequantize_reference(storage: FP8BlockExperts, active: Tensor | None = None) -> Tensor:
    """Float64 oracle, written from the format with :func:`moeyard.quant.fp8.dequantize`: ``[E, a, b]``
    float64 (the float32 product of an e4m3 value and a float32 scale is exact in float64, so rounding
    it to float32 gives the stored float32 product); inactive experts' rows are zero. Slow, for tests."""
    from .dequant import check_active
    from .fp8 import dequantize

    check_active(storage, active)
    parts, start, srow = [], 0, 0
    for size in storage.row_segments:
        n = -(-size // BLOCK)
        q = storage.weight[:, start : start + size]
        s = storage.weight_scale_inv[:, srow : srow + n].double()
        parts.append(dequantize(q, s, BLOCKS, dtype=torch.float64))
        start, srow = start + size, srow + n
    vals = torch.cat(parts, dim=1)
    if active is not None:
        vals = vals * (active > 0)[:, None, None]
    return vals


# ---------------------------------------------------------------------- checks


def check_shape(shape, name: str = "weight") -> None:
    """Raise ValueError unless ``shape`` is ``[E, a, b]``."""
    if len(shape) != 3:
        raise ValueError(f"{name}: expected a 3-D expert stack [E, a, b], got shape {tuple(shape)}")


def check_compute_dtype(dtype: torch.dtype, name: str = "dtype") -> None:
    """Raise TypeError unless ``dtype`` is a compute dtype (float16, bfloat16, float32, float64)."""
    if dtype not in COMPUTE_DTYPES:
        raise TypeError(
            f"{name}: FP8 block storage needs float16, bfloat16, float32 or float64 weights "
            f"(the compute dtype), got {dtype}"
        )
