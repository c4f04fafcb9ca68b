"""Requests for a Qwen3-Omni pipeline: prompt text in the model's chat format plus real media.

Media are decoded here, in the client, with well-kept libraries (Pillow for images,
soundfile + SciPy for audio) so a bad file fails with an :class:`InputError` that names it,
before anything reaches the engine; the pipeline keeps serving other requests. The
decoded media then go through the model's real HF processors inside vLLM
(``Qwen2VLImageProcessor`` for images, ``WhisperFeatureExtractor`` for audio).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

AUDIO_SAMPLE_RATE = 16_000  # Hz, what Qwen3-Omni's Whisper feature extractor expects

DEFAULT_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)
DEFAULT_TEXT = "Describe the picture and answer the spoken question."

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"
#: (image, audio) placeholders in the prompt text, per thinker family: Qwen3-Omni's processor
#: expands the pad token inside its markers; Gemma 4's processor expands a bare token to
#: ``marker + N x token + marker`` itself (the embedded Gemma-4 thinker's markers are
#: Qwen3-Omni's tokens, :data:`omni_cache.models.gemma.GEMMA4_MEDIA_TOKENS`)
PLACEHOLDERS = {"qwen3-omni": (IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER),
                "gemma4": ("<|image_pad|>", "<|audio_pad|>")}


class InputError(ValueError):
    """A request input (file or value) is unusable. The message names it and says why."""


def sample_path(name: str) -> Path:
    """Path of a bundled sample input (``astronaut.jpg``, ``speech.wav``)."""
    return Path(str(resources.files("omni_cache") / "assets" / name))


def load_image(path: str | Path):
    """Decode an image file to an RGB ``PIL.Image``.

    Raises:
        InputError: missing file or not a decodable image (names the file).
    """
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise InputError(f"image {str(p)!r}: file not found")
    try:
        with Image.open(p) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(f"image {str(p)!r}: not a decodable image ({exc})") from exc


def load_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Decode an audio file to mono float32 at 16 kHz.

    Returns:
        ``(samples [num_samples] float32, 16000)``.

    Raises:
        InputError: missing file, undecodable, or empty (names the file).
    """
    import soundfile as sf

    p = Path(path)
    if not p.is_file():
        raise InputError(f"audio {str(p)!r}: file not found")
    try:
        data, sr = sf.read(str(p), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError, TypeError) as exc:
        raise InputError(f"audio {str(p)!r}: not a decodable audio file ({exc})") from exc
    if data.size == 0:
        raise InputError(f"audio {str(p)!r}: no samples")
    mono = data.mean(axis=1)
    if sr != AUDIO_SAMPLE_RATE:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(int(sr), AUDIO_SAMPLE_RATE)
        mono = resample_poly(mono, AUDIO_SAMPLE_RATE // g, int(sr) // g).astype(np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32), AUDIO_SAMPLE_RATE


@dataclass
class Turn:
    """One chat message: ``role`` is system / user / assistant."""

    role: str
    text: str = ""
    image: Any = None  # PIL.Image
    audio: tuple[np.ndarray, int] | None = None


@dataclass
class OmniRequest:
    """A chat prompt with its media, in prompt order."""

    turns: list[Turn]
    request_id: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    family: str = "qwen3-omni"  # the thinker's: picks the media placeholders (PLACEHOLDERS)
    #: vLLM's ``cache_salt``: requests of different salts share no prefix-cache block (thinker
    #: and, through the talker block keys, talker); ``None``: unsalted
    cache_salt: str | None = None

    def prompt_text(self) -> str:
        """The prompt in Qwen3-Omni's chat format, ending with the assistant header.

        Raises:
            KeyError: unknown ``family``.
        """
        image_ph, audio_ph = PLACEHOLDERS[self.family]
        parts = []
        for t in self.turns:
            body = ""
            if t.image is not None:
                body += image_ph
            if t.audio is not None:
                body += audio_ph
            body += t.text
            parts.append(f"<|im_start|>{t.role}\n{body}<|im_end|>\n")
        return "".join(parts) + "<|im_start|>assistant\n"

    def to_engine_prompt(self) -> dict[str, Any]:
        """The dict vLLM-Omni's ``Omni.generate`` takes (``prompt`` + ``multi_modal_data``, and
        ``cache_salt`` where set)."""
        images = [t.image for t in self.turns if t.image is not None]
        audios = [t.audio for t in self.turns if t.audio is not None]
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images[0] if len(images) == 1 else images
        if audios:
            mm["audio"] = audios[0] if len(audios) == 1 else audios
        prompt: dict[str, Any] = {"prompt": self.prompt_text()}
        if mm:
            prompt["multi_modal_data"] = mm
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt


def build_request(
    text: str = DEFAULT_TEXT,
    *,
    image: str | Path | None = None,
    audio: str | Path | None = None,
    system: str = DEFAULT_SYSTEM_PROMPT,
    history: list[Turn] | None = None,
    request_id: str | None = None,
    family: str = "qwen3-omni",
) -> OmniRequest:
    """A single-user-turn request (after optional ``history``) with optional media files.

    Raises:
        InputError: an image or audio file is missing or undecodable.
    """
    turns = [Turn("system", system)] + list(history or [])
    turns.append(
        Turn(
            "user",
            text,
            image=load_image(image) if image is not None else None,
            audio=load_audio(audio) if audio is not None else None,
        )
    )
    return OmniRequest(turns=turns, request_id=request_id, family=family)
