"""The mutation run's verdicts (tests/lanes/mutants.py): a mutant is killed only by a failed
assertion, never by a crash or another exception (issue 44, item 3)."""

from __future__ import annotations

import json

import pytest

from tests.lanes.mutants import MUTANTS, assertion_failure
from tests.mutants import FAULTS


def test_a_failed_assertion_kills_and_names_test_and_message():
    out = ("....F\n=== short test summary info ===\n"
           "FAILED tests/pipeline/test_cache_equality.py::test_served_rows_equal_their_writers_rows - "
           "AssertionError: {'req-3': ['block 2 (rows 64-96): served rows differ']}\n1 failed, 4 passed in 9.1s\n")
    k = assertion_failure(out)
    assert k["assertion"] and k["type"] == "AssertionError"
    assert k["test"].endswith("test_served_rows_equal_their_writers_rows") and "block 2" in k["message"]
    refusal = "FAILED tests/unit/test_core_cache.py::test_stale - Failed: DID NOT RAISE <class 'StaleRowsError'>\n"
    assert assertion_failure(refusal)["assertion"]
    assert assertion_failure("FAILED tests/unit/test_core_cache.py::test_read - assert False\n")["assertion"]


def test_a_crash_or_an_error_is_not_a_kill():
    crash = "FAILED tests/unit/test_stage_manager.py::test_x - omni_cache.core.interface.StaleRowsError: block 1\n"
    assert assertion_failure(crash)["assertion"] is False
    engine = "FAILED tests/pipeline/test_cache_equality.py::test_y - RuntimeError: Engine core initialization failed\n"
    assert assertion_failure(engine)["assertion"] is False
    assert assertion_failure("ERROR tests/pipeline/test_cache_equality.py::test_z - KeyError: 'x'\n") is None


def test_every_fault_has_a_mutant_with_a_selection():
    assert {m.name for m in MUTANTS} == set(FAULTS) and all(m.selections for m in MUTANTS)
    assert len(FAULTS) >= 16  # ten before issue 44, six classes it listed as not planted


def test_cuda_runs_pipeline_selections_in_the_lane_environment(monkeypatch, tmp_path):
    """``--device cuda``: the GPU lane's environment (``OMNI_TEST_DEVICE=cuda``; without it the
    first GPU run errored on every pipeline selection) and no unit selection; a mutant with
    only unit selections is ``skipped``, never ``killed``."""
    import tests.lanes.mutants as lane

    monkeypatch.delenv("OMNI_TEST_DEVICE", raising=False)
    cuda = lane.selection_env("cuda")
    assert cuda["OMNI_TEST_DEVICE"] == "cuda" and cuda["OMNI_TEST_BATCH_INVARIANT"] == "0"
    assert "OMNI_TEST_DEVICE" not in lane.selection_env("cpu")
    seen = []

    def fake_run(sel, fault, plugin_dir, *, lock, timeout_s, log, device):
        seen.append((sel, device))
        return lane.SelectionRun(" ".join(sel), "failed", 1, 0.0)

    monkeypatch.setattr(lane, "run_selection", fake_run)
    by_name = {m.name: m for m in MUTANTS}
    r = lane.run_mutant(by_name["bit_flip"], tmp_path, tmp_path, lock=None, timeout_s=1, baseline=False,
                        device="cuda")
    assert seen == [(("tests/pipeline/test_cache_equality.py", "-k", "served_rows"), "cuda")] and r.verdict == "killed"
    r = lane.run_mutant(by_name["ledger_check_off"], tmp_path, tmp_path, lock=None, timeout_s=1,
                        baseline=False, device="cuda")
    assert r.verdict == "skipped" and len(seen) == 1


def test_report_is_written_after_every_mutant(monkeypatch, tmp_path):
    """A run cut short (the GPU hold of 2026-11-27 ended 4.5 min into the step, before the
    report was written at the end) keeps every mutant it finished: ``report.json`` after each
    one, ``complete`` false and the rest ``pending``."""
    import tests.lanes.mutants as lane

    class HoldEnded(Exception):
        pass

    calls = []

    def fake_mutant(m, plugin_dir, out, **kw):
        if calls:
            raise HoldEnded
        calls.append(m.name)
        return lane.MutantResult(m.name, m.models, "killed", 0.1, [], None)

    monkeypatch.setattr(lane, "run_mutant", fake_mutant)
    monkeypatch.setattr(lane, "write_plugin_dist", lambda d: None)
    with pytest.raises(HoldEnded):
        lane.main(["--only", "bit_flip,slot_shift", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["name"] for r in report["results"]] == calls and report["killed"] == 1
    assert report["complete"] is False and len(report["pending"]) == 1


def test_seam_fault_reaches_both_cuda_stagings(monkeypatch):
    """``seam_off_by_one`` is planted where CUDA makes the seam too: ``stage_handoff`` (``host``
    staging) and ``StagedStep.complete`` (``snapshot``, CUDA's default: the ninth GPU session's
    mutant, planted without it, survived there): a hit's staged rows repeat its last cached row, a miss's are untouched.
    Runs the stager's CPU contract (``HostStager(cpu)``: the same staging, no stream)."""
    from types import SimpleNamespace

    import torch

    from omni_cache.core.staging import HostStager, StagedStep
    from omni_cache.engine.stage_manager import OmniCacheStageManager
    from tests.mutants import FAULTS

    for name in ("merge", "stage_handoff"):  # restored after the test (the fault patches the class)
        monkeypatch.setattr(OmniCacheStageManager, name, OmniCacheStageManager.__dict__[name])
    monkeypatch.setattr(StagedStep, "complete", StagedStep.complete)
    prefix, fresh = torch.arange(8.).reshape(4, 2), torch.arange(100., 106.).reshape(3, 2)
    mgr = SimpleNamespace(_stager=HostStager(torch.device("cpu")))
    plan = SimpleNamespace(req_ids=["hit", "miss"], handoff_keys=["hidden"])

    def staged():
        step = OmniCacheStageManager.stage_handoff(mgr, plan, {"hit": {"hidden": fresh}, "miss": {"hidden": fresh}},
                                                   {"hit": {"hidden": prefix}})
        return step.rows("hit")["hidden"], step.rows("miss")["hidden"]

    def snapshot():  # CUDA's default staging: the prefix staged, the fresh rows copied in later
        step = HostStager(torch.device("cpu")).stage_prefixes(["hidden"], [("hit", {"hidden": prefix}, 3)])
        return step.complete("hit", {"hidden": fresh})["hidden"]

    hit, miss = staged()
    assert torch.equal(hit, torch.cat([prefix, fresh])) and torch.equal(miss, fresh)
    assert torch.equal(snapshot(), torch.cat([prefix, fresh]))
    FAULTS["seam_off_by_one"]()
    hit, miss = staged()
    assert torch.equal(hit, torch.cat([prefix, prefix[-1:], fresh[:-1]])) and torch.equal(miss, fresh)
    # the ninth GPU session's survivor: the seam made in StagedStep.complete was not planted
    assert torch.equal(snapshot(), torch.cat([prefix, prefix[-1:], fresh[:-1]]))


def test_stale_generation_reaches_the_engines_step_write(monkeypatch):
    """``stale_generation`` is planted where the engine writes (``write_step_rows``, one write
    for a step), not only in ``write_request_rows``: a request writing into a block another
    request filled leaves the earlier generation's rows in the pool (the ninth GPU session's
    stress selection ran with the fault planted only where the engine never writes)."""
    import torch

    from omni_cache.core.cache import HiddenStateCache
    from omni_cache.core.step_write import StepRequest
    from tests.mutants import FAULTS
    from tests.unit.core_util import KEYS, make_cache, rows

    for name in ("_store_rows", "write_step_rows"):  # restored after the test (the fault patches the class)
        monkeypatch.setattr(HiddenStateCache, name, HiddenStateCache.__dict__[name])

    def pool_after_reuse():
        cache = make_cache()
        first, second = ({k: rows(4, 3, seed=s + i) for i, k in enumerate(KEYS)} for s in (0, 10))
        cache.write_step_rows([StepRequest("A", [1], 0, 4, {})], first)
        cache.write_step_rows([StepRequest("B", [1], 0, 4, {})], second)  # block 1 freed by A, reused
        return {k: cache.pools[k].gather(list(range(4, 8))) for k in KEYS}, first, second

    got, first, second = pool_after_reuse()
    assert all(torch.equal(got[k], second[k]) for k in KEYS)
    FAULTS["stale_generation"]()
    got, first, second = pool_after_reuse()
    assert all(torch.equal(got[k], first[k]) for k in KEYS)
