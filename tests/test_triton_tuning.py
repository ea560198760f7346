"""Shared-memory and register estimates of the triton backend's tile configs, and the pruning by them
(pure Python: nothing is compiled)."""

import warnings

import pytest
import torch
import triton

from moeyard.experts.triton import schedule, tuning
from moeyard.experts.triton.tuning import LORA_FUSED, LORA_SPLIT, Launch, registers, smem_bytes

LIMIT = tuning.SMEM_OPTIN_HOPPER


def cfg(bm, bn, bk, warps, stages):
    return triton.Config(dict(BM=bm, BN=bn, BK=bk), num_warps=warps, num_stages=stages)


def test_gemm_estimates_by_hand():
    c = cfg(128, 128, 64, 8, 4)
    down = Launch(kind="down")
    # 4 stages x (A 128x64 + B 64x128) x 2 bytes
    assert smem_bytes(c, down) == 4 * (128 * 64 + 64 * 128) * 2 == 131072
    # accumulator 128*128/256 = 64; pointers: A and B 128*64*2 bytes / 16 / 256 threads * 2 regs = 8 each
    assert registers(c, down) == 64 + 8 + 8 + tuning.OVERHEAD
    up = Launch(kind="up", dual=True)
    assert smem_bytes(cfg(128, 128, 64, 8, 3), up) == 3 * (128 * 64 + 2 * 64 * 128) * 2
    assert registers(c, up) == 2 * 64 + 8 + 2 * 8 + tuning.OVERHEAD


def test_fused_lora_estimates_by_hand():
    c = cfg(128, 128, 64, 8, 4)
    fused = Launch(kind="down", lora=LORA_FUSED, rank=16)
    # plus La [BK=64, RP=16] per stage
    assert smem_bytes(c, fused) == 131072 + 4 * 64 * 16 * 2
    # plus acc_z 128*16/256 = 8 counted 3 times and La's pointers 2*64*16*2/(16*256) = 0.5 (rounded up)
    assert tuning.FUSED_Z_FACTOR == 3
    assert registers(c, fused) == 64 + 8 + 8 + 24 + 1 + tuning.OVERHEAD
    # split: the main loop is unchanged; the epilogue holds acc 64 + z 128*64/256 * (1 + 2/4) = 48
    # + Lb [64, 128] bf16 64*128/2/256 = 16
    split64 = Launch(kind="down", lora=LORA_SPLIT, rank=64)
    assert smem_bytes(c, split64) == 131072
    assert registers(c, split64) == 64 + 48 + 16 + tuning.OVERHEAD


def test_wgrad_estimates_by_hand():
    c = cfg(64, 256, 128, 8, 4)
    w = Launch(kind="wgrad")
    assert smem_bytes(c, w) == 4 * (64 * 256 + 64 * 128) * 2
    # acc [BN, BK] 256*128/256 = 128; L^T pointers 2*256*64*2/4096 = 16, R 2*64*128*2/4096 = 8
    assert registers(c, w) == 128 + 16 + 8 + tuning.OVERHEAD
    # the bias gradient reads L into registers: 256*64 elements * (2/4 + 1) / 256 + 256/256
    assert registers(c, Launch(kind="wgrad", has_db=True)) == 128 + 16 + 8 + 96 + 1 + tuning.OVERHEAD


@pytest.mark.parametrize(
    "kind,lora", [("down", 0), ("down", LORA_FUSED), ("up", LORA_FUSED), ("dh", LORA_SPLIT), ("wgrad", 0)]
)
def test_float32_doubles_shared_memory(kind, lora):
    c = cfg(64, 128, 64, 4, 3)
    rank = 32 if lora else 0
    half = Launch(kind=kind, lora=lora, rank=rank, dual=kind == "up")
    full = Launch(kind=kind, lora=lora, rank=rank, dual=kind == "up", a_bytes=4, b_bytes=4, lora_bytes=4)
    assert smem_bytes(c, full) == 2 * smem_bytes(c, half)


def test_fused_rank_changes_the_estimates():
    c = cfg(128, 128, 64, 8, 3)
    regs = [registers(c, Launch(kind="down", lora=LORA_FUSED, rank=r)) for r in (16, 64, 128)]
    smem = [smem_bytes(c, Launch(kind="down", lora=LORA_FUSED, rank=r)) for r in (16, 64, 128)]
    assert regs[0] < regs[1] < regs[2] and smem[0] < smem[1] < smem[2]
    assert regs[0] > registers(c, Launch(kind="down"))


def test_prune_drops_over_limits_and_keeps_order():
    launch = Launch(kind="down")
    too_many_regs = cfg(256, 256, 64, 4, 2)  # accumulator alone 256*256/128 = 512 registers
    too_much_smem = cfg(128, 128, 64, 8, 8)  # 8 * 32 KiB = 256 KiB
    ok = [cfg(128, 128, 64, 8, 4), cfg(64, 128, 64, 4, 4), cfg(128, 256, 64, 8, 3)]
    assert registers(too_many_regs, launch) > 255 and smem_bytes(too_many_regs, launch) <= LIMIT
    assert smem_bytes(too_much_smem, launch) > LIMIT and registers(too_much_smem, launch) <= 255
    configs = [ok[0], too_many_regs, ok[1], too_much_smem, ok[2]]
    assert tuning.prune(configs, launch, LIMIT) == ok


def test_prune_register_file_per_block():
    # 16 warps: 65536 / 512 threads = 128 registers per thread at most
    c = cfg(128, 256, 64, 16, 3)  # accumulator 64, pointers 12: fits 255 but not 128 when fused at r = 128
    launch = Launch(kind="down", lora=LORA_FUSED, rank=128)
    assert tuning.register_limit(16) == 128 and 128 < registers(c, launch) <= 255
    assert tuning.prune([c, cfg(64, 64, 32, 8, 3)], launch, LIMIT) == [cfg(64, 64, 32, 8, 3)]


def test_prune_never_empty_and_warns_once(monkeypatch):
    monkeypatch.setattr(tuning, "_WARNED", set())
    launch = Launch(kind="down", a_bytes=4, b_bytes=4)
    configs = [cfg(256, 256, 128, 4, 4), cfg(128, 256, 128, 4, 4), cfg(256, 256, 64, 4, 4)]
    with pytest.warns(RuntimeWarning, match="keeping the smallest"):
        kept = tuning.prune(configs, launch, 1024)
    assert kept == [configs[1]]  # the fewest registers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.prune(configs, launch, 1024) == [configs[1]]
    with pytest.raises(ValueError, match="configs"):
        tuning.prune([], launch, LIMIT)


def test_pruner_reads_the_launch_from_its_arguments():
    launch = tuning.launch_of(
        "up",
        dict(
            x_ptr=torch.empty(0, dtype=torch.float32),
            w_ptr=torch.empty(0),
            la_ptr=torch.empty(0, dtype=torch.bfloat16),
            DUAL=True,
            LORA=2,
            RP=64,
        ),
    )
    assert launch == Launch(kind="up", dual=True, lora=LORA_FUSED, rank=64, a_bytes=4, b_bytes=4, lora_bytes=2)
    assert tuning.launch_of("down", dict(a_ptr="*bf16", w_ptr="*fp32", LORA=0, RP=16)) == Launch(kind="down", b_bytes=4)
    # the dh kernel's DUAL flag is a gated activation: one accumulator
    assert tuning.launch_of("dh", dict(DUAL=True, LORA=1, RP=32)) == Launch(kind="dh", lora=LORA_SPLIT, rank=32)
    fits, over = cfg(64, 128, 64, 4, 3), cfg(128, 128, 64, 8, 4)  # 160 KiB for float32 A and B: 320 KiB
    prune = tuning.pruner("down", lambda: LIMIT)
    f32 = torch.empty(0, dtype=torch.float32)
    assert prune([over, fits], dict(a_ptr=f32, w_ptr=f32), LORA=0) == [fits]
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    assert prune([over, fits], dict(a_ptr=bf16, w_ptr=bf16), LORA=0) == [over, fits]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="kind"):
        Launch(kind="gemm")
    with pytest.raises(ValueError, match="kind"):
        tuning.pruner("gemm", lambda: LIMIT)
    with pytest.raises(ValueError, match="lora"):
        Launch(kind="down", lora=3)
    with pytest.raises(ValueError, match="dual"):
        Launch(kind="dh", dual=True)
    with pytest.raises(ValueError, match="rank"):
        Launch(kind="down", lora=LORA_FUSED, rank=0)


def test_tuned_uses_the_pruner(monkeypatch):
    from moeyard.experts.triton import kernels_fwd

    monkeypatch.setattr(schedule, "interpreting", lambda: False)
    monkeypatch.setattr(schedule, "device_smem_limit", lambda: LIMIT)
    monkeypatch.delenv(schedule.ENV_AUTOTUNE, raising=False)
    tuner = schedule.tuned(kernels_fwd.down_kernel, schedule.GEMM_CONFIGS, ["KA"], "down")
    f32 = torch.empty(0, dtype=torch.float32)
    kept = tuner.early_config_prune(schedule.GEMM_CONFIGS, dict(a_ptr=f32, w_ptr=f32), LORA=0, RP=16)
    f32_launch = Launch(kind="down", a_bytes=4, b_bytes=4)
    assert kept == [c for c in schedule.GEMM_CONFIGS if tuning.fits(c, f32_launch, LIMIT)[2]]
    assert len(kept) < len(schedule.GEMM_CONFIGS)
    monkeypatch.setenv(schedule.ENV_AUTOTUNE, "0")
    assert schedule.tuned(kernels_fwd.down_kernel, schedule.GEMM_CONFIGS, ["KA"], "down").meta == schedule.FIXED


@pytest.mark.parametrize("rank", [0, 16, 64, 128])
@pytest.mark.parametrize("mode", [LORA_SPLIT, LORA_FUSED])
def test_every_list_keeps_a_config(rank, mode):
    """bf16 on H100/H200: each launcher keeps candidates without LoRA and with LoRA of every rank."""
    for _, configs, kind, gated, lora, rows in schedule._report_lists():
        if rank and not lora:
            continue
        launch = Launch(kind=kind, dual=gated, lora=mode if rank else 0, rank=rank, has_rows=rows)
        assert any(tuning.fits(c, launch, LIMIT)[2] for c in configs), (kind, rank, mode)


def test_report_lists_every_launcher():
    text = schedule.report()
    for title, _configs, *_ in schedule._report_lists():
        assert title in text
    assert "PRUNED" in text and "kept" in text and "r=128 f" in text


def test_row_product_configs_share_one_column_block():
    # ops.wgrad_rows allocates cdiv(NL, rows_block()) partials before the autotuner picks a config
    assert {c.kwargs["BN"] for c in schedule.ROWS_WGRAD_CONFIGS} == {schedule.ROWS_BN}


def test_row_product_estimates_by_hand():
    # the factor's [BN, BK] tile once, the [BM, BK] float32 product and its store pointers
    c = cfg(64, 256, 16, 4, 4)
    plain, rows = Launch(kind="wgrad"), Launch(kind="wgrad", has_rows=True)
    assert smem_bytes(c, rows) == smem_bytes(c, plain) + 256 * 16 * 2
    assert registers(c, rows) == registers(c, plain) + 64 * 16 // 128 + 2 * 64 * 16 * 4 // (16 * 128)
    assert tuning.launch_of("wgrad", dict(ROWS=True, l_ptr="*bf16", r_ptr="*bf16")).has_rows


def test_tma_estimates_by_hand():
    tma = Launch(kind="down_tma")
    c = cfg(128, 128, 64, 8, 4)
    # descriptor loads: no pointer registers; same staging as the pointer kernel
    assert registers(c, tma) == 64 + tuning.OVERHEAD
    assert smem_bytes(c, tma) == 4 * (128 * 64 + 64 * 128) * 2
    persistent = triton.Config(dict(BM=128, BN=256, BK=64, PERSISTENT=True), num_warps=8, num_stages=3)
    assert smem_bytes(persistent, tma) == 3 * (128 * 64 + 64 * 256) * 2 + 32768  # 176 KiB: as compiled, sm_90a
    assert all(tuning.fits(c, tma, LIMIT)[2] for c in schedule.TMA_CONFIGS)
    assert {c.kwargs["BM"] for c in schedule.TMA_CONFIGS} == {schedule.TMA_BM}  # one tile table for all


class _FakeAutotuner:
    """What :class:`schedule._Tuned` uses of ``triton.runtime.Autotuner``: ``arg_names``, ``run`` (tunes,
    sets ``best_config``), ``fn[grid](...)`` (launches with a config's kwargs, through :func:`moeyard.launch.run`,
    which takes a kernel that is not a JIT function, as this one, through its own ``[grid]``)."""

    def __init__(self):
        self.arg_names = ["x_ptr", "M", "N", "HAS_BIAS"]
        self.calls, self.best_config = [], None
        outer = self

        class Fn:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

            def run(self, *args, grid, warmup, **kwargs):
                outer.calls.append(("launch", args, kwargs))

        self.fn = Fn()

    def run(self, *args, grid, warmup, **kwargs):
        self.best_config = cfg(64, 64 + len(self.calls), 32, 4, 3)
        self.calls.append(("tune", args, kwargs))


def test_tuned_launcher_tunes_each_key_once():
    fake = _FakeAutotuner()
    launcher = schedule._Tuned(fake, ["M", "N"])
    f32, bf16 = torch.empty(4), torch.empty(4, dtype=torch.bfloat16)
    grid = (1,)
    launcher[grid](f32, 128, 256, HAS_BIAS=True)
    pick = fake.best_config
    launcher[grid](f32, 128, 256, HAS_BIAS=False)  # a constexpr outside the key: the same pick
    assert [c[0] for c in fake.calls] == ["tune", "launch"]
    assert fake.calls[1][2] == {"HAS_BIAS": False, **pick.all_kwargs()}
    launcher[grid](f32, 128, 512, HAS_BIAS=True)  # another key value
    launcher[grid](bf16, 128, 256, HAS_BIAS=True)  # another dtype
    assert [c[0] for c in fake.calls] == ["tune", "launch", "tune", "tune"]
    launcher[grid](bf16, 128, 256, HAS_BIAS=True)
    assert fake.calls[-1][0] == "launch" and fake.best_config == launcher.picks[((128, 256), (torch.bfloat16,), ())]
    assert launcher.arg_names is fake.arg_names  # other attributes are the autotuner's
