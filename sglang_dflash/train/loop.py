"""THE drafter training loop (`Trainer`): frozen target computing features on the fly, many anchors per sequence, one
mask for all blocks, position-decayed CE, bf16 autocast on CUDA, checkpoint/resume, a time budget, a loss-curve PNG.
`train_drafter` runs the same Trainer on in-memory sequences (tests, tiny drafters for the serving tests), with
`greedy_continuations` to make them.

One step:
    tokens [S, T] (right-padded) --frozen target, no grad--> features [S, T, K*H] at target_layer_ids
    anchors [S, A] in each response --build_batch--> blocks [S, A*B] + mask (dense, or a flex BlockMask)
    drafter(blocks, context = hidden_norm(fc(features))) -> hidden --target lm_head--> logits [S*A*B, V]
    loss = decayed_block_loss(logits, labels)      (weights exp(-(k-1)/gamma), k = 1..B-1)
         + selector_weight * selector_loss(...)     (DFlash2 drafters only: train/dflash2.py)
"""

from __future__ import annotations

import json
import math
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..acceptance import accepted_prefix_len
from ..drafter import DFlashDrafter, check_flex_supported
from .blocks import IGNORE, build_batch, decayed_block_loss, flex_block_mask, sample_anchors
from .data import TokenStore
from .dflash2 import dflash2_part, selector_drafts, selector_loss


@dataclass
class Sequence:
    tokens: torch.Tensor  # [T] prompt + the target's own response
    response_start: int  # position of the first response token


@dataclass
class TrainConfig:
    steps: int = 1000  # planned steps (the LR schedule's length); a time budget may lower it once, early
    batch_size: int = 8  # sequences per step
    num_anchors: int = 32  # blocks per sequence
    lr: float = 6e-4
    warmup_frac: float = 0.04
    final_lr_frac: float = 0.05
    weight_decay: float = 0.01
    gamma: float = 7.0
    max_len: int = 1024  # sequences are cut to this many tokens
    attention: str = "dense"  # "dense" or "flex"
    bf16: bool = True  # autocast the drafter to bfloat16 on CUDA (master weights stay float32)
    seed: int = 0
    time_budget_s: float | None = None  # fit the schedule to this many seconds, measured over the first steps
    ckpt_every: int = 0  # save trainer state every N steps (0: only at the end)
    eval_every: int = 0  # held-out loss / acceptance every N steps (0: only at the end)
    log_every: int = 25
    selector_weight: float = 1.0  # DFlash2: weight of the selector loss next to the block CE
    selector_lr_scale: float = 1.0  # DFlash2: the selector's learning rate = lr x this (it starts from scratch)
    conv_lr_scale: float = 1.0  # DFlash2: the convolutions' learning rate = lr x this (see train/dflash2.py)


@torch.no_grad()
def batch_features(target_model, layer_ids, tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states of the frozen target at layer_ids for right-padded tokens [S, T] -> [S, T, K*H].
    Right padding needs no attention mask: causal attention never lets a real token see a later pad.
    logits_to_keep=1: the target's own logits are not needed (for Gemma-3's 262k vocabulary they would be GBs)."""
    out = target_model(input_ids=tokens, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return torch.cat([out.hidden_states[k + 1] for k in layer_ids], dim=-1)


def pad_batch(seqs: list[torch.Tensor], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.full((len(seqs), int(lengths.max())), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    return tokens.to(device), lengths.to(device)


@dataclass
class DraftBatch:
    """One drafter pass over a batch, every block laid out block after block (N = S*A blocks)."""

    logits: torch.Tensor  # [N*B, V] float32 draft logits
    labels: torch.Tensor  # [N*B] next tokens, IGNORE at block position 0 and past a sequence's end
    hidden: torch.Tensor  # [N*B, H] the drafter's final hidden states (DFlash2's selector reads them)
    ids: torch.Tensor  # [N*B] block ids: the anchor token x_a, then MASK


def batch_logits_and_labels(drafter: DFlashDrafter, target_model, tokens, lengths, response_starts, num_anchors,
                            generator=None, attention: str = "dense", anchors: torch.Tensor | None = None):
    """Drafter logits [S*A*B, V] (float32) and labels [S*A*B] for a batch, anchors sampled per sequence."""
    out = batch_forward(drafter, target_model, tokens, lengths, response_starts, num_anchors, generator, attention,
                        anchors)
    return out.logits, out.labels


def batch_forward(drafter: DFlashDrafter, target_model, tokens, lengths, response_starts, num_anchors,
                  generator=None, attention: str = "dense", anchors: torch.Tensor | None = None) -> DraftBatch:
    """THE training forward: the frozen target's features, the blocks at anchors sampled per sequence (or given),
    one drafter pass, the draft logits."""
    cfg, dev = drafter.config, tokens.device
    features = batch_features(target_model, cfg.target_layer_ids, tokens)
    if anchors is None:
        anchors = torch.stack([sample_anchors(int(r), int(n), num_anchors, generator)
                               for r, n in zip(response_starts, lengths)]).to(dev)
    blocks = build_batch(tokens, lengths, anchors, cfg.block_size, cfg.mask_token_id)
    embed = target_model.get_input_embeddings().weight.detach()
    lm_head = target_model.get_output_embeddings().weight.detach()
    context = drafter.project_context(features)
    s, t = tokens.shape
    ctx_pos = torch.arange(t, device=dev).expand(s, t)
    embeds = drafter.block_embeddings(blocks.ids, embed)
    if attention == "flex":
        visible = flex_block_mask(anchors, cfg.block_size, t, device=dev)
    elif attention == "dense":
        visible = blocks.visible
    else:
        raise ValueError(f"attention={attention!r}: use 'dense' or 'flex'")
    hidden = drafter(embeds, blocks.positions, context, ctx_pos, visible).reshape(-1, drafter.config.hidden_size)
    return DraftBatch(drafter.draft_logits(hidden, lm_head), blocks.labels.reshape(-1), hidden, blocks.ids.reshape(-1))


def accept_lengths(logits: torch.Tensor, labels: torch.Tensor, block_size: int,
                   drafts: torch.Tensor | None = None) -> torch.Tensor:
    """Per block, the tokens a greedy verify would commit if the target's next tokens are the labels:
    1 + the number of leading draft positions equal to the label. [N*B, V], [N*B] -> [N]. drafts [N*B]: the drafted
    tokens (DFlash2: the selector's walk); None: the argmax of the logits (DFlash)."""
    drafts = logits.argmax(-1) if drafts is None else drafts
    hit = (drafts == labels).view(-1, block_size)[:, 1:]
    valid = (labels != IGNORE).view(-1, block_size)[:, 1:]
    return 1 + accepted_prefix_len(hit & valid)


class Trainer:
    def __init__(self, drafter: DFlashDrafter, target_model, store: TokenStore, cfg: TrainConfig,
                 out_dir: str | Path | None, pad_id: int = 0, held_out: TokenStore | None = None):
        """out_dir=None: nothing is written (no trainer state, so no resume)."""
        self.drafter, self.target, self.cfg = drafter, target_model, cfg
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.device = next(target_model.parameters()).device
        self.pad_id = pad_id
        for p in target_model.parameters():
            p.requires_grad_(False)
        target_model.eval()
        self.seqs = self._usable(store)
        self.held_out = self._usable(held_out) if held_out is not None and len(held_out) else []
        if not self.seqs:
            raise ValueError("no training sequence has >= 2 response tokens within max_len; generate longer "
                             "responses or raise max_len")
        self.gen = torch.Generator().manual_seed(cfg.seed)
        groups = []
        for part, scale in (("backbone", 1.0), ("selector", cfg.selector_lr_scale), ("conv", cfg.conv_lr_scale)):
            named = [(n, p) for n, p in drafter.named_parameters() if dflash2_part(n) == part]  # DFlash: backbone only
            lr = cfg.lr * scale
            # no decay for vectors, nor for DFlash2's base kernels (identity at init: decay would pull tap 0 to 0)
            decay = [p.ndim >= 2 and not n.endswith("base_kernel") for n, p in named]
            groups += [{"params": [p for (_, p), d in zip(named, decay) if d], "weight_decay": cfg.weight_decay,
                        "lr": lr},
                       {"params": [p for (_, p), d in zip(named, decay) if not d], "weight_decay": 0.0, "lr": lr}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95))
        self.total_steps = cfg.steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.step, self.losses, self.history = 0, [], []
        self.selector_losses: list[float] = []  # DFlash2: the selector loss of each step (inside self.losses too)
        self.autocast = cfg.bf16 and self.device.type == "cuda"
        if cfg.attention == "flex":
            check_flex_supported(drafter.config)
            if self.device.type != "cuda":
                raise ValueError("attention='flex' trains on CUDA only (PyTorch's flex attention has no CPU "
                                 "backward). Fix: use attention='dense' on CPU")

    def _usable(self, store: TokenStore) -> list[tuple[torch.Tensor, int]]:
        out = []
        for i in range(len(store)):
            toks = store.tokens(i)[: self.cfg.max_len]
            r = int(store.prompt_lens[i])
            if len(toks) - r >= 2:
                out.append((toks, r))
        return out

    def _lr_factor(self, step: int) -> float:
        warm = max(1, int(self.cfg.warmup_frac * self.total_steps))
        if step < warm:
            return (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, self.total_steps - warm))
        f = self.cfg.final_lr_frac
        return f + (1 - f) * 0.5 * (1 + math.cos(math.pi * prog))

    # ------------------------------------------------------------------ state
    @property
    def state_path(self) -> Path | None:
        return self.out_dir / "trainer_state.pt" if self.out_dir is not None else None

    def save_state(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path is not None else self.state_path
        if path is None:
            raise ValueError("this Trainer has no out_dir. Fix: pass out_dir, or a path to save_state")
        torch.save({"drafter": self.drafter.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "step": self.step, "total_steps": self.total_steps,
                    "losses": self.losses, "history": self.history, "gen": self.gen.get_state(),
                    "selector_losses": self.selector_losses,
                    "config": asdict(self.cfg)}, str(path) + ".part")
        Path(str(path) + ".part").replace(path)
        return path

    def load_state(self, path: str | Path | None = None) -> bool:
        path = Path(path) if path is not None else self.state_path
        if path is None or not path.is_file():
            return False
        # weights_only: a state file holds tensors and plain containers only (save_state); a full unpickle would
        # run whatever code a crafted file names (its __reduce__), so a file handed to --resume could take over
        # the machine. The weights-only unpickler refuses anything else before building it.
        try:
            st = torch.load(str(path), map_location=self.device, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is a page of advice to load it anyway; keep the line saying what was refused
            lines = [ln.strip() for ln in str(e).splitlines() if "WeightsUnpickler error" in ln]
            first = lines[0].split(". Please")[0] if lines else type(e).__name__
            raise ValueError(f"trainer state {path} refused: it holds objects other than tensors and plain "
                             f"containers, which a weights-only load does not build ({first}). Fix: resume only "
                             f"from a trainer_state.pt written by Trainer.save_state; delete the file (or fit with "
                             f"resume=False) to start over") from None
        self.drafter.load_state_dict(st["drafter"])
        self.opt.load_state_dict(st["opt"])
        self.total_steps = st["total_steps"]
        self.sched.load_state_dict(st["sched"])
        self.step, self.losses, self.history = st["step"], st["losses"], st["history"]
        self.gen.set_state(st["gen"])
        self.selector_losses = st.get("selector_losses", [])
        return True

    # ------------------------------------------------------------------ steps
    def _batch(self):
        idx = torch.randint(len(self.seqs), (self.cfg.batch_size,), generator=self.gen).tolist()
        seqs = [self.seqs[i] for i in idx]
        tokens, lengths = pad_batch([s[0] for s in seqs], self.pad_id, self.device)
        return tokens, lengths, [s[1] for s in seqs]

    def train_step(self) -> float:
        self.drafter.train()
        tokens, lengths, starts = self._batch()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            out = batch_forward(self.drafter, self.target, tokens, lengths, starts, self.cfg.num_anchors, self.gen,
                                self.cfg.attention)
        loss, selector = self.loss(out)  # float32 (the selector's scores as inference computes them)
        if selector is not None:
            self.selector_losses.append(selector.item())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.losses.append(loss.item())
        return self.losses[-1]

    def loss(self, out: DraftBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the training loss, its selector part or None): the block CE, plus selector_weight x the selector loss
        for a DFlash2 drafter."""
        b = self.drafter.config.block_size
        loss = decayed_block_loss(out.logits, out.labels, b, self.cfg.gamma)
        if self.drafter.candidate_selector is None or not self.cfg.selector_weight:
            return loss, None
        selector, _ = selector_loss(self.drafter.candidate_selector, out.hidden, out.logits, out.labels, out.ids, b,
                                    self.cfg.gamma)
        return loss + self.cfg.selector_weight * selector, selector.detach()

    @torch.no_grad()
    def evaluate(self, max_seqs: int = 64) -> dict:
        """Held-out loss and the block acceptance length a greedy verify would get at random anchors
        (exact for greedy-generated data: the labels are the target's own greedy tokens). DFlash2: the acceptance of
        the selector's greedy walk (what inference drafts), and beside it that of the argmax of the draft logits
        (`..._argmax`: what the backbone alone would draft), the selector loss and its stats."""
        if not self.held_out:
            return {}
        self.drafter.eval()
        b, dflash2 = self.drafter.config.block_size, self.drafter.candidate_selector is not None
        g = torch.Generator().manual_seed(1234)
        rows: dict[str, list[torch.Tensor]] = {}

        def add(key, value):
            rows.setdefault(key, []).append(value.float().reshape(-1).cpu())

        for i in range(0, min(max_seqs, len(self.held_out)), self.cfg.batch_size):
            chunk = self.held_out[i: i + self.cfg.batch_size]
            tokens, lengths = pad_batch([c[0] for c in chunk], self.pad_id, self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                out = batch_forward(self.drafter, self.target, tokens, lengths, [c[1] for c in chunk],
                                    self.cfg.num_anchors, g, "dense")
            add("held_out_loss", decayed_block_loss(out.logits, out.labels, b, self.cfg.gamma))
            if dflash2:
                loss, stats = selector_loss(self.drafter.candidate_selector, out.hidden, out.logits, out.labels,
                                            out.ids, b, self.cfg.gamma)
                add("held_out_selector_loss", loss)
                for k, v in stats.items():
                    add(f"held_out_selector_{k}", v)
                drafts = selector_drafts(self.drafter, out.hidden, out.logits, out.ids, b)
                add("held_out_block_accept", accept_lengths(out.logits, out.labels, b, drafts))
                add("held_out_block_accept_argmax", accept_lengths(out.logits, out.labels, b))
            else:
                add("held_out_block_accept", accept_lengths(out.logits, out.labels, b))
        self.drafter.train()
        # losses and stats: the mean over chunks; acceptance: the mean over all blocks
        return {"step": self.step, **{k: torch.cat(v).mean().item() for k, v in rows.items()}}

    def fit(self, progress: bool = True, resume: bool = True) -> list[float]:
        if resume and self.load_state():
            print(f"resumed from {self.state_path} at step {self.step}/{self.total_steps}")
        self.first_step_of_fit = self.step  # steps / s of this call = (step - first_step_of_fit) / its wall time
        t0, marks = time.time(), []
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not progress, desc="train drafter")
        while self.step < self.total_steps:
            loss = self.train_step()
            bar.update(1)
            if self.cfg.time_budget_s is not None and self.step % 25 == 0 and self.step >= 50:
                # fit the schedule's length to the time budget from the speed of the last steps (warm-up excluded),
                # re-estimated as training goes; the cosine LR follows the moving end
                now = time.time()
                marks.append((self.step, now))
                (s0, t_0), (s1, t_1) = marks[max(0, len(marks) - 8)], marks[-1]
                if s1 > s0:
                    left = self.cfg.time_budget_s - (now - t0)
                    fit = int(self.step + left / ((t_1 - t_0) / (s1 - s0)))
                    self.total_steps = max(self.step + 1, min(self.cfg.steps, fit))
                    bar.total = self.total_steps
            if not progress and self.step % (self.cfg.log_every * 20) == 0:
                recent, selector = self.losses[-100:], self.selector_losses[-100:]
                selector = f" (selector {sum(selector) / len(selector):.3f})" if selector else ""
                print(f"step {self.step}/{self.total_steps} loss {sum(recent) / len(recent):.3f}"
                      f"{selector} lr {self.sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            if self.step % self.cfg.log_every == 0:
                recent = self.selector_losses[-self.cfg.log_every:]
                bar.set_postfix(loss=f"{sum(self.losses[-self.cfg.log_every:]) / self.cfg.log_every:.3f}",
                                lr=f"{self.sched.get_last_lr()[0]:.2e}",
                                **({"selector": f"{sum(recent) / len(recent):.3f}"} if recent else {}))
            if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
                self.history.append(self.evaluate())
            if self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0 and self.out_dir is not None:
                self.save_state()
        bar.close()
        self.history.append(self.evaluate())
        if self.out_dir is not None:
            self.save_state()
        self.drafter.eval()
        return self.losses


def train_drafter(drafter: DFlashDrafter, target_model, sequences: list[Sequence], steps: int, lr: float = 3e-3,
                  num_anchors: int = 16, gamma: float = 7.0, seed: int = 0, progress: bool = True,
                  weight_decay: float = 0.0) -> list[float]:
    """Train `drafter` in place on a few in-memory sequences (the tiny test pairs; nothing written to disk): one
    sequence per step, cycling through a fixed shuffle, one-cycle learning rate, target features computed once.

    Not the Trainer's recipe on purpose: the server tests assert multi-token commits on prompts the 300-step tiny
    drafters never saw, and drafters trained by the Trainer's recipe (random draws, cosine, betas 0.95) accepted
    nothing there (measured 2026-11-23). Returns the loss curve."""
    from ..reference.target import HFTarget
    from .blocks import build_blocks

    target = HFTarget(target_model, drafter.config.target_layer_ids)
    for p in target.model.parameters():
        p.requires_grad_(False)
    cfg = drafter.config
    feats = []
    with torch.inference_mode():
        for s in sequences:
            _, f = target.forward(s.tokens.to(target.device), 0, target.new_cache())
            feats.append(f)
    feats = [f.clone() for f in feats]  # out of inference mode, so autograd may save them
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    drafter.train()
    losses = []
    order = torch.randperm(len(sequences), generator=g).tolist()
    for step in tqdm(range(steps), disable=not progress, desc="train drafter"):
        i = order[step % len(order)]
        tokens = sequences[i].tokens.to(target.device)
        anchors = sample_anchors(sequences[i].response_start, tokens.shape[0], num_anchors, g).to(tokens.device)
        blocks = build_blocks(tokens, anchors, cfg.block_size, cfg.mask_token_id)
        context = drafter.project_context(feats[i].to(target.device))[None]
        ctx_pos = torch.arange(tokens.shape[0], device=tokens.device)[None]
        embeds = drafter.block_embeddings(blocks.ids[None], target.embed_weight.detach())
        hidden = drafter(embeds, blocks.positions[None], context, ctx_pos, blocks.visible[None])
        logits = drafter.draft_logits(hidden[0], target.lm_head_weight.detach())
        loss = decayed_block_loss(logits, blocks.labels, cfg.block_size, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    drafter.eval()
    return losses


@torch.inference_mode()
def greedy_continuations(target_model, prompts: list[list[int]], max_new_tokens: int) -> list[Sequence]:
    """The target's own greedy responses: the drafter learns the target's distribution, not a dataset's."""
    from ..reference.engine import ReferenceEngine
    from ..sampling import SamplingParams

    results = ReferenceEngine(target_model).generate_target_only(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    return [Sequence(torch.tensor(r.prompt_ids + r.output_ids), len(r.prompt_ids)) for r in results]


def smooth(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_losses(losses: list[float], path: str | Path, title: str = "drafter training loss",
                history: list[dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, lw=0.5, alpha=0.35, label="train loss (per step)")
    ax.plot(smooth(losses, max(1, len(losses) // 50)), lw=1.5, label="train loss (smoothed)")
    pts = [h for h in (history or []) if h]
    if pts:
        ax.plot([h["step"] for h in pts], [h["held_out_loss"] for h in pts], "o-", label="held-out loss")
        ax2 = ax.twinx()
        ax2.plot([h["step"] for h in pts], [h["held_out_block_accept"] for h in pts], "s--", color="C3",
                 label="held-out block accept (tau est.)")
        ax2.set_ylabel("tokens / block")
        ax2.legend(loc="center right")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("position-decayed CE (log scale)")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def write_json(obj, path: str | Path) -> None:
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")
