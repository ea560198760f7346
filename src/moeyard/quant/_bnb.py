"""bitsandbytes, imported on first use (an optional dependency), and the constants of its 4-bit format.

Format source: bitsandbytes ``functional.quantize_4bit`` / ``dequantize_4bit`` (0.50) and the QLoRA
paper (Dettmers et al., arXiv 2305.14314, NF4 and double quantisation).
"""

from __future__ import annotations

import torch

# Block sizes ``bitsandbytes.functional.quantize_4bit`` accepts (elements per absmax).
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# ``quantize_4bit(compress_statistics=True)`` quantises the absmax with ``quantize_blockwise(blocksize=256)``.
NESTED_BLOCKSIZE = 256
# The NF4 table (``bitsandbytes.functional.get_4bit_type("nf4")``: quantiles of N(0, 1), QLoRA's NormalFloat),
# indexed by the 4-bit code. Kept here so stored experts can be rebuilt and dequantised without bitsandbytes.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def bnb_functional():
    """``bitsandbytes.functional``, imported now.

    Raises:
        ImportError: bitsandbytes is not installed (the message says how to install it).
    """
    try:
        import bitsandbytes.functional as F
    except ImportError as ex:
        raise ImportError(
            "NF4 quantisation of expert weights needs bitsandbytes "
            "(pip install bitsandbytes, or pip install 'moeyard[quant]')"
        ) from ex
    return F


def nf4_code(device=None) -> torch.Tensor:
    """The NF4 table as a ``[16]`` float32 tensor (equal to bitsandbytes' ``get_4bit_type("nf4")``)."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
