"""Unit tests for omni_cache.core.request_write: one request's step write, typed once."""

import numpy as np
import pytest
import torch

from omni_cache.core.request_write import normalise_request_write, table_entries, validate_request_write
from tests.unit.core_util import BS

NUM_BLOCKS = 16
MASK = np.array([True, False])


def _normalise(block_ids, start, n, block_hashes, few_blocks):
    rows = {"hidden": torch.zeros(n, 2)}
    return normalise_request_write("A", block_ids, start, rows, n, block_hashes, block_size=BS,
                                   num_blocks=NUM_BLOCKS, key_mask=MASK, few_blocks=few_blocks)


def _plain(write):
    """The write's contents as Python values (lists / arrays alike)."""
    b = write.blocks
    hashed = [True] * len(b.block_ids) if b.hashed is True else [bool(h) for h in b.hashed]
    return (write.start, write.num_tokens, write.first_block, write.blocks_in_range,
            [int(i) for i in b.block_ids], b.first_start, b.last_end,
            [int(h) for h, c in zip(b.block_hashes, hashed) if c], hashed,
            [int(i) for i in write.other_block_ids], [int(h) for h in write.other_block_hashes])


@pytest.mark.parametrize("table,start,n,block_hashes", [
    ([5, 9, 2, 7], 2, 10, {0: 11, 1: 12, 2: 13}),  # a chunk that fills blocks 1, 2 and restates 0
    ([5, 9, 2, 7], 0, 12, {0: 11, 1: 12, 2: 13}),  # a prefill: the hashed blocks are the touched ones
    ([5, 9, 2, 7], 0, 12, {2: 13, 0: 11, 1: 12}),  # the same, hashes out of order
    ([5, 9, 2, 7], 13, 1, {}),  # a decode token
    ([5, 9, 2, 7], 4, 8, (1, [12, 13])),  # (first, hashes)
    (np.array([5, 9, 2, 7]), 4, 8, (1, np.array([12, 13], dtype=np.uint64))),
])
def test_few_and_many_block_forms_normalise_alike(table, start, n, block_hashes):
    """The list path (a decode step's) and the array path (a prefill's) give the same write."""
    few = _normalise(table, start, n, block_hashes, few_blocks=1000)
    many = _normalise(table, start, n, block_hashes, few_blocks=0)
    assert _plain(few) == _plain(many)


@pytest.mark.parametrize("few_blocks", [0, 1000])
def test_a_hashed_block_left_partial_is_refused_before_anything_is_written(few_blocks):
    for block_hashes in ({1: 12}, {0: 11, 1: 12}):
        write = _normalise([5, 9], 0, 6, block_hashes, few_blocks)
        with pytest.raises(ValueError, match="block 1 is hashed but only filled to offset 2 of 4"):
            validate_request_write(write, block_size=BS, num_blocks=NUM_BLOCKS)
    write = _normalise([5, 99], 0, 6, {}, few_blocks)
    assert not write.blocks_in_range
    with pytest.raises(ValueError, match="block ids outside"):
        validate_request_write(write, block_size=BS, num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="outside a block table"):
        _normalise([5, 9], 6, 4, {}, few_blocks)


def test_table_entries_of_every_block_table_form():
    for table in ([4, 8, 15], np.array([4, 8, 15]), torch.tensor([4, 8, 15])):
        assert table_entries(table, slice(1, 3)).tolist() == [8, 15]
        assert table_entries(table, np.array([2, 0])).tolist() == [15, 4]
