"""Probe: is a request's audio a function of its own inputs and seeds? (docs/architecture.md,
"What is bitwise under concurrency")

Starts one streaming CPU pipeline (tiny model, omni-cache on) and sends: X; another request;
X again (talker seeded per request: ``tts_local_seed`` from the stage config); X twice with
``tts_local_seed`` removed (residual codebooks from the talker's global RNG); then X beside a
different request, ``--rounds`` times. Prints, for each, whether X's audio (its last
streamed packet) and thinker tokens equal X's first run bitwise.

    .venv/bin/python scripts/probe_talker_rng.py --out /tmp/probe-rng
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository (tests.*)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the stage config and records")
    ap.add_argument("--rounds", type=int, default=3, help="concurrent rounds (X beside another request)")
    args = ap.parse_args()

    from omni_cache.driver.inputs import build_request
    from omni_cache.driver.pipeline import OmniPipeline
    from omni_cache.models import build_qwen3_omni, default_model_dir
    from tests.pipeline.workloads import FIRST_PROMPT, LONG
    from tests.util import variant_stage_config

    model = build_qwen3_omni(default_model_dir("tiny"), "tiny")
    cfg = variant_stage_config(args.out, "omni_cache", streaming=True)
    companions = ["Tell me about the weather?", "And which of the details did you notice first, and why?",
                  "Why?", "Name three colours, please."]
    with OmniPipeline(model, cfg) as pipe:
        sp = pipe.default_sampling_params()
        print("talker extra_args:", sp[1].extra_args, "seed:", sp[1].seed)
        unseeded = copy.deepcopy(sp)
        unseeded[1].extra_args = {}
        (first,) = pipe.generate([build_request(FIRST_PROMPT)])

        def same(r) -> str:
            return f"audio {np.array_equal(r.audio, first.audio)}, thinker tokens {r.token_ids == first.token_ids}"

        pipe.generate([build_request(LONG + "Something else entirely?")])
        (again,) = pipe.generate([build_request(FIRST_PROMPT)])
        print("seeded, sent again:", same(again))
        u1, u2 = (pipe.generate([build_request(FIRST_PROMPT)], unseeded)[0] for _ in range(2))
        print("unseeded, twice: equal to each other:", np.array_equal(u1.audio, u2.audio))
        for i in range(args.rounds):
            x, _ = pipe.generate([build_request(FIRST_PROMPT),
                                  build_request(LONG + companions[i % len(companions)])])
            print(f"seeded, beside another request (round {i}):", same(x))


if __name__ == "__main__":
    main()
