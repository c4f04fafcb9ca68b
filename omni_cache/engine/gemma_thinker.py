"""A KV-shared (YOCO) Gemma-3n text model as the thinker stage of a vLLM-Omni pipeline.

:class:`OmniCacheGemma3nThinker` is vLLM's ``Gemma3nForCausalLM`` (unchanged forward, fast
prefill included) that additionally returns what vLLM-Omni's AR runner hands downstream,
the way vLLM-Omni's Qwen3-Omni thinker does: ``(final hidden, {"hidden_states": {"layers":
{i: [num_tokens, hidden_size]}}})`` plus the thinker embeddings of the three TTS tokens
(``embed.tts_bos/eos/pad``, ``[1, 1, hidden_size]``). The runner flattens the layers to the
per-request payload keys ``hidden_states.layer_<i>``.

Captured layers follow vLLM-Omni's convention (index ``i`` = hidden state entering layer
``i``; ``0`` = embedding output), read from the **active AltUp stream**
(``altup_active_idx``) of Gemma-3n's ``[altup_num_inputs, num_tokens, hidden_size]`` state
with forward hooks (``torch.nn.Module`` hooks, no vLLM code changed):

- ``0``: forward pre-hook of decoder layer 0 (its input: the scaled embeddings);
- ``i >= 1``: forward hook of decoder layer ``i - 1`` (its output). ``F`` (``F`` = first
  KV-shared layer) is the self-decoder output — full-length even under fast prefill;
  ``F < i <= L`` are cross-decoder outputs, only allowed with fast prefill off
  (:meth:`omni_cache.yoco.LayerPlan.check` refuses them otherwise, at model construction).

The final hidden states are never handed downstream (``omni_pooler_payload_include_hidden
= False``): under fast prefill their prompt rows are wrong. Which layers are captured and
which one feeds the talker come from the stage ``env`` (``OMNI_CACHE_YOCO_ACCEPT_LAYER``,
``OMNI_CACHE_YOCO_CAPTURE_LAYERS``), see :func:`omni_cache.yoco.stage_plan`.

:func:`gemma_thinker2talker_full_payload` is the stage-input adapter
(``custom_process_next_stage_input_func``): it maps captured layer ``0`` onto the Qwen3-Omni
talker's thinker-embedding input and the accept layer onto its thinker-hidden input, then
delegates to vLLM-Omni's ``thinker2talker_full_payload``.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

import torch
from vllm.model_executor.models.gemma3n import Gemma3nForCausalLM
from vllm.model_executor.models.gemma4_mm import Gemma4ForConditionalGeneration

from omni_cache import settings
from omni_cache.engine.metrics import MetricsFile
from omni_cache.yoco import FINAL, stage_plan

logger = logging.getLogger(__name__)

ARCH = "OmniCacheGemma3nThinker"
GEMMA4_ARCH = "OmniCacheGemma4Thinker"


class _YocoThinkerMixin:
    """What a KV-shared vLLM model needs to be a vLLM-Omni thinker: vLLM-Omni's runner flags,
    the layer plan and its start-up check, captured layers (module hooks), the cross-decoder
    counters and the ``OmniOutput`` with the TTS embeddings. Subclasses name their text config
    (:meth:`_text_config`), decoder layers (:meth:`_decoder_layers`), the rows a layer's input /
    output carry (:meth:`_rows`) and the embedding of text tokens (:meth:`_embed_text`)."""

    ARCH = "?"

    def _init_thinker(self, vllm_config) -> None:
        # vLLM-Omni runner flags (see vllm_omni/worker/gpu_model_runner.py)
        self.have_multimodal_outputs = True
        self.has_preprocess = False
        self.has_postprocess = False
        self.use_async_omni_output = False
        self.omni_pooler_payload_include_hidden = False
        cfg = self._text_config()
        fast = bool(vllm_config.cache_config.kv_sharing_fast_prefill)
        self.layer_plan, self.accept_layer = stage_plan(cfg, fast, os.environ)
        self.layer_plan.check(where=f"thinker stage ({self.ARCH})")
        self.is_staged_run = getattr(vllm_config.model_config, "model_stage", None) is not None
        self.yoco_counters = {"forwards": 0, "truncated_forwards": 0, "full_forwards": 0,
                              "fallback_forwards": 0, "rows_skipped_by_cross_decoder": 0,
                              "encoder_items": 0, "encoder_tokens": 0}
        self._yoco_file = MetricsFile("yoco", min_interval_s=0.5)
        self.tts_tokens = torch.tensor([tts_token_ids(vllm_config.model_config.hf_config)], dtype=torch.long)
        if self.is_staged_run:
            p = next(self.parameters())
            self._alloc_capture_buffers(vllm_config.scheduler_config.max_num_batched_tokens,
                                        int(cfg.hidden_size), vllm_config.model_config.dtype, p.device)
            self._install_capture_hooks()
        logger.info("omni-cache: %s\n%s", self.ARCH, self.layer_plan)

    # ---- what differs between the model families ---------------------------------------
    def _text_config(self):
        return self.config

    def _decoder_layers(self):
        return self.model.layers

    def _rows(self, hidden_states) -> torch.Tensor:
        """``[num_tokens, hidden_size]`` rows of a decoder layer's input or output."""
        return hidden_states

    def _embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_input_ids(input_ids)

    # ---- capture ---------------------------------------------------------------------
    # The hooks run inside vLLM's compiled regions (the whole text model, or the self-decoder
    # compiled apart for fast prefill). They copy a layer's rows into a persistent buffer —
    # an in-graph write to a fixed address, which torch.compile keeps in the graph and a CUDA
    # graph replays — and never touch Python state: a dict store there becomes a side effect
    # Dynamo replays after the graph (``update`` in the transformed bytecode), which vLLM
    # refuses under CUDA graphs ("Assigning / modifying buffers of nn.Module during forward
    # pass ...", vllm/compilation/wrapper.py) — the thinker did not start with
    # ``enforce_eager: false`` on an H100 (docs/gpu.md, "Compiled YOCO").
    def _alloc_capture_buffers(self, max_num_tokens: int, hidden_size: int, dtype: torch.dtype,
                               device: torch.device) -> None:
        """One persistent buffer per captured layer, ``[max_num_tokens, hidden_size]`` of the
        model's ``dtype`` on its ``device`` (``max_num_tokens``: the scheduler's
        ``max_num_batched_tokens``, the most rows a forward carries); e.g. 2 layers x 8,192 x
        2,048 x 2 bytes = 64 MiB at Gemma-4-E4B's width."""
        self._capture_rows = int(max_num_tokens)
        self._capture_bufs = {i: torch.zeros((self._capture_rows, hidden_size), dtype=dtype, device=device)
                              for i in self.layer_plan.captured_layers}

    def _install_capture_hooks(self) -> None:
        # Hooks on the decoder layers (plain modules). Not on the self-/cross-decoder: their
        # class is wrapped by vLLM's ``support_torch_compile``, whose ``__call__`` calls
        # ``forward`` directly and so bypasses module hooks.
        layers = self._decoder_layers()
        for i in self.layer_plan.captured_layers:
            if i == 0:
                layers[0].register_forward_pre_hook(self._capture_layer_input(0), with_kwargs=True)
            else:
                layers[i - 1].register_forward_hook(self._capture_layer_output(i))

    def _capture_layer_input(self, index: int):
        buf, rows_of, arch = self._capture_bufs[index], self._rows, self.ARCH

        def hook(_module, args, kwargs):  # decoder layer (positions, hidden_states, ...)
            rows = rows_of(kwargs["hidden_states"] if "hidden_states" in kwargs else args[1])
            _check_capture_dtype(arch, index, rows, buf)
            buf[: rows.shape[0]].copy_(rows)  # [num_tokens, hidden]
        return hook

    def _capture_layer_output(self, index: int):
        buf, rows_of, arch = self._capture_bufs[index], self._rows, self.ARCH

        def hook(_module, _args, output):
            rows = rows_of(output)
            _check_capture_dtype(arch, index, rows, buf)
            buf[: rows.shape[0]].copy_(rows)
        return hook

    def _captured_layers(self, num_tokens: int) -> dict[int, torch.Tensor]:
        """The captured layers of the forward that just ran: ``{i: [num_tokens, hidden_size]}``
        (copies: the buffers are overwritten by the next forward, and the hand-off may read
        them after it under async scheduling). Their dtype is checked in the hooks, against the
        layer's own rows (:func:`_check_capture_dtype`), not against the model's output: under
        ``VLLM_BATCH_INVARIANT`` vLLM's Gemma-3n returns float32 rows from bf16 layers (its
        AltUp unembedding's mean runs in vLLM's batch-invariant float32 ``mean``; the thinker
        did not start on an H100 with the old check, 2026-11-27)."""
        return {i: b[:num_tokens].clone() for i, b in self._capture_bufs.items()}

    def _count_forward(self, num_tokens: int) -> None:
        """Counters of how the cross-decoder ran (``yoco_counters``); with
        ``OMNI_CACHE_METRICS_DIR`` set also written to ``<dir>/yoco-<pid>.json`` (tests;
        :class:`~omni_cache.engine.metrics.MetricsFile`, rate-limited)."""
        from vllm.forward_context import get_forward_context, is_forward_context_available
        from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata

        if not is_forward_context_available():
            return
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict):
            return  # dummy / profile run
        last = md.get(self._decoder_layers()[-1].self_attn.attn.layer_name)
        n_logits = getattr(last, "num_logits_indices", None) if isinstance(last, KVSharingFastPrefillMetadata) else None
        c = self.yoco_counters
        fallback = False
        c["forwards"] += 1
        if n_logits is not None and n_logits < num_tokens:
            c["truncated_forwards"] += 1
            c["rows_skipped_by_cross_decoder"] += num_tokens - n_logits
        else:
            c["full_forwards"] += 1
            if isinstance(last, KVSharingFastPrefillMetadata) and n_logits is None:
                # fast prefill disarmed for this step (prompt logprobs, or a request opted out)
                c["fallback_forwards"] += 1
                fallback = True
        self._publish(force=fallback)

    def _publish(self, force: bool = False) -> None:
        # a counter's first non-zero value and every fallback are published at once (tests
        # assert on them); the rest at most every 0.5 s
        c = self.yoco_counters
        first_nonzero = any(v and not self._yoco_file_last.get(k) for k, v in c.items())
        if self._yoco_file.publish(dict(c), force=force or first_nonzero):
            self._yoco_file_last = dict(c)

    _yoco_file_last: dict = {}

    _FORWARD_KWARGS = ("intermediate_tensors", "inputs_embeds", "per_layer_inputs")

    def forward(self, input_ids, positions, **kwargs):
        # vLLM-Omni's runner adds per-step extras (model_intermediate_buffer,
        # request_token_spans, ...) that this model does not use.
        kwargs = {k: v for k, v in kwargs.items() if k in self._FORWARD_KWARGS}
        num_tokens = int(positions.shape[-1])
        if self.is_staged_run and num_tokens > self._capture_rows:
            raise RuntimeError(f"{self.ARCH}: a forward of {num_tokens} tokens, more than the "
                               f"{self._capture_rows} rows of the captured-layer buffers (max_num_batched_tokens)")
        hidden = super().forward(input_ids, positions, **kwargs)
        self._count_forward(num_tokens)
        if not self.is_staged_run:
            return hidden
        return hidden, {"hidden_states": {"layers": self._captured_layers(num_tokens)}}

    def make_omni_output(self, model_outputs, **kwargs):
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        if isinstance(model_outputs, OmniOutput):
            return model_outputs
        if isinstance(model_outputs, tuple):
            hidden, mm = model_outputs
        else:
            hidden, mm = model_outputs, {}
        mm = dict(mm or {})
        emb = self._embed_text(self.tts_tokens.to(hidden.device)).reshape(1, 3, -1)  # [1, 3, hidden]
        bos, eos, pad = emb.chunk(3, dim=1)
        mm["embed"] = {"tts_bos": [bos], "tts_eos": [eos], "tts_pad": [pad]}
        return OmniOutput(text_hidden_states=hidden.reshape(-1, hidden.shape[-1]), multimodal_outputs=mm)


class OmniCacheGemma3nThinker(_YocoThinkerMixin, Gemma3nForCausalLM):
    """vLLM's Gemma-3n text model as a vLLM-Omni thinker (captured layers + TTS embeddings).

    Raises:
        omni_cache.yoco.YocoConfigError: at construction, when the stage asks for rows
            fast prefill truncates (a cross-decoder layer, or the final hidden states).
    """

    ARCH = ARCH

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._active = int(self.config.altup_active_idx)
        self._init_thinker(vllm_config)

    def _rows(self, hidden_states) -> torch.Tensor:
        # Gemma-3n's state is [altup_num_inputs, num_tokens, hidden]: the active AltUp stream
        return hidden_states[self._active]


class OmniCacheGemma4Thinker(_YocoThinkerMixin, Gemma4ForConditionalGeneration):
    """vLLM's Gemma-4 multimodal model (vision + audio towers, KV-shared text model with fast
    prefill) as a vLLM-Omni thinker: captured layers of every prompt row — text, image and
    audio rows alike (layer 0 of a media row is the tower's projected soft token, the row the
    text model consumes) — plus the TTS embeddings.

    ``encoder_items`` / ``encoder_tokens`` in ``yoco_counters`` count the media items (and their
    soft tokens) the towers encoded: vLLM runs the encoder only for items not wholly inside a
    prefix hit, and the tests assert it.

    Raises:
        omni_cache.yoco.YocoConfigError: at construction, as :class:`OmniCacheGemma3nThinker`.
    """

    ARCH = GEMMA4_ARCH

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_thinker(vllm_config)
        contiguous_linear_inputs(getattr(self, "audio_tower", None))

    def _text_config(self):
        return self.config.text_config

    def _decoder_layers(self):
        return self.language_model.model.layers

    def _rows(self, hidden_states) -> torch.Tensor:
        # a Gemma-4 decoder layer returns (hidden_states, residual=None)
        return hidden_states[0] if isinstance(hidden_states, tuple) else hidden_states

    def _embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the language model's own embedding (what the thinker's rows of text tokens start
        # from); not ``self.embed_input_ids``, which also refreshes the step's per-layer inputs
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, **kwargs):
        out = super().embed_multimodal(**kwargs)
        items = list(out) if out is not None else []
        self.yoco_counters["encoder_items"] += len(items)
        self.yoco_counters["encoder_tokens"] += int(sum(int(t.shape[0]) for t in items))
        self._publish(force=True)
        return out


def _check_capture_dtype(arch: str, index: int, rows: torch.Tensor, buf: torch.Tensor) -> None:
    """Raise ``RuntimeError`` when a captured layer's rows (``[num_tokens, hidden_size]``) are
    not of its persistent buffer's dtype: the copy would cast them, and a served row is its
    writer's row or is not served. A static check (dtypes are known when torch.compile traces
    the hook): nothing of it enters the graph."""
    if rows.dtype != buf.dtype:
        raise RuntimeError(f"{arch}: captured layer {index}'s rows are {rows.dtype}, its buffer "
                           f"{buf.dtype} (the model's dtype): a copy would cast them")


def contiguous_linear_inputs(tower: torch.nn.Module | None) -> int:
    """Make the input of every vLLM linear layer in ``tower`` row-contiguous (a forward pre-hook;
    a copy only when the input is not contiguous). Returns the number of layers hooked.

    vLLM replaces a multimodal tower's ``nn.Linear`` layers by its own
    (``recursive_replace_linear`` in ``vllm/model_executor/models/gemma4_mm.py``). Its CPU GEMM
    dispatch (``vllm/model_executor/layers/utils.py``) sends a bf16 GEMM to the sgl kernel on a
    CPU with AMX and to oneDNN (``ops.onednn_mm``) otherwise; oneDNN requires
    ``a.stride(-1) == 1``, and Gemma 4's audio tower (transformers' ``Gemma4AudioLightConv1d``)
    hands ``linear_end`` the transposed output of its convolution, so on a CPU without AMX every
    audio request killed the stage's engine ("Expected a.stride(-1) == 1 to be true"; seen on
    an AMD EPYC, 2026-11-25). Values are unchanged: ``contiguous()`` copies the same elements.
    """
    if tower is None:
        return 0
    from vllm.model_executor.layers.linear import LinearBase

    hooked = 0
    for module in tower.modules():
        if isinstance(module, LinearBase):
            module.register_forward_pre_hook(_contiguous_first_input)
            hooked += 1
    return hooked


def _contiguous_first_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


#: the TTS tokens whose thinker embeddings go downstream (``embed.tts_bos/eos/pad``), as
#: Qwen3-Omni's ``config.json`` names their ids; the embedded KV-shared thinkers' configs carry
#: them too (``omni-cache make-model``)
TTS_TOKEN_KEYS = ("tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id")


def tts_token_ids(hf_config: Any) -> list[int]:
    """``[bos, eos, pad]`` TTS token ids read from the thinker's config (:data:`TTS_TOKEN_KEYS`;
    the top-level ``hf_config`` of the thinker stage, e.g. ``Gemma4Config``).

    Raises:
        ValueError: a key is missing — the talker would get the embeddings of other tokens; a
            model built before these keys were written is rebuilt by ``omni-cache make-model``.
    """
    missing = [k for k in TTS_TOKEN_KEYS if getattr(hf_config, k, None) is None]
    if missing:
        raise ValueError(f"the thinker's config lacks {', '.join(missing)}: the Qwen3-Omni talker needs the TTS "
                         "tokens' embeddings; add the ids of Qwen3-Omni's tokenizer (omni-cache make-model writes "
                         "them)")
    return [int(getattr(hf_config, k)) for k in TTS_TOKEN_KEYS]


class _AcceptLayerView:
    """``transfer_manager`` as vLLM-Omni's Qwen3-Omni payload builder reads it, with
    ``hf_config.talker_config.accept_hidden_layer`` = the thinker's accept layer."""

    def __init__(self, transfer_manager: Any, accept: int):
        self._tm = transfer_manager
        self._cfg = SimpleNamespace(
            hf_config=SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=accept)))

    def _get_model_config(self):
        return self._cfg

    @property
    def unwrapped(self) -> Any:
        """The transfer manager this view reads through (state that must outlive the call goes there)."""
        return self._tm

    def __getattr__(self, name: str):
        return getattr(self._tm, name)


def _accept_layer(transfer_manager: Any) -> int:
    mc = (transfer_manager._get_model_config() if hasattr(transfer_manager, "_get_model_config")
          else transfer_manager.config)
    cfg = mc.hf_config
    _, accept = stage_plan(cfg, False, os.environ)
    if accept == FINAL:
        raise RuntimeError(f"{settings.YOCO_ACCEPT_LAYER.name}=final: the final hidden states are not handed "
                           "downstream; accept a captured layer (e.g. the self-decoder output)")
    return int(accept)


def gemma_thinker2talker_full_payload(transfer_manager: Any, pooling_output: dict, request: Any):
    """Stage-input adapter: KV-shared thinker → Qwen3-Omni talker.

    ``pooling_output`` holds ``hidden_states.layer_0`` (thinker embeddings,
    ``[num_tokens, hidden_size]``) and ``hidden_states.layer_<accept>`` (the accept layer,
    by default the self-decoder output) plus ``embed.tts_*``. With
    ``OMNI_CACHE_HANDOFF_DUMP`` set the tensors are recorded first
    (:func:`omni_cache.engine.handoff.record_payload`).

    Returns:
        vLLM-Omni's talker payload (``thinker2talker_full_payload``), or None when it
        withholds one.
    """
    from vllm_omni.model_executor.stage_input_processors.qwen3_omni import thinker2talker_full_payload

    from omni_cache.engine.handoff import record_payload

    record_payload(pooling_output, request)
    return thinker2talker_full_payload(_AcceptLayerView(transfer_manager, _accept_layer(transfer_manager)),
                                       pooling_output, request)


def gemma_thinker2talker_async_chunk(transfer_manager: Any, multimodal_output: Any, request: Any,
                                     is_finished: bool = False):
    """Streamed stage-input adapter (``async_chunk: true``): KV-shared thinker → Qwen3-Omni
    talker, chunk by chunk. vLLM-Omni's ``thinker2talker_async_chunk`` with the accept layer
    mapped as in :func:`gemma_thinker2talker_full_payload`: the first hand-off carries every
    prompt row (layer 0 → ``embed.prefill``, the accept layer → ``hidden_states.output``), each
    later chunk one decode row. With ``OMNI_CACHE_HANDOFF_DUMP`` set every chunk sent is
    recorded (:func:`omni_cache.engine.handoff.record_thinker2talker_async_chunk`).

    Returns:
        vLLM-Omni's streamed payload, or None while rows are still accumulating.
    """
    from omni_cache.engine.handoff import record_thinker2talker_async_chunk

    return record_thinker2talker_async_chunk(_AcceptLayerView(transfer_manager, _accept_layer(transfer_manager)),
                                             multimodal_output, request, is_finished)
