"""One request's step write, typed once at the cache's boundary: :class:`RequestWrite`.

:meth:`HiddenStateCache.write_request_rows <omni_cache.core.cache.HiddenStateCache.write_request_rows>`
takes the engine's forms (a block table as a list, numpy array or tensor; block hashes as a
``{block index: hash}`` mapping or ``(first, hashes)``); :func:`normalise_request_write` turns
them into a :class:`RequestWrite` (the touched blocks as a
:class:`~omni_cache.core.ledger_state.BlockWrite`, the hashed blocks it does not touch, the
rows), :func:`validate_request_write` checks it once. The usual forms are packed with one
``struct`` call (measured faster than numpy conversions for the engine's few hundred ints).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omni_cache.core.block_hashes import U64_END, block_hash_array, hash_value
from omni_cache.core.ledger_state import BlockWrite
from omni_cache.core.row_index import in_range
from omni_cache.core.slots import BlockIds

#: block index -> block hash, or ``(first block index, hashes of first, first + 1, ...)``
BlockHashes = Mapping[int, int] | tuple[int, Sequence[int] | np.ndarray | torch.Tensor]
#: length of the shared ``arange`` before it first grows (entries)
ARANGE_START = 1024

_ARANGE = np.arange(ARANGE_START, dtype=np.int64)
_ARANGE.flags.writeable = False


@dataclass(frozen=True, slots=True)
class RequestWrite:
    """One request's rows of one step, normalised.

    Attributes:
        req_id: the request id (the ledger owner of every touched block).
        start: position of the first row in the request (tokens).
        num_tokens: rows per key (``n``).
        first_block: index in the request's block table of ``blocks.block_ids[0]``.
        blocks: the touched blocks (block table entries ``first_block ..``; none when ``n``
            is 0), their offsets and hashes, the keys written, the owner.
        blocks_in_range: whether every touched block id is in ``[0, num_blocks)``.
        other_block_ids: int ``[m]`` (list or int64 array): blocks hashed by the call but not
            touched (e.g. prefix-hit blocks restated), cached on the owner's behalf.
        other_block_hashes: uint64 ``[m]`` (list or array): their hashes.
        rows: key -> ``[n, width]`` rows (any float dtype, on any device).
    """

    req_id: str
    start: int
    num_tokens: int
    first_block: int
    blocks: BlockWrite
    blocks_in_range: bool
    other_block_ids: Sequence[int] | np.ndarray
    other_block_hashes: Sequence[int] | np.ndarray
    rows: Mapping[str, torch.Tensor]


def normalise_request_write(req_id: str, block_ids: BlockIds, start: int, rows: Mapping[str, torch.Tensor],
                            num_tokens: int, block_hashes: BlockHashes, block_size: int, num_blocks: int,
                            key_mask: np.ndarray, few_blocks: int) -> RequestWrite:
    """The :class:`RequestWrite` of ``num_tokens`` rows per key (checked by the caller) at
    positions ``[start, start + num_tokens)``. Calls over at most ``few_blocks`` blocks and
    block hashes are converted with Python lists (cheaper for a decode step), larger ones with
    numpy arrays.

    Raises:
        ValueError: positions outside the block table; block hashes for block indices outside
            it, or not unsigned 64-bit ints.
    """
    n, table_blocks = num_tokens, len(block_ids)
    if start < 0 or (n and (start + n - 1) // block_size >= table_blocks):
        raise ValueError(f"request {req_id!r}: positions [{start}, {start + n}) fall outside a "
                         f"block table of {table_blocks} blocks x {block_size} tokens")
    first = start // block_size
    end = (start + n - 1) // block_size + 1 if n else first
    last_end = start + n - (end - 1) * block_size  # in-block end of the write in its last block
    is_map = type(block_hashes) is dict or isinstance(block_hashes, Mapping)
    hashed_count = len(block_hashes) if is_map else len(block_hashes[1])
    if end - first <= few_blocks and hashed_count <= few_blocks:
        parts = _few_blocks(req_id, block_ids, first, end, block_hashes, num_blocks)
    else:
        parts = _many_blocks(req_id, block_ids, first, end, block_hashes, num_blocks)
    touched, hashes, hashed, ids_in_range, other_ids, other_hashes = parts
    blocks = BlockWrite(touched, start - first * block_size, last_end, hashes, hashed, key_mask, req_id)
    return RequestWrite(req_id, start, n, first, blocks, ids_in_range, other_ids, other_hashes, rows)


def validate_request_write(write: RequestWrite, block_size: int, num_blocks: int) -> None:
    """Check a write once, before anything is written.

    Raises:
        ValueError: the write's last block is hashed but left partial; a touched block id
            outside ``[0, num_blocks)``.
    """
    if not write.num_tokens:
        return
    blocks = write.blocks
    if (blocks.hashed is True or blocks.hashed[-1]) and blocks.last_end != block_size:
        raise ValueError(f"request {write.req_id!r}: block {write.first_block + len(blocks.block_ids) - 1} is "
                         f"hashed but only filled to offset {blocks.last_end} of {block_size}")
    if not write.blocks_in_range:
        raise ValueError(f"request {write.req_id!r}: block ids outside [0, {num_blocks}) in "
                         f"{list(blocks.block_ids)[:8]}")


def _few_blocks(req_id: str, block_ids: BlockIds, first: int, end: int, block_hashes: BlockHashes,
                num_blocks: int) -> tuple:
    """:func:`normalise_request_write`'s parts as Python lists: ``(touched block ids, their
    hashes, whether hashed, whether the ids are in range, other hashed block ids, their
    hashes)``."""
    pairs = _hash_pairs(block_hashes, len(block_ids), req_id)
    touched = table_entries(block_ids, slice(first, end)).tolist()
    hashes = [0] * (end - first)
    hashed = [False] * (end - first)
    others = []
    for b, h in pairs:
        if first <= b < end:
            hashes[b - first], hashed[b - first] = h, True
        else:
            others.append((b, h))
    ids_in_range = not touched or (min(touched) >= 0 and max(touched) < num_blocks)
    return touched, hashes, hashed, ids_in_range, [int(block_ids[b]) for b, _ in others], [h for _, h in others]


def _many_blocks(req_id: str, block_ids: BlockIds, first: int, end: int, block_hashes: BlockHashes,
                 num_blocks: int) -> tuple:
    """:func:`_few_blocks` with numpy arrays; ``hashed`` is ``True`` where the hashed blocks are
    exactly the touched ones (a prefill's)."""
    indices, hashes, ordered, touched, ids_in_range = _step_arrays(block_ids, first, end, block_hashes, num_blocks)
    hashed_count, touched_count = indices.size, end - first
    # Block indices are distinct (dict keys, or first + range), so hashed_count of them in
    # [first, end) are exactly [first, end)
    if ordered:
        relative = None
        prefill = hashed_count == touched_count and hashed_count and indices.item(0) == first
    elif hashed_count == touched_count and hashed_count and indices.tobytes() == _arange(end)[first:].tobytes():
        relative = None  # in order: [first, end), the engine's usual mapping
        prefill = True
    else:
        relative = indices - first
        prefill = (hashed_count == touched_count and hashed_count
                   and relative.view(np.uint64).max() < touched_count)  # (negative: huge)
    if prefill:
        if relative is not None:
            in_order = np.empty(hashed_count, dtype=np.uint64)
            in_order[relative] = hashes
            hashes = in_order
        return touched, hashes, True, ids_in_range, (), ()
    if hashed_count and not in_range(indices, len(block_ids)):
        raise ValueError(f"request {req_id!r}: block hashes for block indices outside a block table of "
                         f"{len(block_ids)} blocks: "
                         f"{indices[(indices < 0) | (indices >= len(block_ids))].tolist()[:8]}")
    touched_hashes = np.zeros(touched_count, dtype=np.uint64)
    hashed = np.zeros(touched_count, dtype=bool)
    inside = (indices >= first) & (indices < end)
    touched_hashes[indices[inside] - first] = hashes[inside]
    hashed[indices[inside] - first] = True
    return touched, touched_hashes, hashed, ids_in_range, table_entries(block_ids, indices[~inside]), hashes[~inside]


def _arange(n: int) -> np.ndarray:
    """``arange(n)`` int64, read-only, shared (no allocation per call)."""
    global _ARANGE
    if n > _ARANGE.size:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.size), dtype=np.int64)
        _ARANGE.flags.writeable = False
    return _ARANGE[:n]


def _int64s(values) -> np.ndarray:
    """The ints of the iterable ``values`` (a list, a dict's keys) as int64 ``[n]``, packed by
    ``struct`` (measured 2x faster than ``array('q')`` for 512 ints); writable.

    Raises:
        struct.error: an entry is not an integer (no ``__index__``) or not in int64's range.
    """
    out = np.empty(len(values), dtype=np.int64)
    if out.size:
        struct.pack_into(f"{out.size}q", out, 0, *values)
    return out


def _step_arrays(block_ids: BlockIds, first: int, end: int, block_hashes: BlockHashes, limit: int
                 ) -> tuple[np.ndarray, np.ndarray, bool, np.ndarray, bool]:
    """``_hashed_blocks(block_hashes) + _table_part(block_ids, first, end, limit)``, for the
    engine's usual arguments (a list block table and a ``{block index: hash}`` dict) with one
    ``struct`` call into one buffer (block ids as unsigned, block indices, hashes as unsigned);
    where that cannot pack, or a block id is out of range, the two calls (and their errors)."""
    if type(block_hashes) is dict and type(block_ids) is list and end > first:
        touched, hashed = end - first, len(block_hashes)
        buf = np.empty(touched + 2 * hashed, dtype=np.uint64)
        try:
            struct.pack_into(f"{touched}Q{hashed}q{hashed}Q", buf, 0, *block_ids[first:end], *block_hashes,
                             *block_hashes.values())
        except struct.error:
            pass
        else:
            ids = buf[:touched]
            if ids.max() < limit:
                indices = buf[touched:touched + hashed].view(np.int64)
                return indices, buf[touched + hashed:], False, ids.view(np.int64), True
    return (*_hashed_blocks(block_hashes), *_table_part(block_ids, first, end, limit))


def _table_part(block_ids: BlockIds, first: int, end: int, limit: int) -> tuple[np.ndarray, bool]:
    """``(entries [first, end) of a block table as int64, whether all are in [0, limit))``: for
    a list, packed by ``struct`` as unsigned ints (a negative entry cannot pack) so that one
    reduction checks the range; anything else, or out of range, the general conversion."""
    if type(block_ids) is list:
        out = np.empty(end - first, dtype=np.uint64)
        try:
            struct.pack_into(f"{end - first}Q", out, 0, *block_ids[first:end])
        except struct.error:
            pass
        else:
            if not out.size or out.max() < limit:
                return out.view(np.int64), True
    ids = table_entries(block_ids, slice(first, end))
    return ids, in_range(ids, limit)


def table_entries(block_ids: BlockIds, index: slice | np.ndarray) -> np.ndarray:
    """Entries ``index`` (a slice, or int64 ``[k]`` positions) of a block table (list, numpy
    array or tensor) as int64 ``[k]``.

    Raises:
        IndexError: a position outside the table.
    """
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.cpu().numpy()
    if isinstance(block_ids, np.ndarray):
        return block_ids.reshape(-1)[index].astype(np.int64)
    if isinstance(index, slice):
        part = block_ids[index]
        try:
            return _int64s(part)
        except struct.error:  # e.g. numpy ints beyond int64
            return np.array(part, dtype=np.int64)
    return np.array([block_ids[i] for i in index.tolist()], dtype=np.int64)


def _hash_pairs(block_hashes: BlockHashes, table_blocks: int, req_id: str) -> list[tuple[int, int]]:
    """``[(block index, block hash)]`` of a write's few ``block_hashes``, checked: indices in
    ``[0, table_blocks)``, hashes unsigned 64-bit ints."""
    if type(block_hashes) is dict or isinstance(block_hashes, Mapping):  # a dict: no ABC check per request
        pairs = list(block_hashes.items())
    else:
        first, hashes = block_hashes
        hashes = block_hash_array(hashes, strict=True)[0].tolist()
        pairs = [(int(first) + j, h) for j, h in enumerate(hashes)]
    for j, (b, h) in enumerate(pairs):
        if type(b) is not int:
            try:
                b = operator.index(b)
            except TypeError:
                raise ValueError(f"block hash keys are block indices (ints), got {b!r}") from None
        if not 0 <= b < table_blocks:
            raise ValueError(f"request {req_id!r}: block hashes for block indices outside a block "
                             f"table of {table_blocks} blocks: {b!r}")
        if type(h) is not int or not 0 <= h < U64_END:
            h = hash_value(h)
            if h is None:
                raise ValueError(f"block hashes are ints in [0, 2**64); got {pairs[j][1]!r}")
        pairs[j] = (b, h)
    return pairs


def _hashed_blocks(block_hashes: BlockHashes) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(block indices int64 [m], block hashes uint64 [m], whether the indices are
    ascending consecutive)`` of a write's ``block_hashes``."""
    if type(block_hashes) is dict or isinstance(block_hashes, Mapping):
        count = len(block_hashes)
        if not count:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64), True
        try:  # integers only
            indices = _int64s(block_hashes)
        except struct.error:
            raise ValueError(f"block hash keys are block indices (ints), got {list(block_hashes)[:8]}") from None
        try:  # struct's Q takes only ints in [0, 2**64): the usual case, checked at once
            hashes = np.empty(count, dtype=np.uint64)
            struct.pack_into(f"{count}Q", hashes, 0, *block_hashes.values())
        except struct.error:
            hashes = block_hash_array(list(block_hashes.values()), strict=True)[0]
        return indices, hashes, False
    first, hashes = block_hashes
    values = block_hash_array(hashes, strict=True)[0]
    if isinstance(hashes, (np.ndarray, torch.Tensor)):
        values = values.copy()  # not a view of the caller's array: the ledger may keep it (deferred)
    return np.arange(int(first), int(first) + values.size, dtype=np.int64), values, True
