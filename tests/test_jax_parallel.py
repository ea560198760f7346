"""moeyard.jax expert parallelism on 4 and 8 simulated CPU devices equals one device: outputs and every
gradient, both exchanges (``ragged_all_to_all`` through an emulation of the collective, which XLA:CPU
lacks), an FP8 recipe on the local experts, LoRA adapters (each device its experts' factors), the layer
through ``ep_apply``, skewed routing, sentinel ids,
repeated ids. The checks run in a
subprocess (``jax_ep_worker.py``): the CPU device count is fixed when JAX starts."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import moeyard.jax as mj  # noqa: E402
from moeyard import MoEConfig  # noqa: E402

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def worker():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "..", "src"), HERE, os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("XLA_FLAGS", None)
    run = subprocess.run(
        [sys.executable, os.path.join(HERE, "jax_ep_worker.py")], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


CHECKS = [
    "emulation",
    "all_to_all_W8",
    "ragged_W8_align4",
    "all_to_all_W4_plain_autodiff_drop",
    "ragged_W4_drop",
    "all_to_all_W4_mxfp8",
    "all_to_all_W4_lora",
    "ragged_W8_lora_mxfp8",
    "layer_all_to_all_W4",
    "layer_ragged_W8",
    "layer_all_to_all_W4_lora",
]


@pytest.mark.parametrize("check", CHECKS)
def test_expert_parallel_equals_one_device(worker, check):
    """float64: the largest difference of output, gradients (and the layer's aux loss) is rounding only."""
    assert worker[check] <= 1e-10, (check, worker[check])


def test_ragged_exchange_runs_the_real_primitive(worker):
    # the emulated collective is the CPU lowering of JAX's own primitive, so its result is typed as on a GPU:
    # a receive buffer typed invariant had given wrong gradients there (forward right), and fails here
    assert worker["emulated_as"] == "lowering"


def test_repeated_ids_give_nan_rows(worker):
    """The pairs that find no room come back as NaN rows of their tokens (2 here), the rest exact."""
    assert worker["overflow_nan_rows"] == 2 and worker["overflow_others"] <= 1e-12


def test_bad_arguments():
    cfg = MoEConfig(num_experts=4, hidden_size=8, intermediate_size=4, top_k=2)
    layer = mj.MoE(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="^exchange"):
        mj.expert_parallel(layer, exchange="nccl")
    with pytest.raises(ValueError, match="^align"):
        mj.expert_parallel(layer, align=0)
    with pytest.raises(TypeError, match="^layer"):
        mj.expert_parallel(object())
    with pytest.raises(ValueError, match="^layer"):
        mj.ep_apply(layer, jnp.ones((4, 8)), mesh=None)
    x, ids, w = jnp.ones((3, 8)), jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2))
    with pytest.raises(ValueError, match="^axis_name"):  # outside shard_map
        mj.ep_experts(x, ids, w, layer.gate_up_proj[...], layer.down_proj[...], axis_name="ep")
    with pytest.raises(ValueError, match="^exchange"):
        mj.ep_experts(x, ids, w, layer.gate_up_proj[...], layer.down_proj[...], axis_name="ep", exchange="x")
