"""Unit tests for omni_cache.core.row_index: one index, shared device copies, bounds."""

import numpy as np
import pytest
import torch

from omni_cache.core import HiddenPool
from omni_cache.core.row_index import RowIndex
from tests.unit.core_util import BS


def test_row_index_shares_one_copy_and_checks_bounds():
    ix = RowIndex(np.array([4, 5, 6, 9, 1], dtype=np.int64))
    head, tail = ix.split([3, 2])
    cpu = torch.device("cpu")
    assert head.on(cpu).tolist() == [4, 5, 6] and tail.on(cpu).tolist() == [9, 1]
    assert head.on(cpu).data_ptr() == ix.on(cpu).data_ptr()  # a view of the parent's copy
    ix.check(10, "block ids")
    with pytest.raises(IndexError):
        ix.check(9, "block ids")
    pool = HiddenPool("hidden", 4, BS, 4, torch.bfloat16)
    for bad in ([-1], [16]):
        with pytest.raises(IndexError):
            pool.write(bad, torch.zeros(1, 4))
        with pytest.raises(IndexError):
            pool.gather(bad)
