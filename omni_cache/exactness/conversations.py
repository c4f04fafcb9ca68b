"""Seeded voice/photo conversations for the exactness fuzzer.

A *group* is a base conversation plus layout-preserving variants of it (each changes one
thing and keeps every token position: audio scaled, reversed, shifted or noised at equal
length; a photo mirrored, recoloured or re-encoded at equal size; two words of equal token
length swapped). Run turn by turn, the conversations of a group share long prefixes that end
at the variant's change — in the system prose, inside a clip's audio tokens, inside a photo —
which is where a prefix cache must stop serving. Everything follows from ``(seed, Knobs)``:
the same pair gives the same conversations, prompts, media and send schedule, bit for bit
(:func:`make_group`), so a failure is reproduced by its seed and knobs alone.

Media come from the bundled speech recording and photograph
(``omni_cache/assets``, :func:`omni_cache.driver.inputs.sample_path`): clips are cut from the
speech at a seeded offset and length (16 kHz float32), photos are seeded crops resized to one
of a few sizes.
"""

from __future__ import annotations

import dataclasses
import io
import random
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from omni_cache.driver.inputs import AUDIO_SAMPLE_RATE, OmniRequest, Turn, load_audio, load_image, sample_path

#: words of the generated prose and questions; a variant swaps two of equal length, which keeps
#: every token position with the embedded models' byte-level tokenizer (one token per byte but
#: for a few merges: "Ġs", "Ġu", "Ġa", "sy", "us", "as" … — words that could merge are left out,
#: :func:`_mergeless`; checked by the unit tests)
_ALL_WORDS = tuple("""time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy music market sense nation plan college
interest death experience effect use class control care field development role effort rate heart
drug show leader light voice wife police mind price report decision son view relationship town road
arm difference value building action model season society tax director position player record paper
space ground form event official matter center couple site project activity star table need court
oil situation cost industry figure street image phone data picture practice piece land product
doctor wall patient worker news test movie north love support technology step baby computer type
attention film tree source organization hair window evidence population""".split())


def _mergeless(word: str) -> bool:
    return word[0] not in "sua" and not any(p in word for p in ("sy", "us", "as"))


WORDS = tuple(w for w in _ALL_WORDS if _mergeless(w))
#: layout-preserving changes a variant may make (see the module docstring)
AUDIO_CHANGES = ("audio_scale", "audio_reverse", "audio_shift", "audio_noise")
IMAGE_CHANGES = ("image_mirror", "image_recolour", "image_reencode")
TEXT_CHANGES = ("word_swap",)
IMAGE_SIZES = ((224, 224), (336, 224), (280, 280))


@dataclass(frozen=True)
class Knobs:
    """What a seed may generate; the shrinker lowers these.

    Attributes:
        turns: most user turns of a conversation (each conversation has 1..turns, at least
            ``min(turns, 3)``; every turn is one request: the conversation so far).
        variants: layout-preserving variants of the base conversation in the group.
        system_words: most words of system prose (a conversation has ``system_words // 4``
            to ``system_words``; ~7 tokens each with the embedded models' byte-level
            tokenizer: 240 words are ~1,700 tokens).
        media: whether turns may carry speech clips and photos.
        concurrent: whether a turn's requests may be sent together (in flight at once).
    """

    turns: int = 5
    variants: int = 2
    system_words: int = 240
    media: bool = True
    concurrent: bool = True

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class UserTurn:
    """One user turn: a question, optional speech clip (``[num_samples]`` float32, 16 kHz) and
    photo (PIL image), and the assistant's answer carried into later turns as text."""

    text: str
    audio: np.ndarray | None = None
    image: object = None
    answer: str = ""


@dataclass
class Conversation:
    """A system prompt and user turns; ``change``: what this variant changed (None: the base)."""

    name: str
    system: str
    turns: list[UserTurn]
    change: str | None = None

    def request(self, upto: int, request_id: str | None = None) -> OmniRequest:
        """The request of turn ``upto`` (0-based): system, turns ``0..upto-1`` with their
        answers as assistant text, then turn ``upto``'s user message."""
        msgs = [Turn("system", self.system)]
        for i, t in enumerate(self.turns[:upto + 1]):
            msgs.append(Turn("user", t.text, image=t.image,
                             audio=None if t.audio is None else (t.audio, AUDIO_SAMPLE_RATE)))
            if i < upto:
                msgs.append(Turn("assistant", t.answer))
        return OmniRequest(turns=msgs, request_id=request_id)


@dataclass
class Group:
    """A fuzz case: conversations sharing prefixes, and the send schedule.

    Attributes:
        seed, knobs: what generated it (:func:`make_group`).
        conversations: the base conversation first, then its variants.
        waves: per turn, the batches sent in order — each batch a list of
            ``(conversation index, turn index)`` sent together (one request: sent alone).
    """

    seed: int
    knobs: Knobs
    conversations: list[Conversation]
    waves: list[list[list[tuple[int, int]]]] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def describe(self) -> str:
        kinds = ",".join(c.change or "base" for c in self.conversations)
        return f"seed {self.seed}: {len(self.conversations)} conversations ({kinds}), {self.num_requests} requests"


@cache
def _speech() -> np.ndarray:
    return load_audio(sample_path("speech.wav"))[0]


@cache
def _photo():
    return load_image(sample_path("astronaut.jpg"))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _clip(rng: random.Random) -> np.ndarray:
    speech = _speech()
    n = int(rng.uniform(0.6, 2.4) * AUDIO_SAMPLE_RATE)
    start = rng.randrange(0, len(speech) - n)
    return np.ascontiguousarray(speech[start:start + n], dtype=np.float32)


def _image(rng: random.Random):
    im = _photo()
    w, h = im.size
    cw, ch = rng.randint(w // 2, w), rng.randint(h // 2, h)
    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
    return im.crop((x, y, x + cw, y + ch)).resize(rng.choice(IMAGE_SIZES))


def _base(rng: random.Random, seed: int, knobs: Knobs, salt: str) -> Conversation:
    n_turns = rng.randint(min(knobs.turns, 3), knobs.turns)
    # the salt makes every run's prompts its own: a rerun (shrinking) starts from an empty cache
    system = f"Session {salt}. " + _words(rng, rng.randint(max(1, knobs.system_words // 4), knobs.system_words)) + "."
    turns = []
    for _ in range(n_turns):
        kind = rng.choice(("text", "audio", "image", "audio+image", "audio")) if knobs.media else "text"
        turns.append(UserTurn(
            text=_words(rng, rng.randint(3, 12)) + "?",
            audio=_clip(rng) if "audio" in kind else None,
            image=_image(rng) if "image" in kind else None,
            answer=_words(rng, rng.randint(4, 24)) + "."))
    return Conversation(f"s{seed}-base", system, turns)


def _swap_words(rng: random.Random, text: str) -> str:
    """Two words of equal length swapped, or (no such pair) one word replaced by another
    word of its length: the text changes, every token position stays."""
    words = text.split(" ")
    plain = [i for i, w in enumerate(words) if w and w[-1] not in "?."]
    pairs = [(i, j) for i in plain for j in plain if i < j and words[i] != words[j]
             and len(words[i]) == len(words[j])]
    if pairs:
        i, j = rng.choice(pairs)
        words[i], words[j] = words[j], words[i]
        return " ".join(words)
    for i in rng.sample(plain, len(plain)):
        alike = [w for w in WORDS if len(w) == len(words[i]) and w != words[i]]
        if alike:
            words[i] = rng.choice(alike)
            return " ".join(words)
    return text


def _mutate(rng: random.Random, base: Conversation, name: str) -> Conversation:
    """A copy of ``base`` with one layout-preserving change at a seeded place."""
    conv = Conversation(name, base.system, [dataclasses.replace(t) for t in base.turns])
    places = [("audio", i) for i, t in enumerate(conv.turns) if t.audio is not None]
    places += [("image", i) for i, t in enumerate(conv.turns) if t.image is not None]
    places += [("text", i) for i in range(len(conv.turns))] + [("system", -1)]
    what, i = rng.choice(places)
    if what == "audio":
        conv.change = rng.choice(AUDIO_CHANGES)
        a = conv.turns[i].audio
        conv.turns[i].audio = {
            "audio_scale": lambda: a * np.float32(0.5),
            "audio_reverse": lambda: a[::-1].copy(),
            "audio_shift": lambda: np.roll(a, rng.randint(1, 4000)),
            "audio_noise": lambda: a + np.random.default_rng(rng.randrange(1 << 30)).normal(
                0, 1e-3, a.shape).astype(np.float32),
        }[conv.change]().astype(np.float32)
    elif what == "image":
        conv.change = rng.choice(IMAGE_CHANGES)
        conv.turns[i].image = _changed_image(conv.turns[i].image, conv.change)
    else:
        conv.change = "word_swap"
        if what == "system":
            conv.system = _swap_words(rng, conv.system)
        else:
            conv.turns[i].text = _swap_words(rng, conv.turns[i].text)
    conv.change = f"{conv.change}@{'system' if i < 0 else f'turn{i}'}"
    return conv


def _changed_image(im, change: str):
    from PIL import Image, ImageOps

    if change == "image_mirror":
        return ImageOps.mirror(im)
    if change == "image_recolour":
        r, g, b = im.split()
        return Image.merge("RGB", (b, r, g))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=40)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def make_group(seed: int, knobs: Knobs = Knobs(), salt: str | None = None) -> Group:
    """The fuzz case of ``seed``: a base conversation, ``knobs.variants`` variants, and the
    send schedule (per turn: all that turn's requests together, or one at a time in a seeded
    order; together only with ``knobs.concurrent``).

    ``salt``: text at the start of every system prompt (default: the seed), so two runs of
    one case in one engine do not share blocks.
    """
    rng = random.Random(seed)
    base = _base(rng, seed, knobs, salt if salt is not None else str(seed))
    convs = [base] + [_mutate(rng, base, f"s{seed}-v{v}") for v in range(knobs.variants)]
    waves = []
    for t in range(max(len(c.turns) for c in convs)):
        live = [(ci, t) for ci, c in enumerate(convs) if t < len(c.turns)]
        rng.shuffle(live)
        together = knobs.concurrent and rng.random() < 0.5
        waves.append([live] if together else [[x] for x in live])
    return Group(seed, knobs, convs, waves)
