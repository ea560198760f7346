"""One forward + backward of the ``triton`` backend at qwen3-30b-a3b, bracketed for Nsight Compute.

Autotunes and warms up first (outside the profiled range), then runs one step between
``cudaProfilerStart`` / ``cudaProfilerStop``. On the GPU machine (repository root):

  ncu --profile-from-start off --clock-control none -k regex:"up_kernel|dh_kernel|wgrad_kernel|down_kernel" \\
      --section SpeedOfLight --section WarpStateStats --section Occupancy python3 benchmarks/ncu_step.py

(``PYTHONPATH=src``.) Shapes and inputs as ``benchmarks/triton_profile.py``.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moeyard  # noqa: E402
import triton_profile as tp  # noqa: E402


def main():
    s = tp.Shape.of("qwen3-30b-a3b")
    x, w_up, w_down, tw, ids, dout = tp.make_inputs(s, 0)
    leaves = [t.detach().requires_grad_() for t in (x, w_up, w_down, tw)]

    def step():
        out = moeyard.experts(leaves[0], ids, leaves[3], leaves[1], leaves[2], backend="triton")
        torch.autograd.grad(out, leaves, dout)

    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
