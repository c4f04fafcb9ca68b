"""The talker's served KV, audited: a digest of every talker KV block when its writer fills it
and when a prefix hit serves it (oracle (a) for the talker's cache, docs/architecture.md
"Integrity").

The talker's prefix cache is vLLM's own KV reuse over content-keyed block hashes
(:mod:`omni_cache.engine.talker_scheduler`): a hit serves KV *blocks*, no rows pass through
omni-cache, so the thinker's served-rows oracle cannot see them. With ``OMNI_CACHE_HIT_AUDIT``
set on the talker stage, :class:`TalkerKVAudit` appends to ``<dir>/talker-kv-<pid>.jsonl`` one
JSON line per event, in step order:

- ``{"kind": "write", "request", "block", "block_id", "digest"}`` — after the step in which
  ``request`` computed the last row of its block ``block`` (index in the request), stored in
  KV block ``block_id``; ``digest``: :func:`kv_block_digests` of that block over every layer;
- ``{"kind": "read", ...}`` — the same for each block of a new request's prefix hit, after the
  step that served it and after that step's writes: vLLM caches a block when it allocates it,
  so a request scheduled in the same step as the block's writer is served it in that step (a
  same-step hit; the writer's KV is written before the layer's attention reads it). Logged
  before the step, such a read came before its write and digested a block not yet computed —
  the CPU CI's one flaky failure of the talker oracle (2026-11-27, "served, never written"). A
  served block is not written during the step that serves it (it is full and referenced), so a
  read digested after the step is the KV the reader attended to;
- ``{"kind": "error", "message"}`` — a KV layout it cannot index (no single block dimension):
  the audit stops there (a warning in the stage's log) and the oracle reports it.

:func:`omni_cache.exactness.oracles.talker_kv_mismatches` then holds every read to the last
write of its block id: same block index, same digest (the writer may be the reader itself,
resumed after preemption) — a served talker block
is bitwise the KV its writer left there, on every device. Audits only: each event copies the
block's KV of every layer to the host (a sync). Unset: nothing is computed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from omni_cache import settings

logger = logging.getLogger(__name__)


def _block_dim(kv: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a layer's KV tensor that indexes blocks (vLLM's layouts differ by
    attention backend: ``[2, num_blocks, ...]``, ``[num_blocks, 2, ...]``): the one dimension of
    size ``num_blocks``.

    Raises:
        ValueError: no dimension, or more than one, has that size.
    """
    dims = [d for d, n in enumerate(kv.shape) if n == num_blocks]
    if len(dims) != 1:
        raise ValueError(f"KV tensor {tuple(kv.shape)}: cannot tell its block dimension ({num_blocks} blocks)")
    return dims[0]


def kv_block_digests(kv_caches: list[torch.Tensor], block_ids: list[int], num_blocks: int) -> list[str]:
    """SHA-1 of each KV block's bytes, all layers in order (one digest per block id).

    Args:
        kv_caches: the runner's per-layer KV tensors (any dtype; the block dimension is found by
            :func:`_block_dim`).
        block_ids: KV block ids (vLLM's block table entries).
        num_blocks: blocks in the KV cache (``kv_cache_config.num_blocks``).
    """
    if not block_ids:
        return []
    hashes = [hashlib.sha1() for _ in block_ids]
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for kv in kv_caches:
        dim = _block_dim(kv, num_blocks)
        rows = kv.index_select(dim, idx.to(kv.device)).movedim(dim, 0).contiguous().cpu()
        for h, r in zip(hashes, rows):
            h.update(r.view(-1).view(torch.uint8).numpy().tobytes())
    return [h.hexdigest() for h in hashes]


class TalkerKVAudit:
    """Logs the talker's KV block writes and prefix-hit reads (module docstring).

    Args:
        block_size: tokens per KV block (``cache_config.block_size``).
    """

    def __init__(self, block_size: int) -> None:
        out = settings.HIT_AUDIT.get()
        self.path = Path(out) / f"talker-kv-{os.getpid()}.jsonl" if out else None
        self.block_size = block_size

    @classmethod
    def for_runner(cls, runner: Any) -> TalkerKVAudit | None:
        """An audit for a talker stage's runner when ``OMNI_CACHE_HIT_AUDIT`` is set, else None."""
        if getattr(runner.model_config, "model_stage", None) != "talker" or not settings.HIT_AUDIT.get():
            return None
        return cls(int(runner.cache_config.block_size))

    def _log(self, runner: Any, kind: str, events: list[tuple[str, int, int]]) -> None:
        if not events or self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            digests = kv_block_digests(list(runner.kv_caches), [b for _, _, b in events],
                                       int(runner.kv_cache_config.num_blocks))
        except ValueError as e:  # a KV layout this audit cannot index: say so in the log, stop auditing
            logger.warning("omni-cache: talker KV audit stopped: %s", e)
            with self.path.open("a") as f:
                f.write(json.dumps({"kind": "error", "message": str(e)}) + "\n")
            self.path = None
            return
        with self.path.open("a") as f:
            f.writelines(json.dumps({"kind": kind, "request": rid, "block": i, "block_id": b, "digest": d}) + "\n"
                         for (rid, i, b), d in zip(events, digests))

    def after_step(self, runner: Any, scheduler_output: Any) -> None:
        """The step's writes — the blocks each scheduled request filled (its forward enqueued;
        the digest's copy waits for it on the stream) — then its reads: each new request's
        prefix-hit blocks (module docstring: same-step hits)."""
        bs = self.block_size
        start = {new.req_id: int(new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        start.update({rid: int(n) for rid, n in zip(cached.req_ids, cached.num_computed_tokens)})
        writes = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            state = runner.requests.get(rid)
            if state is None or rid not in start:
                continue
            c = start[rid]
            for i in range(c // bs, (c + int(n)) // bs):
                if (i + 1) * bs > c:
                    writes.append((rid, i, int(state.block_ids[0][i])))
        self._log(runner, "write", writes)
        reads = [(new.req_id, i, int(new.block_ids[0][i]))
                 for new in scheduler_output.scheduled_new_reqs
                 for i in range(int(new.num_computed_tokens) // bs)]
        self._log(runner, "read", reads)
