"""Unit tests for omni_cache.core.slots: the slot mapping."""

import pytest
import torch

from omni_cache.core.slots import num_full_blocks, slot_mapping
from tests.unit.core_util import BS


def test_slot_mapping_formula_and_range():
    table = torch.tensor([5, 2, 7])
    pos = torch.arange(12)
    expected = [table[p // BS].item() * BS + p % BS for p in range(12)]
    assert slot_mapping(table, pos, BS).tolist() == expected
    with pytest.raises(ValueError, match="outside a block table of 3 blocks"):
        slot_mapping(table, torch.tensor([12]), BS)
    with pytest.raises(ValueError, match="outside a block table"):
        slot_mapping(table, torch.tensor([-1]), BS)
    assert num_full_blocks(11, BS) == 2 and num_full_blocks(12, BS) == 3
