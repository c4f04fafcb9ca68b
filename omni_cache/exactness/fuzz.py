"""The differential exactness fuzzer: seeded conversation groups
(:mod:`omni_cache.exactness.conversations`) through three engines of one streaming mode —
cache off, vLLM-Omni's built-in cache, omni-cache — judged by the oracles of
:mod:`omni_cache.exactness.oracles`, a failure shrunk to a small reproducible case.

Every engine gets the same requests in the same schedule (a group's waves: per turn, its
requests together or one at a time). Per group, omni-cache runs either with the thinker's
cache alone (the talker reads no prefix-cache block: ``skip_reading_prefix_cache`` on stage 1)
or thinker + talker caches (``cache`` = ``"thinker"`` / ``"thinker+talker"``). The built-in
engine keeps the talker's prefix cache off (vLLM-Omni keeps it off: its talker prompt ids are
placeholders), so oracle (b) compares omni-cache with it where both served the same thinker
hit: tokens and every thinker → talker hand-off tensor bitwise, and audio bitwise with the
thinker's cache alone (a talker hit computes the talker's suffix over cached KV, which the
built-in has no counterpart for) — for requests sent alone; for requests in flight together
the prompt rows and tokens (their decode rows and audio depend on timing: RequestVerdict).
Oracle (c) compares with the cache-off engine: tokens
equal, prompt rows within the tolerance.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_cache.exactness import oracles
from omni_cache.exactness.conversations import Group, Knobs, make_group

CACHES = ("thinker", "thinker+talker")
ENGINE_NAMES = ("off", "builtin", "omni")
#: a concurrent batch's second cache-off run (the timing control), in ``results``
RERUN = "off_rerun"
#: the stage-config variant each engine runs (:func:`recording_stage_config`)
ENGINE_VARIANTS = {"off": "off", "builtin": "builtin", "omni": "omni_cache"}


def recording_stage_config(out_dir: str | Path, variant: str, *, streaming: bool, thinker: dict | None = None,
                           base: str | Path | None = None, in_process: bool = False) -> Path:
    """The CPU stage config (``base``; default the bundled ``qwen3_omni_cpu.yaml``) with
    hand-offs recorded (``out_dir/handoff``: thinker → talker; ``out_dir/codec``: talker →
    code2wav), cache counters in ``out_dir/metrics`` and served hits logged in
    ``out_dir/audit`` (``OMNI_CACHE_HIT_AUDIT``: the thinker's ``hits-*`` / ``blocks-*``, the
    talker's KV blocks ``talker-kv-*``), for ``variant``:

    - ``off``: the thinker's and the talker's prefix caches off;
    - ``builtin``: vLLM-Omni's own hidden-state cache on the thinker, the talker's off (as
      vLLM-Omni ships it);
    - ``omni_cache``: omni-cache on the thinker and the talker's content-keyed cache on (as
      the bundled config).

    ``thinker``: more stage-0 keys; ``streaming``: ``async_chunk``; ``in_process``: vLLM's
    ``uni`` executor on every stage (one process per stage; docs/cpu.md). Returns the YAML path
    (``out_dir/stage_config_<variant>.yaml``).

    Raises:
        ValueError: an unknown variant.
    """
    from omni_cache import settings
    from omni_cache.driver.stage_config import bundled_stage_config
    from omni_cache.driver.variants import derive_stage_config
    from omni_cache.engine.plugin import RECORDING_PIPELINE, register

    if variant not in ENGINE_VARIANTS.values():
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(ENGINE_VARIANTS.values())}")
    register()
    out_dir = Path(out_dir)
    env = {settings.HANDOFF_DUMP.name: str(out_dir / "handoff"), settings.METRICS_DIR.name: str(out_dir / "metrics"),
           settings.HIT_AUDIT.name: str(out_dir / "audit")}
    stages: dict[int, dict] = {0: dict(thinker or {})}
    if variant == "off":
        stages[0]["enable_prefix_caching"] = False
    else:
        env[settings.PREFIX_CACHE_BACKEND.name] = variant
    if variant != "omni_cache":
        stages[1] = {"enable_prefix_caching": False}
    if in_process:
        for sid in (0, 1, 2):
            stages.setdefault(sid, {})["distributed_executor_backend"] = "uni"
    return derive_stage_config(base or bundled_stage_config("qwen3_omni_cpu.yaml"),
                               out_dir / f"stage_config_{variant}.yaml", pipeline=RECORDING_PIPELINE,
                               top={"async_chunk": bool(streaming)}, stages=stages,
                               env={0: env, 1: {settings.HANDOFF_DUMP.name: str(out_dir / "codec"),
                                                  settings.HIT_AUDIT.name: str(out_dir / "audit")}})


@dataclass
class FuzzEngine:
    """A running pipeline for the fuzzer: ``pipe`` (an
    :class:`~omni_cache.driver.pipeline.OmniPipeline` or
    :class:`~omni_cache.driver.streaming.StreamingPipeline`) started from a
    :func:`recording_stage_config` written into ``dir``."""

    name: str
    pipe: Any
    dir: Path


@dataclass
class RequestVerdict:
    """One request of a group, judged.

    Attributes:
        conversation, turn: which request.
        prompt_tokens: thinker prompt length.
        hit: omni-cache's thinker hit (tokens); ``builtin_hit``: the built-in's.
        talker_hit: omni-cache's talker hit (tokens).
        served_blocks_verified / served_blocks_unverified: oracle (a)'s blocks.
        talker_blocks_verified / talker_blocks_unverified: oracle (a) on the talker's served KV
            blocks (:func:`talker_served_report`); unverified: the KV held, the writer's content
            not judged (its writer ran in an earlier group).
        vs_off: per key, how the prompt rows differ from cache off (:class:`~.oracles.RowDiff`).
        builtin_vs_off: the same for the built-in cache.
        concurrent: sent together with other requests (a batch of the group's schedule). Their
            decode steps share a batch whose make-up depends on when each request arrives
            (``AsyncOmni``) and vLLM's CPU kernels are not batch-invariant, so for them (b)
            holds the prompt rows and tokens bitwise, and reports the rest
            (``concurrent_handoff_equal``, ``audio_equal_builtin``); measured in
            docs/benchmarks.md ("Exactness fuzz").
        concurrent_handoff_equal: concurrent requests only: every hand-off tensor (decode rows
            too) bitwise equal to the built-in's.
        audio_equal_off / builtin_audio_equal_off: audio bitwise equal to cache off's.
        audio_equal_builtin: omni-cache's audio bitwise equal to the built-in's.
        off_rerun_audio_equal: concurrent requests only: the batch sent again to the cache-off
            engine reproduced this request's audio (False: the talker's batch, which depends
            on when the thinker's outputs arrive, changed it — vLLM's CPU kernels are not
            batch-invariant — so audio of concurrent requests is not held to (b)).
        violations: ``{"a"|"b"|"c": [mismatch, ...]}``; (b) also lists where it could not
            compare (``b_skipped``).
    """

    conversation: str
    turn: int
    prompt_tokens: int = 0
    hit: int = 0
    builtin_hit: int = 0
    talker_hit: int = 0
    served_blocks_verified: int = 0
    served_blocks_unverified: int = 0
    talker_blocks_verified: int = 0
    talker_blocks_unverified: int = 0
    vs_off: list[dict] = field(default_factory=list)
    builtin_vs_off: list[dict] = field(default_factory=list)
    concurrent: bool = False
    concurrent_handoff_equal: bool | None = None
    audio_equal_off: bool = True
    builtin_audio_equal_off: bool = True
    audio_equal_builtin: bool = True
    off_rerun_audio_equal: bool | None = None
    b_skipped: str | None = None
    violations: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class GroupResult:
    """A group's verdicts, the cache variant it ran, and how far rows that must never be
    served are from the right ones (:func:`foreign_distances`)."""

    seed: int
    knobs: dict
    cache: str
    streaming: bool
    describe: str
    requests: list[RequestVerdict]
    foreign_ulps: dict[str, dict] = field(default_factory=dict)
    #: engine → ``"<conversation>/<turn>"`` → the request id it ran under (its records' name)
    request_ids: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def violated(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.requests:
            for o, msgs in r.violations.items():
                if msgs:
                    out[o] = out.get(o, 0) + len(msgs)
        return out

    def as_dict(self) -> dict:
        d = asdict(self)
        d["violated"] = self.violated
        return d


def _params(pipe, *, talker_reads: bool) -> list:
    sps = copy.deepcopy(pipe.default_sampling_params())
    if not talker_reads:
        sps[1].skip_reading_prefix_cache = True  # SamplingParams derives it only at construction
    return sps


def _send(engine: FuzzEngine, requests: list, sps) -> list:
    if hasattr(engine.pipe, "run_many"):
        return engine.pipe.run_many(requests, sampling_params_list=sps)
    return engine.pipe.generate(requests, sps)


def run_group(group: Group, engines: dict[str, FuzzEngine], cache: str, *, streaming: bool,
              block_size: int = 32) -> GroupResult:
    """Send ``group``'s waves through every engine (``engines``: ``off``, ``builtin``,
    ``omni``; the same batches in the same order) and judge every request.

    Raises:
        ValueError: unknown ``cache`` or a missing engine.
        RuntimeError: a request failed in an engine (its error text).
    """
    if cache not in CACHES:
        raise ValueError(f"unknown cache {cache!r}; choose from {CACHES}")
    missing = set(ENGINE_NAMES) - set(engines)
    if missing:
        raise ValueError(f"missing engines {sorted(missing)}")
    results: dict[str, dict[tuple[int, int], Any]] = {n: {} for n in (*ENGINE_NAMES, RERUN)}
    for wave in group.waves:
        for batch in wave:
            reqs = [group.conversations[c].request(t) for c, t in batch]
            # a batch sent together runs twice with the cache off: the control for how much
            # of a concurrent request's output depends on timing alone (see RequestVerdict)
            order = ENGINE_NAMES + ((RERUN,) if len(batch) > 1 else ())
            for name in order:
                eng = engines["off" if name == RERUN else name]
                sps = _params(eng.pipe, talker_reads=(name == "omni" and cache == "thinker+talker"))
                outs = _send(eng, copy.deepcopy(reqs), sps)
                for key, res in zip(batch, outs, strict=True):
                    if res.error:
                        raise RuntimeError(f"{name}: {group.conversations[key[0]].name} turn {key[1]}: {res.error}")
                    results[name][key] = res
    return judge(group, engines, results, cache, streaming=streaming, block_size=block_size)


def records(engine_dir: str | Path, request_id: str, sub: str = "handoff") -> list[dict]:
    """The hand-offs a stage recorded for ``request_id`` into ``engine_dir/sub``
    (``<seq>-<request id>[-<engine suffix>].pt``, :func:`omni_cache.engine.handoff.record_payload`),
    in the order written: tensor name → CPU tensor."""
    import torch

    rid = re.escape(re.sub(r"[^A-Za-z0-9_.-]", "_", request_id))
    pat = re.compile(rf"(\d+)-{rid}(?:[-_].*)?\.pt")
    found = [(int(m.group(1)), p) for p in (Path(engine_dir) / sub).glob("*.pt") if (m := pat.fullmatch(p.name))]
    return [torch.load(p) for _, p in sorted(found, key=lambda x: x[0])]


def audit_lines(engine_dir: str | Path) -> list[dict]:
    """The served hits a thinker logged into ``engine_dir/audit`` (``OMNI_CACHE_HIT_AUDIT``)."""
    lines = []
    for p in sorted((Path(engine_dir) / "audit").glob("hits-*.jsonl")):
        lines += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return lines


def _owner(engine_rid: str, ids: Iterable[str]) -> str | None:
    """The result id an engine-internal request id belongs to (vLLM-Omni may append a suffix)."""
    for i in ids:
        if engine_rid == i or engine_rid.startswith(i + "-") or engine_rid.startswith(i + "_"):
            return i
    return None


def block_digest_lines(engine_dir: str | Path) -> list[dict]:
    """The filled blocks' writer digests a thinker logged into ``engine_dir/audit``
    (:class:`omni_cache.engine.metrics.BlockDigestAudit`)."""
    lines = []
    for p in sorted((Path(engine_dir) / "audit").glob("blocks-*.jsonl")):
        lines += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return lines


def writer_digests(engine_dir: str | Path, ids: Iterable[str]) -> dict[tuple[str, int], list[dict[str, str]]]:
    """``(result id, block index) → [hand-off key → digest, ...]`` (one per time that request
    computed the block) from :func:`block_digest_lines`, engine ids mapped to ``ids``."""
    ids = list(ids)
    out: dict[tuple[str, int], list[dict[str, str]]] = {}
    for line in block_digest_lines(engine_dir):
        w = _owner(line["writer"], ids)
        if w is not None:
            out.setdefault((w, int(line["block"])), []).append(line["digests"])
    return out


def served_rows_report(engine_dir: str | Path, results: Iterable[Any], *, block_size: int = 32,
                       rows: dict[str, dict] | None = None) -> dict[str, tuple[int, int, list[str]]]:
    """Oracle (a) over an engine's audited hits: for every result (``request_id``,
    ``num_prompt_tokens``) that was served a hit, ``(blocks verified, blocks unverified,
    mismatches)`` (:func:`~omni_cache.exactness.oracles.served_rows_mismatches`); writers are
    looked up among ``results`` (a writer outside them is unverified); a block its writer's
    recorded hand-off does not hold (filled while decoding) is checked against the writer's
    block digest (:func:`block_digest_lines`). ``rows``: request id → prompt rows already read
    (else read from the records)."""
    results = list(results)
    rows = dict(rows or {})
    for r in results:
        if r.request_id not in rows:
            rows[r.request_id] = oracles.prompt_rows(records(engine_dir, r.request_id), r.num_prompt_tokens)
    digests = writer_digests(engine_dir, rows)
    out: dict[str, tuple[int, int, list[str]]] = {}
    for line in audit_lines(engine_dir):
        rid = _owner(line["request"], rows)
        if rid is None:
            continue
        writers = [_owner(w, rows) if w else None for w in line["writers"]]
        ver, unver, bad = oracles.served_rows_mismatches(rows[rid], line["hit_tokens"], writers, rows, block_size,
                                                         writer_digests=digests)
        v0, u0, b0 = out.get(rid, (0, 0, []))
        out[rid] = (v0 + ver, u0 + unver, b0 + bad)
    return out


def talker_kv_lines(engine_dir: str | Path) -> list[dict]:
    """The talker's KV audit lines (``engine_dir/audit/talker-kv-*.jsonl``,
    :class:`omni_cache.engine.talker_audit.TalkerKVAudit`), in the order logged."""
    out = []
    for p in sorted((Path(engine_dir) / "audit").glob("talker-kv-*.jsonl")):
        out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


def talker_served_report(engine_dir: str | Path, results: Iterable[Any], rows: Mapping[str, dict], chat,
                         *, block_size: int = 32) -> dict[str, tuple[int, int, list[str]]]:
    """Oracle (a) on the talker's served KV for the readers among ``results`` (``request_id``,
    ``prompt_token_ids``): per reader ``(blocks verified, blocks unverified, mismatches)`` —
    each served block bitwise the KV its writer left (:func:`~.oracles.talker_kv_mismatches`)
    and, where the writer is among ``results``, the writer's content up to the block the
    reader's (:func:`~.oracles.talker_content_mismatches`; ``rows``: request id → prompt rows,
    their embedding key read). ``chat``: :class:`~.oracles.ChatTokens`."""
    by_id = {r.request_id: r for r in results}
    bad, served = oracles.talker_kv_mismatches(talker_kv_lines(engine_dir))
    out: dict[str, tuple[int, int, list[str]]] = {}

    def add(rid, v=0, u=0, msg=None):
        v0, u0, b0 = out.get(rid, (0, 0, []))
        out[rid] = (v0 + v, u0 + u, b0 + ([msg] if msg else []))

    for reader, msg in bad:
        rid = _owner(reader, by_id)
        if rid is not None:
            add(rid, msg=f"talker KV: {msg}")
    for s in served:
        rid, wid = _owner(s.reader, by_id), _owner(s.writer, by_id)
        if rid is None:
            continue
        if wid is None:
            add(rid, u=1)
            continue
        emb = [next(v for k, v in rows[x].items() if k in oracles.EMBEDDING_KEYS) for x in (rid, wid)]
        why = oracles.talker_content_mismatches(s.block, by_id[rid].prompt_token_ids, by_id[wid].prompt_token_ids,
                                                emb[0], emb[1], chat, block_size)
        add(rid, v=why is None, msg=why and f"talker {why} ({wid})")
    return out


def judge(group: Group, engines: dict[str, FuzzEngine], results: dict[str, dict], cache: str, *,
          streaming: bool, block_size: int = 32) -> GroupResult:
    """Apply oracles (a), (b), (c) to every request of a group that ran (``results``:
    engine → (conversation, turn) → result)."""
    rows: dict[str, dict[tuple[int, int], dict]] = {n: {} for n in ENGINE_NAMES}
    recs: dict[str, dict[tuple[int, int], list]] = {n: {} for n in ENGINE_NAMES}
    for name in ENGINE_NAMES:
        for key, res in results[name].items():
            recs[name][key] = records(engines[name].dir, res.request_id)
            rows[name][key] = oracles.prompt_rows(recs[name][key], res.num_prompt_tokens)
    served = served_rows_report(engines["omni"].dir, results["omni"].values(), block_size=block_size,
                                rows={res.request_id: rows["omni"][key] for key, res in results["omni"].items()})
    talker = talker_served_report(engines["omni"].dir, results["omni"].values(),
                                  {res.request_id: rows["omni"][key] for key, res in results["omni"].items()},
                                  _chat_tokens(engines["omni"].pipe.model_dir), block_size=block_size)
    verdicts = [_judge_request(group, key, results, rows, recs, served, cache, talker)
                for key in sorted(results["omni"])]
    ids = {n: {f"{group.conversations[c].name}/{t}": res.request_id for (c, t), res in results[n].items()}
           for n in ENGINE_NAMES}
    return GroupResult(group.seed, group.knobs.as_dict(), cache, streaming, group.describe(), verdicts,
                       foreign_distances(group, rows["off"]), ids)


@functools.cache
def _chat_tokens(model_dir) -> oracles.ChatTokens:
    from transformers import AutoTokenizer

    return oracles.ChatTokens.of(AutoTokenizer.from_pretrained(model_dir))


def _judge_request(group, key, results, rows, recs, served, cache, talker) -> RequestVerdict:
    off, bi, on = (results[n][key] for n in ENGINE_NAMES)
    v = RequestVerdict(group.conversations[key[0]].name, key[1], on.num_prompt_tokens, on.num_cached_tokens,
                       bi.num_cached_tokens, on.talker_num_cached_tokens)
    v.concurrent = key in results[RERUN]
    v.audio_equal_builtin = _same_audio(on.audio, bi.audio)
    if v.concurrent:
        v.off_rerun_audio_equal = _same_audio(results[RERUN][key].audio, off.audio)
    # (a) served rows = their writer's
    v.served_blocks_verified, v.served_blocks_unverified, a = served.get(on.request_id, (0, 0, []))
    v.talker_blocks_verified, v.talker_blocks_unverified, ta = talker.get(on.request_id, (0, 0, []))
    a = a + ta
    # (b) omni-cache = built-in, where both served the same hit
    b = []
    if on.num_cached_tokens != bi.num_cached_tokens:
        v.b_skipped = f"hits differ: omni-cache {on.num_cached_tokens}, built-in {bi.num_cached_tokens}"
    else:
        if on.token_ids != bi.token_ids:
            b.append("thinker tokens differ from the built-in cache's")
        whole = oracles.handoff_mismatches(recs["omni"][key], recs["builtin"][key])
        if not v.concurrent:
            b += whole
            if cache == "thinker" and not _same_audio(on.audio, bi.audio):
                b.append("audio differs from the built-in cache's")
        else:
            # in flight together: the prompt rows bitwise; decode rows and audio depend on
            # which requests share a step, i.e. on timing (see RequestVerdict.concurrent)
            b += [f"{k}: prompt rows differ" for k in rows["omni"][key]
                  if not torch.equal(rows["omni"][key][k], rows["builtin"][key][k])]
            v.concurrent_handoff_equal = not whole
    # (c) against cache off
    diffs, c = oracles.compare_prompt_rows(rows["omni"][key], rows["off"][key], on.num_cached_tokens)
    if on.token_ids != off.token_ids:
        c.append("thinker tokens differ from cache off's")
    v.vs_off = [d.as_dict() for d in diffs]
    v.builtin_vs_off = [d.as_dict() for d in oracles.compare_prompt_rows(rows["builtin"][key], rows["off"][key],
                                                                          bi.num_cached_tokens)[0]]
    v.audio_equal_off = _same_audio(on.audio, off.audio)
    v.builtin_audio_equal_off = _same_audio(bi.audio, off.audio)
    v.violations = {"a": a, "b": b, "c": c}
    return v


def _same_audio(x, y) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return x.shape == y.shape and bool(np.array_equal(x, y))


def foreign_distances(group: Group, rows: dict[tuple[int, int], dict]) -> dict[str, dict]:
    """How far rows that must never be served are from the right ones, per kind: ``{"min":
    least row-scale ulps met, "rows": rows compared, "beyond": rows beyond oracle (c)'s
    tolerance}`` (non-embedding keys), for

    - ``shifted``: a request's cache-off rows against its own rows one position earlier (a
      row served at the wrong slot);
    - ``<change>`` (a variant's, e.g. ``word_swap``, ``image_reencode``): two cache-off
      requests of one turn whose content differs, over the non-embedding rows from the first
      position whose embedding row differs on (a row of another prompt).
    """
    out: dict[str, dict] = {}

    def note(kind: str, u) -> None:
        if u.numel():
            o = out.setdefault(kind, {"min": float("inf"), "rows": 0, "beyond": 0})
            o["min"] = min(o["min"], float(u.min()))
            o["rows"] += int(u.numel())
            o["beyond"] += int((u > oracles.TOLERANCE_ULPS).sum())

    keys = sorted(rows)
    for k in keys:
        for name, t in rows[k].items():
            if name not in oracles.EMBEDDING_KEYS and t.shape[0] > 1:
                note("shifted", oracles.row_ulps(t[1:], t[:-1]))
    for i, k1 in enumerate(keys):
        for k2 in keys[i + 1:]:
            if k1[1] != k2[1]:
                continue
            r1, r2 = rows[k1], rows[k2]
            emb = next((k for k in oracles.EMBEDDING_KEYS if k in r1 and k in r2), None)
            if emb is None:
                continue
            n = min(r1[emb].shape[0], r2[emb].shape[0])
            differs = ~(r1[emb][:n] == r2[emb][:n]).all(dim=-1)
            if not bool(differs.any()):
                continue  # the same content: no foreign rows here
            start = int(differs.nonzero()[0, 0])
            kind = (group.conversations[k2[0]].change or "base").split("@")[0]
            for name in set(r1) & set(r2) - oracles.EMBEDDING_KEYS:
                note(kind, oracles.row_ulps(r1[name][start:n], r2[name][start:n]))
    return out


def merge_foreign(per_group) -> dict[str, dict]:
    """Per kind over groups: the least row-scale ulps, rows compared, rows beyond the tolerance."""
    out: dict[str, dict] = {}
    for f in per_group:
        for k, v in f.items():
            o = out.setdefault(k, {"min": float("inf"), "rows": 0, "beyond": 0})
            o["min"], o["rows"], o["beyond"] = min(o["min"], v["min"]), o["rows"] + v["rows"], o["beyond"] + v["beyond"]
    return out


def shrink(seed: int, knobs: Knobs, fails: Callable[[Group], bool], *, budget: int = 8) -> tuple[Knobs, int]:
    """Greedy shrink of a failing case: lower one knob at a time (fewer turns, fewer variants,
    no concurrency, no media, shorter prose), keeping a change while the case still fails.
    ``fails(group)`` runs a group and says whether it still fails (each run uses a fresh
    salt, so it starts from an empty cache). Returns ``(smallest failing knobs, runs used)``."""
    runs = 0
    cur = knobs
    changed = True
    while changed and runs < budget:
        changed = False
        for cand in _smaller(cur):
            if runs >= budget:
                break
            runs += 1
            if fails(make_group(seed, cand, salt=f"{seed}-shrink{runs}")):
                cur, changed = cand, True
                break
    return cur, runs


def _smaller(k: Knobs) -> list[Knobs]:
    from dataclasses import replace

    out = []
    if k.turns > 1:
        out.append(replace(k, turns=k.turns - 1))
    if k.variants > 0:
        out.append(replace(k, variants=k.variants - 1))
    if k.concurrent:
        out.append(replace(k, concurrent=False))
    if k.media:
        out.append(replace(k, media=False))
    if k.system_words > 16:
        out.append(replace(k, system_words=k.system_words // 2))
    return out


def repro_command(seed: int, knobs: Knobs, cache: str, streaming: bool) -> str:
    """The command that runs one case again (``tests/lanes/fuzz_exactness.py``)."""
    return (f"python -m tests.lanes.fuzz_exactness --seed {seed} --groups 1 --cache {cache} "
            f"--modes {'streaming' if streaming else 'non-streaming'} --turns {knobs.turns} "
            f"--variants {knobs.variants} --system-words {knobs.system_words}"
            + ("" if knobs.media else " --no-media") + ("" if knobs.concurrent else " --no-concurrent"))
