"""Worker functions for LoRA and QLoRA under expert parallelism (tests/test_parallel_lora.py), run in
spawned gloo processes (the plumbing and the oracles of ep_workers.py).

Every rank builds the same unsplit layer or model from one seed, runs every rank's tokens through it
(the single-process oracle), runs its own tokens through its expert-parallel copy, and compares:
outputs, input gradients, each LoRA factor's gradient against this rank's block of the oracle's
(``shard_factors``), replicated parameters' gradients summed over ranks.

Legend: W ranks, E experts, E_l = E / W, R the LoRA rank.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import moeyard
from ep_workers import LAYER_CONFIGS, TOL, check, check_err, make_layer, slices, summed
from moeyard.parallel import expert_parallel
from moeyard.parallel.lora import lora_state_dict, shard_factors, shard_lora

R = 2  # LoRA rank
ALPHA = 3.0


# ---------------------------------------------------------------- moeyard.MoE with adapters


def random_lora(m, seed: int) -> dict:
    """``m.add_lora(R)`` under ``torch.manual_seed(seed)`` (A as drawn), B redrawn from ``N(0, 0.3)`` on the
    unsplit layer so that A gets gradients; returns the global adapter state dict."""
    torch.manual_seed(seed)
    m.add_lora(R, alpha=ALPHA)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for a in m.lora.values():
            a.lora_B.weight.copy_(torch.randn(a.lora_B.weight.shape, generator=g, dtype=torch.float64) * 0.3)
    return {k: v.clone() for k, v in m.state_dict().items() if k.startswith("lora.")}


def factor_blocks(named: dict, E: int, rank: int, W: int) -> dict:
    """This rank's block of every global ``...lora_A...`` / ``...lora_B...`` entry of ``named``."""
    out = {}
    for k, A in named.items():
        if "lora_A" in k:
            kb = k.replace("lora_A", "lora_B")
            out[k], out[kb] = shard_factors(A, named[kb], R, E, rank, W)
    return out


def lora_results(m, x, dy) -> dict:
    """Output, input gradient and every trainable parameter's gradient of one step."""
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dy)
    res = {"out": y.detach(), "x": x.grad}
    res.update({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    return res


def lora_oracle(kw: dict, T_counts, x_all, dy_all, seed: int, recipe=None) -> tuple[dict, dict, object]:
    """The unsplit float64 layer with adapters (under ``recipe``) on every rank's tokens (one batch per rank,
    gradients accumulated): results, the global adapter state dict, the layer."""
    ref = make_layer(kw)
    ref.recipe = recipe
    sd = random_lora(ref, seed)
    parts = [lora_results(ref, x_all[slices(T_counts, r)], dy_all[slices(T_counts, r)]) for r in range(len(T_counts))]
    res = {k: torch.cat([p[k] for p in parts]) for k in ("out", "x")}
    res.update({n: p.grad for n, p in ref.named_parameters() if p.requires_grad})
    return res, sd, ref


def check_lora_layer(
    rank: int,
    W: int,
    *,
    mesh=None,
    dispatchers=("all_to_all", "sync_free", "all_gather"),
    after: bool = False,
    overlap_chunks: int = 1,
    backend: str = "loop",
    dtype=torch.float64,
    recipe=None,
) -> None:
    """``MoE.add_lora`` before (or ``after``) :func:`expert_parallel`, every config and dispatcher: each
    rank holds its block of the factors (PEFT's local layout, ``num_experts`` E_l); outputs, input
    gradients, every factor's gradient (this rank's block of the oracle's) and the router's and shared
    expert's (summed) against the oracle. After: the factors drawn equal the unsplit layer's, and the
    global state dict loads (each rank keeps its block). With ``recipe``, both layers' frozen base under
    that FP8 recipe (emulated), the adapters in the compute dtype: LoRA on an FP8 base under expert
    parallelism."""
    g = torch.Generator().manual_seed(31)
    T_counts = [3 + 2 * r for r in range(W)]
    if W > 2:
        T_counts[2] = 0
    for cname, kw in LAYER_CONFIGS.items():
        E, El = kw["num_experts"], kw["num_experts"] // W
        x_all = torch.randn(sum(T_counts), 8, generator=g, dtype=torch.float64)
        dy_all = torch.randn(x_all.shape, generator=g, dtype=torch.float64)
        oracle, sd, _ = lora_oracle(kw, T_counts, x_all, dy_all, seed=5, recipe=recipe)
        blocks = factor_blocks(sd, E, rank, W)
        grad_blocks = factor_blocks({k: v for k, v in oracle.items() if k.startswith("lora.")}, E, rank, W)
        sl = slices(T_counts, rank)
        for name in dispatchers:
            what = f"lora {cname}/{name}/{'after' if after else 'before'}/{backend}/overlap{overlap_chunks}/rank{rank}"
            what += f"/{recipe}" if recipe else ""
            m = make_layer(kw)
            m.recipe = recipe
            if not after:
                random_lora(m, seed=5)
            more = dict(max_tokens=max(T_counts)) if name == "sync_free" else {}
            expert_parallel(m, mesh, dispatcher=name, overlap_chunks=overlap_chunks, **more)
            if after:
                torch.manual_seed(5)
                m.add_lora(R, alpha=ALPHA)
                for k in blocks:
                    if "lora_A" in k:  # drawn as the unsplit layer draws them
                        check(torch.equal(m.state_dict()[k], blocks[k]), f"{what}: {k} as drawn")
                missing, unexpected = m.load_state_dict(sd, strict=False)
                check(not unexpected and all(not k.startswith("lora.") for k in missing), f"{what}: load {unexpected}")
            for k, want in blocks.items():
                check(torch.equal(m.state_dict()[k], want), f"{what}: {k} is this rank's block")
            check(all(a.num_experts == El for a in m.lora.values()), f"{what}: adapters cover E_l experts")
            m.backend = backend
            m.to(dtype)
            got = lora_results(m, x_all[sl].to(dtype), dy_all[sl].to(dtype))
            for k, v in got.items():
                if k in ("out", "x"):
                    ref = oracle[k][sl]
                elif k.startswith("lora."):
                    ref = grad_blocks[k]
                else:
                    v, ref = summed(v.to_local() if hasattr(v, "to_local") else v), oracle[k]
                check_err(f"{what}: {k}", v, ref, TOL[dtype])


def check_merge(rank: int, W: int, mesh=None) -> None:
    """``merge_lora`` on an expert-parallel layer folds this rank's factors into its weights: each rank's
    block of the unsplit layer's merged weights, and the same outputs."""
    kw = LAYER_CONFIGS["gpt_oss"]
    E, El = kw["num_experts"], kw["num_experts"] // W
    ref = make_layer(kw)
    random_lora(ref, seed=9)
    m = copy.deepcopy(ref)
    expert_parallel(m, mesh)
    ref.merge_lora()
    m.merge_lora()
    check(m.lora is None, "merge_lora drops the adapters")
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(m, name)
        w = w.to_local() if hasattr(w, "to_local") else w
        check_err(f"merge/rank{rank}: {name}", w, getattr(ref, name).detach()[rank * El : (rank + 1) * El], 1e-14)
    x = torch.randn(3 + rank, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    check_err(f"merge/rank{rank}: out", m(x).detach(), ref(x).detach(), 1e-12)
    del E


# ---------------------------------------------------------------- QLoRA: NF4 experts

QLORA_SIZES = (
    dict(hidden=8, intermediate=4, blocksize=32),  # 1-2 blocks per expert: scales stored decoded
    dict(hidden=128, intermediate=64, blocksize=32),
)  # 256 / 512 blocks per expert: nested scales sliced


def check_qlora(rank: int, W: int, *, before: bool, dispatcher: str, size: dict, mesh=None) -> None:
    """NF4 experts (``quantize_experts`` ``before`` or after :func:`expert_parallel`) with LoRA on top:
    each rank stores only its block's NF4 storage (E_l experts' bytes and scales, none of the others');
    outputs and every gradient against one process running the unsplit layer on the weights the ranks'
    storages dequantise to (gathered), float32."""
    from moeyard.quant import NF4Experts, quantize_experts

    kw = dict(LAYER_CONFIGS["qwen3"])
    E, El, H, I, bs = kw["num_experts"], kw["num_experts"] // W, size["hidden"], size["intermediate"], size["blocksize"]
    what = f"qlora/{'before' if before else 'after'}/{dispatcher}/H{H}/rank{rank}"
    m = make_layer(kw, hidden=H, intermediate=I).float()
    whole = {}
    if before:
        quantize_experts(m, "nf4", blocksize=bs)
        whole = {n: getattr(m, n) for n in ("gate_up_proj", "down_proj")}
    sd = random_lora(m, seed=3)
    T_counts = [4 + rank_ for rank_ in range(W)]
    more = dict(max_tokens=max(T_counts)) if dispatcher == "sync_free" else {}
    expert_parallel(m, mesh, dispatcher=dispatcher, **more)
    if not before:
        quantize_experts(m, "nf4", blocksize=bs)
    dense = {}
    for name in ("gate_up_proj", "down_proj"):
        q = getattr(m, name)
        check(isinstance(q, NF4Experts) and tuple(q.shape)[0] == El, f"{what}: {name} is this rank's NF4 block")
        a, b = q.shape[1], q.shape[2]
        check(q.data.numel() == El * a * b // 2 and q.absmax.numel() == El * a * b // bs, f"{what}: {name} bytes")
        if before:  # the global storage's block, bit for bit
            check(
                torch.equal(q.data, whole[name].data[rank * El * a * b // 2 : (rank + 1) * El * a * b // 2]),
                f"{what}: {name} codes",
            )
            check(q.compress_statistics == ((rank * El * a * b // bs) % 256 == 0), f"{what}: {name} scales")
            check(
                torch.equal(q.dequantize(), whole[name].dequantize()[rank * El : (rank + 1) * El]),
                f"{what}: {name} dequantised",
            )
        parts = [torch.empty(El, a, b) for _ in range(W)]
        dist.all_gather(parts, q.dequantize())
        dense[name] = torch.cat(parts)
    stores = [n for n, mod in m.named_modules() if isinstance(mod, NF4Experts)]
    check(stores == ["gate_up_proj", "down_proj"], f"{what}: NF4 storages {stores}")
    for n, p in m.named_parameters():  # the adapters: this rank's block, nothing of the other experts'
        check(not n.startswith("lora.") or R * El in (p.shape[0], p.shape[1]), f"{what}: {n} {tuple(p.shape)}")
    # the oracle: the same layer on the dequantised weights, unsplit, on every rank's tokens
    ref = make_layer(kw, hidden=H, intermediate=I).float()
    with torch.no_grad():
        for name, w in dense.items():
            getattr(ref, name).copy_(w)
    random_lora(ref, seed=3)
    g = torch.Generator().manual_seed(17)
    x_all = torch.randn(sum(T_counts), H, generator=g)
    dy_all = torch.randn(x_all.shape, generator=g)
    parts = [lora_results(ref, x_all[slices(T_counts, r)], dy_all[slices(T_counts, r)]) for r in range(W)]
    oracle = {k: torch.cat([p[k] for p in parts]) for k in ("out", "x")}
    oracle.update({n: p.grad for n, p in ref.named_parameters() if p.requires_grad})
    sl = slices(T_counts, rank)
    got = lora_results(m, x_all[sl], dy_all[sl])
    blocks = factor_blocks({k: v for k, v in oracle.items() if k.startswith("lora.")}, E, rank, W)
    for k, v in got.items():
        ref_k = oracle[k][sl] if k in ("out", "x") else blocks[k] if k.startswith("lora.") else oracle[k]
        if not k.startswith("lora.") and k not in ("out", "x"):
            v = summed(v)
        check_err(f"{what}: {k}", v, ref_k, TOL[torch.float32])
    check(set(sd) == {k for k in blocks}, f"{what}: adapters {sorted(sd)}")


# ---------------------------------------------------------------- transformers + PEFT


def _peft_compare(what: str, got: dict, oracle: dict, rank: int, W: int, E: int, tol: float = 1e-5) -> None:
    """``verify.forward_backward`` of one rank's sequence against the oracle on all of them: logits, the
    expert adapters' gradients (this rank's block), the others' (summed)."""
    grads = {k[5:]: v for k, v in oracle.items() if k.startswith("grad.")}
    blocks = factor_blocks({k: v for k, v in grads.items() if ".experts." in k}, E, rank, W)
    for k, v in got.items():
        if k == "logits":
            ref = oracle[k][rank : rank + 1]
        elif k[5:] in blocks:
            check(v.shape == blocks[k[5:]].shape, f"{what}: {k} shape {tuple(v.shape)}")
            ref = blocks[k[5:]]
        else:
            v, ref = summed(v), oracle[k]
        check_err(f"{what}: {k}", v, ref, tol)


def check_peft(rank: int, W: int, ckpt_dir: str, mesh) -> None:
    """PEFT ``target_parameters`` adapters on a transformers Qwen3-MoE under expert parallelism, each rank its
    own sequence, against one process on all of them: get_peft_model before expert_parallel (adapters
    sharded; as wrapped, and through fuse_lora) on a group and a mesh, and after it (a group: PEFT sizes
    the adapters from the local weights, its parametrization path runs; a mesh: ``shard_lora``). Then one
    SGD step, the factors gathered (``lora_state_dict``) and saved with ``save_pretrained`` on rank 0."""
    from moeyard import verify
    from moeyard.integrations.peft import fuse_lora

    with verify.quiet_transformers():
        base = verify.build_model("qwen3_moe", lora_rank=R, experts_implementation="moeyard")
        plain = verify.build_model("qwen3_moe", experts_implementation="moeyard")
    E = base.base_model.model.config.num_experts
    ids, probe = verify.make_inputs(base, batch=W, seq=6)
    with moeyard.use_backend("loop"):
        oracle = verify.forward_backward(base, ids, probe)
        own = (ids[rank : rank + 1], probe[rank : rank + 1])
        for label, group, dispatcher, fuse in (
            ("as wrapped", None, "all_to_all", False),
            ("fuse_lora", None, "sync_free", True),
            ("mesh", mesh, "all_gather", False),
        ):
            model = copy.deepcopy(base)
            if fuse:
                fuse_lora(model)
            expert_parallel(
                model, group, dispatcher=dispatcher, **({"max_tokens": 6} if dispatcher == "sync_free" else {})
            )
            _peft_compare(f"peft before/{label}/rank{rank}", verify.forward_backward(model, *own), oracle, rank, W, E)
        # PEFT's merge_and_unload on the split model: each rank folds its block into its experts
        merged = model.merge_and_unload() if group is None else None
        if merged is not None:
            check(not any("lora_" in n for n, _ in merged.named_parameters()), "merge_and_unload drops the adapters")
            check_err(
                f"peft merged/rank{rank}: logits",
                merged(input_ids=own[0]).logits.detach().double(),
                oracle["logits"][rank : rank + 1],
                1e-5,
            )
        # get_peft_model after expert_parallel on a process group: PEFT's own parametrization path, local adapters
        model = expert_parallel(copy.deepcopy(plain), dispatcher="all_to_all")
        model = verify.add_expert_lora(model, R, seed=1)  # the same values on every rank: not a block of one draw
        sd = lora_state_dict(model, rank0_only=False)
        ref = copy.deepcopy(base)
        missing, unexpected = ref.load_state_dict(sd, strict=False)
        check(not unexpected and not [k for k in missing if "lora_" in k], f"peft after: load {unexpected}")
        got = verify.forward_backward(model, *own)
        _peft_compare(f"peft after/group/rank{rank}", got, verify.forward_backward(ref, ids, probe), rank, W, E)
        # ... on a mesh: PEFT sizes the adapters of all E experts from the DTensors; shard_lora keeps the block
        model = expert_parallel(copy.deepcopy(plain), mesh, dispatcher="all_to_all")
        model = verify.add_expert_lora(model, R, seed=0)  # the draw of build_model(lora_rank=R)
        check(shard_lora(model) == 2 * 2, "shard_lora: 2 layers x 2 weights")
        _peft_compare(f"peft after/mesh/rank{rank}", verify.forward_backward(model, *own), oracle, rank, W, E)
        # train one step, gather, save on rank 0; the reference is the oracle's step
        model = expert_parallel(copy.deepcopy(base), dispatcher="all_to_all")
        step(model, *own, lr=0.5)
        ref = copy.deepcopy(base)
        step(ref, ids, probe, lr=0.5)
    sd = lora_state_dict(model)
    if rank == 0:
        want = {k: v for k, v in ref.state_dict().items() if "lora_" in k}
        check(set(sd) == set(want), f"lora_state_dict keys {sorted(set(sd) ^ set(want))}")
        for k in want:
            check_err(f"saved {k}", sd[k], want[k], 1e-5)
        model.save_pretrained(os.path.join(ckpt_dir, "peft"), state_dict=sd)
        torch.save(sd, os.path.join(ckpt_dir, "peft_saved.pt"))
    check(sd == {} or rank == 0, "rank0_only: other ranks get nothing")


def step(model, ids, probe, lr: float) -> None:
    """One SGD step on ``(logits * probe).sum()``."""
    model.zero_grad(set_to_none=True)
    (model(input_ids=ids).logits.double() * probe).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model.zero_grad(set_to_none=True)


def check_peft_qlora(rank: int, W: int) -> None:
    """A PEFT-wrapped transformers Qwen3-MoE quantised to NF4, then expert parallel: each rank keeps its
    block of every NF4 storage, and computes as the quantised model on one process."""
    from moeyard import verify
    from moeyard.quant import NF4Experts, quantize_experts

    with verify.quiet_transformers():
        base = verify.build_model("qwen3_moe", lora_rank=R, experts_implementation="moeyard")
    quantize_experts(base, "nf4")
    E = base.base_model.model.config.num_experts
    ids, probe = verify.make_inputs(base, batch=W, seq=6)
    model = expert_parallel(copy.deepcopy(base), dispatcher="all_to_all")
    for m in verify.experts_modules(model):
        check(
            all(
                isinstance(getattr(m, n), NF4Experts) and getattr(m, n).shape[0] == E // W
                for n in ("gate_up_proj", "down_proj")
            ),
            "peft qlora: this rank's NF4 blocks",
        )
    with moeyard.use_backend("loop"):
        oracle = verify.forward_backward(base, ids, probe)
        got = verify.forward_backward(model, ids[rank : rank + 1], probe[rank : rank + 1])
    _peft_compare(f"peft qlora/rank{rank}", got, oracle, rank, W, E)


def check_unsplittable_storage(rank: int, W: int) -> None:
    """Quantised storage that cannot keep one rank's experts (FP8 blocks: no ``select``) is refused by
    expert_parallel before anything changes; quantised after it, each rank stores its own experts."""
    import pytest

    from moeyard.quant import FP8BlockExperts, quantize_experts

    m = quantize_experts(make_layer(LAYER_CONFIGS["qwen3"], hidden=128, intermediate=64).float(), "fp8_block")
    with pytest.raises(ValueError, match="FP8BlockExperts storage, which cannot keep one rank's experts"):
        expert_parallel(m)
    check(m.expert_parallel is None and m.gate_up_proj.shape[0] == 8, "refused: the layer untouched")
    m = quantize_experts(
        expert_parallel(make_layer(LAYER_CONFIGS["qwen3"], hidden=128, intermediate=64).float()), "fp8_block"
    )
    check(isinstance(m.down_proj, FP8BlockExperts) and m.down_proj.shape[0] == 8 // W, "fp8 after: local block")
    check(torch.isfinite(m(torch.randn(3, 128))).all(), "fp8 after: runs")


def check_moe_save(rank: int, W: int, ckpt_dir: str) -> None:
    """A ``MoE``'s adapters gathered at this EP size and saved by rank 0 (the global layout)."""
    kw = LAYER_CONFIGS["qwen3"]
    ref = make_layer(kw)
    want = random_lora(ref, seed=13)
    m = expert_parallel(copy.deepcopy(ref))
    sd = lora_state_dict(m)
    if rank == 0:
        check(set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want), "MoE lora_state_dict")
        torch.save(sd, os.path.join(ckpt_dir, "moe_lora.pt"))


def check_load(rank: int, W: int, ckpt_dir: str) -> None:
    """Adapters saved at another EP size load here: PEFT's from_pretrained then expert_parallel, and a
    ``MoE``'s load_state_dict after expert_parallel; each rank holds its block, the model computes as one
    process with the same adapters."""
    from peft import PeftModel

    from moeyard import verify

    saved = torch.load(os.path.join(ckpt_dir, "peft_saved.pt"))
    with verify.quiet_transformers():
        one = PeftModel.from_pretrained(
            verify.build_model("qwen3_moe", experts_implementation="moeyard"),
            os.path.join(ckpt_dir, "peft"),
            is_trainable=True,
        )
        model = expert_parallel(copy.deepcopy(one), dispatcher="sync_free", max_tokens=5)
    E = one.base_model.model.config.num_experts
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    check(set(loaded) == set(saved), "peft: loaded keys")
    for k, v in factor_blocks({k: v for k, v in saved.items() if ".experts." in k}, E, rank, W).items():
        check(torch.equal(loaded[k], v), f"peft load at EP{W}: {k}")
    ids, probe = verify.make_inputs(one, batch=W, seq=5)
    with moeyard.use_backend("loop"):
        oracle = verify.forward_backward(one, ids, probe)
        _peft_compare(
            f"peft loaded at EP{W}/rank{rank}",
            verify.forward_backward(model, ids[rank : rank + 1], probe[rank : rank + 1]),
            oracle,
            rank,
            W,
            E,
        )
    sd = torch.load(os.path.join(ckpt_dir, "moe_lora.pt"))
    kw = LAYER_CONFIGS["qwen3"]
    m = expert_parallel(make_layer(kw, seed=99))
    m.add_lora(R, alpha=ALPHA)
    m.load_state_dict(sd, strict=False)
    for k, v in factor_blocks(sd, kw["num_experts"], rank, W).items():
        check(torch.equal(m.state_dict()[k], v), f"MoE load at EP{W}: {k}")


# ---------------------------------------------------------------- per world size


def worker_2(rank: int, W: int, ckpt_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (W,))
    check_lora_layer(rank, W)
    check_lora_layer(rank, W, after=True)
    check_lora_layer(rank, W, mesh=mesh, dispatchers=("all_to_all",))
    check_lora_layer(rank, W, mesh=mesh, dispatchers=("sync_free",), after=True)
    check_lora_layer(rank, W, dispatchers=("all_to_all", "sync_free"), overlap_chunks=2)
    check_lora_layer(rank, W, dispatchers=("sync_free",), backend="bmm_padded", dtype=torch.float32)
    for recipe in ("fp8_rowwise", "mxfp8"):  # LoRA on an FP8 base under expert parallelism
        check_lora_layer(rank, W, dispatchers=("all_to_all",), recipe=recipe)
    check_merge(rank, W)
    check_merge(rank, W, mesh)
    for before in (True, False):
        for size in QLORA_SIZES:
            check_qlora(rank, W, before=before, dispatcher="sync_free" if before else "all_to_all", size=size)
    check_qlora(rank, W, before=True, dispatcher="all_gather", size=QLORA_SIZES[0], mesh=mesh)
    check_qlora(rank, W, before=False, dispatcher="all_gather", size=QLORA_SIZES[0], mesh=mesh)
    check_peft_qlora(rank, W)
    check_unsplittable_storage(rank, W)
    check_peft(rank, W, ckpt_dir, mesh)
    check_moe_save(rank, W, ckpt_dir)


# ---------------------------------------------------------------- FSDP2 x expert parallelism, QLoRA


def check_fsdp_qlora(rank: int, W: int, dp: int = 2) -> None:
    """QLoRA with :func:`fsdp_expert_parallel` on a ``(dp, ep)`` mesh: NF4 experts, LoRA on them, frozen
    embedding and head, trainable dense block, router and shared expert (float32). Two AdamW steps
    against one process on the global batch: each rank's loss, every trainable parameter's gradient
    (gathered: the adapters' this EP rank's block) and value after each step; the adapters, the
    non-expert weights and their AdamW state are sharded (the adapters over dp, the rest over dp * ep)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ep_workers import TinyLM, lm_loss
    from moeyard.parallel import fsdp_expert_parallel, param_groups_by_mesh
    from moeyard.quant import NF4Experts, quantize_experts

    kw = dict(LAYER_CONFIGS["deepseek_v3"])  # shared expert, router with a bias buffer, sigmoid scores
    E, ep = kw["num_experts"], W // dp

    def build():
        model = TinyLM(kw).float()
        quantize_experts(model.moe, "nf4", blocksize=32)
        random_lora(model.moe, seed=4)
        for p in list(model.embed.parameters()) + list(model.head.parameters()):
            p.requires_grad_(False)
        return model

    B, S, vocab = 2, 3, 11
    g = torch.Generator().manual_seed(23)
    ids = torch.randint(0, vocab, (2, W * B, S), generator=g)
    targets = torch.randint(0, vocab, (2, W * B, S), generator=g)
    ref, model = build(), build()
    ref_params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    ref_opt = torch.optim.AdamW(ref_params.values(), lr=1e-2, foreach=True)
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    fsdp_expert_parallel(model, mesh, dispatcher="sync_free", max_tokens=B * S)
    ep_rank = mesh["ep"].get_local_rank()
    check(
        isinstance(model.moe.gate_up_proj, NF4Experts) and model.moe.gate_up_proj.shape[0] == E // ep,
        "fsdp qlora: this EP rank's NF4 block",
    )
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    check(set(params) == set(ref_params), f"fsdp qlora: trainable {sorted(set(params) ^ set(ref_params))}")
    for n, p in params.items():  # sharded: the adapters (their E_l block) over dp, the rest over dp * ep
        over = dp if n.startswith("moe.lora.") else W
        check(
            isinstance(p, DTensor) and p.to_local().numel() <= -(-p.shape[0] // over) * p.shape[1:].numel(),
            f"fsdp qlora: {n} sharded",
        )
    opt = torch.optim.AdamW(param_groups_by_mesh(params.values()), lr=1e-2, foreach=True)  # CUDA's default
    mine = slice(rank * B, (rank + 1) * B)
    tol = 2e-5
    for step in range(2):
        what = f"fsdp qlora/dp{dp}/step{step}/rank{rank}"
        ref_opt.zero_grad()
        ref_losses = [
            lm_loss(ref, ids[step, r * B : (r + 1) * B], targets[step, r * B : (r + 1) * B]) for r in range(W)
        ]
        (sum(ref_losses) / W).backward()
        opt.zero_grad()
        loss = lm_loss(model, ids[step, mine], targets[step, mine])
        loss.backward()
        check_err(f"{what}: loss", loss.detach(), ref_losses[rank].detach(), tol)
        grads = factor_blocks({n: p.grad for n, p in ref_params.items() if n.startswith("moe.lora.")}, E, ep_rank, ep)
        for n, p in params.items():
            check_err(f"{what}: grad {n}", p.grad.full_tensor(), grads.get(n, ref_params[n].grad), tol)
        ref_opt.step()
        opt.step()
        values = factor_blocks(
            {n: p.detach() for n, p in ref_params.items() if n.startswith("moe.lora.")}, E, ep_rank, ep
        )
        for n, p in params.items():
            check_err(
                f"{what}: {n} after the step", p.detach().full_tensor(), values.get(n, ref_params[n].detach()), tol
            )
    for n, p in params.items():  # AdamW's state is sharded as its parameter
        state = opt.state[p]["exp_avg"]
        check(isinstance(state, DTensor) and state.to_local().shape == p.to_local().shape, f"AdamW state of {n}")


def worker_4(rank: int, W: int, ckpt_dir: str) -> None:
    check_lora_layer(rank, W, dispatchers=("sync_free",))
    check_load(rank, W, ckpt_dir)
    check_fsdp_qlora(rank, W)
