"""Device → pinned host staging of one step's hand-off rows, and of a step's input ids.

Why (found on H100s, 2026-11-26, docs/gpu.md "Zero overhead"): vLLM-Omni builds a step's
hand-off to the next stage on a background thread, one step late, under async scheduling
(``OmniAsyncGPUModelRunnerOutput``). Handing it device tensors made that thread copy each
request's rows to the host with a synchronous copy on the stream that already holds the next
step's forward, so the engine waited for step N+1 before it could return step N: the overlap
of host and GPU that async scheduling exists for was lost on every step, hit or not.
vLLM-Omni's own cache stages the whole step's rows to the host at save time for the same
reason ("The engine thread never waits on this thread's device→host copy",
``vllm_omni/core/prefix_cache/manager.py``). Here:

- :class:`HostStager` copies, at save time, every hand-off key's rows of the whole step off
  the forward's buffers with one device ``cat`` per key on the current stream (so a CUDA-graph
  replay of the next step cannot overwrite them), then device → pinned host on a side stream
  (non-blocking), and records one event. :meth:`StagedStep.wait` waits for that event only
  (normally long complete when the builder runs), never for later work on the stream.
- :meth:`HostStager.stage_prefixes` (``OMNI_CACHE_HANDOFF_STAGING=snapshot``, the default since the
  compiled group ran with it on an H100 as with ``host``):
  vLLM-Omni's runner copies every step's outputs to pinned host memory for its payload
  builder whatever the prefix cache does (``_snapshot_omni_output_tensors_for_async_output``),
  so a second copy of the fresh rows is waste: only a hit's cached prefix rows (read from the
  device pool) are copied, into a pinned buffer with room for the request's fresh rows, which
  :meth:`StagedStep.complete` copies in from vLLM-Omni's snapshot when the builder runs. A step
  without a hit copies nothing.
- :class:`KeptIds` keeps a step's input ids (async scheduling: the decode tokens' values exist
  only on the device) with one non-blocking copy to pinned memory (a slice of a
  :class:`KeptIdsRing`), read back on the host once the copy has landed (:meth:`KeptIds.ready`),
  never synchronising with the stream.

Pinned buffers come from torch's caching host allocator (``torch.empty(..., pin_memory=True)``):
reused once every copy that used them has completed and the step's views are dropped.
Engine-free (torch only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class StagedStep:
    """One step's hand-off rows in pinned host memory.

    Attributes:
        host: key → ``[rows, width]`` pinned CPU tensor (the key's dtype): every staged
            request's rows, in batch order (a hit's prefix rows then its fresh rows).
        spans: request → its rows ``[start, end)`` in ``host``.
        event: recorded after the device → host copies (``None``: nothing was copied).
        prefix: request → rows of its span that were copied at save time, for a step staged
            by :meth:`HostStager.stage_prefixes` (its fresh rows ``[start + prefix, end)``
            are copied in by :meth:`complete`); empty for :meth:`HostStager.stage`.
    """

    host: dict[str, torch.Tensor]
    spans: dict[str, tuple[int, int]]
    event: torch.cuda.Event | None
    prefix: dict[str, int] = field(default_factory=dict)

    def wait(self) -> None:
        """Wait until the copies of this step are complete (only those)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def rows(self, req_id: str) -> dict[str, torch.Tensor]:
        """Key → the request's rows ``[n, width]`` (views of :attr:`host`; call :meth:`wait`
        first).

        Raises:
            KeyError: a request the step did not stage.
        """
        a, b = self.spans[req_id]
        return {k: t[a:b] for k, t in self.host.items()}

    def complete(self, req_id: str, fresh: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Key → the request's rows ``[prefix + n, width]``: its staged prefix rows followed by
        ``fresh`` (key → ``[n, width]``, host or device; copied in after its prefix).

        Raises:
            KeyError: a request whose prefix the step did not stage.
            ValueError: ``fresh`` does not fill the room left for it.
        """
        self.wait()
        a, b = self.spans[req_id]
        p = self.prefix[req_id]
        out = {}
        # the buffers were made at save time, under vLLM's inference mode; the payload builder
        # calls this on its own thread, outside it (an in-place update there is refused)
        with torch.inference_mode():
            for k, t in self.host.items():
                rows = fresh[k]
                if rows.shape[0] != b - a - p:
                    raise ValueError(f"request {req_id!r}, key {k!r}: {rows.shape[0]} fresh rows for a room of "
                                     f"{b - a - p}")
                t[a + p:b].copy_(rows)
                out[k] = t[a:b]
        return out


class HostStager:
    """Stages steps' hand-off rows from one CUDA device to pinned host memory.

    Args:
        device: the CUDA device the rows live on (with its index); a CPU device stages by
            copying alone (no stream, no pinning: the same contract, for tests on the CPU).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stage(self, keys: Sequence[str], req_ids: Sequence[str],
              parts: Mapping[str, Sequence[Mapping[str, torch.Tensor]]]) -> StagedStep:
        """Copy the step's rows to the host, asynchronously.

        Args:
            keys: the hand-off keys (each part carries all of them).
            req_ids: the step's requests in batch order.
            parts: request → its row groups in prompt order (e.g. ``[prefix, fresh]``), each
                key → ``[n_i, width]`` on :attr:`device` (same ``n_i`` for every key).

        Returns:
            The :class:`StagedStep`; its rows are valid after :meth:`StagedStep.wait`.
        """
        spans: dict[str, tuple[int, int]] = {}
        off = 0
        for rid in req_ids:
            n = sum(int(p[keys[0]].shape[0]) for p in parts[rid]) if keys else 0
            spans[rid] = (off, off + n)
            off += n
        if not keys:
            return StagedStep({}, spans, None)
        # off the forward's (possibly CUDA-graph static) buffers, on the current stream
        dev = {k: torch.cat([p[k] for rid in req_ids for p in parts[rid]]) for k in keys}
        if self.stream is None:
            return StagedStep(dev, spans, None)
        self.stream.wait_stream(current_stream(self.device))
        host: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self.stream):
            for k, t in dev.items():
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # not reused by the allocator before the copy ran
                host[k] = h
            event = torch.cuda.Event()
            event.record(self.stream)
        return StagedStep(host, spans, event)


    def stage_prefixes(self, keys: Sequence[str],
                       hits: Sequence[tuple[str, Mapping[str, torch.Tensor], int]]) -> StagedStep:
        """Copy the step's hits' cached prefix rows to the host, asynchronously, each into a
        pinned buffer with room for the request's fresh rows (:meth:`StagedStep.complete`).

        Args:
            keys: the hand-off keys (each prefix carries all of them).
            hits: ``(request, prefix, fresh rows)`` in batch order: ``prefix`` key →
                ``[hit_tokens, width]`` rows on :attr:`device` (the pool's read: not a buffer a
                later forward reuses), ``fresh rows`` the request's rows this step (tokens).

        Returns:
            The :class:`StagedStep` (``prefix``: request → its hit tokens).
        """
        spans: dict[str, tuple[int, int]] = {}
        prefix: dict[str, int] = {}
        off = 0
        for rid, rows, n_fresh in hits:
            p = int(rows[keys[0]].shape[0]) if keys else 0
            spans[rid], prefix[rid] = (off, off + p + n_fresh), p
            off += p + n_fresh
        if not keys or not hits:
            return StagedStep({}, spans, None, prefix)
        host: dict[str, torch.Tensor] = {}
        pin = self.stream is not None
        for k in keys:
            t0 = hits[0][1][k]
            host[k] = torch.empty((off, t0.shape[1]), dtype=t0.dtype, pin_memory=pin)
        if self.stream is None:
            for rid, rows, _ in hits:
                a = spans[rid][0]
                for k in keys:
                    host[k][a:a + prefix[rid]].copy_(rows[k])
            return StagedStep(host, spans, None, prefix)
        self.stream.wait_stream(current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for rid, rows, _ in hits:
                a = spans[rid][0]
                for k in keys:
                    t = rows[k]
                    host[k][a:a + prefix[rid]].copy_(t, non_blocking=True)
                    t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return StagedStep(host, spans, event, prefix)


#: entries of the pinned ring that keeps steps' input ids (:class:`KeptIdsRing`): a step keeps at
#: most its ``max_num_batched_tokens`` ids (8,192 in the bundled configs), so a lap takes at least
#: 128 steps, while a kept slice is read within a block of decode steps plus a step or two
KEPT_RING_ENTRIES = 1 << 20


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` (``device``: a CUDA device), its ``Stream`` object
    looked up by the raw stream handle instead of built per call: ``Event.record()`` without a
    stream builds one, measured 49 us of a decode step's 0.47 ms save on an H200 host
    (``benchmarks.sync_probe --profile``, docs/gpu.md "Twenty-third session")."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


class KeptIds:
    """A step's input ids ``[n]`` kept for reading on the host later without a sync: on CUDA
    one non-blocking copy to pinned memory (a slice of a :class:`KeptIdsRing`, or a buffer of its
    own) plus an event; elsewhere a copy."""

    __slots__ = ("host", "event", "ring", "start")

    def __init__(self, ids: torch.Tensor, host: torch.Tensor | None = None,
                 ring: KeptIdsRing | None = None, start: int = 0) -> None:
        self.ring, self.start = ring, start
        if ids.device.type == "cuda":
            self.host = host if host is not None else torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self.host.copy_(ids, non_blocking=True)
            self.event: torch.cuda.Event | None = torch.cuda.Event()
            self.event.record(current_stream(ids.device))
        else:
            self.host = ids.clone() if host is None else host.copy_(ids)
            self.event = None

    @property
    def lost(self) -> bool:
        """Whether the ring went a full lap past this slice (its ids overwritten: never read)."""
        return self.ring is not None and self.ring.written > self.start + self.ring.entries

    def ready(self) -> bool:
        """Whether the copy has reached the host (never waits: ``torch.cuda.Event.query``);
        False for a :attr:`lost` slice."""
        if self.lost:
            return False
        if self.event is not None:
            if not self.event.query():
                return False
            self.event = None  # (complete: values() need not synchronise)
        return True

    def values(self, start: int, end: int) -> list[int]:
        """The ids ``[start, end)`` as Python ints (waits for this copy if it is still in
        flight: callers ask :meth:`ready` first, a wait here would stall the engine's overlap
        of host and device).

        Raises:
            RuntimeError: the slice is :attr:`lost`.
        """
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if self.lost:
            raise RuntimeError("omni-cache: kept input ids were overwritten (the ring went a lap past them)")
        return self.host[start:end].tolist()


class KeptIdsRing:
    """Pinned host memory keeping steps' input ids (:class:`KeptIds`), used in laps: no pinned
    allocation per step (torch's caching host allocator took ~0.27 ms per allocation on an H100
    while copies were in flight, :class:`~omni_cache.core.row_index.StagingRing`). Each step's ids
    go to the next contiguous slice (a slice that would cross the end starts the next lap); a
    slice stays valid until the ring has handed out a full lap past it — its reader checks
    (:attr:`KeptIds.lost`) and never reads an overwritten slice. Ids longer than half the
    ring, or of another dtype than the first ids kept, get a buffer of their own.

    Args:
        device: the device the ids live on (CUDA: pinned memory; the CPU: plain memory, for tests).
        entries: the ring's length in ids.
    """

    def __init__(self, device: torch.device, entries: int = KEPT_RING_ENTRIES) -> None:
        self.device, self.entries = device, entries
        self.written = 0  # ring entries handed out so far, laps included
        self._buf: torch.Tensor | None = None

    def keep(self, ids: torch.Tensor) -> KeptIds:
        """Keep ``ids`` (``[n]``, on :attr:`device`): one non-blocking copy to the ring."""
        n = ids.numel()
        if self._buf is None:
            self._buf = torch.empty(self.entries, dtype=ids.dtype, pin_memory=self.device.type == "cuda")
        if n > self.entries // 2 or ids.dtype != self._buf.dtype:
            return KeptIds(ids)
        pos = self.written % self.entries
        if pos + n > self.entries:  # the slice would cross the end: start the next lap
            self.written += self.entries - pos
            pos = 0
        start, self.written = self.written, self.written + n
        return KeptIds(ids.reshape(-1), host=self._buf[pos:pos + n], ring=self, start=start)
