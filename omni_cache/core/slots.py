"""Block table -> slot id mapping and chained block hashes.

vLLM's KV cache is paged: ``num_blocks`` blocks of ``block_size`` tokens. A
request's *block table* lists its block ids; the token at position ``p`` lives
at *slot id* ``block_table[p // block_size] * block_size + p % block_size``.
omni-cache pools use the same slot ids as flat row indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np
import torch

_HASH_BYTES = 8
#: Parent hash of the first block of a prompt (a fixed constant, so block hashes are
#: identical across processes and runs).
NONE_HASH = int.from_bytes(blake2b(b"omni-cache/root", digest_size=_HASH_BYTES).digest(), "little")


def slot_ids(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Map token positions of one request to KV slot ids.

    Args:
        block_ids: int64 ``[num_blocks_of_request]``, the request's block table row.
        positions: int64 ``[n]``, token positions within the request (0-based).
        block_size: tokens per block.

    Returns:
        int64 ``[n]`` slot ids ``block_ids[p // block_size] * block_size + p % block_size``,
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


def _identifier_bytes(identifier: object) -> bytes:
    """Stable, type-hashed encoding of an extra-key identifier (no salted ``hash()``)."""
    if isinstance(identifier, bytes):
        return b"b" + identifier
    if isinstance(identifier, str):
        return b"s" + identifier.encode()
    if isinstance(identifier, int):
        return b"i" + str(identifier).encode()
    return b"r" + repr(identifier).encode()  # tuples of str/int/bytes have a stable repr


def chained_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[tuple[int, int, object]] = (),
    parent: int | None = None,
) -> list[int]:
    """One 64-bit block hash per FULL block of ``token_ids``, chained like vLLM's block hash.

    ``tag_i = blake2b(tag_{i-1}, tokens of block i, extra keys overlapping block i)``,
    mirroring ``hash_block_tokens`` in ``vllm/v1/core/kv_cache_utils.py``: a block's hash
    identifies the whole token prefix up to its end, so equal block hashes mean equal prefixes.

    Args:
        token_ids: token ids of the request (list, numpy or CPU tensor); a trailing
            partial block gets no block hash.
        block_size: tokens per block.
        extra_keys: ``(start_pos, end_pos, identifier)`` half-open spans, e.g. a
            multimodal item's placeholder positions and its content hash, so prompts with
            identical placeholder tokens but different images get different block hashes.
            Identifiers are bytes/str/int or values with a stable ``repr``. Positions are
            relative to ``token_ids[0]``; the span is hashed by its offsets relative to
            each block it overlaps, so continuing a chain with ``parent`` (and spans shifted
            accordingly) gives the same block hashes as hashing the whole prompt.
        parent: hash of the block preceding ``token_ids[0]``; ``None`` for a prompt start.

    Returns:
        ``len(token_ids) // block_size`` unsigned 64-bit ints, deterministic across processes.
    """
    n_blocks = num_full_blocks(len(token_ids), block_size)
    if n_blocks == 0:
        return []
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.cpu().numpy()
    data = memoryview(np.asarray(token_ids[: n_blocks * block_size], dtype="<i8").tobytes())
    per_block: list[list[bytes]] = [[] for _ in range(n_blocks)]
    for start, end, identifier in sorted(extra_keys, key=lambda k: (k[0], k[1])):
        ident = _identifier_bytes(identifier)
        for b in range(max(start, 0) // block_size, min((end - 1) // block_size + 1, n_blocks)):
            lo = b * block_size
            head = np.array([start - lo, end - lo, len(ident)], dtype="<i8").tobytes()
            per_block[b].append(head + ident)
    stride = block_size * 8
    prev = NONE_HASH if parent is None else parent
    block_hashes = []
    for b in range(n_blocks):
        h = blake2b(prev.to_bytes(_HASH_BYTES, "little"), digest_size=_HASH_BYTES)
        h.update(data[b * stride : (b + 1) * stride])
        for extra in per_block[b]:
            h.update(extra)
        prev = int.from_bytes(h.digest(), "little")
        block_hashes.append(prev)
    return block_hashes
