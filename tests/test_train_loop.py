"""Batched drafter training on a tiny random target (CPU, fast): loss goes down, flex == dense, checkpoint and
trainer-state round trips, the compact token store, the acceptance estimate."""

import json

import pytest
import torch

from sglang_dflash.checkpoint import load_drafter, save_drafter
from sglang_dflash.config import DFlashConfig
from sglang_dflash.drafter import DFlashDrafter
from sglang_dflash.targets.tiny import tiny_drafter_config, tiny_target
from sglang_dflash.train.blocks import IGNORE
from sglang_dflash.train.data import TokenStore
from sglang_dflash.train.generate import generate_responses
from sglang_dflash.train.loop import Trainer, TrainConfig, accept_lengths, batch_logits_and_labels, pad_batch

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=128, hidden_size=32, num_layers=3, seed=0)


@pytest.fixture(scope="module")
def store(target):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 127, (6,), generator=g).tolist() for _ in range(12)]
    return generate_responses(target, prompts, max_new_tokens=40, stop_token_ids=[1], pad_id=0, batch_size=6,
                              progress=False)


def make_drafter(target, block_size=8, seed=3):
    torch.manual_seed(seed)
    cfg = tiny_drafter_config(target.config, num_layers=1, block_size=block_size, target_layer_ids=[0, 2],
                              mask_token_id=127)
    return DFlashDrafter(DFlashConfig.from_dict(cfg))


def test_generated_responses_are_the_targets_greedy_continuations(target, store):
    assert len(store) == 12 and store.flat.dtype == torch.uint16
    toks = store.tokens(0)
    p = int(store.prompt_lens[0])
    with torch.no_grad():
        logits = target(toks[None]).logits[0]
    # every response token is the target's argmax given everything before it
    assert torch.equal(logits[p - 1: len(toks) - 1].argmax(-1), toks[p:])


def test_token_store_round_trip_and_split(store, tmp_path):
    store.save(tmp_path / "d.pt")
    back = TokenStore.load(tmp_path / "d.pt")
    assert all(torch.equal(store.tokens(i), back.tokens(i)) for i in range(len(store)))
    assert back.prompt_lens.tolist() == store.prompt_lens.tolist()
    train, held = store.split(0.25, seed=0)
    assert len(train) == 9 and len(held) == 3
    seqs = {tuple(store.tokens(i).tolist()) for i in range(len(store))}
    tr = {tuple(train.tokens(i).tolist()) for i in range(len(train))}
    he = {tuple(held.tokens(i).tolist()) for i in range(len(held))}
    assert tr | he == seqs and not tr & he


def test_a_few_steps_reduce_the_loss(target, store):
    drafter = make_drafter(target)
    cfg = TrainConfig(steps=60, batch_size=4, num_anchors=8, lr=3e-3, warmup_frac=0.05, seed=0)
    train, held = store.split(0.25, seed=0)
    trainer = Trainer(drafter, target, train, cfg, "/tmp/unused-no-ckpt", held_out=held)
    before = trainer.evaluate()
    losses = trainer.fit(progress=False, resume=False)
    after = trainer.history[-1]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.9 * sum(losses[:10]) / 10
    assert after["held_out_loss"] < before["held_out_loss"]


def test_flex_attention_path_equals_dense_path(target, store):
    """Forward only: flex attention has no CPU backward (training with attention='flex' needs CUDA)."""
    drafter = make_drafter(target)
    seqs = [store.tokens(i) for i in range(3)]
    tokens, lengths = pad_batch(seqs, 0, "cpu")
    starts = [int(store.prompt_lens[i]) for i in range(3)]
    anchors = torch.stack([torch.tensor([6, 10, 20, 30]) for _ in range(3)])
    out = {}
    with torch.no_grad():
        for mode in ("dense", "flex"):
            out[mode], labels = batch_logits_and_labels(drafter, target, tokens, lengths, starts, 4,
                                                        attention=mode, anchors=anchors)
    assert (labels != IGNORE).sum() > 20
    assert torch.allclose(out["dense"], out["flex"], atol=1e-4, rtol=1e-4)


def test_trainer_state_resume_continues_exactly(target, store, tmp_path):
    cfg = TrainConfig(steps=8, batch_size=2, num_anchors=4, lr=1e-3, seed=5)
    straight = make_drafter(target)
    Trainer(straight, target, store, cfg, tmp_path / "a").fit(progress=False, resume=False)

    half = make_drafter(target)
    t1 = Trainer(half, target, store, TrainConfig(**{**cfg.__dict__, "steps": 8}), tmp_path / "b")
    for _ in range(4):
        t1.train_step()
    t1.save_state()
    resumed = make_drafter(target, seed=99)  # different init: everything must come from the state file
    t2 = Trainer(resumed, target, store, cfg, tmp_path / "b")
    t2.fit(progress=False, resume=True)
    assert t2.step == 8 and len(t2.losses) == 8
    for (n, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_checkpoint_round_trip_bf16_shards(target, tmp_path):
    drafter = make_drafter(target)
    save_drafter(drafter, tmp_path / "d", max_shard_bytes=20_000, dtype=torch.bfloat16)
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == 127
    back = load_drafter(tmp_path / "d", target_config=target.config)
    for (n, a), b in zip(drafter.state_dict().items(), back.state_dict().values()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), n


def test_accept_lengths():
    b, v = 4, 5
    labels = torch.tensor([IGNORE, 1, 2, 3, IGNORE, 1, 2, IGNORE])
    logits = torch.zeros(8, v)
    logits[torch.arange(8), labels.clamp(min=0)] = 1.0  # all right
    logits[2] = torch.tensor([0, 0, 0, 0, 1.0])  # block 0: position 2 wrong -> accepts 1 draft
    assert accept_lengths(logits, labels, b).tolist() == [2, 3]  # block 1: 2 right, then no label


@pytest.mark.slow
def test_teacher_forced_tau_matches_the_engine_on_a_trained_drafter(target, store):
    """Train on the prompts' own greedy continuations, then measure greedy tau on the same prompts two ways."""
    from sglang_dflash.train.evaluate import greedy_tau_teacher_forced, measure_tau

    drafter = make_drafter(target, block_size=8)
    cfg = TrainConfig(steps=150, batch_size=4, num_anchors=16, lr=3e-3, seed=0)
    Trainer(drafter, target, store, cfg, "/tmp/unused-no-ckpt").fit(progress=False, resume=False)
    drafter.eval()
    prompts = [store.tokens(i)[: int(store.prompt_lens[i])].tolist() for i in range(6)]
    engine = measure_tau(target, drafter, prompts, max_new_tokens=40, stop_token_ids=(1,))
    replay = greedy_tau_teacher_forced(target, drafter, prompts, max_new_tokens=40, stop_token_ids=(1,))
    assert engine["greedy_equal"]
    assert engine["tau"] > 1.2, engine["per_prompt_tau"]  # the drafter learned something
    # same commits except for float noise and the last step (the replay stops at the known continuation's end)
    assert abs(engine["tau"] - replay["tau"]) < 0.15 * engine["tau"], (engine["per_prompt_tau"],
                                                                        replay["per_prompt_tau"])


def test_drafter_results_one_json_per_set_and_temperature(tmp_path):
    """benchmarks/results/drafters/: the keys the issue names, the T=0 greedy check carried to the T=1 file of the
    same set, and the teacher-forced cross-check not mistaken for a tau measurement."""
    import json

    from sglang_dflash.train.evaluate import write_drafter_results

    m = lambda tau, **kw: {"prompts": 32, "tau": tau, "verify_steps": 100, "max_new_tokens": 128, **kw}  # noqa: E731
    report = {"gsm": {"T=0 replay": m(9.0), "T=0": m(2.5, greedy_equal=True), "T=1": m(1.4)},
              "mtbench": {"T=0": m(1.5, greedy_equal=False)}}
    paths = write_drafter_results(report, {"target": "smollm2", "drafter": "D", "device": "cpu"}, tmp_path)
    rows = {p.name: json.loads(p.read_text()) for p in paths}
    assert sorted(rows) == ["smollm2-gsm-T0.json", "smollm2-gsm-T1.json", "smollm2-mtbench-T0.json"]
    for row in rows.values():
        assert {"target", "set", "temperature", "prompts", "tau", "greedy_equal"} <= set(row)
    assert rows["smollm2-gsm-T1.json"]["greedy_equal"] is True and rows["smollm2-gsm-T1.json"]["tau"] == 1.4
    assert rows["smollm2-gsm-T0.json"]["tau"] == 2.5 and rows["smollm2-mtbench-T0.json"]["greedy_equal"] is False


class _RunsCode:
    """A pickle payload: unpickling it calls exec, which writes the marker file (what a crafted state file does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_resume_refuses_a_state_file_that_would_run_code(target, store, tmp_path, writer):
    """Trainer.load_state is weights-only: a file whose unpickling would run code is refused, the code never runs,
    and the error names the file and the fix (issue #46)."""
    import pickle

    marker = tmp_path / "pwned"
    state = {"drafter": {}, "step": 3, "payload": _RunsCode(marker)}
    out = tmp_path / "state"
    out.mkdir()
    path = out / "trainer_state.pt"
    if writer == "torch.save":
        torch.save(state, path)
    else:  # the legacy (non-zip) format takes another path through torch.load
        with open(path, "wb") as f:
            pickle.dump(state, f, protocol=2)
    trainer = Trainer(make_drafter(target), target, store, TrainConfig(steps=2, batch_size=2, num_anchors=4), out)
    with pytest.raises(ValueError, match="trainer state .*trainer_state.pt refused.*Fix: resume only"):
        trainer.fit(progress=False, resume=True)
    assert not marker.exists(), "loading the state file ran the code it carried"
    assert trainer.step == 0


def test_package_loads_no_pickle_beyond_weights_only():
    """Every torch.load in the package and the benchmarks is weights-only, and nothing calls pickle.load(s): a
    checkpoint or data file handed to us is data, never code."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bad = []
    for d in ("sglang_dflash", "benchmarks", "kernels"):
        for f in (root / d).rglob("*.py"):
            text = f.read_text()
            for m in re.finditer(r"torch\.load\(([^()]*(?:\([^()]*\)[^()]*)*)\)", text):
                if "weights_only=True" not in m.group(1):
                    bad.append(f"{f.relative_to(root)}: {m.group(0)}")
            bad += [f"{f.relative_to(root)}: {m.group(0)}" for m in
                    re.finditer(r"\bpickle\.loads?\(|allow_pickle=True|\bdill\.loads?\(|\bjoblib\.load\(", text)]
    assert not bad, bad
