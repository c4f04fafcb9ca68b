"""Unit tests for omni_cache.core.block_hashes: chained block hashes."""

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from omni_cache.core.block_hashes import chained_block_hashes
from tests.unit.core_util import BS


def test_chained_block_hashes_extra_keys_and_chaining():
    toks = [9, 9, 9, 9, 1, 2, 3, 4, 5, 6]
    base = chained_block_hashes(toks, BS)
    assert len(base) == 2
    img_a = chained_block_hashes(toks, BS, [(1, 6, "imgA")])
    img_a2 = chained_block_hashes(toks, BS, [(1, 6, "imgA")])
    img_b = chained_block_hashes(toks, BS, [(1, 6, "imgB")])
    assert img_a == img_a2 and img_a != img_b and img_a != base
    assert img_a[0] != img_b[0] and img_a[1] != img_b[1]  # span overlaps both blocks
    late = chained_block_hashes(toks, BS, [(5, 7, "imgA")])
    assert late[0] == base[0] and late[1] != base[1]  # only the overlapped block changes
    # a different first block changes every later block hash (chained)
    other = chained_block_hashes([8] + toks[1:], BS)
    assert other[0] != base[0] and other[1] != base[1]
    # continuing from a parent block hash equals hashing the whole prompt
    assert chained_block_hashes(toks[BS:], BS, [(1, 3, "imgA")], parent=late[0]) == late[1:]
    assert chained_block_hashes(torch.tensor(toks), BS) == base


def test_chained_block_hashes_stable_across_processes():
    args = (list(range(40)), 16, [(3, 20, "img"), (21, 22, b"x"), (0, 1, 7)])
    code = f"from omni_cache.core.block_hashes import chained_block_hashes as t; print(t(*{args!r}))"
    env = {**os.environ, "PYTHONHASHSEED": "4242"}  # a different str-hash salt than ours
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{chained_block_hashes(*args)}\n"


def test_chained_block_hashes_continue_from_parent_with_span_across_the_split():
    """The runner hashes only newly filled blocks (parent = last block hash); that must equal
    hashing the whole prompt, also when a multimodal span crosses the split."""
    rng = random.Random(0)
    toks = [rng.randrange(1000) for _ in range(32 * 7)]
    spans = [(40, 130, "img-A")]
    whole = chained_block_hashes(toks, 32, spans)
    for split in (1, 2, 3, 5):
        lo = split * 32
        head = chained_block_hashes(toks[:lo], 32, [s for s in spans if s[0] < lo])
        tail = chained_block_hashes(toks[lo:], 32, [(a - lo, b - lo, i) for a, b, i in spans if b > lo],
                                parent=head[-1])
        assert head + tail == whole
