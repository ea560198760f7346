"""Expert parallelism under ``jax.shard_map``: the routed experts split over one mesh axis, tokens sent
to their experts' devices and back, forward and backward.

Device r of the axis (size W) holds experts ``[r * E_l, (r + 1) * E_l)``, ``E_l = E / W``, and its own
tokens; the router, shared experts and everything else are replicated. Inside ``shard_map``,
:func:`ep_experts` takes the local tokens, their global expert ids and the local expert weights and
returns the local outputs: equal to :func:`moeyard.jax.experts` on one device (tested on 4 and 8 CPU
devices under skewed routing, outputs and every gradient). Two exchanges, both with static
worst-case shapes (no host sync):

- ``all_to_all`` (default; runs on every backend, CPU included): each device sends every other device
  one block of ``C = T * min(K, E_l)`` rows (a token sends at most ``min(K, E_l)`` pairs to one device,
  its K ids being distinct) through ``jax.lax.all_to_all``; the receiver runs its local experts on the
  ``W * C`` rows (empty slots carry an invalid local id and contribute nothing), and the results return
  the same way. Moves ``W * C`` rows each way whatever the routing.
- ``ragged_all_to_all``: only the routed rows, through ``jax.lax.ragged_all_to_all``, laid out
  expert-major on arrival (each local expert's rows from every source contiguous, each expert's block
  padded to a multiple of ``align``), so the local experts read the receive buffer as is. Per-expert
  counts are all-gathered first (``[W, E]`` int32). The receive buffer is sized for the worst case
  including the alignment padding: ``W * C + E_l * (align - 1)`` rows, rounded up to a multiple of
  ``align``. The backward runs the same exchanges reversed, each written out as the other direction's
  ``ragged_all_to_all`` (a custom VJP). Every receive buffer is typed as varying over the axis: the
  collective's result takes its buffer's type, and a result typed invariant (as a plain ``jnp.zeros`` buffer
  made it) reaches the backward of ``jax.grad`` over the ``shard_map`` from one device only, which gave wrong
  gradients of x and of both expert weights on two H200s (2026-11-27) while the forward matched the dense
  exchange exactly. XLA:CPU does not implement the collective: the CPU tests register an emulation as its
  CPU lowering (JAX's own primitive, so its typing is the real one); ``benchmarks/jax_gpu.py`` and
  ``benchmarks/jax_ragged_diag.py`` check it against ``all_to_all`` on the GPUs present.

A token that repeats an id could send more than C pairs to one device: those pairs are not sent and
the token's output row is NaN (visible, never silently wrong); moeyard's router never repeats an id.

The layer::

    layer = moeyard.jax.MoE(config, rngs=nnx.Rngs(0))
    moeyard.jax.expert_parallel(layer, axis_name="ep")            # its experts call ep_experts
    mesh = jax.make_mesh((W,), ("ep",), axis_types=(AxisType.Auto,))
    y, aux_loss = moeyard.jax.ep_apply(layer, x, mesh=mesh)       # x [T, H] sharded over "ep"

or, in your own ``shard_map``, ``partition_specs(layer)`` for the layer's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..activations import Activation, get_activation
from ..quant.recipe import resolve_recipe
from .checks import check_bool, check_float, check_topk, invalid_ids
from .dispatch import plan_unchecked, weighted_sum
from .experts import check_weights
from .ffn import FFNSpec, routed_ffn
from .lora import lora_views

__all__ = [
    "EXCHANGES",
    "EPExperts",
    "ep_apply",
    "ep_experts",
    "expert_parallel",
    "lora_columns_by_device",
    "partition_specs",
]

EXCHANGES = ("all_to_all", "ragged_all_to_all")
ragged_all_to_all = jax.lax.ragged_all_to_all  # the collective the ragged exchange calls (the CPU tests emulate it)
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")  # sharded on their dim 0


def ep_experts(
    hidden_states,
    topk_ids,
    topk_weights,
    gate_up_proj,
    down_proj,
    *,
    axis_name: str,
    exchange: str = "all_to_all",
    align: int = 1,
    activation: str | Activation = "swiglu",
    gate_up_bias=None,
    down_bias=None,
    transposed: bool = False,
    interleaved: bool = False,
    drop_invalid: bool = False,
    custom_vjp: bool = True,
    lora=None,
    recipe=None,
):
    """:func:`moeyard.jax.experts` with the experts split over mesh axis ``axis_name``; call it inside
    ``jax.shard_map`` (module docstring).

    Args:
        hidden_states: ``[T, H]`` this device's tokens.
        topk_ids: ``[T, K]`` global expert ids in ``[0, E)``, ``E = E_l * W``.
        topk_weights: ``[T, K]`` routing weights.
        gate_up_proj, down_proj, gate_up_bias, down_bias: this device's ``E_l`` experts, in any layout of
            :func:`moeyard.jax.experts`.
        axis_name: the mesh axis the experts are split over.
        exchange: ``all_to_all`` or ``ragged_all_to_all`` (module docstring).
        align: ``ragged_all_to_all`` only: pad each local expert's received rows to a multiple of this.
        activation, transposed, interleaved, drop_invalid: as :func:`moeyard.jax.experts` (ids outside
            ``[0, E)`` are never read on the host here: NaN rows, or nothing with ``drop_invalid``).
        custom_vjp: the local experts' backward (:func:`moeyard.jax.experts`), with either exchange.
        lora: LoRA adapters of this device's ``E_l`` experts (:func:`moeyard.jax.experts`' ``lora``), in
            PEFT's layout over the local experts: ``lora_A [r*E_l, in]`` (a block of the global rows) and
            ``lora_B [out, r*E_l]`` (columns rank-major over the local experts, as
            :func:`moeyard.parallel.lora.shard_factors` gives each PyTorch rank).
        recipe: an FP8 training recipe for the local experts' GEMMs (:func:`moeyard.jax.experts`).
    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    Raises:
        TypeError / ValueError: as :func:`moeyard.jax.experts`; an unknown ``exchange``, a bad ``align``,
            or not inside a ``shard_map`` over ``axis_name``.
    """
    act = get_activation(activation)
    recipe = resolve_recipe(recipe)
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align: expected a positive int, got {align!r}")
    for name, v in (("drop_invalid", drop_invalid), ("custom_vjp", custom_vjp)):
        check_bool(name, v)
    check_float("hidden_states", hidden_states, dim=2)
    E_l, H, I = check_weights(
        gate_up_proj,
        down_proj,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        transposed=transposed,
        interleaved=interleaved,
        gated=act.gated,
    )
    if hidden_states.shape[1] != H:
        raise ValueError(f"hidden_states: expected hidden size {H} (from gate_up_proj), got {hidden_states.shape[1]}")
    if hidden_states.dtype != gate_up_proj.dtype:
        raise TypeError(
            f"hidden_states: expected dtype {gate_up_proj.dtype} (as the expert weights), got {hidden_states.dtype}"
        )
    try:
        W = jax.lax.axis_size(axis_name)
    except NameError as ex:
        raise ValueError(
            f"axis_name: {axis_name!r} is not a mesh axis here (call ep_experts inside jax.shard_map over it)"
        ) from ex
    E = E_l * W
    check_topk(topk_ids, topk_weights, hidden_states.shape[0], E, drop_invalid)
    N1 = gate_up_proj.shape[2] if transposed else gate_up_proj.shape[1]
    factors, scales = lora_views(lora, E_l, (N1, H), (H, I), gate_up_proj.dtype)
    spec = FFNSpec(
        activation=act,
        interleaved=bool(interleaved),
        transposed=bool(transposed),
        drop_invalid=True,
        num_experts=E_l,
        recipe=recipe,
        lora_scales=scales,
    )
    ids = topk_ids.astype(jnp.int32)
    w = topk_weights.astype(hidden_states.dtype)
    w = jnp.where(invalid_ids(ids, E), 0 if drop_invalid else jnp.nan, w)
    weights = (gate_up_proj, gate_up_bias, down_proj, down_bias, factors)
    if exchange == "all_to_all":
        pairs, sent = _dense_exchange(hidden_states, ids, weights, spec, axis_name, W, custom_vjp)
    else:
        pairs, sent = _ragged_exchange(hidden_states, ids, weights, spec, axis_name, W, align, custom_vjp)
    # a valid pair that found no room (a repeated id) makes its token's row NaN
    w = jnp.where(sent | invalid_ids(ids, E), w, jnp.nan)
    return weighted_sum(pairs, w)


def block_rows(num_tokens: int, top_k: int, local_experts: int) -> int:
    """C: the rows one device sends another at most, ``T * min(K, E_l)``."""
    return num_tokens * min(top_k, local_experts)


def _dense_exchange(x, ids, weights, spec: FFNSpec, axis_name: str, W: int, custom_vjp: bool):
    """``all_to_all`` of ``[W, C, H]`` blocks: returns the pairs' expert outputs ``[T, K, H]`` (zero where
    not sent) and which valid pairs were sent ``[T, K]``."""
    T, K = ids.shape
    H, E_l = x.shape[1], spec.num_experts
    N, C = T * K, block_rows(T, K, spec.num_experts)
    plan = plan_unchecked(ids, E_l * W)  # the pairs sorted by global expert: by destination, then local expert
    dest_start = plan.expert_offsets[::E_l]  # [W + 1]: each destination's first sorted pair
    slots = jnp.arange(C, dtype=jnp.int32)
    filled = slots[None, :] < jnp.diff(dest_start)[:, None]  # [W, C]
    pair = plan.sort_order[jnp.clip(dest_start[:W, None] + slots[None, :], 0, max(N - 1, 0))]  # [W, C]
    flat_ids = ids.reshape(-1)
    send_x = jnp.where(filled[..., None], x[pair // K], 0)
    send_local = jnp.where(filled, flat_ids[pair] - jnp.arange(W, dtype=jnp.int32)[:, None] * E_l, E_l)
    recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0)  # [W, C, H]: block s came from device s
    recv_local = jax.lax.all_to_all(send_local, axis_name, 0, 0)
    ones = jnp.ones((W * C, 1), x.dtype)
    up, b_up, down, b_down, lora = weights
    y = routed_ffn(
        spec, custom_vjp, recv_x.reshape(W * C, H), recv_local.reshape(W * C, 1), ones, up, b_up, down, b_down, lora
    )
    back = jax.lax.all_to_all(y.reshape(W, C, H), axis_name, 0, 0).reshape(W * C, H)
    valid = plan.valid
    dest = jnp.where(valid, flat_ids // E_l, 0)
    slot = plan.pair_rows - dest_start[dest]  # the pair's place in its destination's block
    sent = valid & (slot < C)
    row = jnp.where(sent, dest * C + slot, W * C)  # row W * C: the zero row
    back = jnp.concatenate([back, jnp.zeros((1, H), back.dtype)])
    return back[row].reshape(T, K, H), sent.reshape(T, K)


def _ragged_exchange(x, ids, weights, spec: FFNSpec, axis_name: str, W: int, align: int, custom_vjp: bool):
    """``ragged_all_to_all`` of the routed rows only (module docstring): returns as :func:`_dense_exchange`."""
    T, K = ids.shape
    H, E_l = x.shape[1], spec.num_experts
    E, N, C = E_l * W, T * K, block_rows(T, K, spec.num_experts)
    me = jax.lax.axis_index(axis_name)
    plan = plan_unchecked(ids, E)
    sorted_x = x[plan.sort_order // K]  # [N, H], expert-major (invalid pairs at the tail, never sent)
    counts = jax.lax.all_gather(plan.tokens_per_expert, axis_name)  # [W, E]: source s's pairs per expert
    sizes = _clip_blocks(counts, W, E_l, C)  # [W, E]: what source s sends of expert e (C rows per block at most)
    total = sizes.sum(0)  # [E] rows each expert receives
    padded = ((total + align - 1) // align * align).reshape(W, E_l)
    base = (jnp.cumsum(padded, axis=1) - padded).reshape(E)  # expert e's first row on its device
    prefix = jnp.cumsum(sizes, axis=0) - sizes  # [W, E]: rows of e from the sources before s
    src_offsets = jnp.cumsum(counts, axis=1) - counts  # [W, E]: expert e's first row in source s's sorted rows
    num_rows = -(-(W * C + E_l * (align - 1)) // align) * align  # worst case, alignment padding included
    local = me * E_l + jnp.arange(E_l, dtype=jnp.int32)  # my experts' global ids

    # dispatch: slice e of my sorted rows to device e // E_l, at its rows for (expert e, source me);
    # combine: the rows of (my expert l, source s) back to source s, where its sorted rows of l start
    dispatch = (plan.expert_offsets[:E], sizes[me], base + prefix[me], sizes[:, local].reshape(W * E_l))
    combine = (
        (base[local] + prefix[:, local]).reshape(W * E_l),
        sizes[:, local].reshape(W * E_l),
        src_offsets[:, local].reshape(W * E_l),
        sizes[me],
    )
    recv = _exchange(sorted_x, num_rows, dispatch, combine, axis_name)
    # the local experts through the same routed FFN as the dense exchange (its custom VJP when asked): the
    # receive buffer's rows are expert-major already; rows past the last expert's carry the id E_l (dropped)
    group_ends = jnp.cumsum(padded[me])
    row_experts = jnp.searchsorted(group_ends, jnp.arange(num_rows, dtype=jnp.int32), side="right").astype(jnp.int32)
    up, b_up, down, b_down, lora = weights
    y = routed_ffn(
        spec, custom_vjp, recv, row_experts[:, None], jnp.ones((num_rows, 1), x.dtype), up, b_up, down, b_down, lora
    )
    back = _exchange(y, N, combine, dispatch, axis_name)
    flat_ids = ids.reshape(-1)
    rank = plan.pair_rows - plan.expert_offsets[jnp.where(plan.valid, flat_ids, 0)]  # place among its expert's pairs
    sent = plan.valid & (rank < sizes[me][jnp.where(plan.valid, flat_ids, 0)])
    pairs = jnp.where(sent[:, None], back[plan.pair_rows], 0)
    return pairs.reshape(T, K, H), sent.reshape(T, K)


def _exchange(operand, rows: int, there: tuple, back: tuple, axis_name: str):
    """``ragged_all_to_all`` of ``operand`` into ``rows`` zero rows by ``there`` (input offsets, send sizes,
    output offsets, receive sizes); its VJP sends the output's cotangent back by ``back``, the same
    slices in the other direction (rows no slice names get a zero gradient)."""
    return _ragged(operand, _receive_buffer(rows, operand, axis_name), there, back, axis_name)


def _receive_buffer(rows: int, like, axis_name: str):
    """``[rows, *like.shape[1:]]`` zeros in ``like``'s dtype for a ``ragged_all_to_all`` to write into, typed
    as varying over ``axis_name``: the collective's result takes the type of this operand (jax's abstract
    evaluation copies its aval), and a result typed invariant, though it differs per device, reaches the
    backward of ``jax.grad`` over the ``shard_map`` from one device only (the wrong gradients on GPUs of
    jax 0.11, 2026-11-27; the CPU tests' emulated collective checks the typing)."""
    return jax.lax.pcast(jnp.zeros((rows, *like.shape[1:]), like.dtype), axis_name, to="varying")


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged(operand, output, there, back, axis_name):
    return ragged_all_to_all(operand, output, *there, axis_name=axis_name)


def _ragged_fwd(operand, output, there, back, axis_name):
    return _ragged(operand, output, there, back, axis_name), (operand.shape[0], output.shape, there, back)


def _ragged_bwd(axis_name, res, g):
    rows, out_shape, there, back = res
    d_operand = ragged_all_to_all(g, _receive_buffer(rows, g, axis_name), *back, axis_name=axis_name)
    d_output = jax.lax.pcast(jnp.zeros(out_shape, g.dtype), axis_name, to="varying")  # zeros: nothing to pass on
    return (
        d_operand,
        d_output,
        tuple(jnp.zeros(a.shape, jax.dtypes.float0) for a in there),
        tuple(jnp.zeros(a.shape, jax.dtypes.float0) for a in back),
    )


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def _clip_blocks(counts, W: int, E_l: int, C: int):
    """``counts [W, E]`` clipped so that no source sends more than ``C`` rows to one device (the
    excess only with repeated ids), the lower local experts first; every device computes the same."""
    c = counts.reshape(W, W, E_l)  # [source, destination, local expert]
    before = jnp.cumsum(c, axis=2) - c
    return jnp.clip(c, 0, jnp.maximum(C - before, 0)).reshape(W, W * E_l)


@dataclass(frozen=True)
class EPExperts:
    """The experts call of an expert-parallel :class:`moeyard.jax.MoE` (``layer.expert_parallel``): the
    signature of :func:`moeyard.jax.experts`, running :func:`ep_experts` over ``axis_name``."""

    axis_name: str = "ep"
    exchange: str = "all_to_all"
    align: int = 1

    def __call__(self, hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj, **kwargs):
        return ep_experts(
            hidden_states,
            topk_ids,
            topk_weights,
            gate_up_proj,
            down_proj,
            axis_name=self.axis_name,
            exchange=self.exchange,
            align=self.align,
            **kwargs,
        )


def expert_parallel(layer, *, axis_name: str = "ep", exchange: str = "all_to_all", align: int = 1):
    """Make ``layer`` (a :class:`moeyard.jax.MoE`) run its experts with :func:`ep_experts` over
    ``axis_name``; returns ``layer`` (changed in place: only its experts call). Call it then inside
    ``jax.shard_map`` with :func:`partition_specs`, or through :func:`ep_apply`.

    Raises:
        TypeError: ``layer`` is not a moeyard.jax.MoE. ValueError: unknown ``exchange``, bad ``align``.
    """
    from .layer import MoE

    if not isinstance(layer, MoE):
        raise TypeError(f"layer: expected a moeyard.jax.MoE, got {type(layer).__name__}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align: expected a positive int, got {align!r}")
    layer.expert_parallel = EPExperts(axis_name=axis_name, exchange=exchange, align=align)
    return layer


def _names(path) -> tuple:
    """A state path's keys as plain values (``("lora", "down_proj", "lora_B", "weight", ...)``)."""
    return tuple(getattr(p, "key", getattr(p, "name", getattr(p, "idx", None))) for p in path)


def _is_lora_b(path) -> bool:
    names = _names(path)
    return len(names) >= 4 and names[0] == "lora" and names[2] == "lora_B"


def partition_specs(state, axis_name: str = "ep"):
    """``PartitionSpec``s for a layer's state (``nnx.state(layer)`` or one of ``nnx.split``'s states):
    ``P(axis_name)`` for the routed experts' weights and biases (split on their expert dimension) and for
    the LoRA adapters' ``lora_A [r*E, in]`` (rows expert-major), ``P(None, axis_name)`` for their ``lora_B
    [out, r*E]`` once its columns are grouped by device (:func:`lora_columns_by_device`), ``P()``
    (replicated) for everything else."""

    def spec(path, _):
        names = _names(path)
        if names and names[0] == "lora":
            return P(None, axis_name) if _is_lora_b(path) else P(axis_name)
        return P(axis_name) if names and names[0] in EXPERT_PARAMS else P()

    return jax.tree_util.tree_map_with_path(spec, state)


def lora_columns_by_device(state, num_devices: int, num_experts: int):
    """``state`` with each LoRA ``lora_B [out, r*E]`` (columns rank-major over all E experts, PEFT's layout) laid
    out with its columns grouped by device (W = ``num_devices``, E = ``num_experts``), ``[out, W, r, E_l]``
    flattened: each device's slice of the columns (:func:`partition_specs`) is then ``[out, r*E_l]``,
    rank-major over its own experts, the layout :func:`ep_experts` takes (and
    :func:`moeyard.parallel.lora.shard_factors` gives a PyTorch rank). A permutation, differentiable
    (gradients come back in PEFT's layout); everything else as is."""
    E_l = num_experts // num_devices

    def relayout(path, v):
        if not _is_lora_b(path):
            return v
        out, rE = v.shape
        return v.reshape(out, -1, num_devices, E_l).transpose(0, 2, 1, 3).reshape(out, rE)

    return jax.tree_util.tree_map_with_path(relayout, state)


def ep_apply(layer, x, *, mesh, axis_name: str = "ep"):
    """Run an expert-parallel :class:`moeyard.jax.MoE` (:func:`expert_parallel`) on the global tokens
    ``x [T, H]`` under ``jax.shard_map`` over ``mesh``'s ``axis_name``: ``x`` split into W equal
    shards, the experts (and their LoRA adapters' factors, :func:`lora_columns_by_device`) into W blocks,
    the rest replicated. Returns ``(y [T, H], aux_loss)``, the loss
    the mean of the W shards' losses (each from its own tokens, as on the PyTorch side). Differentiable
    (inside ``nnx.grad`` / ``jax.grad``): the replicated parameters get the sum of the shards' gradients.
    The router's jitter draws the same key on every shard and does not advance the layer's stream.

    Raises:
        ValueError: T or E not a multiple of the axis size, or the layer is not expert parallel.
    """
    from flax import nnx

    if getattr(layer, "expert_parallel", None) is None or layer.expert_parallel.axis_name != axis_name:
        raise ValueError(f"layer: expected expert_parallel(layer, axis_name={axis_name!r}) first")
    W = mesh.shape[axis_name]
    E = layer.config.num_experts
    if E % W or x.shape[0] % W:
        raise ValueError(
            f"mesh: axis {axis_name!r} of size {W} must divide num_experts={E} and the {x.shape[0]} tokens"
        )
    graphdef, state = nnx.split(layer)
    state = lora_columns_by_device(state, W, E)  # each device's lora_B columns: its experts' (local layout)

    def body(state, x):
        m = nnx.merge(graphdef, state, copy=True)
        y, aux = m(x, return_aux_loss=True)
        return y, jax.lax.pmean(aux, axis_name)

    specs = partition_specs(state, axis_name)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis_name)), out_specs=(P(axis_name), P()))(state, x)
