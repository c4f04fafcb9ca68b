"""The talker's per-request generators reach the code predictor (omni_cache.engine.talker).

Engine-free: vLLM-Omni's own ``Qwen3OmniMoeForConditionalGeneration.talker_mtp`` and its
talker's ``code_predictor_forward`` run unchanged on a model object built without weights;
only the code predictor is a small stand-in that records the sampling arguments it gets and
draws its codes from them (the real predictor needs a vLLM config). The pipeline tests
(tests/pipeline/test_streaming_equality.py) check the end result: a request's audio no
longer depends on the requests before it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

H = 8          # talker hidden size
GROUPS = 4     # codec groups (layer 0 + 3 residual codebooks)
VOCAB = 1000


class _Predictor(torch.nn.Module):
    """Stand-in code predictor: residual codes drawn from the generator(s) it is given."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def forward(self, layer0_code, layer0_embed, last_talker_hidden, generator=None, generators=None):
        self.calls.append({"generator": generator, "generators": generators})
        bsz = layer0_code.shape[0]
        gens = list(generators) if generators is not None else [generator] * bsz
        rows = [torch.randint(VOCAB, (GROUPS - 1,), generator=g) for g in gens]
        codes = torch.cat([layer0_code.reshape(bsz, 1), torch.stack(rows)], 1).unsqueeze(-1)
        return codes, torch.zeros(bsz, GROUPS + 1, H)


def _model():
    from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_talker import (
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    from omni_cache.engine.talker import OmniCacheQwen3OmniMoeForConditionalGeneration as Cls

    talker = Qwen3OmniMoeTalkerForConditionalGeneration.__new__(Qwen3OmniMoeTalkerForConditionalGeneration)
    torch.nn.Module.__init__(talker)
    talker.code_predictor = _Predictor()
    talker.num_code_groups = GROUPS
    talker.config = SimpleNamespace(code_predictor_config=SimpleNamespace(hidden_size=H))
    talker.language_model = SimpleNamespace(model=SimpleNamespace(codec_embedding=torch.nn.Embedding(VOCAB, H)))
    model = Cls.__new__(Cls)
    torch.nn.Module.__init__(model)
    model.talker = talker
    model.talker_config = SimpleNamespace(text_config=SimpleNamespace(hidden_size=H))
    return model


def _call(model, rows, **kw):
    ids = torch.arange(rows, dtype=torch.int32)
    x = torch.zeros(rows, H)
    return model.talker_mtp(ids, x, x, x, **kw)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_per_row_generators_reach_the_predictor_and_decide_each_row():
    model = _model()
    assert model.talker_mtp_accepts_per_row_generators is True
    _, alone = _call(model, 1, generator=_gen(7))
    _, batch = _call(model, 3, generators=[_gen(3), _gen(7), None])
    assert torch.equal(batch[1, 1:], alone[0, 1:])  # row 1's residual codes: its own generator's, whatever is beside it
    calls = model.talker.code_predictor.calls
    assert calls[0]["generator"] is not None and calls[0]["generators"] is None
    assert len(calls[1]["generators"]) == 3 and calls[1]["generators"][2] is None


def test_no_generator_keeps_the_global_rng_and_the_binding_is_removed():
    model = _model()
    torch.manual_seed(0)
    _, a = _call(model, 2)
    torch.manual_seed(0)
    _, b = _call(model, 2, generators=[None, None])
    assert torch.equal(a, b)
    assert model.talker.code_predictor.calls[-1] == {"generator": None, "generators": None}
    _call(model, 1, generator=_gen(1))
    assert "forward" not in vars(model.talker.code_predictor)  # only bound for that call


def test_graph_padded_rows_get_no_generator_and_too_many_are_refused():
    from omni_cache.engine.talker import predictor_sampling_kwargs

    g = _gen(0)
    assert predictor_sampling_kwargs(None, [g, None], 4) == {"generators": [g, None, None, None]}
    assert predictor_sampling_kwargs(g, None, 1) == {"generator": g}
    assert predictor_sampling_kwargs(g, None, 2) == {"generators": [g, None]}
    assert predictor_sampling_kwargs(None, None, 3) == {}
    with pytest.raises(ValueError, match="3 generators for 2 rows"):
        predictor_sampling_kwargs(None, [g, g, g], 2)


def test_a_failing_call_still_removes_the_binding():
    model = _model()
    with pytest.raises(RuntimeError):
        model.talker_mtp(torch.zeros(1, dtype=torch.int32), torch.zeros(1, H + 1), torch.zeros(1, H),
                         torch.zeros(1, H), generator=_gen(0))
    assert "forward" not in vars(model.talker.code_predictor)
