"""Planted faults for the mutation run (``tests/lanes/mutants.py``): each one a real way this
product could serve a wrong row, planted from test code only — monkeypatches applied by
:func:`plant` in every process that matters, never a switch in a production class.

How a fault reaches the processes:

- the engine processes (vLLM-Omni's stage engine cores; with the ``uni`` executor the worker
  runs there too) load vLLM's entry-point group ``vllm.general_plugins``; the mutation run
  puts a throw-away ``*.dist-info`` on ``PYTHONPATH`` whose entry point is
  :func:`plant_from_env` (:func:`write_plugin_dist`), so no installed file changes;
- the test process (the driver: the talker identity hook, engine-free unit tests) loads this
  module as a pytest plugin (``pytest -p tests.mutants``), which plants at import, before the
  test modules are imported.

Both read the fault's name from :data:`ENV`; unset, nothing is planted (this module is inert
in the normal suite). A fault is planted once per process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

#: environment variable naming the fault to plant (unset: none)
ENV = "TEST_MUTANT"
#: environment variable naming a file that :func:`plant` appends ``<fault> <pid> <argv0>`` to
EVIDENCE_ENV = "TEST_MUTANT_EVIDENCE"
#: the entry point's distribution name (a throw-away ``*.dist-info`` directory)
DIST = "omni_cache_test_mutants"

#: the line :func:`plant` prints (stderr) in every process it plants in
PLANTED = "[omni-cache test mutant] planted"

_planted: list[str] = []


def _replace(module_names: tuple[str, ...], attr: str, new) -> None:
    """``attr`` of every module in ``module_names`` (imported now) set to ``new``: the
    function and every module that bound it by name at import."""
    import importlib

    for name in module_names:
        setattr(importlib.import_module(name), attr, new)


# ---- faults in the thinker's read path (worker process) ----------------------------------

def _wrap_read_prefix(corrupt: Callable) -> None:
    """``HiddenStateCache.read_prefix`` returns ``corrupt(cache, block_ids, num_tokens, keys,
    out_device, rows)`` instead of its rows (the ledger check still runs first)."""
    from omni_cache.core.cache import HiddenStateCache

    orig = HiddenStateCache.read_prefix

    def read_prefix(self, req_id, block_ids, num_tokens, block_hashes, keys, out_device=None):
        keys = tuple(keys)
        rows = orig(self, req_id, block_ids, num_tokens, block_hashes, keys, out_device)
        if num_tokens <= 0:
            return rows
        return corrupt(self, req_id, list(block_ids)[:num_tokens // self.block_size], num_tokens, keys,
                       out_device, rows)

    HiddenStateCache.read_prefix = read_prefix


def _foreign_block() -> None:
    """Another request's rows for a block: the last block of every hit is served from a
    block that another request filled (the most recently listed such block in the ledger)."""
    import numpy as np

    def corrupt(cache, req_id, ids, num_tokens, keys, out_device, rows):
        hit_ids = set(int(b) for b in ids)
        writers = {cache.ledger.owner[b] for b in hit_ids}
        other = next((b for b in range(cache.num_blocks - 1, -1, -1)
                      if b not in hit_ids and cache.ledger.owner[b] not in (None, *writers)), None)
        if other is None:
            return rows
        bs = cache.block_size
        for k in keys:
            foreign = cache.pools[k].gather_blocks(np.asarray([other], dtype=np.int64), out_device)
            rows[k][num_tokens - bs:num_tokens] = foreign.to(rows[k].device, rows[k].dtype)
        return rows

    _wrap_read_prefix(corrupt)


def _slot_shift() -> None:
    """Rows one slot off: every served row is read from the KV slot after its own."""
    import numpy as np

    def corrupt(cache, req_id, ids, num_tokens, keys, out_device, rows):
        bs = cache.block_size
        slots = (np.asarray(ids, dtype=np.int64)[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1) + 1
        slots = np.minimum(slots, cache.num_blocks * bs - 1)
        return {k: cache.pools[k].gather(slots, out_device) for k in keys}

    _wrap_read_prefix(corrupt)


def _bit_flip() -> None:
    """One bit flipped in a served row: the lowest mantissa bit of the first element of the
    last served row, of every key."""
    import torch

    def corrupt(cache, req_id, ids, num_tokens, keys, out_device, rows):
        for k in keys:
            t = rows[k]
            words = {2: torch.int16, 4: torch.int32}[t.element_size()]
            t[num_tokens - 1:num_tokens, :1].view(words).bitwise_xor_(1)
        return rows

    _wrap_read_prefix(corrupt)


# ---- faults in the write path / ledger (worker process) -----------------------------------

def _stale_generation() -> None:
    """A block served after its writer left and the slot was reused (stale generation): a
    write into a block that another request filled before is dropped from the pool (the
    pool keeps the earlier generation's rows) while the ledger records the new fill, so a
    later hit on the new content is served the old rows. Planted in both write paths:
    ``write_request_rows`` (``_store_rows``) and the engine's, ``write_step_rows`` (one write
    for the whole step: such a request's rows are replaced by what the pool holds at its
    slots). Until the ninth GPU session only the first was planted, which the engine never
    calls: its stress selection passed with the fault "planted" (on the CPU)."""
    import numpy as np

    from omni_cache.core.cache import HiddenStateCache

    orig = HiddenStateCache._store_rows
    orig_step = HiddenStateCache.write_step_rows

    def _store_rows(self, write):
        ids = [int(b) for b in list(write.blocks.block_ids)]
        owners = [self.ledger.owner[b] for b in ids]
        if any(o is not None and o != write.req_id for o in owners):
            return
        return orig(self, write)

    def write_step_rows(self, requests, rows):
        bs, off, rows = self.block_size, 0, {k: v.clone() for k, v in rows.items()}
        for r in requests:
            n = r.num_tokens
            table = [int(b) for b in list(r.block_ids)]
            if n and any((o := self.ledger.owner[b]) is not None and o != r.req_id
                         for b in table[r.start // bs:(r.start + n - 1) // bs + 1]):
                pos = np.arange(r.start, r.start + n, dtype=np.int64)
                slots = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
                for k, t in rows.items():  # the earlier generation's rows stay in the pool
                    t[off:off + n] = self.pools[k].gather(slots, out_device=t.device).to(t.dtype)
            off += n
        return orig_step(self, requests, rows)

    HiddenStateCache._store_rows = _store_rows
    HiddenStateCache.write_step_rows = write_step_rows


def _deferred_write_dropped() -> None:
    """A deferred ledger write dropped: a request's step write that the ledger would defer
    (more than ``scalar_max`` blocks, or behind another deferred one) is never applied."""
    from omni_cache.core.ledger import BlockLedger

    orig = BlockLedger.defer_request_write

    def defer_request_write(self, write):
        n = len(write.block_ids)
        if self.defer and n and (n > self.scalar_max or self._pending):
            return
        return orig(self, write)

    BlockLedger.defer_request_write = defer_request_write


def _thinker_media_dropped() -> None:
    """A media identifier left out of the thinker's block hash (the ledger's
    ``chained_block_hashes``): blocks are hashed from their token ids alone."""
    import omni_cache.core.block_hashes as bh

    orig = bh.chained_block_hashes

    def chained_block_hashes(token_ids, block_size, extra_keys=(), *args, **kwargs):
        return orig(token_ids, block_size, (), *args, **kwargs)

    _replace(("omni_cache.core.block_hashes", "omni_cache.core", "omni_cache.engine.stage_manager"),
             "chained_block_hashes", chained_block_hashes)


def _wrap_write_step_rows(corrupt: Callable) -> None:
    """``HiddenStateCache.write_step_rows`` stores ``corrupt(requests, rows)`` (a copy of the
    step's rows, changed) instead of the rows the forward returned."""
    from omni_cache.core.cache import HiddenStateCache

    orig = HiddenStateCache.write_step_rows

    def write_step_rows(self, requests, rows):
        return orig(self, requests, corrupt(list(requests), {k: v.clone() for k, v in rows.items()}))

    HiddenStateCache.write_step_rows = write_step_rows


def _decode_rows_corrupted() -> None:
    """A decode step's row stored wrong: for every request scheduled with one token (a decode
    step) the stored row has its lowest mantissa bit flipped, while the forward's own rows (what
    the talker gets this step) stay right — so only a later hit on a block filled while
    decoding serves it. Before the writer's block digests no bitwise oracle saw it on CUDA."""
    import torch

    def corrupt(requests, rows):
        off = 0
        for r in requests:
            if r.num_tokens == 1:
                for t in rows.values():
                    t[off:off + 1, :1].view({2: torch.int16, 4: torch.int32}[t.element_size()]).bitwise_xor_(1)
            off += r.num_tokens
        return rows

    _wrap_write_step_rows(corrupt)


def _write_batch_shift() -> None:
    """A slicing error on the write side of a batched step: every request's rows are taken
    one row later in the step's batch (``start + 1``; the batch's last row repeats)."""
    def corrupt(requests, rows):
        if len(requests) < 2:
            return rows
        return {k: v[list(range(1, v.shape[0])) + [v.shape[0] - 1]] for k, v in rows.items()}

    _wrap_write_step_rows(corrupt)


def _seam_off_by_one() -> None:
    """An off-by-one at the seam between cached and fresh rows: a hit request's hand-off
    repeats its last cached row and drops its last fresh one (same length). Planted wherever
    the seam is made: ``merge`` (no stager: the CPU), ``stage_handoff`` (CUDA's ``host`` staging,
    before the rows go to pinned memory) and ``StagedStep.complete`` (CUDA's default
    ``snapshot`` staging: the fresh rows copied in after the staged prefix). The ninth GPU
    session planted only the first two, and the mutant survived there: CUDA made the seam in
    ``complete``."""
    import torch

    from omni_cache.core.staging import StagedStep
    from omni_cache.engine.stage_manager import OmniCacheStageManager

    orig = OmniCacheStageManager.merge
    orig_stage = OmniCacheStageManager.stage_handoff
    orig_complete = StagedStep.complete

    def complete(self, req_id, fresh):
        self.wait()
        a, p = self.spans[req_id][0], self.prefix.get(req_id, 0)
        if p:
            fresh = {k: torch.cat([self.host[k][a + p - 1:a + p].to(t.device, t.dtype), t[:-1]]) if t.shape[0] else t
                     for k, t in fresh.items()}
        return orig_complete(self, req_id, fresh)

    def stage_handoff(self, plan, fresh, prefixes):
        shifted = dict(fresh)
        for rid in prefixes:
            shifted[rid] = {k: torch.cat([prefixes[rid][k][-1:].to(t.device, t.dtype), t[:-1]])
                            if k in prefixes[rid] and prefixes[rid][k].shape[0] and t.shape[0] else t
                            for k, t in fresh[rid].items()}
        return orig_stage(self, plan, shifted, prefixes)

    def merge(plan, fresh, prefixes):
        merged = orig(plan, fresh, prefixes)
        for rid in prefixes:
            for k, t in merged[rid].items():
                n = prefixes[rid][k].shape[0]
                if n < t.shape[0]:
                    merged[rid][k] = torch.cat([t[:n], t[n - 1:n], t[n:-1]])
        return merged

    OmniCacheStageManager.merge = staticmethod(merge)
    OmniCacheStageManager.stage_handoff = stage_handoff
    StagedStep.complete = complete


def _ledger_check_off() -> None:
    """The ledger's block hash / fill check switched off: every block of a hit counts as
    covered, whatever hash it was cached under and whatever was written to it."""
    from omni_cache.core.ledger import BlockLedger

    BlockLedger.first_uncovered = lambda self, block_ids, block_hashes, key_mask: len(block_ids)


def _key_misaligned() -> None:
    """One cached tensor's key misaligned from the others: the last hand-off key's served rows
    are read one KV slot later than their block table says; the other keys' are right."""
    import numpy as np

    def corrupt(cache, req_id, ids, num_tokens, keys, out_device, rows):
        k = sorted(keys)[-1]
        bs = cache.block_size
        slots = (np.asarray(ids, dtype=np.int64)[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1) + 1
        rows[k] = cache.pools[k].gather(np.minimum(slots, cache.num_blocks * bs - 1), out_device)
        return rows

    _wrap_read_prefix(corrupt)


# ---- faults in the scheduler (engine core) -------------------------------------------------

def _cap_disabled() -> None:
    """The scheduler cap disabled: vLLM's KV prefix hit is returned uncapped, whatever the
    hidden-state tier covers (uncovered rows are served, or refused by the worker)."""
    from omni_cache.engine.scheduler import OmniCacheSchedulerMixin

    def _get_local_prefix_cache_hit(self, request):
        self._omni_cache_state()
        return super(OmniCacheSchedulerMixin, self)._get_local_prefix_cache_hit(request)

    OmniCacheSchedulerMixin._get_local_prefix_cache_hit = _get_local_prefix_cache_hit


def _yoco_truncation_ignored() -> None:
    """The hit not truncated at a YOCO fast-prefill boundary: the runner writes the final
    hidden rows of fast-prefill chunks as valid, and the scheduler records every block valid
    for every key (so a hit needing the final rows is served the self-decoder output)."""
    import omni_cache.engine.scheduler as sched
    import omni_cache.engine.stage_manager as sm
    from omni_cache.core.coverage import RowValidity

    orig_rules = sched._yoco_rules
    sm.fast_prefill_truncates = lambda runner: False
    sched._yoco_rules = lambda vllm_config: (False, orig_rules(vllm_config)[1])
    RowValidity.serves = lambda self, need: True


# ---- faults in the talker's keys (driver process) ------------------------------------------

def _talker_length_keys() -> None:
    """Talker blocks keyed by length only: the key of block ``j`` says only ``j`` (what vLLM's
    hash of the talker's placeholder prompt ``[0] * n`` amounts to)."""
    import omni_cache.core.talker_keys as tk

    orig = tk.talker_block_keys

    def talker_block_keys(prompt_token_ids, media, *, talker_prompt_len, block_size, seed=()):
        keys = orig(prompt_token_ids, media, talker_prompt_len=talker_prompt_len, block_size=block_size, seed=seed)
        return [f"length/{block_size}/{j}" for j in range(len(keys))]

    _replace(("omni_cache.core.talker_keys", "omni_cache.driver.talker_identity"), "talker_block_keys",
             talker_block_keys)


def _talker_media_dropped() -> None:
    """A media identifier left out of the talker's block keys: keys from token ids alone."""
    import omni_cache.core.talker_keys as tk

    orig = tk.talker_block_keys

    def talker_block_keys(prompt_token_ids, media, *, talker_prompt_len, block_size, seed=()):
        return orig(prompt_token_ids, [], talker_prompt_len=talker_prompt_len, block_size=block_size, seed=seed)

    _replace(("omni_cache.core.talker_keys", "omni_cache.driver.talker_identity"), "talker_block_keys",
             talker_block_keys)


def _talker_seed_dropped() -> None:
    """The talker's block keys without their seed (speaker, language, cache salt, LoRA): two
    voices of the same conversation share talker KV."""
    import omni_cache.core.talker_keys as tk

    orig = tk.talker_block_keys

    def talker_block_keys(prompt_token_ids, media, *, talker_prompt_len, block_size, seed=()):
        return orig(prompt_token_ids, media, talker_prompt_len=talker_prompt_len, block_size=block_size, seed=())

    _replace(("omni_cache.core.talker_keys", "omni_cache.driver.talker_identity"), "talker_block_keys",
             talker_block_keys)


def _async_placeholders_unresolved() -> None:
    """Under async scheduling the step's device input ids are not kept (the H200 defect of
    22d261f): a decode-filled block's tokens stay placeholders on the host, so its hash is
    never made and a later hit on it is not served (capped, or refused where no cap runs)."""
    from omni_cache.engine.stage_manager import OmniCacheStageManager

    OmniCacheStageManager.keep_async_inputs = lambda self, plan: None
    OmniCacheStageManager._scheduler_requests = lambda self: None  # (nor read from the scheduler: 24th session)


def _resume_rows_lost() -> None:
    """Rows lost across preemption: a request resumed after preemption hands off only the rows
    it recomputes, not its prefix hit's (the resumed view starts with no hit)."""
    from omni_cache.engine.stage_manager import OmniCacheStageManager

    orig = OmniCacheStageManager.new_step_starts

    def new_step_starts(self, scheduler_output):
        orig(self, scheduler_output)
        for rid in getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", set()) or set():
            if rid in self.reqs:
                self.reqs[rid].hit_tokens = 0

    OmniCacheStageManager.new_step_starts = new_step_starts


#: fault name → what plants it
FAULTS: dict[str, Callable[[], None]] = {
    "foreign_block": _foreign_block,
    "slot_shift": _slot_shift,
    "stale_generation": _stale_generation,
    "cap_disabled": _cap_disabled,
    "deferred_write_dropped": _deferred_write_dropped,
    "talker_length_keys": _talker_length_keys,
    "talker_media_dropped": _talker_media_dropped,
    "thinker_media_dropped": _thinker_media_dropped,
    "yoco_truncation_ignored": _yoco_truncation_ignored,
    "bit_flip": _bit_flip,
    "decode_rows_corrupted": _decode_rows_corrupted,
    "write_batch_shift": _write_batch_shift,
    "seam_off_by_one": _seam_off_by_one,
    "ledger_check_off": _ledger_check_off,
    "key_misaligned": _key_misaligned,
    "talker_seed_dropped": _talker_seed_dropped,
    "async_placeholders_unresolved": _async_placeholders_unresolved,
    "resume_rows_lost": _resume_rows_lost,
}


def plant(name: str) -> None:
    """Plant fault ``name`` in this process (once).

    Raises:
        KeyError: an unknown fault.
    """
    if name in _planted:
        return
    FAULTS[name]()
    _planted.append(name)
    print(f"{PLANTED} {name} in pid {os.getpid()}", file=sys.stderr, flush=True)
    evidence = os.environ.get(EVIDENCE_ENV)
    if evidence:  # one line per process: what was planted where (the mutation report counts them)
        with open(evidence, "a") as f:
            f.write(f"{name} {os.getpid()} {sys.argv[0] if sys.argv else ''}\n")


def plant_from_env() -> None:
    """The ``vllm.general_plugins`` entry point: plant the fault :data:`ENV` names, if any."""
    name = os.environ.get(ENV)
    if name:
        plant(name)


def write_plugin_dist(directory: Path) -> Path:
    """A ``*.dist-info`` in ``directory`` declaring :func:`plant_from_env` as a
    ``vllm.general_plugins`` entry point (put ``directory`` on ``PYTHONPATH``). Returns it."""
    d = Path(directory) / f"{DIST}-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0\n")
    (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{DIST} = tests.mutants:plant_from_env\n")
    return d


# as a pytest plugin (``-p tests.mutants``): plant in the test process before collection
plant_from_env()
