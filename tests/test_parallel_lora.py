"""LoRA and QLoRA under expert parallelism on CPU with gloo (the checks live in ep_lora_workers.py):
2 ranks against one process; adapters saved at EP = 2 load at EP = 1 (here) and EP = 4.
"""
import pytest
import torch
import torch.distributed as dist

import ep_lora_workers
import ep_workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
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
    grouped_mm), merge_lora; QLoRA (quantize_experts before and after, nested and decoded scales); PEFT
    adapters on a transformers Qwen3-MoE (before and after expert_parallel, fuse_lora, a mesh); the
    adapters gathered and saved with save_pretrained on rank 0."""
    assert (ep2_adapters / "peft" / "adapter_config.json").exists()
