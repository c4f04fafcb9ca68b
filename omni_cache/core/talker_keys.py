"""Content identity of the talker's prompt blocks: what makes talker prefix caching safe.

vLLM-Omni hands Qwen3-Omni's talker placeholder prompt ids (``[0] * n``, built by
``thinker2talker_token_only`` and the async-chunk prewarm in vLLM-Omni 0.30), so vLLM's block
hash of a talker block sees only its length. The talker's row ``r`` of the prompt is,
for the user segments of the thinker prompt (``_thinker_to_talker_prefill`` in
``vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py``), the text projection of the
thinker's layer-0 embedding (text tokens) or the hidden projection of the thinker's
``accept_hidden_layer`` row (image/audio/video tokens) at one thinker position ``t(r)``; the
final assistant segment adds 9 rows that depend on the thinker's first answer token.
System segments and earlier answers are skipped.

So the talker's KV at row ``r`` is a function of the thinker's prompt content up to
``t(r)`` — token ids and the media whose placeholders start at or before it (an encoder
output covers its whole item). :func:`talker_block_keys` gives each full talker block whose
rows all come from user segments a key that commits to exactly that: the token ids
``prompt[0..t]`` and every media item ``(offset, length, modality, identifier)`` with
``offset <= t``, where ``t`` is the thinker position of the block's last row, plus a seed
(speaker, language, the thinker request's cache salt and LoRA, the talker block size). Two
conversations that differ anywhere before a thinker position therefore never share a talker
block whose rows reach it. Blocks with assistant rows (and every block after them) get no
key: the talker scheduler (:mod:`omni_cache.engine.talker_scheduler`) hashes them with a
per-request nonce, so they are never shared.

The row layout is vLLM-Omni's own (``_compute_talker_prompt_ids_length`` in
``stage_input_processors/qwen3_omni.py``; the same token ids are hard-coded there):
a talker prompt whose length differs from the layout computed here gets no keys.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b, sha256

import numpy as np

#: ``SamplingParams.extra_args`` key that carries a talker request's block keys to its engine
#: (vLLM passes ``extra_args`` through to the scheduler's ``Request`` untouched).
TALKER_KEYS_ARG = "omni_cache_talker_blocks"
#: version of the key scheme: part of every key's seed (a change never matches old blocks)
SCHEME = "omni-cache/talker-keys/v1"

# Qwen3-Omni's chat-template tokens, as vLLM-Omni 0.30 hard-codes them in
# ``_compute_talker_prompt_ids_length`` (the talker prompt length is computed with these).
IM_START_TOKEN_ID = 151644
SYSTEM_TOKEN_ID = 8948
USER_TOKEN_ID = 872
ASSISTANT_TOKEN_ID = 77091
#: talker rows of the final assistant segment: 3 role tokens + 4 pad + BOS + first text token
ASSISTANT_ROWS = 9


@dataclass(frozen=True)
class MediaItem:
    """One multimodal item of the thinker prompt, as vLLM's ``MultiModalFeatureSpec`` has it.

    Attributes:
        offset: thinker position of its first placeholder token (tokens).
        length: its placeholder tokens (tokens).
        modality: ``"image"``, ``"audio"``, ``"video"``.
        identifier: vLLM's content hash of the processed item (or the user's
            ``multi_modal_uuids`` entry — vLLM's own prefix cache trusts it the same way).
    """

    offset: int
    length: int
    modality: str
    identifier: str


def talker_prompt_rows(prompt_token_ids: Sequence[int]) -> tuple[np.ndarray, int]:
    """The talker prompt's row layout for a Qwen3-Omni thinker prompt.

    Args:
        prompt_token_ids: the thinker's prompt ``[num_tokens]`` (chat template applied).

    Returns:
        ``(user_rows, assistant_rows)``: ``user_rows`` ``[num_user_rows]`` int64, the thinker
        position of each talker row that comes from a user segment, in talker-row order;
        ``assistant_rows``: 9 if the prompt ends with an assistant segment, else 0. The
        talker prompt length vLLM-Omni computes is ``len(user_rows) + assistant_rows`` for a
        prompt that ends with ``<|im_start|>assistant\\n``.
    """
    ids = np.asarray(prompt_token_ids, dtype=np.int64)
    starts = np.flatnonzero(ids == IM_START_TOKEN_ID)
    bounds = np.append(starts, len(ids))
    rows: list[np.ndarray] = []
    assistant = 0
    for i, s in enumerate(starts):
        e = int(bounds[i + 1])
        role = int(ids[s + 1]) if s + 1 < len(ids) else -1
        if role == USER_TOKEN_ID:
            rows.append(np.arange(s, e, dtype=np.int64))
        elif role == ASSISTANT_TOKEN_ID and i == len(starts) - 1:
            assistant = ASSISTANT_ROWS
    user_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return user_rows, assistant


def talker_block_keys(prompt_token_ids: Sequence[int], media: Sequence[MediaItem], *,
                      talker_prompt_len: int, block_size: int, seed: Sequence[object] = ()
                      ) -> list[str]:
    """Keys of the talker prompt's shareable blocks (see the module docstring).

    Args:
        prompt_token_ids: the thinker's prompt ``[num_tokens]``.
        media: the thinker prompt's multimodal items (any order).
        talker_prompt_len: the talker request's prompt length (tokens), as vLLM-Omni built it.
        block_size: the talker's KV block size (its hash block size; tokens).
        seed: what else shapes the talker's rows or must isolate them (speaker, language, the
            thinker's cache salt and LoRA); ``repr``-ed into every key.

    Returns:
        One hex key (blake2b, 128 bits) per leading full talker block made only of user-segment
        rows; ``[]`` when the layout computed here does not give ``talker_prompt_len`` (the
        talker then shares nothing for this request).

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"talker block_size must be >= 1, got {block_size}")
    user_rows, assistant = talker_prompt_rows(prompt_token_ids)
    if len(user_rows) + assistant != talker_prompt_len:
        return []
    ids = np.asarray(prompt_token_ids, dtype=np.int64)
    items = sorted(media, key=lambda m: (m.offset, m.modality, m.identifier))
    h = blake2b(digest_size=16, person=b"omni-cache-talkr")
    h.update(repr((SCHEME, int(block_size), tuple(seed))).encode())
    pos, mi, keys = 0, 0, []
    for j in range(len(user_rows) // block_size):
        t = int(user_rows[(j + 1) * block_size - 1])
        # feed the thinker content in position order up to t inclusive: token runs and the
        # media items starting there, each record tagged and length-prefixed (unambiguous)
        while mi < len(items) and items[mi].offset <= t:
            m = items[mi]
            _feed_tokens(h, ids[pos:m.offset])
            pos = max(pos, m.offset)
            rec = f"{m.modality}\x00{m.identifier}\x00{m.length}".encode()
            h.update(b"M" + len(rec).to_bytes(4, "little") + rec)
            mi += 1
        _feed_tokens(h, ids[pos:t + 1])
        pos = max(pos, t + 1)
        keys.append(h.copy().hexdigest())
    return keys


def ensure_signing_secret() -> str:
    """The talker keys' signing secret (``OMNI_CACHE_TALKER_KEYS_SECRET``), created in this
    process's environment if unset — call it before starting the engine, so the stage
    processes inherit it."""
    from omni_cache import settings

    name = settings.TALKER_KEYS_SECRET.name
    if not os.environ.get(name):
        os.environ[name] = secrets.token_hex(32)
    return os.environ[name]


def signature(block_size: int, keys: Sequence[str], secret: str) -> str:
    """HMAC-SHA256 (hex) of a talker request's block keys under ``secret``.

    Why: vLLM-Omni lets a client send per-stage sampling params, ``extra_args`` included; an
    unsigned key list would let a client file its talker KV under another conversation's
    keys (cache poisoning). Only the driver, which holds the secret, signs."""
    msg = repr((SCHEME, int(block_size), list(keys))).encode()
    return hmac.new(secret.encode(), msg, sha256).hexdigest()


def verified_keys(entry: object, block_size: int, secret: str | None) -> list[str] | None:
    """The keys of an ``extra_args[TALKER_KEYS_ARG]`` entry if it is well-formed, for
    ``block_size`` and signed with ``secret``; else None (the request shares nothing)."""
    if not secret or not isinstance(entry, dict) or entry.get("block_size") != block_size:
        return None
    keys = entry.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return None
    mac = entry.get("signature")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, signature(block_size, keys, secret)):
        return None
    return keys


def _feed_tokens(h, run: np.ndarray) -> None:
    if len(run):
        h.update(b"T" + len(run).to_bytes(4, "little") + run.astype("<i8").tobytes())
