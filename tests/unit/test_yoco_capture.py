"""The YOCO thinker's layer capture compiles without a Python side effect.

vLLM compiles the Gemma text model (or, with fast prefill, its self-decoder apart) and refuses,
under CUDA graphs, compiled code whose Dynamo-transformed bytecode names ``update`` — a module
state change replayed after the graph ("Assigning / modifying buffers of nn.Module during forward
pass ...", ``bytecode_hook`` in vllm/compilation/wrapper.py). The capture hooks of
:class:`omni_cache.engine.gemma_thinker._YocoThinkerMixin` once stored rows in a dict and so
stopped the compiled Gemma-4 thinker from starting on an H100 (docs/gpu.md, "Compiled YOCO").
This test compiles the real hooks on small decoder layers (a fake model: engine-free), applies
vLLM's check to the transformed bytecode, and compares the captured rows with the layers' own
(the writer's rows, bitwise); the control shows the check fires on a dict-storing hook.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from omni_cache.engine.gemma_thinker import _YocoThinkerMixin

HIDDEN, MAX_TOKENS = 8, 16


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden_states):
        return torch.tanh(self.lin(hidden_states))


class _Thinker(_YocoThinkerMixin, nn.Module):
    """Three decoder layers; captures layer 0 (input of layer 0) and 2 (output of layer 1)."""

    ARCH = "test"

    def __init__(self):
        nn.Module.__init__(self)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.layer_plan = SimpleNamespace(captured_layers=(0, 2))
        self._alloc_capture_buffers(MAX_TOKENS, HIDDEN, torch.float32, torch.device("cpu"))
        self._install_capture_hooks()

    def _decoder_layers(self):
        return self.layers

    def body(self, positions, h):  # what vLLM compiles: the decoder layers
        for layer in self.layers:
            h = layer(positions, hidden_states=h)
        return h


def _compiled_names(fn, *args) -> list[set[str]]:
    """Run ``fn`` under torch.compile; the names of every Dynamo-transformed code object."""
    names: list[set[str]] = []
    handle = torch._dynamo.convert_frame.register_bytecode_hook(lambda old, new: names.append(set(new.co_names)))
    try:
        torch._dynamo.reset()
        torch.compile(fn, backend="eager")(*args)
    finally:
        handle.remove()
        torch._dynamo.reset()
    assert names, "nothing was compiled"
    return names


def test_capture_hooks_compile_without_module_state_changes():
    torch.manual_seed(0)
    m = _Thinker()
    x = torch.randn(5, HIDDEN)
    names = _compiled_names(m.body, torch.arange(5), x)
    assert not any("update" in n for n in names), names  # vLLM's check (cudagraph on) would refuse it
    layers = m._captured_layers(5)
    with torch.no_grad():
        after1 = m.layers[1](None, hidden_states=m.layers[0](None, hidden_states=x))
    assert torch.equal(layers[0], x) and torch.equal(layers[2], after1)  # the writer's rows, bitwise
    # a shorter forward next: its rows, and copies that the next forward does not change
    y = torch.randn(3, HIDDEN)
    torch.compile(m.body, backend="eager")(torch.arange(3), y)
    again = m._captured_layers(3)
    assert torch.equal(again[0], y) and torch.equal(layers[0], x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_whose_rows_are_not_the_buffers_dtype_raises_not_casts(compiled):
    """The dtype check is on each captured layer's own rows (a copy into the float32 buffer
    would cast bf16 rows); the model's output dtype does not matter (vLLM's batch-invariant
    Gemma-3n returns float32 from bf16 layers: the H100 run of 2026-11-27)."""
    m = _Thinker()
    m.layers[0].to(torch.bfloat16)  # layer 0 and 1 in bf16: layer 0's input and layer 1's output are bf16 rows
    m.layers[1].to(torch.bfloat16)
    body = torch.compile(m.body, backend="eager") if compiled else m.body
    torch._dynamo.reset()
    try:
        with pytest.raises(RuntimeError, match=r"layer \d's rows are torch.bfloat16, its buffer torch.float32"):
            body(torch.arange(4), torch.randn(4, HIDDEN, dtype=torch.bfloat16))
    finally:
        torch._dynamo.reset()
    # the model's output in another dtype than the captured rows' is fine
    f = _Thinker()
    f.layers[2] = _ToDouble()  # the uncaptured last layer: the output float64, the captured rows float32
    assert f.body(torch.arange(4), torch.randn(4, HIDDEN)).dtype == torch.float64
    assert f._captured_layers(4)[0].dtype == torch.float32


class _ToDouble(nn.Module):
    def forward(self, positions, hidden_states):
        return hidden_states.double()


def test_control_a_dict_storing_hook_trips_the_check():
    m = _Thinker()
    store: dict[int, torch.Tensor] = {}
    m.layers[2].register_forward_hook(lambda _mod, _args, out: store.__setitem__(3, out.clone()))
    names = _compiled_names(m.body, torch.arange(5), torch.randn(5, HIDDEN))
    assert any("update" in n for n in names)
