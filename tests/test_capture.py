"""The generic DFLASH capture's mechanics (serving/capture.py) on a stand-in model laid out like SGLang's: what it
records, how it hands the rows to the logits processor, its check against a native capture, and the startup errors.
The real-model proofs run in CPU servers (tests/serving/test_generic_capture_cpu.py)."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash.serving import capture


class Layer(torch.nn.Module):
    """Returns (hidden, residual) like SGLang's decoder layers: the residual stream is their sum."""

    def __init__(self, seed):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        g = torch.Generator().manual_seed(seed)
        torch.nn.init.normal_(self.lin.weight, generator=g)
        torch.nn.init.normal_(self.lin.bias, generator=g)

    def forward(self, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return torch.tanh(self.lin(residual)), residual


class Processor(torch.nn.Module):
    def forward(self, input_ids, hidden, lm_head, batch, aux_hidden_states=None):
        return aux_hidden_states


class Stack(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(i) for i in range(n))
        self.layers_to_capture = []  # native capture, as SGLang's Llama: hidden + residual at layer i's input

    def forward(self, x):
        hidden, residual, aux = x, None, []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(hidden + residual)
            hidden, residual = layer(hidden, residual)
        return hidden, aux


class CausalLM(torch.nn.Module):
    def __init__(self, n=5, native=False):
        super().__init__()
        self.model, self.logits_processor, self.native = Stack(n), Processor(), native

    def forward(self, x):
        hidden, aux = self.model(x)
        if self.native:
            return self.logits_processor(None, hidden, None, None, aux)
        return self.logits_processor(None, hidden, None, None)


def hf_hidden_states(model, x):
    """HF's hidden_states[k + 1]: the residual stream after layer k."""
    out, hidden, residual = [], x, None
    for layer in model.model.layers:
        hidden, residual = layer(hidden, residual)
        out.append(hidden + residual)
    return out


def test_generic_capture_records_the_residual_stream_after_each_layer():
    model = CausalLM()
    capture.install_capture_hook(model)
    model.set_dflash_layers_to_capture([0, 2, 4])  # the last layer too (a native loop never reaches it)
    x = torch.randn(3, 8)
    for _ in range(2):  # a second forward gets fresh rows
        rows = model(x)
        ref = hf_hidden_states(model, x)
        assert len(rows) == 3 and all(torch.equal(r, ref[k]) for r, k in zip(rows, [0, 2, 4]))


def test_check_mode_matches_native_and_catches_a_difference(caplog):
    model = CausalLM(native=True)
    model.model.layers_to_capture = [1 + 1, 3 + 1]  # native ids are k + 1
    check = capture.LayerCapture(model, [1, 3], compare=True)
    x = torch.randn(4, 8)
    with caplog.at_level("INFO", logger="sglang_dflash"):
        for _ in range(4):
            model(x)
    assert check.compared == 4 and "equal to the native one on 4 forwards" in caplog.text
    model.model.layers_to_capture = [1 + 1, 2 + 1]  # a native capture of another layer: must be caught
    with pytest.raises(RuntimeError, match="generic capture of layer 3 differs"):
        model(x)


def test_bad_ids_and_uncapturable_models():
    model = CausalLM()
    capture.install_capture_hook(model)
    with pytest.raises(ValueError, match="outside the target's 5 layers"):
        model.set_dflash_layers_to_capture([1, 5])
    with pytest.raises(ValueError, match="strictly increasing"):
        model.set_dflash_layers_to_capture([3, 1])

    class NoLayers(torch.nn.Module):
        logits_processor = Processor()

    with pytest.raises(capture.CaptureUnsupportedError, match="NoLayers.*no list of decoder layers.*Fix:"):
        capture.install_capture_hook(NoLayers())

    class NoProcessor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Stack(2)

    with pytest.raises(capture.CaptureUnsupportedError, match="no `logits_processor`"):
        capture.install_capture_hook(NoProcessor())

    class Odd(torch.nn.Module):  # a layer output the capture cannot read as a residual stream
        def forward(self, x, r):
            return x, r, x

    odd = CausalLM(n=2)
    odd.model.layers[0] = Odd()
    capture.install_capture_hook(odd)
    odd.set_dflash_layers_to_capture([0])
    with pytest.raises(capture.CaptureUnsupportedError, match="not a tensor or \\(hidden, residual\\)"):
        odd.model.layers[0](torch.zeros(1, 8), None)


def test_mode_switch(monkeypatch):
    monkeypatch.setenv(capture.CAPTURE_ENV, "bogus")
    with pytest.raises(ValueError, match="SGLANG_DFLASH_CAPTURE='bogus'"):
        capture.capture_mode()
    monkeypatch.setenv(capture.CAPTURE_ENV, "")
    assert capture.capture_mode() == "auto"


class NativeLM(CausalLM):
    """A model class with SGLang's native hook (as Llama's: capture ids k + 1, rows passed to the logits processor)."""

    def __init__(self):
        super().__init__(native=True)

    def set_dflash_layers_to_capture(self, layer_ids):
        self.model.layers_to_capture = [i + 1 for i in layer_ids]


def sglang_configure(*, model, dflash_use_aux_hidden_state, dflash_target_layer_ids, **_):
    """What SGLang's configure_aux_hidden_state_capture does for DFLASH."""
    if dflash_use_aux_hidden_state:
        model.set_dflash_layers_to_capture(dflash_target_layer_ids)


@pytest.mark.parametrize("mode", ["auto", "generic", "check"])
def test_configure_capture_modes(monkeypatch, mode):
    monkeypatch.setenv(capture.CAPTURE_ENV, mode)
    x = torch.randn(2, 8)
    ref = hf_hidden_states(CausalLM(), x)  # same seeds, same layers
    native = NativeLM()
    capture.configure_capture(sglang_configure, model=native, dflash_use_aux_hidden_state=True,
                              dflash_target_layer_ids=[0, 2], is_dspark=False)
    rows = native(x)
    assert [torch.equal(r, ref[k]) for r, k in zip(rows, [0, 2])] == [True, True]
    assert (native.model.layers_to_capture == []) == (mode == "generic")  # generic: the native capture is off
    assert (getattr(native, "_dflash_capture_check", None) is not None) == (mode == "check")
    plain = CausalLM()  # no native hook: the generic capture in every mode
    capture.configure_capture(sglang_configure, model=plain, dflash_use_aux_hidden_state=True,
                              dflash_target_layer_ids=[1], is_dspark=False)
    assert torch.equal(plain(x)[0], ref[1])


# ----------------------------------------------------------------- CUDA graphs that replay the body only
class Mode:
    """capture_hidden_mode as SGLang's ForwardBatch / LogitsMetadata carry it."""

    def __init__(self, need: bool):
        self.need = need

    def need_capture(self):
        return self.need


def batch(need: bool):
    return type("Batch", (), {"capture_hidden_mode": Mode(need)})()


def test_a_body_only_graph_replay_hands_over_the_rows_its_capture_recorded(monkeypatch):
    """SGLang's prefill graphs (breakable / full) replay the model's body and run the logits processor eagerly: no
    layer hook runs at a replay. The rows recorded while the graph was captured live in one buffer the replays
    rewrite; the eager hand-over reads them there (before this, it passed nothing and the drafter got the final
    hidden state, one layer wide: the Qwen3.5 crash)."""
    model = CausalLM()
    capture.install_capture_hook(model)
    monkeypatch.setattr(capture, "graph_rows", lambda: 6)
    model.set_dflash_layers_to_capture([0, 2, 4])
    x = torch.randn(4, 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = model(x)  # "capture": the hooks run, and also fill the replay buffer
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    handed = model.logits_processor(None, torch.zeros(4, 8), None, batch(True))  # "replay": only the eager tail
    assert torch.equal(handed, torch.cat(captured, dim=-1))
    assert model.logits_processor(None, torch.zeros(4, 8), None, batch(False)) is None  # nobody asks: nothing
    eager = model(torch.randn(4, 8))  # an eager forward still hands over its own fresh rows
    assert isinstance(eager, list) and not torch.equal(eager[0], captured[0])


def test_a_hand_over_that_finds_no_rows_is_an_error_not_a_silent_pass():
    model = CausalLM()
    capture.install_capture_hook(model)
    model.set_dflash_layers_to_capture([1, 3])  # outside a server: no graphs, no replay buffer
    with pytest.raises(RuntimeError, match="no capture hook ran in this forward.*Fix"):
        model.logits_processor(None, torch.zeros(2, 8), None, batch(True))


def test_a_layer_whose_all_reduce_is_fused_into_the_next_is_refused():
    model = CausalLM(n=2)
    capture.install_capture_hook(model)
    model.set_dflash_layers_to_capture([0])
    hidden = torch.zeros(1, 8)
    hidden._sglang_needs_allreduce_fusion = True  # SGLang's mark: a per-rank partial sum
    with pytest.raises(capture.CaptureUnsupportedError, match="partial sum.*Fix"):
        capture.residual_stream(model, (hidden, torch.zeros(1, 8)))


# ------------------------------------------------------------------------- Qwen3.5 text wrappers (SGLang 0.5.17)
class _Body(torch.nn.Module):
    """Stands in for the Qwen3.5 body (SGLang's qwen3_5.Qwen3_5ForCausalLM), with its real capture setter."""

    def __init__(self, n, setter):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(n))
        self._setter = setter
        self.aux = None

    def set_dflash_layers_to_capture(self, ids):
        self._setter(self, ids)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        return torch.zeros(2, 8), self.aux


@pytest.mark.parametrize("cls_name", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_qwen3_5_text_wrappers_get_their_bodys_native_capture(cls_name):
    """SGLang 0.5.17's text-only Qwen3.5 classes (the seeds' Qwen3.5-35B-A3B) have no capture hook, but their body
    captures "before layer i" and their forward hands the body's (hidden, aux) to the logits processor. Checked on
    SGLang's own classes: the wrapper gets a setter that flags the body's layers ids + 1 (the body's real method),
    its real forward passes the body's rows through, and the last layer (no "before" in the body) is refused."""
    text = pytest.importorskip("sglang.srt.models.qwen3_5_text")
    body_cls = pytest.importorskip("sglang.srt.models.qwen3_5").Qwen3_5ForCausalLM
    cls = getattr(text, cls_name)
    assert not hasattr(cls, capture.NATIVE) and (cls.__module__, cls.__name__) in capture.BODY_NATIVE
    model = cls.__new__(cls)  # the class's own methods on stand-in parts (no weights, no kernels)
    torch.nn.Module.__init__(model)
    model.model = _Body(6, body_cls.set_dflash_layers_to_capture)
    model.logits_processor = Processor()
    model.pp_group = type("PP", (), {"is_last_rank": True})()
    model.is_mrope_enabled, model.lm_head = False, None
    capture.configure_capture(sglang_configure, model=model, dflash_use_aux_hidden_state=True,
                              dflash_target_layer_ids=[0, 2, 4], is_dspark=False)
    flagged = [i for i, layer in enumerate(model.model.layers) if getattr(layer, "_is_layer_to_capture", False)]
    assert flagged == [1, 3, 5]
    model.model.aux = [torch.ones(2, 8), 2 * torch.ones(2, 8), 3 * torch.ones(2, 8)]
    handed = cls.forward(model, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), None)
    assert handed is model.model.aux
    with pytest.raises(capture.CaptureUnsupportedError, match="include the last layer"):
        model.set_dflash_layers_to_capture([2, 5])
