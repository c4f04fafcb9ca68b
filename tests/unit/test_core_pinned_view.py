"""Unit tests for omni_cache.core.pinned_view: the zero-copy view of pinned memory (CUDA)."""

import pytest
import torch

from omni_cache.core.pinned_view import uva_view
from tests.util import same_bits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uva_view_aliases_pinned_memory_bitwise():
    host = torch.empty(64, 512, dtype=torch.bfloat16, pin_memory=True)
    host.view(torch.int16).copy_(torch.randint(-2**15, 2**15, host.shape, dtype=torch.int16))  # NaNs too
    view = uva_view(host, torch.device("cuda", torch.cuda.current_device()))
    assert view is not None and view.device.type == "cuda" and view.shape == host.shape
    idx = torch.randperm(64, device="cuda")[:20]
    assert same_bits(view.index_select(0, idx).cpu(), host[idx.cpu()])
    rows = torch.randn(20, 512, device="cuda").to(torch.bfloat16)
    view.index_copy_(0, idx, rows)
    torch.cuda.synchronize()
    assert same_bits(host[idx.cpu()], rows.cpu())
    assert uva_view(torch.empty(4), torch.device("cuda", 0)) is None  # not pinned
