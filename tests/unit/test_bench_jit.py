"""benchmarks.prefill.jit: Triton compiles read from a variant's log and matched with its TTFT
spikes (engine-free: a log written here in vLLM's format)."""

from __future__ import annotations

import time

import yaml

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
    assert "floor #3 TTFT 1100 ms (p50 95): no compile logged while it ran" in text


def test_verbose_jit_monitor_sets_every_stage(tmp_path):
    cfg = tmp_path / "stage_config_off.yaml"
    cfg.write_text(yaml.safe_dump({"async_chunk": True, "stages": [{"stage_id": 0}, {"stage_id": 1,
                                                                    "jit_monitor_verbose": False}]}))
    jit.verbose_jit_monitor(cfg)
    raw = yaml.safe_load(cfg.read_text())
    assert [st.get("jit_monitor_verbose") for st in raw["stages"]] == [True, False]  # a stage's own setting kept
    assert raw["async_chunk"] is True
