"""Block table -> slot mapping, the addressing the pools share with vLLM's KV cache.

vLLM's KV cache is paged: ``num_blocks`` blocks of ``block_size`` tokens. A request's *block
table* lists its block ids; the token at position ``p`` lives at *slot*
``block_table[p // block_size] * block_size + p % block_size`` (vLLM's ``slot_mapping`` holds
these per scheduled token). omni-cache pools use the same slots as flat row indices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: a request's block table row (block ids ``[n]``): a list of ints, a numpy int array or a CPU
#: int tensor
BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def slot_mapping(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Map token positions of one request to KV slots (vLLM's ``slot_mapping``).

    Args:
        block_ids: int64 ``[num_blocks_of_request]``, the request's block table row.
        positions: int64 ``[n]``, token positions within the request (0-based).
        block_size: tokens per block.

    Returns:
        int64 ``[n]`` slots ``block_ids[p // block_size] * block_size + p % block_size``,
        on ``block_ids``' device.

    Raises:
        ValueError: a position is negative or past the end of the block table.
    """
    positions = positions.to(device=block_ids.device, dtype=torch.int64)
    block_idx = torch.div(positions, block_size, rounding_mode="floor")
    if positions.numel() and (
        int(positions.min()) < 0 or int(block_idx.max()) >= block_ids.numel()
    ):
        raise ValueError(
            f"positions [{int(positions.min())}, {int(positions.max())}] fall outside a block "
            f"table of {block_ids.numel()} blocks x {block_size} tokens"
        )
    return block_ids.to(torch.int64)[block_idx] * block_size + positions % block_size


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """Number of completely filled blocks that ``num_tokens`` tokens occupy."""
    return num_tokens // block_size
