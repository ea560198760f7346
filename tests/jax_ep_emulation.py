"""``jax.lax.ragged_all_to_all`` written with ``all_gather`` and a scatter, for XLA:CPU (which does not
implement the collective): the semantics of its docstring, so the ragged exchange's offsets and sizes are
tested on CPU devices; the GPU check (``benchmarks/jax_gpu.py``) runs the real collective."""

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """Slice i of the caller's ``operand`` (``input_offsets[i]``, ``send_sizes[i]`` rows) lands on device
    ``i // (len / W)`` at its rows ``output_offsets[i] ...``; the rest of ``output`` is kept."""
    W = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    n = input_offsets.shape[0] // W  # slices per destination
    rows = operand.shape[0]
    ops = jax.lax.all_gather(operand, axis_name)  # [W, rows, ...]
    src = jax.lax.all_gather(input_offsets, axis_name).reshape(W, W, n)[:, me]  # [source, slice]
    size = jax.lax.all_gather(send_sizes, axis_name).reshape(W, W, n)[:, me]
    dst = jax.lax.all_gather(output_offsets, axis_name).reshape(W, W, n)[:, me]
    j = jnp.arange(rows)
    take = j < size[..., None]  # [W, n, rows]
    values = ops[jnp.arange(W)[:, None, None], jnp.clip(src[..., None] + j, 0, rows - 1)]
    target = jnp.where(take, dst[..., None] + j, output.shape[0])  # out of range: dropped
    return output.at[target.reshape(-1)].set(values.reshape(-1, *operand.shape[1:]), mode="drop")
