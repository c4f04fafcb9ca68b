"""Unit tests for omni_cache.core.pool: HiddenPool on every tier."""

import pytest
import torch

from omni_cache.core import HiddenPool, Tier
from tests.unit.core_util import BS, rows
from tests.util import same_bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_roundtrip_bitwise(dtype):
    pool = HiddenPool("hidden", 4, BS, 5, dtype, tier=Tier.HOST)  # pinned memory: CUDA tests below
    assert pool.storage.shape == (4, BS, 5) and pool.nbytes == 4 * BS * 5 * dtype.itemsize
    slots = torch.tensor([13, 0, 7, 2])
    data = rows(4, 5).to(dtype)
    pool.write(slots, data)
    assert torch.equal(pool.gather(slots).view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(pool.storage.view(-1, 5)[13], data[0])


def test_pool_casts_and_rejects_width():
    pool = HiddenPool("layer_24", 2, BS, 3, torch.bfloat16)
    pool.write(torch.tensor([1]), torch.ones(1, 3, dtype=torch.float64))
    assert pool.gather(torch.tensor([1])).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="layer_24"):
        pool.write(torch.tensor([1]), torch.ones(1, 4))


@pytest.mark.parametrize("width,dtype", [(4, torch.bfloat16), (3, torch.bfloat16), (2, torch.float32),
                                         (3, torch.float64)])
def test_pool_cpu_paths_bitwise_with_nan_payloads(width, dtype):
    """CPU writes go through numpy int64 words where rows allow (8-byte multiples) and
    index_copy_ otherwise; both keep every bit, NaN payloads included."""
    pool = HiddenPool("hidden", 6, BS, width, dtype)
    bits = torch.randint(0, 256, (2 * BS * width * dtype.itemsize,), dtype=torch.uint8)
    data = bits.view(dtype).view(2 * BS, width)
    pool.write_blocks([4, 1], data)
    assert same_bits(pool.gather_blocks([4, 1]), data)
    pool.write([3, 22], data[:2])
    assert same_bits(pool.gather([3, 22]), data[:2])
    assert same_bits(pool.storage[1], data[BS:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("zero_copy", [True, False])
def test_cuda_pinned_host_cpu_write_waits_for_a_pending_gpu_read(zero_copy):
    """Rows written from the CPU into blocks a queued GPU read still has to copy do not reach
    that read (the CPU write waits for it)."""
    pool = HiddenPool("hidden", 8, 4, 256, torch.float32, "cuda", Tier.PINNED_HOST, zero_copy=zero_copy)
    first = torch.randn(8, 256)
    pool.write(torch.arange(8) + 4, first)  # blocks 1, 2
    pool.gather_blocks([3], out_device="cuda")  # loads the kernels (lazy loading waits for the device)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    got = pool.gather_blocks([1, 2], out_device="cuda")  # queued behind the sleep
    assert not torch.cuda.current_stream().query(), "the read did not stay queued"
    pool.write(torch.arange(8) + 4, torch.randn(8, 256))
    assert torch.equal(got.cpu(), first)
