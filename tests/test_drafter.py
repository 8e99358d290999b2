"""The drafter's attention semantics: KV injection, bidirectional blocks, causal / sliding layers, padding."""

import torch

from sglang_dflash.drafter import RMSNorm
from sglang_dflash.targets.tiny import tiny_drafter, tiny_target

TARGET = tiny_target("qwen3")


def run(drafter, block, ctx_len=6, start=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = drafter.config.hidden_size
    k = drafter.config.num_context_features
    feats = torch.randn(1, ctx_len, k * h, generator=g)
    context = drafter.project_context(feats)
    start = ctx_len if start is None else start
    embeds = drafter.block_embeddings(block[None], TARGET.get_input_embeddings().weight)
    pos = torch.arange(start, start + block.shape[0])[None]
    return drafter(embeds, pos, context, torch.arange(ctx_len)[None]), context


@torch.no_grad()
def test_block_attention_is_bidirectional_in_full_layers():
    drafter = tiny_drafter(TARGET.config, block_size=8)
    block = torch.tensor([5, 255, 255, 255, 255, 255, 255, 255])
    base, _ = run(drafter, block)
    changed = block.clone()
    changed[-1] = 7  # a LATER block token
    out, _ = run(drafter, changed)
    assert not torch.allclose(out[0, 0], base[0, 0])  # earlier positions see it: non-causal


@torch.no_grad()
def test_causal_layers_hide_later_block_tokens():
    drafter = tiny_drafter(TARGET.config, block_size=8, is_causal=True)
    block = torch.tensor([5, 255, 255, 255, 255, 255, 255, 255])
    base, _ = run(drafter, block)
    changed = block.clone()
    changed[-1] = 7
    out, _ = run(drafter, changed)
    torch.testing.assert_close(out[0, :-1], base[0, :-1])
    assert not torch.allclose(out[0, -1], base[0, -1])


def layer_io(drafter, block, context, pin=None, visible=None):
    """One drafter forward; returns (inputs, outputs) of every layer. pin=(l, x) replaces layer l's input by x, so
    that whatever layer l's output does beyond that input can only come from its own use of the context."""
    inputs, outputs, hooks = [], [], []

    def record(module, args, out):  # returns None: the output is kept as it is
        inputs.append(args[0])
        outputs.append(out)

    for i, layer in enumerate(drafter.layers):
        if pin is not None and pin[0] == i:
            hooks.append(layer.register_forward_pre_hook(lambda m, args, x=pin[1]: (x, *args[1:])))
        hooks.append(layer.register_forward_hook(record))
    c, q = context.shape[1], block.shape[0]
    embeds = drafter.block_embeddings(block[None], TARGET.get_input_embeddings().weight)
    try:
        drafter(embeds, torch.arange(c, c + q)[None], context, torch.arange(c)[None], visible)
    finally:
        for h in hooks:
            h.remove()
    return inputs, outputs


@torch.no_grad()
def test_context_reaches_every_layer():
    """KV injection: every draft layer attends to the target's context itself, not only through the layers before
    it. For each layer l of a 3-layer drafter, pin l's input to its value in a reference run and change the context:
    l's output must change (injection into the first layer only, EAGLE-style, leaves layers 2 and 3 unchanged: the
    mutation test plants it). Controls: pinned with the same context, l reproduces its output exactly (the pin
    isolates l); with the context hidden by the visible mask, changing it changes nothing (the route is the
    attention over the context rows)."""
    drafter = tiny_drafter(TARGET.config, num_layers=3, block_size=4)
    block = torch.tensor([5, 255, 255, 255])
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 6, drafter.config.num_context_features * drafter.config.hidden_size, generator=g)
    context = drafter.project_context(features)
    other = drafter.project_context(torch.randn(features.shape, generator=g))
    inputs, outputs = layer_io(drafter, block, context)
    for layer in range(3):
        _, same = layer_io(drafter, block, context, pin=(layer, inputs[layer]))
        assert torch.equal(same[layer], outputs[layer]), layer
        _, moved = layer_io(drafter, block, other, pin=(layer, inputs[layer]))
        change = (moved[layer] - outputs[layer]).abs().max().item()
        assert change > 1e-2, f"layer {layer + 1} ignores the context it was given (max change {change:.1e})"
    hidden = torch.ones(1, 4, 10, dtype=torch.bool)
    hidden[:, :, :6] = False
    _, seen = layer_io(drafter, block, context, visible=hidden)
    _, unseen = layer_io(drafter, block, other, visible=hidden)
    torch.testing.assert_close(unseen[-1], seen[-1], rtol=0, atol=0)


@torch.no_grad()
def test_sliding_window_limits_context():
    d = tiny_drafter(TARGET.config, block_size=4, layer_types=["sliding_attention"], sliding_window=3)
    block = torch.tensor([5, 255, 255, 255])
    g = torch.Generator().manual_seed(1)
    h, k = d.config.hidden_size, d.config.num_context_features
    feats = torch.randn(1, 10, k * h, generator=g)
    ctx = d.project_context(feats)
    embeds = d.block_embeddings(block[None], TARGET.get_input_embeddings().weight)
    pos = torch.arange(10, 14)[None]
    out = d(embeds, pos, ctx, torch.arange(10)[None])
    # context rows further than the window from every query cannot matter
    ctx2 = ctx.clone()
    ctx2[:, :7] = torch.randn_like(ctx2[:, :7])
    torch.testing.assert_close(d(embeds, pos, ctx2, torch.arange(10)[None]), out)
    ctx3 = ctx.clone()
    ctx3[:, 9] += 1.0  # inside the window of the first query
    assert not torch.allclose(d(embeds, pos, ctx3, torch.arange(10)[None])[0, 0], out[0, 0])


@torch.no_grad()
def test_batched_padded_context_equals_single():
    drafter = tiny_drafter(TARGET.config, block_size=4)
    blocks = [torch.tensor([5, 255, 255, 255]), torch.tensor([9, 255, 255, 255])]
    singles = [run(drafter, b, ctx_len=n, seed=s) for b, n, s in zip(blocks, (3, 7), (0, 1))]
    h = drafter.config.hidden_size
    context = torch.zeros(2, 7, h)
    visible = torch.ones(2, 4, 11, dtype=torch.bool)
    for i, (n, (_, ctx)) in enumerate(zip((3, 7), singles)):
        context[i, :n] = ctx[0]
        visible[i, :, n:7] = False
    embeds = drafter.block_embeddings(torch.stack(blocks), TARGET.get_input_embeddings().weight)
    pos = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    out = drafter(embeds, pos, context, torch.arange(7).expand(2, 7), visible)
    for i, (single, _) in enumerate(singles):
        torch.testing.assert_close(out[i], single[0], atol=1e-5, rtol=1e-5)


def test_gemma_norm_scales_by_one_plus_weight():
    x = torch.randn(3, 8)
    n = RMSNorm(8, 1e-6, gemma_style=True)
    plain = RMSNorm(8, 1e-6)
    torch.testing.assert_close(n(x), plain(x))  # zero-initialised (1 + 0) == ones-initialised
    with torch.no_grad():
        n.weight.fill_(1.0)
    torch.testing.assert_close(n(x), 2 * plain(x))


def test_rope_stays_float32_in_bf16_drafter():
    drafter = tiny_drafter(TARGET.config).to(torch.bfloat16)
    assert drafter.rope.inv_freq.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in drafter.parameters())
