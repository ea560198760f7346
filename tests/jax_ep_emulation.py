"""``jax.lax.ragged_all_to_all`` written with ``all_gather`` and a scatter, for XLA:CPU (which does not
implement the collective): the semantics of its docstring, so the ragged exchange's offsets and sizes are
tested on CPU devices; the GPU check (``benchmarks/jax_gpu.py``) runs the real collective."""

import jax
import jax.numpy as jnp


def install(parallel) -> str:
    """Make ``moeyard.jax.parallel``'s ragged exchange run on XLA:CPU: register :func:`values` as the CPU
    lowering of JAX's own ``ragged_all_to_all`` primitive, so the primitive's abstract evaluation (the
    result's type) is the real one and only its execution is emulated; where that private hook is missing,
    replace the collective by :func:`ragged_all_to_all`, which checks the same typing rule. Returns which."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.lax.parallel import ragged_all_to_all_p

        def lowered(operand, output, io, ss, oo, rs, *, axis_name, axis_index_groups=None):
            return values(operand, output, io, ss, oo, rs, axis_name=axis_name)

        mlir.register_lowering(ragged_all_to_all_p, mlir.lower_fun(lowered, multiple_results=False), platform="cpu")
        return "lowering"
    except (ImportError, AttributeError):
        parallel.ragged_all_to_all = ragged_all_to_all
        return "function"


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """Slice i of the caller's ``operand`` (``input_offsets[i]``, ``send_sizes[i]`` rows) lands on device
    ``i // (len / W)`` at its rows ``output_offsets[i] ...``; the rest of ``output`` is kept.

    Also the collective's typing rule: its result takes the type of ``output`` (jax's abstract evaluation
    copies ``output``'s aval), so an ``output`` not typed as varying over ``axis_name`` gives a result typed
    invariant though it differs per device, and under ``jax.grad`` of the ``shard_map`` its residuals then
    reach the backward from one device only (the wrong GPU gradients of ``docs/jax.md``). Raises then."""
    if axis_name not in varying_axes(output):
        raise TypeError(f"ragged_all_to_all: output must vary over {axis_name!r}, is typed {jax.typeof(output)}")
    return values(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def values(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """The collective's result (:func:`ragged_all_to_all`'s semantics) from ``all_gather`` and a scatter."""
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


def varying_axes(t) -> frozenset:
    """The mesh axes ``t`` is typed as varying over inside ``shard_map`` (jax 0.10's ``manual_axis_type``,
    later ``vma``)."""
    aval = jax.typeof(t)
    vma = getattr(aval, "vma", None)
    return frozenset(vma if vma is not None else aval.manual_axis_type.varying)
