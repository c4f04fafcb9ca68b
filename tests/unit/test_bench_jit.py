"""benchmarks.prefill.jit: Triton compiles read from a variant's log and matched with its TTFT
spikes (engine-free: a log written here in vLLM's format)."""

from __future__ import annotations

import os
import time

from benchmarks.prefill import jit


def _line(t: float, stage: int, kernel: str) -> str:
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(t))
    return (f"(StageEngineCoreProc_stage{stage}_replica0 pid=4821) WARNING {stamp} [jit_monitor.py:141] Triton "
            f"kernel JIT compilation during inference: {kernel}. This causes a latency spike; consider "
            "extending warmup to cover this shape/config.\n")


def test_compiles_after_warmup_are_counted_and_matched_with_spikes(tmp_path):
    t0 = float(int(time.time()) - 100)  # warm-up ends
    log = tmp_path / "log_omni_cache.txt"
    log.write_text(_line(t0 - 30, 0, "fused_moe_kernel")  # during warm-up: not counted
                   + "INFO some other line\n"
                   + _line(t0 + 10, 0, "fused_moe_kernel")  # during request 1 (a spike)
                   + _line(t0 + 40, 1, "_bmm_outer_product_kernel")  # in a second warm-up (a restart)
                   + _line(t0 + 55, 1, "_bmm_outer_product_kernel"))  # between requests
    rows = [{"index": i, "measure": True, "ttft_ms": ms, "started_unix": t0 + start}
            for i, (start, ms) in enumerate([(2, 90), (9.5, 1200), (20, 95), (30, 1100), (50, 85)])]
    rows.append({"index": 9, "measure": False, "ttft_ms": 5000, "started_unix": t0 + 60})  # untimed
    rep = jit.jit_report(tmp_path, ["omni_cache", "off"], {"omni_cache": [(t0 - 60, t0), (t0 + 35, t0 + 45)]},
                         {"floor": {"omni_cache": rows, "off": []}})
    assert set(rep) == {"omni_cache"}  # "off" was never timed
    r = rep["omni_cache"]
    assert r["compiles_after_warmup"] == 2
    assert r["by_stage_and_kernel"] == {"stage 0: fused_moe_kernel": 1, "stage 1: _bmm_outer_product_kernel": 1}
    spikes = {s["index"]: s["compiles_while_it_ran"] for s in r["ttft_spikes"]}
    assert spikes == {1: ["stage 0: fused_moe_kernel"], 3: []}  # p50 95 ms: 1,200 and 1,100 ms are spikes
    text = jit.format_jit(rep)
    assert "floor #1 TTFT 1200 ms (p50 95): stage 0: fused_moe_kernel" in text
    assert "floor #3 TTFT 1100 ms (p50 95): no compile or GC" in text


def test_compiles_in_tritons_disk_cache_count_while_a_request_ran(tmp_path):
    # vLLM's monitor logs a kernel's first compile only; Triton writes <hash>/<name>.json per compile
    t0 = float(int(time.time()) - 100)
    (tmp_path / "log_omni_cache.txt").write_text(_line(t0 + 10, 0, "fused_moe_kernel"))
    cache = tmp_path / "triton"

    def compiled(h: str, name: str, t: float) -> None:
        (cache / h).mkdir(parents=True)
        for f in (f"{name}.json", f"__grp__{name}.json", f"{name}.cubin"):
            (cache / h / f).write_text("{}")
            os.utime(cache / h / f, (t, t))

    compiled("a", "fused_moe_kernel", t0 + 10.4)  # the compile the log names: not counted twice
    compiled("b", "fused_moe_kernel", t0 + 30.2)  # another shape, while request 3 ran: the log is silent
    compiled("c", "triton_poi_fused_0", t0 - 20)  # during warm-up
    compiled("d", "_bmm_outer_product_kernel", t0 + 70)  # after the last request: no request ran
    rows = [{"index": i, "measure": True, "ttft_ms": ms, "e2e_ms": ms + 50, "started_unix": t0 + start}
            for i, (start, ms) in enumerate([(2, 90), (9.5, 1200), (20, 95), (30, 1100), (50, 85)])]
    args = (tmp_path, ["omni_cache"], {"omni_cache": [(t0 - 60, t0)]}, {"floor": {"omni_cache": rows}})
    assert jit.jit_report(*args)["omni_cache"]["compiles_after_warmup"] == 1  # no cache: the log alone
    r = jit.jit_report(*args, [cache])["omni_cache"]
    assert r["by_stage_and_kernel"] == {"stage 0: fused_moe_kernel": 1, "cache: fused_moe_kernel": 1}
    assert {s["index"]: s["compiles_while_it_ran"] for s in r["ttft_spikes"]} == {
        1: ["stage 0: fused_moe_kernel"], 3: ["cache: fused_moe_kernel"]}
    assert [e["kernel"] for e in jit.cache_compiles([cache], t0)] == ["fused_moe_kernel"] * 2 + [
        "_bmm_outer_product_kernel"]


def test_triton_cache_dirs_follow_triton_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert jit.triton_cache_dirs()[0] == tmp_path
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "missing"))
    assert tmp_path / "missing" not in jit.triton_cache_dirs()


def test_gc_pauses_logged_by_vllms_gc_debugger_are_matched_with_spikes(tmp_path):
    # VLLM_GC_DEBUG=1 (vllm/utils/gc_utils.py): one line per collection; short ones are not reported
    t0 = float(int(time.time()) - 100)

    def gc(t: float, ms: float, gen: int) -> str:
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(t))
        return (f"(StageEngineCoreProc_stage0_replica0 pid=18876) INFO {stamp} [gc_utils.py:81] GC took {ms:.3f}ms "
                f"to complete. Collected 76 objects (out of 871130) in GC generation {gen}.\n")

    (tmp_path / "log_omni_cache.txt").write_text(gc(t0 - 30, 390.5, 2) + gc(t0 + 10, 412.4, 2) + gc(t0 + 11, 0.3, 0)
                                                 + gc(t0 + 50, 35.0, 1))
    rows = [{"index": i, "measure": True, "ttft_ms": ms, "started_unix": t0 + start}
            for i, (start, ms) in enumerate([(2, 90), (9.5, 1200), (20, 95), (50, 85)])]
    r = jit.jit_report(tmp_path, ["omni_cache"], {"omni_cache": [(t0 - 60, t0)]},
                       {"floor": {"omni_cache": rows}})["omni_cache"]
    assert r["gc_pauses_after_warmup"] == ["stage 0: GC gen 2 412 ms", "stage 0: GC gen 1 35 ms"]
    assert [(s["index"], s["gc_pauses_while_it_ran"]) for s in r["ttft_spikes"]] == [(1, ["stage 0: GC gen 2 412 ms"])]
    assert "floor #1 TTFT 1200 ms (p50 92): stage 0: GC gen 2 412 ms" in jit.format_jit({"omni_cache": r})
