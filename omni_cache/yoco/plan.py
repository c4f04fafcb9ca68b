"""Layer plan of a KV-shared (YOCO) thinker under KV-sharing fast prefill.

A YOCO model's layers ``0 .. F-1`` (the **self-decoder**) write KV; layers ``F .. L-1``
(the **cross-decoder**, ``F = num_hidden_layers - num_kv_shared_layers``) reuse it. With
vLLM's ``kv_sharing_fast_prefill`` the cross-decoder runs only on the *logit rows* of a
prefill step — the last scheduled token of each request's chunk — and the other rows of the
final hidden states are the self-decoder output pushed through the final norm: wrong
(``../shared/notes/vllm-seams.md``).

Capture index convention (vLLM-Omni's ``capture_layer_indices``, EAGLE3's aux states):
index ``i`` is the hidden state entering layer ``i``; ``0`` is the embedding output and
``F`` the self-decoder output. An index is **full-length** under fast prefill iff ``i <= F``.
The final (normed) hidden state — :data:`FINAL` — and every index ``> F`` are **truncated**.

Pure Python (no vLLM imports, like :mod:`omni_cache.core`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_cache import settings

#: the final-layer (normed) hidden state, as a "layer" a downstream stage may need.
FINAL = "final"

FAST_PREFILL_KEY = "kv_sharing_fast_prefill"
ACCEPT_LAYER_ENV = settings.YOCO_ACCEPT_LAYER.name
CAPTURE_LAYERS_ENV = settings.YOCO_CAPTURE_LAYERS.name


class YocoConfigError(ValueError):
    """A stage config asks for tensors that fast prefill cannot produce exactly."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


@dataclass(frozen=True)
class LayerPlan:
    """Which layers are full-length and which truncated under fast prefill, and which ones a
    downstream stage needs.

    Attributes:
        num_hidden_layers: ``L``.
        first_kv_shared_layer: ``F`` (``== L`` for a model without KV-shared layers).
        layer_types: per layer, e.g. ``"sliding_attention"`` / ``"full_attention"``.
        fast_prefill: the stage runs with ``kv_sharing_fast_prefill: true``.
        captured_layers: capture indices the stage hands downstream (``0 .. L``).
        needs_final: a downstream stage needs the final hidden state of every prompt token.
    """

    num_hidden_layers: int
    first_kv_shared_layer: int
    layer_types: tuple[str, ...] = ()
    fast_prefill: bool = False
    captured_layers: tuple[int, ...] = ()
    needs_final: bool = False

    @classmethod
    def from_hf_config(
        cls,
        hf_config: Any,
        *,
        fast_prefill: bool = False,
        captured_layers: Iterable[int] = (),
        needs_final: bool = False,
    ) -> LayerPlan:
        """Plan from a HF text config (object or ``config.json`` dict): reads
        ``num_hidden_layers``, ``num_kv_shared_layers`` (0 if absent) and ``layer_types``.
        A multimodal config's ``text_config`` is used when present.

        Raises:
            YocoConfigError: missing ``num_hidden_layers`` or ``num_kv_shared_layers``
                outside ``[0, num_hidden_layers)``.
        """
        text = _get(hf_config, "text_config") or hf_config
        n = _get(text, "num_hidden_layers")
        if not isinstance(n, int) or n <= 0:
            raise YocoConfigError(f"model config has no valid num_hidden_layers ({n!r})")
        shared = _get(text, "num_kv_shared_layers", 0) or 0
        if not 0 <= shared < n:
            raise YocoConfigError(f"num_kv_shared_layers={shared} must be in [0, {n})")
        return cls(n, n - shared, tuple(_get(text, "layer_types", None) or ()), bool(fast_prefill),
                   tuple(sorted(set(int(i) for i in captured_layers))), bool(needs_final))

    @property
    def num_kv_shared_layers(self) -> int:
        return self.num_hidden_layers - self.first_kv_shared_layer

    @property
    def self_decoder_layers(self) -> range:
        """Layers that write KV and always run on every token."""
        return range(self.first_kv_shared_layer)

    @property
    def cross_decoder_layers(self) -> range:
        """KV-shared layers; under fast prefill they run on logit rows only."""
        return range(self.first_kv_shared_layer, self.num_hidden_layers)

    @property
    def self_decoder_output(self) -> int:
        """Capture index of the self-decoder output (``F``): the deepest full-length one."""
        return self.first_kv_shared_layer

    @property
    def truncates(self) -> bool:
        """True if fast prefill actually truncates rows (fast prefill on and ``F < L``)."""
        return self.fast_prefill and self.first_kv_shared_layer < self.num_hidden_layers

    def is_full_length(self, index: int | str) -> bool:
        """Whether capture index ``index`` (or :data:`FINAL`) holds exact rows for every
        scheduled token of a prefill step."""
        if not self.truncates:
            return True
        return index != FINAL and int(index) <= self.first_kv_shared_layer

    def problems(self) -> list[str]:
        """Reasons this plan would hand wrong rows downstream (empty: consistent)."""
        out = []
        for i in self.captured_layers:
            if not 0 <= i <= self.num_hidden_layers:
                out.append(f"captured layer {i} is outside 0..{self.num_hidden_layers}")
            elif not self.is_full_length(i):
                out.append(f"captured layer {i} is in the cross-decoder (layers {self.first_kv_shared_layer}.."
                           f"{self.num_hidden_layers - 1}), truncated to logit rows under fast prefill")
        if self.needs_final and not self.is_full_length(FINAL):
            out.append("the final hidden states are truncated to logit rows under fast prefill")
        return out

    def check(self, where: str = "stage config") -> None:
        """Refuse a plan that would hand truncated rows downstream.

        Raises:
            YocoConfigError: names the two settings (``kv_sharing_fast_prefill`` and
                ``OMNI_CACHE_YOCO_ACCEPT_LAYER`` / ``OMNI_CACHE_YOCO_CAPTURE_LAYERS``) and
                the fix (capture the self-decoder output, layer ``F``, or turn fast prefill
                off).
        """
        bad = self.problems()
        if bad:
            raise YocoConfigError(
                f"{where}: {FAST_PREFILL_KEY}: true conflicts with the tensors handed downstream "
                f"({ACCEPT_LAYER_ENV} / {CAPTURE_LAYERS_ENV}): " + "; ".join(bad)
                + f". Fix: capture the self-decoder output instead ({ACCEPT_LAYER_ENV}: "
                f"{self.self_decoder_output}, or any layer <= {self.self_decoder_output}), "
                f"or set {FAST_PREFILL_KEY}: false."
            )

    def __str__(self) -> str:
        L, F = self.num_hidden_layers, self.first_kv_shared_layer

        def kind(i: int) -> str:
            t = self.layer_types[i] if i < len(self.layer_types) else "?"
            return {"sliding_attention": "S", "full_attention": "F"}.get(t, "?")

        lines = [f"LayerPlan: {L} layers, self-decoder 0..{F - 1}, cross-decoder (KV-shared) "
                 f"{F}..{L - 1} ({self.num_kv_shared_layers}/{L} = {self.num_kv_shared_layers / L:.0%}), "
                 f"fast prefill {'on' if self.fast_prefill else 'off'}"]
        for i in range(L):
            role = "self " if i < F else "cross"
            rows = "all rows" if (i < F or not self.truncates) else "logit rows only"
            lines.append(f"  layer {i:3d} [{kind(i)}] {role}: {rows}")
        for i in self.captured_layers:
            what = ("embedding output" if i == 0 else "self-decoder output" if i == F
                    else f"output of layer {i - 1}")
            rows = "all rows" if self.is_full_length(i) else "logit rows only"
            lines.append(f"  capture {i} ({what}): {rows}  <- handed downstream")
        lines.append(f"  final hidden: {'all rows' if self.is_full_length(FINAL) else 'logit rows only'}"
                     f"{'  <- handed downstream' if self.needs_final else ''}")
        return "\n".join(lines)


def parse_accept_layer(value: str | int | None, plan_first_shared: int) -> int | str:
    """``OMNI_CACHE_YOCO_ACCEPT_LAYER`` → capture index or :data:`FINAL`.

    Accepted: an integer, ``"self_decoder_output"`` (= ``F``), ``"final"``; None/empty
    defaults to the self-decoder output.

    Raises:
        YocoConfigError: anything else.
    """
    if value is None or str(value).strip() in ("", "self_decoder_output"):
        return plan_first_shared
    v = str(value).strip()
    if v == FINAL:
        return FINAL
    try:
        return int(v)
    except ValueError:
        raise YocoConfigError(f"{ACCEPT_LAYER_ENV}={value!r}: expected a layer index, "
                              f"'self_decoder_output' or 'final'") from None


def parse_capture_layers(value: str | None) -> tuple[int, ...]:
    """``OMNI_CACHE_YOCO_CAPTURE_LAYERS`` (comma-separated ints) → indices.

    Raises:
        YocoConfigError: a non-integer entry.
    """
    if value is None or not str(value).strip():
        return ()
    try:
        return tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise YocoConfigError(f"{CAPTURE_LAYERS_ENV}={value!r}: expected comma-separated layer indices") from None


def stage_plan(hf_config: Any, fast_prefill: bool, env: Mapping[str, str] | None) -> tuple[LayerPlan, int | str]:
    """The plan of a thinker stage from its model config, ``kv_sharing_fast_prefill`` and
    ``env`` settings. Captured layers: the embedding (0), the accept layer (if an index) and
    ``OMNI_CACHE_YOCO_CAPTURE_LAYERS``.

    Returns:
        ``(plan, accept)`` — ``accept`` is the capture index (or :data:`FINAL`) the adapter
        hands the talker as its hidden-state input.
    """
    env = env or {}
    base = LayerPlan.from_hf_config(hf_config, fast_prefill=fast_prefill)
    accept = parse_accept_layer(env.get(ACCEPT_LAYER_ENV), base.first_kv_shared_layer)
    captured = {0, *parse_capture_layers(env.get(CAPTURE_LAYERS_ENV))}
    if accept != FINAL:
        captured.add(int(accept))
    return LayerPlan.from_hf_config(hf_config, fast_prefill=fast_prefill, captured_layers=captured,
                                    needs_final=accept == FINAL), accept
