"""What ``jax.lax.ragged_all_to_all`` does on the GPUs present, on small cases whose result is known from
its documentation: one slice per device (the docstring's example) and two slices per device. Prints each
device's result next to the documented one."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P


def run(operands, outputs, in_off, send, out_off, recv):
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(AxisType.Auto,))

    def f(op, out, a, b, c, d):
        return jax.lax.ragged_all_to_all(op[0], out[0], a[0], b[0], c[0], d[0], axis_name="ep")[None]

    args = [jnp.asarray(np.array(v)) for v in (operands, outputs, in_off, send, out_off, recv)]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep")))
    return np.asarray(g(*args))


print(jax.__version__, jax.devices())
# the docstring's example: one slice per device; expected [1, 3, 0, 0] and [2, 2, 4, 0]
print(
    "doc example:",
    run(
        [[1, 2, 2], [3, 4, 0]],
        [[0] * 4, [0] * 4],
        [[0, 1], [0, 1]],
        [[1, 2], [1, 1]],
        [[0, 0], [1, 2]],
        [[1, 1], [2, 1]],
    ).tolist(),
    "expected [[1, 3, 0, 0], [2, 2, 4, 0]]",
)
# two slices per device (slice i goes to device i // 2): device 0 sends [10] [11 11] to itself, [12] [13] to 1;
# device 1 sends [20] [21] to 0, [22 22] [23] to itself; output_offsets say where on the receiver
ops = [[10, 11, 11, 12, 13, 0], [20, 21, 22, 22, 23, 0]]
in_off = [[0, 1, 3, 4], [0, 1, 2, 4]]
send = [[1, 2, 1, 1], [1, 1, 2, 1]]
out_off = [[0, 1, 0, 1], [3, 4, 2, 4]]  # sender side: where each slice lands on its receiver
recv = [[1, 2, 1, 1], [1, 1, 2, 1]]  # receiver side: sizes from (src 0 slices, src 1 slices)
print(
    "two slices:",
    run(ops, [[0] * 6, [0] * 6], in_off, send, out_off, recv).tolist(),
    "expected [[10, 11, 11, 20, 21, 0], [12, 13, 22, 22, 23, 0]]",
)
