"""A cache-aware conversation window for vLLM-Omni's realtime (duplex) Qwen3-Omni sessions.

vLLM-Omni's Qwen3-Omni duplex plugin (``Qwen3OmniDuplexPlugin``, RFC vllm-omni#7181's
``duplex_plugin`` seam) turns every committed utterance into a fresh request whose prompt
re-encodes the conversation: instructions, then a window of the history — the last 16
messages rounded to whole turns, at most 4 audio payloads (3 of history + the one being
answered), the oldest dropped first. From the fifth voice turn on, every turn drops the oldest
retained turn, so the first item after the instructions changes on every turn and, with it,
every later block hash: the thinker's prefix cache then reuses the instructions only, on
every turn of a long session.

:class:`CacheAwareQwen3OmniDuplexPlugin` keeps the prompt's prefix stable instead. It keeps
the instructions and the first ``pinned_turns`` user turns (with their answers) for the whole
session, then a *segment* of recent turns that grows turn by turn; only when the segment no
longer fits the budget (audio payloads, messages) does it restart — in one step, keeping the
last ``keep_on_slide`` turns — so the next turns again extend a prompt whose prefix is
cached. The trimming is applied to the history before vLLM-Omni's own method runs, which then
finds everything within its limits and keeps it (its audio bookkeeping, image trimming and
the current-payload handling are unchanged).

Settings (process environment of the server): ``OMNI_CACHE_REALTIME_WINDOW`` (``omni_cache``,
default, or ``stock``: the plugin only delegates to vLLM-Omni's; a session picks its own with
``session.extra_body.omni_cache_window``), ``OMNI_CACHE_REALTIME_PINNED_TURNS`` (default 1),
``OMNI_CACHE_REALTIME_KEEP_ON_SLIDE`` (default 1). ``session.extra_body.omni_cache_reference``
makes a session's answers cache-off references (tests and exactness checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_omni.model_executor.models.qwen3_omni.duplex.plugin import Qwen3OmniDuplexPlugin
from vllm_omni.model_executor.models.qwen3_omni.duplex.session import QwenDuplexSessionState

from omni_cache import settings

#: vLLM-Omni's window: messages kept at most (``prepare_prompt_config``: ``len(history) - 16``)
STOCK_MAX_MESSAGES = 16
#: audio payloads in a prompt (``limit_mm_per_prompt.audio`` of vLLM-Omni's duplex deploy; the
#: plugin keeps 3 of history + the one being answered)
STOCK_MAX_AUDIO = 4


@dataclass(frozen=True)
class Turn:
    """One unit of history as vLLM-Omni's plugin groups it: consecutive user messages and the
    assistant reply(s) after them. ``start``: index of its first message; ``audio``: how
    many of its user messages carry audio."""

    start: int
    messages: tuple
    audio: int


def group_turns(history: list[dict]) -> list[Turn]:
    """``history`` (the session's conversation items, oldest first) grouped into turns
    exactly as ``Qwen3OmniDuplexPlugin.prepare_prompt_config`` groups them (a system message
    or a user message after a non-user one starts a turn)."""
    groups: list[tuple[int, list[dict]]] = []
    for index, message in enumerate(history):
        role = message.get("role")
        if not groups or role == "system" or (role == "user" and groups[-1][1][-1].get("role") != "user"):
            groups.append((index, []))
        groups[-1][1].append(message)
    return [Turn(start, tuple(msgs), sum(_has_audio(m) for m in msgs)) for start, msgs in groups]


def _has_audio(message: dict) -> bool:
    content = message.get("content")
    return (message.get("role") == "user" and isinstance(content, list)
            and any(isinstance(p, dict) and p.get("type") == "audio_url" for p in content))


@dataclass
class WindowState:
    """Where the current segment starts (a message index of the session's history)."""

    segment_start: int = 0


def plan_window(turns: list[Turn], state: WindowState, *, pinned_turns: int, keep_on_slide: int,
                max_audio: int = STOCK_MAX_AUDIO, max_messages: int = STOCK_MAX_MESSAGES,
                answering_audio: bool = True) -> list[Turn]:
    """The turns to keep: the pinned opening turns, then the segment from
    ``state.segment_start`` on; when they exceed the budget (audio payloads — one slot left
    for the utterance being answered when ``answering_audio`` — or messages), the segment
    restarts with the last ``keep_on_slide`` turns before the one being answered (``state``
    updated), dropping older ones as needed until the budget holds. The last turn (the one being answered) is
    always kept.

    Returns the kept turns in order.
    """
    user_turns = [t for t in turns if t.messages[0].get("role") != "system"]
    system = [t for t in turns if t.messages[0].get("role") == "system"]
    pinned = user_turns[:pinned_turns]
    rest = user_turns[pinned_turns:]
    audio_budget = max_audio - (1 if answering_audio else 0)

    def fits(seg: list[Turn]) -> bool:
        kept = pinned + seg
        history = kept[:-1] if kept and answering_audio else kept  # the last turn holds the utterance
        return (sum(t.audio for t in history) <= audio_budget
                and sum(len(t.messages) for t in system + kept) <= max_messages)

    segment = [t for t in rest if t.start >= state.segment_start]
    if not fits(segment):
        segment = rest[-(keep_on_slide + 1):] if rest else []  # + the turn being answered
        while len(segment) > 1 and not fits(segment):
            segment = segment[1:]
        if segment:
            state.segment_start = segment[0].start
    while pinned and not fits(segment):  # an over-budget opening: give up pins, oldest first
        pinned = pinned[1:]
    return system + pinned + segment


@dataclass(slots=True)
class CacheAwareSessionState(QwenDuplexSessionState):
    """vLLM-Omni's per-session state of the Qwen3-Omni plugin plus the window's
    :class:`WindowState` (it lives and dies with the session)."""

    window: WindowState = field(default_factory=WindowState)


#: ``session.update`` → ``session.extra_body`` key that picks a session's window
#: (``"omni_cache"`` or ``"stock"``; default: ``OMNI_CACHE_REALTIME_WINDOW``)
WINDOW_KEY = "omni_cache_window"
WINDOWS = ("omni_cache", "stock")
#: ``session.extra_body`` key that makes every answer of the session a cache-off reference:
#: ``skip_reading_prefix_cache`` on the thinker and the talker (no cached row read; blocks are
#: still written) — for exactness checks against the same server
REFERENCE_KEY = "omni_cache_reference"


def session_window(extra_body: object, default: str) -> str:
    """The window a session asked for in ``session.extra_body[WINDOW_KEY]``, else ``default``.

    Raises:
        DuplexRuntimeConfigError: the value is not one of :data:`WINDOWS` (the client gets an
            ``error`` event naming the key; the session and the server go on).
    """
    from vllm_omni.engine.duplex.plugin import DuplexRuntimeConfigError

    value = extra_body.get(WINDOW_KEY, default) if isinstance(extra_body, dict) else default
    if value not in WINDOWS:
        raise DuplexRuntimeConfigError(
            f"session.extra_body.{WINDOW_KEY}={value!r}: expected one of {', '.join(WINDOWS)}")
    return value


class CacheAwareQwen3OmniDuplexPlugin(Qwen3OmniDuplexPlugin):
    """vLLM-Omni's Qwen3-Omni duplex plugin with a window that keeps the prompt's prefix
    stable (module docstring). Selected by omni-cache's Qwen3-Omni pipelines
    (``duplex_plugin``); everything but the window is vLLM-Omni's.

    A client picks the window per session with ``session.update`` →
    ``{"session": {"extra_body": {"omni_cache_window": "omni_cache" | "stock"}}}``; sessions that
    do not ask get ``OMNI_CACHE_REALTIME_WINDOW``."""

    def __init__(self, encode_audio):
        super().__init__(encode_audio)
        self.default_window = settings.REALTIME_WINDOW.get()
        self.pinned_turns = settings.REALTIME_PINNED_TURNS.get_int()
        self.keep_on_slide = settings.REALTIME_KEEP_ON_SLIDE.get_int()

    def validate_client_extra_body(self, extra_body):
        super().validate_client_extra_body(extra_body)
        session_window(extra_body, self.default_window)

    def create_session_state(self):
        return CacheAwareSessionState()

    def runtime_config_for_update(self, config, current):
        runtime = super().runtime_config_for_update(config, current)
        extra = config.extra_body if isinstance(config.extra_body, dict) else {}
        return {**runtime, REFERENCE_KEY: bool(extra.get(REFERENCE_KEY, False))}

    def configure_sampling_params(self, *, runtime_config, defaults):
        params = super().configure_sampling_params(runtime_config=runtime_config, defaults=defaults)
        if runtime_config.get(REFERENCE_KEY):
            for stage_params in params[:2]:  # thinker, talker
                if stage_params is not None:
                    stage_params.skip_reading_prefix_cache = True
        return params

    def prepare_prompt_config(self, config, *, state, payload):
        if session_window(config.get("extra_body"), self.default_window) == "stock":
            return super().prepare_prompt_config(config, state=state, payload=payload)
        history = list(config.get("conversation", []))
        kept = plan_window(group_turns(history), state.window, pinned_turns=self.pinned_turns,
                           keep_on_slide=self.keep_on_slide, answering_audio=bool(payload.get("audio")))
        kept_messages = [m for t in kept for m in t.messages]
        kept_ids = {id(m.get("content")) for m in kept_messages}
        # the audio payloads of dropped turns leave the plugin's bookkeeping too (it keeps the
        # last 4 by commit order, which would otherwise push the pinned turn's audio out)
        state.audio_history = [(keys, value) for keys, value in state.audio_history
                               if any(id(k) in kept_ids for k in keys)]
        return super().prepare_prompt_config({**config, "conversation": kept_messages}, state=state, payload=payload)
