"""Block hashes: computing them (chained like vLLM's) and checking the values callers pass.

A block hash identifies a full KV block's content and the whole token prefix before it
(:func:`chained_block_hashes`). Everywhere in the core a block hash is an unsigned 64-bit int;
:func:`block_hash_array`, :func:`hash_list` and :func:`hash_value` turn the forms callers pass
(lists of ints, uint64 / int64 numpy arrays or CPU tensors) into that, and say which entries are
not block hashes.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from hashlib import blake2b

import numpy as np
import torch

from omni_cache.core.slots import num_full_blocks

#: bytes of one block hash (64 bits)
HASH_BYTES = 8
#: block hashes ``[n]`` as callers pass them (see :func:`block_hash_array`)
HashesLike = Sequence[object] | np.ndarray | torch.Tensor
#: one past the largest block hash
U64_END = 2**64
#: Parent hash of the first block of a prompt (a fixed constant, so block hashes are
#: identical across processes and runs).
NONE_HASH = int.from_bytes(blake2b(b"omni-cache/root", digest_size=HASH_BYTES).digest(), "little")


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

    ``hash_i = blake2b(hash_{i-1}, tokens of block i, extra keys overlapping block i)``,
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
        h = blake2b(prev.to_bytes(HASH_BYTES, "little"), digest_size=HASH_BYTES)
        h.update(data[b * stride : (b + 1) * stride])
        for extra in per_block[b]:
            h.update(extra)
        prev = int.from_bytes(h.digest(), "little")
        block_hashes.append(prev)
    return block_hashes


def hash_value(block_hash: object) -> int | None:
    """``block_hash`` as an unsigned 64-bit int, or ``None`` if it is not one (see
    :func:`block_hash_array`)."""
    try:
        v = int(np.uint64(block_hash))
    except (TypeError, ValueError, OverflowError):
        return None
    return v if v == block_hash else None


def block_hash_array(block_hashes: HashesLike, *, strict: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Block hashes as ``uint64 [n]``, plus a validity mask (bool ``[n]``; ``None``: all valid).

    Accepted forms: a sequence of ints in ``[0, 2**64)`` (what :func:`chained_block_hashes`
    returns; ``-1``, ``"12"``, ``None`` are not block hashes; a value equal to such an int,
    e.g. ``5.0``, stands for it, as Python's ``==`` has it), a numpy array or CPU tensor of
    ``uint64``/``int64`` (int64 is reinterpreted bit for bit as uint64: ``-1`` is
    ``2**64 - 1``).

    Raises:
        ValueError: ``strict`` and some entry is not a block hash (with ``strict=False`` the
            entry is marked invalid instead: it matches no cached block).
        TypeError: an array or tensor of another dtype.
    """
    if isinstance(block_hashes, torch.Tensor):
        block_hashes = block_hashes.detach().cpu().numpy()
    if isinstance(block_hashes, np.ndarray):
        if block_hashes.dtype == np.uint64:
            return block_hashes.reshape(-1), None
        if block_hashes.dtype == np.int64:
            return block_hashes.reshape(-1).view(np.uint64), None
        raise TypeError(f"block hash arrays are uint64 or int64, not {block_hashes.dtype}")
    seq = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
    try:  # array('Q') takes only integers in [0, 2**64) (no floats, strings, negatives)
        return np.frombuffer(array.array("Q", seq), dtype=np.uint64), None
    except (TypeError, ValueError, OverflowError):
        pass
    vals = [hash_value(h) for h in seq]
    arr = np.array([v or 0 for v in vals], dtype=np.uint64)
    if all(v is not None for v in vals):
        return arr, None
    if strict:
        bad = next(h for h, v in zip(seq, vals) if v is None)
        raise ValueError(f"block hashes are ints in [0, 2**64); got {bad!r}")
    return arr, np.array([v is not None for v in vals], dtype=bool)


def hash_list(block_hashes: HashesLike) -> list[int | None]:
    """Block hashes (any form of :func:`block_hash_array`) as Python ints, ``None`` for
    entries that are not block hashes (cheap for a few)."""
    if isinstance(block_hashes, (np.ndarray, torch.Tensor)):
        return block_hash_array(block_hashes, strict=False)[0].tolist()
    return [h if type(h) is int and 0 <= h < U64_END else hash_value(h) for h in block_hashes]
