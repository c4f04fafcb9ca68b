"""Rows to the KV slot mapping's slots as one torch custom op: the write an in-graph save needs.

A decode step's save costs omni-cache ~0.2–0.6 ms of Python on a host-bound GPU step
(docs/gpu.md, "Twenty-sixth session"). The way out designed there (docs/gpu.md, "The next GPU
session", item 0): write each step's rows *inside the forward*, indexed by the slot mapping
vLLM already has on the device for the KV write (a persistent buffer under CUDA graphs), so a
captured graph replays the write with the forward and the step's Python does none of it.
This module is that write, alone: :func:`write_rows_at_slots` is registered as the custom op
``omni_cache::write_rows_at_slots`` (``torch.library.custom_op``, the pool declared mutated) so
``torch.compile`` keeps it in the graph, with static shapes and no host sync, so a CUDA graph
captures it. Padded entries of the slot mapping are vLLM's ``PAD_SLOT_ID`` (-1,
``vllm/v1/attention/backends/utils.py``): their rows go to a scratch row, the pool's last,
never to a slot.

Not wired into the engine yet: the hooks that call it from the thinker's forward, the ledger's
record of rows written in the graph and the confirmation of replayed steps were on branch
``ingraph-write`` (twenty-sixth session), lost with that session's checkout; docs/architecture.md
("Tiers and the hot path") describes them. Nothing here imports vLLM (``omni_cache.core``'s
import rule).
"""

from __future__ import annotations

import torch

#: vLLM's padded slot id (``vllm.v1.attention.backends.utils.PAD_SLOT_ID``)
PAD_SLOT_ID = -1


@torch.library.custom_op("omni_cache::write_rows_at_slots", mutates_args=("pool",))
def write_rows_at_slots(pool: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``rows`` into ``pool`` at the slots of ``slot_mapping``, in place.

    Args:
        pool: ``[num_slots + 1, width]`` (any dtype); row ``num_slots`` is the scratch row that
            padded entries land on (its content is undefined).
        rows: ``[n, width]`` (cast to ``pool``'s dtype); row ``i`` goes to ``slot_mapping[i]``.
        slot_mapping: ``[>= n]`` int64 (or int32) slot ids in ``[0, num_slots)`` or
            :data:`PAD_SLOT_ID`; entries past ``n`` are ignored (vLLM's buffer is padded to the
            captured batch size).

    No host sync, static shapes: capturable in a CUDA graph. Slot ids out of range other than
    :data:`PAD_SLOT_ID` are not checked (the caller's slot mapping is vLLM's own).
    """
    slots = slot_mapping[:rows.shape[0]].to(torch.int64)
    slots = torch.where(slots == PAD_SLOT_ID, pool.shape[0] - 1, slots)
    pool.index_copy_(0, slots, rows.to(pool.dtype))


@write_rows_at_slots.register_fake
def _(pool: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    return None
