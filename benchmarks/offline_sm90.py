"""Compile the ``triton`` backend's kernels for Hopper (sm_90a) on a machine without a GPU, and report
each autotune config's registers, spills and shared memory as ptxas allocated them.

    PYTHONPATH=src python benchmarks/offline_sm90.py [--shape T,H,I,E,K] [--lora R] [--modes split fused]
                                                     [--kernels up,down,dh,...] [--loops] [--json out.json]

How: the backend's Python path runs forward + backward on CPU tensors of the real dtype (bf16) with
every kernel launch recorded instead of executed (outputs are left uninitialised), then each recorded
launch is compiled with ``JITFunction.warmup`` once per config of its autotune list, against a stand-in
Triton driver whose target is ``cuda:90`` (no CUDA needed: Triton ships ptxas). Arguments are
specialised exactly as a real launch would be (16-byte alignment of the CPU tensors' pointers,
divisibility of the integer arguments). ``cuobjdump -res-usage`` reads REG (registers per thread),
STACK (the per-thread stack frame, where spilled registers go) from the cubin, and the dynamic shared
memory from the kernel's ``metadata.shared``; next to them, the estimates of
:mod:`moeyard.experts.triton.tuning` and whether its pruner keeps the config. ``--loops`` adds, from
the disassembly (``nvdisasm``), the main loop's instructions, tensor-core MMAs, global loads and 64-bit
divisions per K step: what each step issues besides its MMAs.

Caveat: the installed Triton may differ from the GPU machine's (here 3.9 vs 3.6 there); code
generation, and so registers and spills, can differ between versions. Treat the numbers as a check of
the estimates, to be confirmed with the compiled kernels' ``n_regs``/``n_spills`` on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

SMEM_LIMIT = 232448  # bytes: sm_90 opt-in shared memory per block (227 KiB)


class _OfflineDriver(DriverBase):
    """A Triton driver that compiles for ``cuda:90`` and launches nothing."""

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("offline: nothing can be timed")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def set_current_device(self, device):
        pass


class Launch:
    """One recorded launch: the tuned launcher's name, kernel, config list, estimate kind
    (``tuning.KINDS``; None for untuned kernels) and arguments."""

    def __init__(self, name, kernel, configs, args, kwargs, kind=None):
        self.name, self.kernel, self.configs, self.args, self.kwargs = name, kernel, configs, args, kwargs
        self.kind = kind

    def named(self) -> dict:
        """The arguments by name, as the autotuner's ``early_config_prune`` sees them."""
        return {**dict(zip(self.kernel.arg_names, self.args, strict=False)), **self.kwargs}  # the rest are in kwargs


class _Recorder:
    """Stands in for ``schedule.tuned(...)``: records ``launcher[grid](*args, **kwargs)``."""

    def __init__(self, name, kernel, configs, kind, sink):
        self.name, self.kernel, self.configs, self.kind, self.sink = name, kernel, configs, kind, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(Launch(self.name, self.kernel, self.configs, args, kwargs, self.kind))

        return launch


@contextmanager
def recording(sink: list):
    """Inside: the backend's tuned launchers record their launches into ``sink``."""
    from moeyard.experts.triton import ops, schedule

    names = {id(c): n for n, c in vars(schedule).items() if n.endswith("_CONFIGS")}
    real_tuned = schedule.tuned

    def fake_tuned(kernel, configs, key, kind=None, **_):
        return _Recorder(names.get(id(configs), kernel.fn.__name__), kernel, configs, kind, sink)

    real_run = triton.runtime.jit.JITFunction.run

    def direct_run(self, *args, grid, warmup, **kwargs):  # kernels launched without autotuning
        if warmup:
            return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        sink.append(Launch(self.fn.__name__, self, [], args, kwargs))

    saved = dict(ops._LAUNCHERS)
    ops._LAUNCHERS.clear()
    ops.tuned = schedule.tuned = fake_tuned
    triton.runtime.jit.JITFunction.run = direct_run
    try:
        yield
    finally:
        triton.runtime.jit.JITFunction.run = real_run
        ops.tuned = schedule.tuned = real_tuned
        ops._LAUNCHERS.clear()
        ops._LAUNCHERS.update(saved)


def record_step(T, H, I, E, K, dtype, lora_rank, lora_mode, tma=True, bias=False, tma_wgrad=True) -> list[Launch]:
    """Launches of one forward + backward (base weights trainable, or frozen with LoRA; ``bias``: with
    both projections' biases); ``tma``, ``tma_wgrad``: the backend's options (the CPU tensors count as a
    Hopper device for them)."""
    from moeyard.activations import get_activation
    from moeyard.experts import ExpertLoRA, expert_weights
    from moeyard.experts.triton import ops, options
    from moeyard.experts.triton.function import triton_experts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).to(dtype).requires_grad_()
    up = torch.randn(E, 2 * I, H, generator=g).to(dtype)
    down = torch.randn(E, H, I, generator=g).to(dtype)
    lora = None
    if lora_rank:
        r = lora_rank
        lora = {
            "gate_up_proj": ExpertLoRA(
                lora_A=torch.randn(r * E, H).to(dtype).requires_grad_(),
                lora_B=torch.randn(2 * I, r * E).to(dtype).requires_grad_(),
                scaling=2.0,
            ),
            "down_proj": ExpertLoRA(
                lora_A=torch.randn(r * E, I).to(dtype).requires_grad_(),
                lora_B=torch.randn(H, r * E).to(dtype).requires_grad_(),
                scaling=2.0,
            ),
        }
    else:
        up.requires_grad_()
        down.requires_grad_()
    biases = {}
    if bias:
        biases = dict(
            gate_up_bias=torch.randn(E, 2 * I, generator=g).to(dtype).requires_grad_(lora is None),
            down_bias=torch.randn(E, H, generator=g).to(dtype).requires_grad_(lora is None),
        )
    weights = expert_weights(up, down, lora=lora, **biases)
    sink: list[Launch] = []
    real_device = ops._tma_device
    ops._tma_device = lambda t: True
    try:
        with recording(sink), options.use_options(lora_mode=lora_mode, tma=tma, tma_wgrad=tma_wgrad):
            out = triton_experts(x, ids, w, weights, get_activation("swiglu"))
            out.backward(torch.randn_like(out))
    finally:
        ops._tma_device = real_device
    return sink


def res_usage(cubin: bytes) -> dict:
    """REG / STACK / LOCAL / SHARED of the cubin's kernel (``cuobjdump -res-usage``); spilled
    registers live in the STACK frame."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|LOCAL|SHARED|STACK):(\d+)", text)}


def disassemble(cubin: bytes) -> str:
    """The cubin's SASS (``nvdisasm -c``, shipped with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/")


def mma_loop(sass: str) -> dict | None:
    """The main loop of ``sass``: of the spans closed by a conditional backward branch that issue
    tensor-core MMAs (``HGMMA`` / ``HMMA``), the innermost (None if none): its
    instruction count, MMA count, global loads (``LDG``: what a step waits for when used at once) and
    64-bit integer divisions (``I2F.U32.RP`` starts each one's fast path). The instructions per MMA
    tell how much else every K step issues. In a persistent kernel the span holds the epilogue too."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"@!?P\d\s+BRA `\((\.L_x_\d+)\)", line)  # a loop's conditional back edge
        if not (m and labels.get(m.group(1), i) < i):
            continue
        body = [b for b in lines[labels[m.group(1)] : i + 1] if _INSTR.search(b)]
        mma = sum(" HGMMA" in b or " HMMA" in b for b in body)
        if mma:
            loops.append(
                dict(
                    instructions=len(body),
                    mma=mma,
                    ldg=sum(re.search(r"\sLDG\.", b) is not None for b in body),
                    div64=sum("I2F.U32.RP" in b for b in body),
                )
            )
    # (unconditional back jumps, from the barrier-wait retry blocks placed after the kernel's body, are
    # not loops of their own); of several loops, the innermost
    return min(loops, key=lambda d: d["instructions"], default=None)


def compile_config(launch: Launch, config, loops: bool = False) -> dict:
    """Compile ``launch`` with ``config`` (a ``triton.Config``) for sm_90a; its resource usage (and with
    ``loops`` its main loop's instruction counts, :func:`mma_loop`)."""
    meta = dict(launch.kwargs)
    if config is not None:
        meta.update(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    kernel = launch.kernel.warmup(*launch.args, grid=(1,), **meta)
    usage = res_usage(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    row = {**usage, "dynamic_smem": kernel.metadata.shared, "tma": "cp.async.bulk.tensor" in ptx}
    if loops:
        loop = mma_loop(disassemble(kernel.asm["cubin"]))
        if loop:
            row["loop"] = loop
    if config is not None and launch.kind is not None:
        from moeyard.experts.triton import tuning

        smem, regs, kept = tuning.fits(config, tuning.launch_of(launch.kind, launch.named()), SMEM_LIMIT)
        row.update(est_regs=regs, est_smem=smem, kept=kept)
    return row


def label(config) -> str:
    if config is None:
        return "(as launched)"
    k = config.kwargs
    return f"{k['BM']}x{k['BN']}x{k['BK']} w{config.num_warps} s{config.num_stages}" + (
        " P" if k.get("PERSISTENT") else ""
    )


def unique(launches: list[Launch]) -> list[Launch]:
    """One launch per (launcher, compile-time variant): constexpr keyword arguments tell them apart."""
    seen, out = set(), []
    for launch in launches:
        key = (launch.name, tuple(sorted((k, repr(v)) for k, v in launch.kwargs.items())))
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="256,2048,768,128,8", help="T,H,I,E,K (T only sets the recorded step's size)")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank on both projections, base frozen")
    p.add_argument("--modes", nargs="+", default=["split"], choices=["split", "fused"], help="LoRA modes")
    p.add_argument("--kernels", help="comma-separated launcher names to compile (default: all recorded)")
    p.add_argument("--bias", action="store_true", help="both projections with biases")
    p.add_argument("--pointer", action="store_true", help="no TMA loads (options tma and tma_wgrad off)")
    p.add_argument(
        "--loops",
        action="store_true",
        help="also disassemble each kernel and count its main loop's instructions per MMA",
    )
    p.add_argument("--json", help="write the rows as JSON here")
    args = p.parse_args(argv)
    T, H, I, E, K = (int(v) for v in args.shape.split(","))
    driver.set_active(_OfflineDriver())
    rows = []
    for mode in args.modes if args.lora else ["split"]:
        launches = unique(
            record_step(T, H, I, E, K, torch.bfloat16, args.lora, mode, not args.pointer, args.bias, not args.pointer)
        )
        for launch in launches:
            if args.kernels and launch.name not in args.kernels.split(","):
                continue
            for config in launch.configs or [None]:
                row = {
                    "mode": mode if args.lora else "-",
                    "launcher": launch.name,
                    "kernel": launch.kernel.fn.__name__,
                    "config": label(config),
                }
                try:
                    row.update(compile_config(launch, config, args.loops))
                    row["fits"] = row["dynamic_smem"] <= SMEM_LIMIT
                except Exception as ex:  # a config that does not compile is a row, not a crash
                    row["error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:120] if str(ex) else ''}"
                rows.append(row)
                print(_line(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _line(r: dict) -> str:
    head = f"{r['mode']:6s} {r['launcher']:22s} {r['config']:25s}"
    if "error" in r:
        return f"{head} error {r['error']}"
    est = (
        (
            f"  | estimate regs {r['est_regs']:3d} smem {r['est_smem'] / 1024:6.1f} KiB "
            f"{'kept' if r['kept'] else 'pruned'}"
        )
        if "est_regs" in r
        else ""
    )
    lowered = " TMA" if r.get("tma") else ""
    loop = r.get("loop")
    loop = (
        f"  | loop {loop['instructions']} instr / {loop['mma']} MMA, {loop['ldg']} LDG, {loop['div64']} div64"
        if loop
        else ""
    )
    return (
        f"{head} regs {r['reg']:3d}  stack {r.get('stack', 0):5d} B  smem {r['dynamic_smem'] / 1024:6.1f} KiB"
        f"{'' if r['fits'] else ' (over 227 KiB)'}{lowered}{est}{loop}"
    )


if __name__ == "__main__":
    sys.exit(main())
