"""LoRA and QLoRA under expert parallelism on CPU with gloo (the checks live in ep_lora_workers.py):
2 ranks against one process; adapters saved at EP = 2 load at EP = 1 (here) and EP = 4.
"""

import pytest
import torch
import torch.distributed as dist

import ep_lora_workers
import ep_workers

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def ep2_adapters(tmp_path_factory):
    """Run every 2-rank check once; the adapters it saves at EP = 2 are reused below."""
    path = tmp_path_factory.mktemp("ep2_lora")
    ep_workers.spawn(ep_lora_workers.worker_2, 2, str(path))
    return path


def test_lora_two_ranks(ep2_adapters):
    """``MoE.add_lora`` before and after expert_parallel (group, mesh; every dispatcher; overlap_chunks 2;
    grouped_mm; on an FP8 base under fp8_rowwise and mxfp8, emulated), merge_lora; QLoRA (quantize_experts
    before and after, nested and decoded scales); PEFT
    adapters on a transformers Qwen3-MoE (before and after expert_parallel, fuse_lora, a mesh); the
    adapters gathered and saved with save_pretrained on rank 0."""
    assert (ep2_adapters / "peft" / "adapter_config.json").exists()


def test_adapters_saved_at_ep2_load_at_ep1(ep2_adapters):
    """PEFT's from_pretrained of the adapters gathered at EP = 2 (global layout) on one process: the
    saved factors, and the training step they came from equals one process's."""
    from peft import PeftModel

    from moeyard import verify

    with verify.quiet_transformers():
        model = PeftModel.from_pretrained(
            verify.build_model("qwen3_moe", experts_implementation="moeyard"), ep2_adapters / "peft"
        )
    saved = torch.load(ep2_adapters / "peft_saved.pt")
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert set(loaded) == set(saved) and len(saved) == 2 * 2 * 2
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    E = model.base_model.model.config.num_experts
    assert saved[next(k for k in saved if "lora_A" in k)].shape[0] == ep_lora_workers.R * E


def test_lora_four_ranks_and_fsdp2_qlora(ep2_adapters):
    """4 ranks (one with no tokens): ``MoE.add_lora`` under expert parallelism; the adapters saved at
    EP = 2 load at EP = 4 (PEFT's from_pretrained then expert_parallel, and a MoE's load_state_dict);
    QLoRA with FSDP2 on a (dp = 2, ep = 2) mesh against one process on the global batch (losses, every
    adapter gradient, two AdamW steps, sharded adapters and optimizer state)."""
    ep_workers.spawn(ep_lora_workers.worker_4, 4, str(ep2_adapters))
