"""benchmarks.profile_stage's stall report: the requests over 1.5 x the median prefill and the
stacks that held them (engine-free: py-spy's raw format written by hand)."""

from benchmarks.profile_stage import heaviest_stacks, stalls

FAST = "thread (0x1);main (e.py:1);execute_model (runner.py:2);_model_forward (runner.py:3) 14\n"
SLOW = ("thread (0x1);main (e.py:1);execute_model (runner.py:2);save_outputs (omni_cache/engine/stage_manager.py:9);"
        "empty (torch/_tensor.py:4) 190\n" + FAST)


def test_heaviest_stacks_orders_by_samples_and_keeps_the_thread():
    assert heaviest_stacks(FAST, depth=99)[0]["stack"][:2] == ["thread (0x1)", "main (e.py:1)"]  # thread once
    top = heaviest_stacks(SLOW, top=2, depth=2)
    assert [t["samples"] for t in top] == [190, 14]
    assert top[0]["stack"] == ["thread (0x1)", "save_outputs (omni_cache/engine/stage_manager.py:9)",
                               "empty (torch/_tensor.py:4)"]


def test_stalls_names_only_requests_over_the_factor_with_their_own_stacks():
    prefill = [80.0, 95.0, 1186.0, None, 90.0, 130.0]
    raws = [FAST, FAST, SLOW, "", FAST, FAST]
    out = stalls(prefill, raws)
    assert [s["index"] for s in out] == [2]  # 130 ms < 1.5 x the median (95 ms)
    assert out[0]["median_ms"] == 95.0 and out[0]["stacks"][0]["samples"] == 190
    assert stalls([None, None], ["", ""]) == []
