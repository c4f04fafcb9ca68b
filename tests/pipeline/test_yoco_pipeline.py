"""KV-shared (YOCO) thinker on the real pipeline: fast prefill and the hidden-state cache
compose exactly.

The embedded Gemma-3n-style thinker (4 of 8 layers KV-shared, sliding + full attention KV
groups) runs as stage 0 of a real vLLM-Omni pipeline feeding the Qwen3-Omni talker and
code2wav (``stage_configs/gemma3n_yoco_cpu.yaml``), in all four combinations of
{``kv_sharing_fast_prefill`` off/on} x {prefix caching + omni-cache off/on}, one pipeline at
a time. The same workload — single requests, a shared-prefix batch, chunked prefill
(``max_num_batched_tokens: 512``), a two-turn chat, a request with prompt logprobs and one
after it — must give bitwise-equal sampled tokens, thinker→talker hand-off tensors (captured
layers 0 and 4 = self-decoder output, TTS embeddings) and audio in every combination. The
runs must also prove they exercised what they claim: truncated cross-decoder forwards with
fast prefill on, prefix hits served by omni-cache with the cache on.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from tests.util import REPO, assert_handoff_equal

pytestmark = pytest.mark.pipeline

CONFIG = REPO / "stage_configs" / "gemma3n_yoco_cpu.yaml"
BLOCK = 32
LONG = "Look carefully and listen to every detail before you answer my questions today. " * 5
OTHER = "Here is a different shared preamble about rivers, bridges and the old harbour town. " * 4
STORY = "Once upon a time a small robot learned to paint the sky in many colours each night. " * 15
COMBOS = [(f, c) for f in ("off", "on") for c in ("off", "on")]  # (fast prefill, cache)


def _variant(out_dir, fast: str, cache: str):
    from omni_cache import settings
    from omni_cache.driver.variants import derive_stage_config

    return derive_stage_config(
        CONFIG, out_dir / f"stage_config_fast-{fast}_cache-{cache}.yaml",
        stages={0: {"kv_sharing_fast_prefill": fast == "on", "enable_prefix_caching": cache == "on",
                    "max_num_batched_tokens": 512}},  # long prompts are prefilled in chunks
        env={0: {settings.HANDOFF_DUMP.name: str(out_dir / "handoff"),
                 settings.METRICS_DIR.name: str(out_dir / "metrics")}},
        sampling={0: {"max_tokens": 12}, 1: {"max_tokens": 12}})


def _chat(tok, system: str, user: str) -> list[int]:
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                      "<|im_start|>assistant\n")


def _new_handoffs(d, seen: set) -> list[dict]:
    """Hand-off files written since the last call, in batch order (request ids start with
    the request's index in its batch)."""
    files = [p for p in sorted((d / "handoff").glob("*.pt")) if p.name not in seen]
    seen.update(p.name for p in files)
    idx = lambda p: int(re.match(r"\d+-(\d+)", p.name).group(1))  # noqa: E731
    return [torch.load(p) for p in sorted(files, key=idx)]


def _workload(pipe, model_dir, out_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir / "thinker")
    seen: set = set()
    named = []

    def run(names, prompts, sps=None):
        results = pipe.generate([{"prompt_token_ids": p} for p in prompts], sps)
        handoffs = _new_handoffs(out_dir, seen)
        assert len(handoffs) == len(results), (names, len(handoffs))
        named.extend(zip(names, results, handoffs))
        return results

    run(["single:first"], [_chat(tok, LONG, "What is first?")])
    run(["single:second"], [_chat(tok, LONG, "And what comes second, please?")])
    # a batch whose requests share the cached prefix (and a third, new prefix): one step
    # computes several requests' suffixes and the budget (512) splits them into chunks
    run(["batch:a", "batch:b", "batch:c"], [_chat(tok, LONG, "Name a bridge."), _chat(tok, LONG, "Name a river."),
                                            _chat(tok, OTHER, "Name a town.")])
    run(["chunked:first"], [_chat(tok, STORY, "Continue the story.")])
    run(["chunked:second"], [_chat(tok, STORY, "Who is the hero?")])
    t1 = _chat(tok, LONG, "Tell me a story.")
    (r1,) = run(["chat:turn1"], [t1])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    t2 = (t1 + [t for t in r1.token_ids if t != im_end] + [im_end]
          + tok.encode("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"))
    run(["chat:turn2"], [t2])
    sps = pipe.default_sampling_params()
    sps[0].prompt_logprobs = 1
    # SamplingParams derives this from prompt_logprobs only at construction; vLLM computes
    # prompt logprobs only for the tokens it computes, so such a request must not hit
    sps[0].skip_reading_prefix_cache = True
    run(["logprobs"], [_chat(tok, LONG, "Score this prompt.")], sps)
    run(["after-logprobs"], [_chat(tok, LONG, "Still there?")])
    return named


@pytest.fixture(scope="module")
def gemma_model_dir():
    from omni_cache.models_gemma import build_gemma_omni, default_gemma_dir

    return build_gemma_omni(default_gemma_dir("tiny"), "tiny")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gemma_model_dir):
    from omni_cache.driver.pipeline import OmniPipeline

    out = {}
    for fast, cache in COMBOS:
        d = tmp_path_factory.mktemp(f"yoco-fast-{fast}-cache-{cache}")
        with OmniPipeline(gemma_model_dir, _variant(d, fast, cache)) as pipe:
            out[(fast, cache)] = (d, _workload(pipe, gemma_model_dir, d))
    return out


def _metrics(d, prefix: str) -> dict:
    files = list((d / "metrics").glob(f"{prefix}-*.json"))
    assert len(files) == 1, (prefix, files)
    return json.loads(files[0].read_text())


@pytest.mark.parametrize("combo", COMBOS[1:], ids=lambda c: f"fast-{c[0]}_cache-{c[1]}")
def test_equal_to_slow_path_bitwise(runs, combo):
    """Sampled tokens, hand-off tensors, prompt logprobs and audio equal fast-off/cache-off."""
    _, ref = runs[("off", "off")]
    _, got = runs[combo]
    assert [n for n, _, _ in ref] == [n for n, _, _ in got]
    for (name, r0, h0), (_, r1, h1) in zip(ref, got):
        assert r0.error is None and r1.error is None, (name, r0.error, r1.error)
        assert r1.num_prompt_tokens == r0.num_prompt_tokens and r0.token_ids, name
        assert r1.token_ids == r0.token_ids, name
        assert_handoff_equal(h1, h0, name)
        assert "hidden" not in h1, "final hidden states must never be handed downstream"
        assert {"hidden_states.layer_0", "hidden_states.layer_4"} <= set(h1), sorted(h1)
        n_rows = r0.num_prompt_tokens + len(r0.token_ids) - 1  # the last sampled token is never fed back
        assert h1["hidden_states.layer_4"].shape[0] == n_rows, (name, h1["hidden_states.layer_4"].shape)
        assert r0.audio is not None and r1.audio is not None, name
        if not name.startswith("batch:"):
            # Audio of requests sent alone is bitwise equal too. In a batch the talker's
            # own batching follows the thinker's timing (which fast prefill and hits change),
            # and the talker's batched forward is not batch-invariant: with identical
            # thinker hand-offs, the batch's audio differed between runs (tokens and
            # hand-offs, asserted above, did not).
            assert np.array_equal(r1.audio, r0.audio), name
        if name == "logprobs":
            assert r0.prompt_logprobs is not None and r1.prompt_logprobs is not None
            assert len(r1.prompt_logprobs) == r1.num_prompt_tokens
            for p0, p1 in zip(r0.prompt_logprobs, r1.prompt_logprobs):
                assert (p0 is None) == (p1 is None)
                if p0 is not None:
                    assert {t: lp.logprob for t, lp in p0.items()} == {t: lp.logprob for t, lp in p1.items()}


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"fast-{c[0]}_cache-{c[1]}")
def test_runs_exercise_fast_prefill_and_hits(runs, combo):
    """The comparison is not vacuous: with fast prefill on, the cross-decoder skipped rows
    (and ran untruncated for the prompt-logprob request); with the cache on, the dependent
    requests hit and omni-cache served every hit from its pool (none refused)."""
    fast, cache = combo
    d, named = runs[combo]
    y = _metrics(d, "yoco")
    if fast == "on":
        assert y["truncated_forwards"] > 0 and y["rows_skipped_by_cross_decoder"] > 0, y
        assert y["fallback_forwards"] > 0, y  # the prompt-logprob batch ran untruncated
    else:
        assert y["truncated_forwards"] == 0 and y["fallback_forwards"] == 0, y
    hits = {n: r.num_cached_tokens for n, r, _ in named}
    if cache == "off":
        assert not any(hits.values()), hits
        return
    for n in ("single:second", "chunked:second", "after-logprobs", "batch:a", "batch:b"):
        assert hits[n] >= BLOCK, (n, hits)
    turn1 = next(r for n, r, _ in named if n == "chat:turn1")
    assert hits["chat:turn2"] >= turn1.num_prompt_tokens // BLOCK * BLOCK, hits
    assert hits["logprobs"] == 0, hits  # vLLM does not read the prefix cache for prompt logprobs
    m = _metrics(d, "metrics")
    assert m["hits_refused"] == 0 and m["hits_served"] >= 5, m
    assert m["hit_tokens"] == sum(hits.values()), (m, hits)
