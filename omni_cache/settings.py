"""Every ``OMNI_CACHE_*`` environment variable, declared once.

Each :class:`Setting` says its name, the values it accepts, its default, which process reads
it and whether a stage config's ``env:`` mapping may carry it. Every reader goes through
:meth:`Setting.get` (validated: a bad value raises :class:`SettingError` naming the variable),
the stage-config validator checks ``env:`` against :data:`SETTINGS`, and the table in
``docs/stage-config.md`` is generated from it (``python -m omni_cache.settings``; a test keeps
the two equal).

Import rule: engine-free (standard library only), so engine and driver code both use it.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass


class SettingError(ValueError):
    """An ``OMNI_CACHE_*`` variable holds a value it does not accept (``name``, ``value``)."""

    def __init__(self, name: str, value: str, reason: str) -> None:
        self.name, self.value = name, value
        super().__init__(f"{name}={value!r}: {reason}")


class ReadBy(enum.Enum):
    """The process that reads a setting."""

    ENGINE = "stage engine process"
    EVERY = "every vLLM-Omni process"
    DRIVER = "the `omni-cache` command"
    ORCHESTRATOR = "the process running vLLM-Omni's orchestrator (`Omni` / `AsyncOmni`)"
    SETUP = "scripts/setup.sh"


class Kind(enum.Enum):
    """How a setting's value is read."""

    CHOICE = "one of the listed values"
    INT = "a non-negative integer"
    PATH = "a directory"
    TEXT = "free text (see the description)"


@dataclass(frozen=True)
class Setting:
    """One ``OMNI_CACHE_*`` variable.

    Attributes:
        name: the environment variable.
        kind: how the value is parsed (:class:`Kind`).
        default: the value when unset (None: unset means "off" / "auto", see ``doc``).
        read_by: the process that reads it (:class:`ReadBy`).
        stage_env: whether a stage config's ``env:`` mapping may set it.
        doc: one line for the docs table.
        choices: accepted values for :attr:`Kind.CHOICE`.
    """

    name: str
    kind: Kind
    default: str | None
    read_by: ReadBy
    stage_env: bool
    doc: str
    choices: tuple[str, ...] = ()

    def check(self, value: str) -> str:
        """``value`` validated for this setting (stripped).

        Raises:
            SettingError: not one of :attr:`choices`, or not a non-negative integer.
        """
        v = str(value).strip()
        if self.kind is Kind.CHOICE and v not in self.choices:
            raise SettingError(self.name, v, f"expected one of {self.choices}")
        if self.kind is Kind.INT and not v.isdigit():
            raise SettingError(self.name, v, "expected a non-negative integer")
        return v

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The validated value from ``environ`` (default ``os.environ``), or :attr:`default`.
        An empty value counts as unset.

        Raises:
            SettingError: see :meth:`check`.
        """
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not str(raw).strip():
            return self.default
        return self.check(raw)

    def get_int(self, environ: Mapping[str, str] | None = None) -> int:
        """:meth:`get` as an int (:attr:`Kind.INT` settings; unset → 0)."""
        return int(self.get(environ) or 0)


PREFIX_CACHE_BACKEND = Setting(
    "OMNI_CACHE_PREFIX_CACHE_BACKEND", Kind.CHOICE, "omni_cache", ReadBy.ENGINE, True,
    "prefix-cache backend of an AR stage with `enable_prefix_caching: true`: omni-cache or "
    "vLLM-Omni's own", choices=("omni_cache", "builtin"))
METRICS_DIR = Setting(
    "OMNI_CACHE_METRICS_DIR", Kind.PATH, None, ReadBy.ENGINE, True,
    "write the stage's counters as JSON there (`metrics-<pid>.json`, `scheduler-<pid>.json`, "
    "`yoco-<pid>.json`, `runner-<pid>.json`)")
HANDOFF_DUMP = Setting(
    "OMNI_CACHE_HANDOFF_DUMP", Kind.PATH, None, ReadBy.ENGINE, True,
    "save every thinker→talker hand-off tensor there (recording pipelines; tests, audits)")
HIT_AUDIT = Setting(
    "OMNI_CACHE_HIT_AUDIT", Kind.PATH, None, ReadBy.ENGINE, True,
    "log every served prefix hit there (`hits-<pid>.jsonl`: request, hit tokens, the request "
    "that wrote each served block) — the exactness fuzzer's served-rows oracle; on the talker "
    "stage, a digest of each KV block at write and at hit (`talker-kv-<pid>.jsonl`)")
YOCO_ACCEPT_LAYER = Setting(
    "OMNI_CACHE_YOCO_ACCEPT_LAYER", Kind.TEXT, None, ReadBy.ENGINE, True,
    "KV-shared thinker: the layer handed to the talker — a layer index, "
    "`self_decoder_output` (default) or `final`")
YOCO_CAPTURE_LAYERS = Setting(
    "OMNI_CACHE_YOCO_CAPTURE_LAYERS", Kind.TEXT, None, ReadBy.ENGINE, True,
    "KV-shared thinker: extra captured layers, comma-separated indices")
FUSED = Setting(
    "OMNI_CACHE_FUSED", Kind.CHOICE, "1", ReadBy.ENGINE, True,
    "CUDA: write a step's rows of every key with one Triton kernel (`1`, default) or with "
    "torch's per-key `index_copy_` (`0`); same results", choices=("0", "1"))
MIN_HIT_TOKENS = Setting(
    "OMNI_CACHE_MIN_HIT_TOKENS", Kind.INT, "0", ReadBy.ENGINE, True,
    "AR stages: a prefix hit (after the cap to the hidden-state cache's coverage) shorter than "
    "this many tokens is recomputed instead of served; 0 (default): every hit is served. On a "
    "GPU a short prefill is overhead-bound, so a hit on a chat template's first block saves no "
    "compute while serving it takes the hit path (docs/gpu.md, \"Twenty-third session\"); measured "
    "once, with 32 on a one-block template hit: docs/gpu.md, \"Twenty-fourth session\"")
HANDOFF_STAGING = Setting(
    "OMNI_CACHE_HANDOFF_STAGING", Kind.CHOICE, "snapshot", ReadBy.ENGINE, True,
    "CUDA: how the thinker's hand-off rows reach vLLM-Omni's payload builder. `snapshot` "
    "(default): fresh rows taken from the host snapshot vLLM-Omni copies of every step anyway (no "
    "copy of ours), only a hit's cached prefix copied at save time; `host`: every hand-off row "
    "copied to pinned host memory at save time (a second copy); `device`: device tensors the "
    "builder copies itself (the path before 2026-11-26). Same rows in all three (the compiled "
    "equality group on an H100, 2026-11-27: `snapshot` and `host` alike; docs/gpu.md)",
    choices=("host", "snapshot", "device"))
CPU_PLATFORM = Setting(
    "OMNI_CACHE_CPU_PLATFORM", Kind.CHOICE, None, ReadBy.EVERY, True,
    "force the CPU OmniPlatform on (`1`) or off (`0`); unset: on when vLLM resolved to its CPU "
    "platform", choices=("0", "1"))
CPU_ATTENTION = Setting(
    "OMNI_CACHE_CPU_ATTENTION", Kind.CHOICE, "auto", ReadBy.ENGINE, True,
    "CPU platform: vLLM's CPU attention kernels as vLLM picks them (`auto`: AMX where the CPU has "
    "it) or never AMX (`vec`: a hit's suffix bitwise a whole prefill's; the test suite's setting; "
    "omni_cache/engine/cpu_attention.py)", choices=("auto", "vec"))
CPU_IDLE_BACKOFF_MS = Setting(
    "OMNI_CACHE_CPU_IDLE_BACKOFF_MS", Kind.INT, "8", ReadBy.ENGINE, True,
    "CPU platform: a stage whose engine steps schedule no token (a streaming talker or code2wav "
    "waiting for its next chunk) sleeps 1, 2, 4 … ms, at most this many, per empty step instead "
    "of stepping every 1 ms and taking the cores from the stage that computes "
    "(docs/cpu.md); `0` = vLLM's 1 ms cadence")
CUDA_PLATFORM = Setting(
    "OMNI_CACHE_CUDA_PLATFORM", Kind.CHOICE, "0", ReadBy.EVERY, True,
    "`1`: the opt-in CUDA OmniPlatform whose AR worker runs omni-cache's runner",
    choices=("0", "1"))
PARALLEL_STAGE_INIT = Setting(
    "OMNI_CACHE_PARALLEL_STAGE_INIT", Kind.CHOICE, "0", ReadBy.ORCHESTRATOR, True,
    "`1`: start the stages that share a GPU at the same time (vLLM-Omni's `parallel_stage_init`: "
    "admission control checks up front that their memory shares fit the card) instead of one "
    "after another; for a card dedicated to this pipeline (docs/gpu.md, \"Start-up\")",
    choices=("0", "1"))
JIT_WARMUP = Setting(
    "OMNI_CACHE_JIT_WARMUP", Kind.CHOICE, None, ReadBy.EVERY, False,
    "CUDA platform (`OMNI_CACHE_CUDA_PLATFORM=1`): `0` skips vLLM's JIT kernel warm-up at a "
    "stage's start (`kernel_config.enable_jit_warmup`, which a stage config may not set: ~110 s "
    "per stage on a cold host, one stage at a time on a shared card); the kernels then compile "
    "at their first use, in the first requests; unset or `1`: vLLM's default (on); docs/gpu.md, "
    "\"Start-up\"", choices=("0", "1"))
ROUTING = Setting(
    "OMNI_CACHE_ROUTING", Kind.CHOICE, "vllm_omni", ReadBy.ORCHESTRATOR, True,
    "thinker (stage 0) replicas: `prefix` routes a request to the replica holding its longest "
    "cached prefix, bounded by load (docs/routing.md); `vllm_omni` keeps vLLM-Omni's routing",
    choices=("vllm_omni", "prefix"))
ROUTING_LOAD_MARGIN = Setting(
    "OMNI_CACHE_ROUTING_LOAD_MARGIN", Kind.INT, "4", ReadBy.ORCHESTRATOR, True,
    "prefix routing: a replica whose queue exceeds the shortest by more than this many "
    "requests gets no request")
ROUTING_CAPACITY_BLOCKS = Setting(
    "OMNI_CACHE_ROUTING_CAPACITY_BLOCKS", Kind.INT, "0", ReadBy.ORCHESTRATOR, True,
    "prefix routing: KV blocks the router assumes per replica (its LRU record's bound); `0` = "
    "the replica's KV blocks as the engine reports them")
REALTIME_WINDOW = Setting(
    "OMNI_CACHE_REALTIME_WINDOW", Kind.CHOICE, "omni_cache", ReadBy.ORCHESTRATOR, False,
    "realtime (duplex) Qwen3-Omni sessions on omni-cache's pipelines: omni-cache's conversation "
    "window, which keeps the prompt's prefix stable (`omni_cache`, default), or vLLM-Omni's "
    "(`stock`); a session may pick its own (`session.extra_body.omni_cache_window`; docs/serving.md)",
    choices=("omni_cache", "stock"))
REALTIME_PINNED_TURNS = Setting(
    "OMNI_CACHE_REALTIME_PINNED_TURNS", Kind.INT, "1", ReadBy.ORCHESTRATOR, False,
    "realtime (duplex) sessions with omni-cache's window: opening user turns kept in every "
    "prompt of the session (docs/serving.md)")
REALTIME_KEEP_ON_SLIDE = Setting(
    "OMNI_CACHE_REALTIME_KEEP_ON_SLIDE", Kind.INT, "1", ReadBy.ORCHESTRATOR, False,
    "realtime sessions with omni-cache's window: recent turns kept when the window restarts "
    "its segment (docs/serving.md)")
TALKER_KEYS_SECRET = Setting(
    "OMNI_CACHE_TALKER_KEYS_SECRET", Kind.TEXT, None, ReadBy.EVERY, False,
    "talker prefix caching: the secret that signs the talker block keys the driver attaches "
    "(set by omni-cache's driver before it starts the engine; stage processes inherit it); "
    "keys without a valid signature — a client's, or with it unset — are not trusted")
HOME = Setting(
    "OMNI_CACHE_HOME", Kind.PATH, None, ReadBy.DRIVER, False,
    "where `omni-cache make-model` puts the embedded models (default `~/.cache/omni-cache`)")
LOG_LEVEL = Setting(
    "OMNI_CACHE_LOG_LEVEL", Kind.CHOICE, "WARNING", ReadBy.DRIVER, False,
    "log level of the `omni-cache` command", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
VENV = Setting(
    "OMNI_CACHE_VENV", Kind.PATH, ".venv", ReadBy.SETUP, False,
    "virtual environment that `scripts/setup.sh` creates")

#: name → setting, in documentation order.
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    PREFIX_CACHE_BACKEND, METRICS_DIR, HANDOFF_DUMP, HIT_AUDIT, YOCO_ACCEPT_LAYER, YOCO_CAPTURE_LAYERS,
    FUSED, MIN_HIT_TOKENS, HANDOFF_STAGING, CPU_PLATFORM, CPU_ATTENTION, CPU_IDLE_BACKOFF_MS, CUDA_PLATFORM,
    PARALLEL_STAGE_INIT,
    JIT_WARMUP, ROUTING,
    ROUTING_LOAD_MARGIN, ROUTING_CAPACITY_BLOCKS, REALTIME_WINDOW, REALTIME_PINNED_TURNS, REALTIME_KEEP_ON_SLIDE,
    TALKER_KEYS_SECRET, HOME, LOG_LEVEL, VENV)}

PREFIX = "OMNI_CACHE_"


def markdown_table() -> str:
    """The settings as the Markdown table in ``docs/stage-config.md``."""
    lines = ["| variable | values | default | read by | stage `env:` | what it does |",
             "|---|---|---|---|---|---|"]
    for s in SETTINGS.values():
        values = " \\| ".join(f"`{c}`" for c in s.choices) if s.choices else s.kind.value
        default = f"`{s.default}`" if s.default is not None else "unset"
        lines.append(f"| `{s.name}` | {values} | {default} | {s.read_by.value} | "
                     f"{'yes' if s.stage_env else 'no'} | {s.doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
