"""Launch options per warp width, and the KV-cache budget from gpu_memory_utilization."""
import pytest
import torch

from specdec.kernels.hardware import warp_size
from specdec.kernels.triton import config
from specdec.worker.device import kv_cache_bytes_from_gpu_utilization

GIB = 1 << 30


@pytest.mark.parametrize("width, rocm, threads, num_warps, num_stages", [
    (32, False, 256, 8, 3),  # NVIDIA: 8 warps of 32, stages kept
    (64, True, 256, 4, 2),  # CDNA: 4 wavefronts of 64, at most 2 stages
    (32, True, 256, 8, 2),  # RDNA (wave32) on ROCm
    (64, True, 32, 1, 2),  # never below one wavefront
    (32, False, 96, 2, 3),  # rounded down to a power of two
])
def test_launch_options_follow_warp_width(monkeypatch, width, rocm, threads, num_warps, num_stages):
    monkeypatch.setattr(config, "_warp_size_of", lambda device_type, index: width)
    monkeypatch.setattr(config, "is_rocm", lambda: rocm)
    options = config.launch_options(torch.device("cuda", 0), threads=threads, num_stages=3)
    assert options == {"num_warps": num_warps, "num_stages": num_stages}


def test_cpu_defaults():
    assert warp_size(torch.device("cpu")) == 32
    assert config.launch_options(torch.device("cpu"), threads=128) == {"num_warps": 4, "num_stages": 2}
    assert [config.next_power_of_2(n) for n in (0, 1, 3, 16, 17)] == [1, 1, 4, 16, 32]


def test_kv_cache_budget():
    # 80 GiB card at 0.9 = 72 GiB, 20 GiB for weights and activations -> 52 GiB of KV cache
    assert kv_cache_bytes_from_gpu_utilization(0.9, 20 * GIB, total_bytes=80 * GIB, free_bytes=60 * GIB) == 52 * GIB
    # another process holds memory: never more than is free now
    assert kv_cache_bytes_from_gpu_utilization(0.9, 20 * GIB, total_bytes=80 * GIB, free_bytes=30 * GIB) == 30 * GIB


@pytest.mark.parametrize("utilization, match", [(0.2, "no memory left for the KV cache"), (1.5, "in \\(0, 1\\]")])
def test_kv_cache_budget_errors_name_the_setting(utilization, match):
    with pytest.raises(ValueError, match=match) as info:
        kv_cache_bytes_from_gpu_utilization(utilization, 20 * GIB, total_bytes=80 * GIB, free_bytes=80 * GIB)
    assert "gpu_memory_utilization" in str(info.value)


def fake_gpu(monkeypatch, free, reserved, allocated, total=80 * GIB):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_engine_kv_blocks_on_a_gpu_follow_utilization_kv_cache_memory_and_the_cached_pool(monkeypatch):
    from specdec.config import EngineConfig
    from specdec.worker.plan import num_kv_blocks

    cuda, block = torch.device("cuda", 0), 1 << 20
    # 16 GiB of weights allocated, 4 GiB more cached by the allocator for no tensor: that is free
    fake_gpu(monkeypatch, free=56 * GIB, reserved=24 * GIB, allocated=20 * GIB)
    cfg = EngineConfig(model="unused", gpu_memory_utilization=0.5)
    assert num_kv_blocks(cfg, cuda, block, 1024, 4) == (40 - 20) * 1024  # 0.5 x 80 GiB - 20 GiB held
    # a second engine in the process: what the first holds counts against its share
    fake_gpu(monkeypatch, free=6 * GIB, reserved=72 * GIB, allocated=72 * GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5.*set kv_cache_memory"):
        num_kv_blocks(cfg, cuda, block, 1024, 4)
    # kv_cache_memory is the budget on any device, whatever the GPU holds
    cfg = EngineConfig(model="unused", kv_cache_memory=64 * block)
    assert num_kv_blocks(cfg, cuda, block, 512, 4) == 64
    with pytest.raises(ValueError, match="needs 65: raise kv_cache_memory or lower max_model_len"):
        num_kv_blocks(cfg, cuda, block, 1024, 4)


def test_platform_defaults_leave_float32_matmuls_in_float32():
    from specdec.worker.device import apply_platform_defaults

    before = torch.backends.cuda.matmul.allow_tf32
    apply_platform_defaults(torch.device("cuda", 0))  # float32 engines promise float32 arithmetic
    assert torch.backends.cuda.matmul.allow_tf32 is before is False
