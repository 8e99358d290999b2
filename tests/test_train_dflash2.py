"""Training a DFlash2 drafter (`train run --arch dflash2`, sglang_dflash/train/dflash2.py) on a tiny random pair (CPU):
the selector loss against a per-row reference (value and gradients), the neutral init / warm start drafting exactly
as the DFlash drafter it starts from, a few steps lowering the selector loss, the saved checkpoint loading and
decoding losslessly, and the CLI's warm start."""

import json

import pytest
import torch

from sglang_dflash.checkpoint import load_drafter, save_drafter
from sglang_dflash.config import DFlashConfig
from sglang_dflash.drafter import DFlashDrafter
from sglang_dflash.reference.engine import ReferenceEngine, propose_step
from sglang_dflash.sampling import SamplingParams
from sglang_dflash.targets.tiny import tiny_drafter_config, tiny_target
from sglang_dflash.train.blocks import IGNORE
from sglang_dflash.train.dflash2 import dflash2_config, neutral_init, selector_loss, warm_start
from sglang_dflash.train.evaluate import evaluate_sets
from sglang_dflash.train.generate import generate_responses
from sglang_dflash.train.loop import Trainer, TrainConfig

torch.set_num_threads(2)
BLOCK = 8
SIZES = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=8)  # hidden 32: 2 groups


def tiny_pair_target():
    return tiny_target("llama", vocab_size=128, hidden_size=32, num_layers=3, seed=0)


@pytest.fixture(scope="module")
def target():
    return tiny_pair_target()


@pytest.fixture(scope="module")
def store(target):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 127, (6,), generator=g).tolist() for _ in range(12)]
    return generate_responses(target, prompts, max_new_tokens=40, stop_token_ids=[1], pad_id=0, batch_size=6,
                              progress=False)


def dflash_drafter(target, seed=3) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = tiny_drafter_config(target.config, num_layers=1, block_size=BLOCK, target_layer_ids=[0, 2],
                              mask_token_id=127)
    return DFlashDrafter(DFlashConfig.from_dict(cfg)).eval()


def dflash2_from(drafter: DFlashDrafter, seed=0) -> DFlashDrafter:
    """`train run --arch dflash2 --init-drafter`'s construction: neutral DFlash2 parts, the DFlash backbone."""
    out = DFlashDrafter(dflash2_config(drafter.config, **SIZES))
    neutral_init(out, seed)
    assert warm_start(out, drafter) == "backbone"
    return out.eval()


def naive_selector_loss(selector, hidden, logits, labels, ids, gamma=7.0):
    """The selector loss one labelled row at a time, from the definition (train/dflash2.py's doc)."""
    k, total, weights = selector.top_k, 0.0, 0.0
    for j in range(labels.numel() // BLOCK):
        for i in range(1, BLOCK):
            row = j * BLOCK + i
            y = int(labels[row])
            if y == IGNORE:
                continue
            prev = int(ids[j * BLOCK]) if i == 1 else int(labels[row - 1])  # the true token before position i
            unary, cands = logits[row].topk(k)
            if y not in cands.tolist():
                continue
            query = selector.predecessor_codebook[prev] * selector.hidden_projection(hidden[row])
            scores = unary + (selector.successor_codebook[cands] * query).sum(-1)
            w = torch.exp(torch.tensor(-(i - 1) / gamma))
            total = total - w * torch.log_softmax(scores, -1)[cands.tolist().index(y)]
            weights = weights + w
    return total / weights


def selector_batch(drafter, n_blocks=6, seed=0):
    """Random hidden states and logits for n_blocks blocks; labels: about half the true tokens among the top K,
    the other half anywhere, and the tails of two blocks past the sequence end (IGNORE)."""
    g = torch.Generator().manual_seed(seed)
    v, k = drafter.config.vocab_size, drafter.config.selector_top_k
    hidden = torch.randn(n_blocks * BLOCK, 32, generator=g, requires_grad=True)
    logits = (torch.randn(n_blocks * BLOCK, v, generator=g) * 3).requires_grad_()
    top = logits.detach().topk(k, dim=-1).indices
    pick = top.gather(1, torch.randint(k, (n_blocks * BLOCK, 1), generator=g))[:, 0]
    labels = torch.where(torch.rand(n_blocks * BLOCK, generator=g) < 0.6, pick,
                         torch.randint(v, (n_blocks * BLOCK,), generator=g))
    ids = torch.full((n_blocks * BLOCK,), 127)
    ids[::BLOCK] = torch.randint(v, (n_blocks,), generator=g)
    labels[::BLOCK] = IGNORE
    labels[BLOCK + 5: 2 * BLOCK] = IGNORE
    labels[4 * BLOCK + 2: 5 * BLOCK] = IGNORE
    return hidden, logits, labels, ids


def test_selector_loss_is_the_per_row_definition_value_and_gradients(target):
    drafter = dflash2_from(dflash_drafter(target))
    sel = drafter.candidate_selector
    with torch.no_grad():  # transitions that matter (the neutral init has W = 0)
        sel.hidden_projection.weight.normal_(0, 1.0)
        sel.predecessor_codebook.normal_(0, 1.0)
    hidden, logits, labels, ids = selector_batch(drafter)
    loss, stats = selector_loss(sel, hidden, logits, labels, ids, BLOCK)
    grads = torch.autograd.grad(loss, [hidden, logits, sel.predecessor_codebook, sel.hidden_projection.weight])
    expected = naive_selector_loss(sel, hidden, logits, labels, ids)
    expected_grads = torch.autograd.grad(expected, [hidden, logits, sel.predecessor_codebook,
                                                    sel.hidden_projection.weight])
    torch.testing.assert_close(loss, expected, msg="selector loss differs from the per-row definition")
    for name, a, b in zip(("hidden", "logits (unary)", "P", "W"), grads, expected_grads):
        torch.testing.assert_close(a, b, msg=f"selector loss gradient w.r.t. {name} differs from the definition's")
    assert grads[1].abs().sum() > 0  # the backbone's logits get a gradient through the candidates' unary scores
    assert 0.3 < stats["covered"] < 0.9 and 0 < stats["unary_top1"] < 1 and 0 < stats["top1"] < 1


def test_neutral_selector_learns_from_its_first_step(target):
    """W = 0 makes every transition exactly 0, yet W's gradient is not zero (the codebooks are random)."""
    drafter = dflash2_from(dflash_drafter(target))
    sel = drafter.candidate_selector
    hidden, logits, labels, ids = selector_batch(drafter)
    loss, _ = selector_loss(sel, hidden, logits, labels, ids, BLOCK)
    loss.backward()
    assert sel.hidden_projection.weight.grad.abs().sum() > 0
    assert (drafter.layers[0].attention_conv.base_kernel[:, 1:] == 0).all()


@torch.no_grad()
def test_warm_started_dflash2_drafts_exactly_like_its_dflash_drafter(target):
    dflash = dflash_drafter(target)
    dflash2 = dflash2_from(dflash)
    assert dflash2.config.is_dflash2 and dflash2.config.selector_top_k == 8
    g = torch.Generator().manual_seed(4)
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    contexts = [dflash.project_context(torch.randn(n, 64, generator=g)) for n in (3, 9, 17, 30)]
    bonus = torch.randint(128, (4,), generator=g).tolist()
    a = propose_step(dflash, bonus, contexts, embed, lm_head)
    b = propose_step(dflash2, bonus, contexts, embed, lm_head)
    assert b.candidates is not None  # the selector walked ...
    assert torch.equal(a.tokens, b.tokens)  # ... the argmax path
    prompts = [[5, 9, 33, 2], [70, 71, 72, 73, 74, 75]]
    params = SamplingParams(max_new_tokens=24)
    ra = ReferenceEngine(target, dflash).generate(prompts, params)
    rb = ReferenceEngine(target, dflash2).generate(prompts, params)
    assert [r.output_ids for r in ra] == [r.output_ids for r in rb]
    assert [r.commit_lens for r in ra] == [r.commit_lens for r in rb]


def test_a_few_steps_lower_the_selector_loss_and_the_saved_drafter_is_lossless(target, store, tmp_path):
    drafter = dflash2_from(dflash_drafter(target)).train()
    train, held = store.split(0.25, seed=0)
    cfg = TrainConfig(steps=80, batch_size=4, num_anchors=8, lr=3e-3, warmup_frac=0.05, seed=0, selector_lr_scale=3)
    trainer = Trainer(drafter, target, train, cfg, None, held_out=held)
    before = trainer.evaluate()
    trainer.fit(progress=False, resume=False)
    after = trainer.history[-1]
    assert len(trainer.selector_losses) == 80
    first, last = trainer.selector_losses[:10], trainer.selector_losses[-10:]
    assert sum(last) < 0.75 * sum(first), (first, last)  # measured: 1.99 -> 1.18 (mean of 10 steps)
    assert after["held_out_selector_loss"] < before["held_out_selector_loss"], (before, after)
    assert {"held_out_block_accept", "held_out_block_accept_argmax", "held_out_selector_covered",
            "held_out_selector_top1", "held_out_selector_unary_top1"} <= set(after)

    save_drafter(drafter, tmp_path / "d", max_shard_bytes=40_000, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in SIZES} == SIZES
    assert DFlashConfig.from_pretrained(tmp_path / "d") == drafter.config
    back = load_drafter(tmp_path / "d", dtype=torch.float32, target_config=target.config)
    for (name, a), b in zip(drafter.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name
    # `train eval`'s measurement: the reference engine, greedy output checked against target-only decoding
    prompts = [store.tokens(i)[: int(store.prompt_lens[i])].tolist() for i in range(3)]
    report = evaluate_sets(target, back, {"tiny": prompts}, 24, temperatures=(0.0, 1.0), stop_token_ids=(1,))
    assert report["tiny"]["T=0"]["greedy_equal"] is True
    assert report["tiny"]["T=0"]["tau"] >= 1.0 and report["tiny"]["T=1"]["verify_steps"] > 0


def test_cli_warm_starts_dflash2_from_a_dflash_drafter(tmp_path):
    from sglang_dflash.train.pipeline import load_target, main

    model, _, _, make_cfg = load_target("tiny", torch.float32, "cpu")
    torch.manual_seed(0)
    init = DFlashDrafter(DFlashConfig.from_dict(make_cfg(num_layers=1)))
    save_drafter(init, tmp_path / "init")
    main(["run", "--tiny", "--out", str(tmp_path / "out"), "--arch", "dflash2", "--init-drafter",
          str(tmp_path / "init"), "--steps", "3", "--n-eval-run", "0", "--quiet", "--conv-group-size", "32",
          "--selector-rank", "16", "--selector-top-k", "8"])
    log = json.loads((tmp_path / "out" / "train_log.json").read_text())
    assert log["init_drafter_copied"] == "backbone" and len(log["selector_losses"]) == 3
    saved = DFlashConfig.from_pretrained(tmp_path / "out" / "drafter")
    assert saved.is_dflash2 and (saved.conv_kernel_size, saved.conv_group_size, saved.selector_rank,
                                 saved.selector_top_k) == (4, 32, 16, 8)
    with pytest.raises(SystemExit, match="another shape"):  # a backbone of another shape is refused, with the fix
        main(["run", "--tiny", "--out", str(tmp_path / "out2"), "--arch", "dflash2", "--init-drafter",
              str(tmp_path / "init"), "--layers", "3", "--steps", "3", "--n-eval-run", "0", "--quiet"])


def test_compare_tau_sets_the_new_drafter_beside_the_base(tmp_path, capsys):
    from sglang_dflash.train.pipeline import main

    def report(tau_gsm, tau_mt, prompts=32):
        row = dict(prompts=prompts, max_new_tokens=128)
        return {"meta": {"drafter": "d"}, "results": {
            "gsm": {"T=0": {**row, "tau": tau_gsm}, "T=0 replay": {**row, "tau": 9.0}},
            "mtbench": {"T=0": {**row, "tau": tau_mt}, "T=1": {**row, "tau": 1.5}}}}

    (tmp_path / "new.json").write_text(json.dumps(report(4.6, 2.0)))
    (tmp_path / "base.json").write_text(json.dumps(report(4.0, 2.5, prompts=16)))
    main(["compare", "--new", str(tmp_path / "new.json"), "--base", str(tmp_path / "base.json"),
          "--out", str(tmp_path / "c.json")])
    table = json.loads((tmp_path / "c.json").read_text())
    assert table["gsm"] == {"T=0": {"new": 4.6, "base": 4.0, "gain": 0.15, "same_prompts": False}}
    assert table["mtbench"]["T=0"]["gain"] == -0.2 and table["mtbench"]["T=1"]["gain"] == 0.0
    assert table["mean_gain"] == {"T=0": round((0.15 - 0.2) / 2, 4), "T=1": 0.0}
    assert "different prompts" in capsys.readouterr().out


def test_each_dflash2_part_gets_its_learning_rate(target, store):
    """Backbone lr, selector lr x selector_lr_scale, convolutions lr x conv_lr_scale (0: frozen in place)."""
    drafter = dflash2_from(dflash_drafter(target)).train()
    cfg = TrainConfig(steps=3, batch_size=2, num_anchors=4, lr=1e-3, seed=0, selector_lr_scale=4, conv_lr_scale=0)
    trainer = Trainer(drafter, target, store, cfg, None)
    lrs = {id(p): g["lr"] for g in trainer.opt.param_groups for p in g["params"]}
    named = dict(drafter.named_parameters())
    assert lrs[id(named["fc.weight"])] == 1e-3 and lrs[id(named["layers.0.mlp.up_proj.weight"])] == 1e-3
    assert lrs[id(named["candidate_selector.successor_codebook"])] == 4e-3
    assert lrs[id(named["layers.0.mlp_conv.kernel_projection.weight"])] == 0
    assert len(lrs) == len(named)  # every parameter in exactly one group
    conv = drafter.layers[0].attention_conv.base_kernel.detach().clone()
    trainer.fit(progress=False, resume=False)
    assert torch.equal(drafter.layers[0].attention_conv.base_kernel, conv)
