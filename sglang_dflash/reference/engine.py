"""The pure-PyTorch reference engine: DFlash speculative decoding and target-only decoding over a batch of requests.

It is the oracle the SGLang worker is tested against and the engine of the CPU demo, so it favours being obviously
right: each request keeps its own target KV cache (ragged acceptance needs no padding tricks), the drafter runs
batched over the active requests, and acceptance uses the same pure functions as the worker.

One speculative step, per active request:
    draft   block [bonus, MASK x (B-1)] at positions fed..fed+B-1, one drafter pass over it and the request's context
    verify  one target pass over [bonus, d_1..d_{B-1}] on top of its cache, returning logits and hidden states
    accept  verify_greedy / verify_sampled (point-mass drafts) / verify_sampled_q (DFlash2 drafts drawn from q)
            -> commit_len = accepted drafts + 1 tokens
    commit  keep the target KV and the drafter context of the fed tokens [bonus, d_1..d_a]; the target's own token
            becomes the next bonus

Tree mode (``tree_size`` N): the same drafter pass gives the draft logits of positions 1..B-1, draft_tree builds
the N-node best-first tree, the target scores all N nodes in one pass under the tree mask (HFTarget.forward_tree),
tree_acceptance keeps one root path, and only that path's KV rows and context rows are committed.

Seeded requests (``SamplingParams.seed``): every token is the target's seeded draw at its position
(sampling.seeded_sample), the prefill's and target-only decoding's too, and a step verifies with
acceptance.verify_seeded / tree_acceptance.verify_tree_seeded (DFlash2 drafts drawn with the same noise), so
``generate`` and ``generate_target_only`` emit the same tokens for the same seed (up to float rounding of the logits),
alone or in any batch. A step with a seeded request keys its unseeded sampled requests by fresh random seeds from the
engine's generator (the same rule, the same law); steps without one are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..acceptance import verify_greedy, verify_sampled, verify_sampled_q, verify_seeded
from ..dflash2 import DraftBlock
from ..draft_tree import build_draft_tree
from ..drafter import DFlashDrafter
from ..sampling import SamplingParams, SamplingTensors, processed_probs, sample_next, seeded_sample
from ..tree_acceptance import verify_tree_greedy, verify_tree_sampled, verify_tree_seeded
from .target import HFTarget


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    commit_lens: list[int] = field(default_factory=list)  # tokens committed per verify step (tau per step)
    target_forwards: int = 0  # prefill included

    @property
    def mean_acceptance(self) -> float:
        return sum(self.commit_lens) / len(self.commit_lens) if self.commit_lens else float("nan")


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    cache: object
    out: list[int] = field(default_factory=list)
    fed: int = 0  # tokens whose KV is in the target cache (and whose context rows the drafter has)
    context: torch.Tensor | None = None  # [fed, H] drafter context rows
    finish: str | None = None
    commit_lens: list[int] = field(default_factory=list)
    forwards: int = 0

    def emit(self, tokens: list[int]) -> None:
        """Append committed tokens, honouring stop tokens and max_new_tokens."""
        for t in tokens:
            self.out.append(t)
            if t in self.params.stop_token_ids:
                self.finish = "stop"
                return
            if len(self.out) >= self.params.max_new_tokens:
                self.finish = "length"
                return

    def result(self) -> GenerationResult:
        return GenerationResult(self.prompt, self.out, self.finish or "length", self.commit_lens, self.forwards)


def draft_step(drafter: DFlashDrafter, bonus_ids: list[int], contexts: list[torch.Tensor],
               embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """The greedy drafts [n, B-1] of `propose_step` (the teacher-forced replay's step)."""
    return propose_step(drafter, bonus_ids, contexts, embed_weight, lm_head_weight).tokens


def propose_step(drafter: DFlashDrafter, bonus_ids: list[int], contexts: list[torch.Tensor],
                 embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, temperature: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, seeds: torch.Tensor | None = None) -> DraftBlock:
    """THE draft step, one drafter pass for n requests: request i drafts the block [bonus_ids[i], MASK x (B-1)] at
    positions len(contexts[i]).. over its context rows contexts[i] [C_i, H] (from project_context, one per token
    fed so far). Returns the drafts for block positions 1..B-1 (`DFlashDrafter.propose`: greedy, or for a DFlash2
    drafter drawn from q where temperature [n] > 0, with the seeded noise of (seeds[i], len(contexts[i]) + j) at
    block position j + 1 where seeds [n] is given). Contexts are right-padded to the longest; padded keys are
    invisible, so a request drafts the same tokens alone or in a batch."""
    hidden = block_hidden(drafter, bonus_ids, contexts, embed_weight)
    positions = None if seeds is None else torch.tensor([len(c) for c in contexts], device=hidden.device)
    return drafter.propose(hidden, lm_head_weight, hidden.new_tensor(bonus_ids, dtype=torch.long), temperature,
                           generator, seeds, positions)


def block_hidden(drafter: DFlashDrafter, bonus_ids: list[int], contexts: list[torch.Tensor],
                 embed_weight: torch.Tensor) -> torch.Tensor:
    """The drafter's final hidden states [n, B-1, H] at block positions 1..B-1 (propose_step's one pass)."""
    cfg, dev = drafter.config, embed_weight.device
    fed = [len(c) for c in contexts]
    n, b, c = len(contexts), cfg.block_size, max(fed)
    block_ids = torch.full((n, b), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = torch.tensor(bonus_ids, device=dev)
    context = torch.zeros(n, c, cfg.hidden_size, dtype=contexts[0].dtype, device=dev)
    visible = torch.ones(n, b, c + b, dtype=torch.bool, device=dev)
    for i, rows in enumerate(contexts):
        context[i, : fed[i]] = rows
        visible[i, :, fed[i]: c] = False
    ctx_pos = torch.arange(c, device=dev).expand(n, c)
    block_pos = torch.tensor(fed, device=dev)[:, None] + torch.arange(b, device=dev)
    embeds = drafter.block_embeddings(block_ids, embed_weight)
    return drafter(embeds, block_pos, context, ctx_pos, visible)[:, 1:]


class ReferenceEngine:
    def __init__(self, target_model, drafter: DFlashDrafter | None = None, seed: int = 0,
                 tree_size: int | None = None):
        layer_ids = drafter.config.target_layer_ids if drafter is not None else ()
        if drafter is not None:
            drafter.config.validate_against_target(target_model.config)
        if tree_size is not None:
            if tree_size < 1:
                raise ValueError(f"tree_size={tree_size}: a tree has at least its root (1 node); None = chain")
            if drafter is not None and drafter.config.is_dflash2:
                # DFlash2's selector conditions each draft on the previous one: its drafts are a path, not
                # independent per-position distributions, so the best-first tree of draft_tree does not apply
                raise ValueError("tree_size with a DFlash2 drafter: tree verify needs a DFlash drafter")
        self.tree_size = tree_size
        self.target = HFTarget(target_model, layer_ids)
        self.drafter = drafter.eval() if drafter is not None else None
        self.generator = torch.Generator(device=self.target.device).manual_seed(seed)

    # ---------------------------------------------------------------- public API
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[GenerationResult]:
        """DFlash speculative decoding. Output is distributed exactly as generate_target_only's."""
        if self.drafter is None:
            raise ValueError("ReferenceEngine.generate needs a drafter; use generate_target_only without one")
        reqs = self._prefill(prompts, params, with_context=True)
        while active := [r for r in reqs if r.finish is None]:
            self._speculative_step(active)
        return [r.result() for r in reqs]

    @torch.inference_mode()
    def generate_target_only(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                             ) -> list[GenerationResult]:
        """Plain autoregressive decoding with the same sampling rule: the baseline every path is compared to."""
        reqs = self._prefill(prompts, params, with_context=False)
        while active := [r for r in reqs if r.finish is None]:
            for r in active:
                logits, _ = self.target.forward([r.out[-1]], r.fed, r.cache)
                r.fed += 1
                r.forwards += 1
                r.commit_lens.append(1)
                r.emit(self._sample([r], logits[-1:], r.fed - 1))
        return [r.result() for r in reqs]

    # ---------------------------------------------------------------- the step
    def _speculative_step(self, reqs: list[_Request]) -> None:
        if self.tree_size is not None:
            return self._tree_step(reqs)
        seeds = self._seeds(reqs)
        # tokens [n, B-1] (+ DFlash2's q over its candidates); a one-argument call where nothing is seeded (tests
        # record the drafts by wrapping _draft)
        draft = self._draft(reqs) if seeds is None else self._draft(reqs, seeds)
        logits, features = [], []
        for r, d in zip(reqs, draft.tokens.tolist()):
            lg, ft = self.target.forward([r.out[-1], *d], r.fed, r.cache)
            r.forwards += 1
            logits.append(lg)
            features.append(ft)
        commit_lens, tokens = self._verify(reqs, draft, torch.stack(logits), seeds)
        for r, n, toks, ft in zip(reqs, commit_lens.tolist(), tokens.tolist(), features):
            r.cache.crop(r.fed + n)  # keep KV of [bonus, d_1..d_{n-1}]; the rejected tail is dropped
            r.context = torch.cat([r.context, self.drafter.project_context(ft[:n])])
            r.fed += n
            r.commit_lens.append(n)
            r.emit(toks[:n])

    def _tree_step(self, reqs: list[_Request]) -> None:
        """One tree step: draft logits -> best-first tree -> one target pass per request under the tree mask ->
        one accepted root path -> commit its KV rows and context rows."""
        hidden = block_hidden(self.drafter, [r.out[-1] for r in reqs], [r.context for r in reqs],
                              self.target.embed_weight)
        anchor = torch.tensor([r.out[-1] for r in reqs], device=self.target.device)
        tree = build_draft_tree(anchor, self.drafter.draft_logits(hidden, self.target.lm_head_weight), self.tree_size)
        logits, features = [], []
        for i, r in enumerate(reqs):
            # a DEAD node (-1) is fed as token 0: its row is scored but never accepted, and nothing attends to it
            lg, ft = self.target.forward_tree(tree.tokens[i].clamp(min=0), tree.depth[i], tree.ancestors[i], r.fed,
                                              r.cache)
            r.forwards += 1
            logits.append(lg)
            features.append(ft)
        logits = torch.stack(logits)
        seeds = self._seeds(reqs)
        if all(r.params.greedy for r in reqs):
            commit_lens, tokens, path = verify_tree_greedy(tree, logits)
        elif seeds is not None:
            s = SamplingTensors.from_params([r.params for r in reqs], logits.shape[-1], logits.device)
            commit_lens, tokens, path = verify_tree_seeded(tree, logits, s, seeds, self._fed(reqs))
        else:
            n, size, v = logits.shape
            s = SamplingTensors.from_params([r.params for r in reqs], v, logits.device).repeat_interleave(size)
            probs = processed_probs(logits.view(n * size, v), s).view(n, size, v)
            commit_lens, tokens, path = verify_tree_sampled(tree, probs, self.generator)
        for i, (r, n, toks, ft) in enumerate(zip(reqs, commit_lens.tolist(), tokens.tolist(), features)):
            rows = path[i, :n]  # root (the bonus) + accepted nodes: the fed tokens whose KV and context are kept
            self.target.keep_rows(r.cache, r.fed, rows)
            r.context = torch.cat([r.context, self.drafter.project_context(ft[rows])])
            r.fed += n
            r.commit_lens.append(n)
            r.emit(toks[:n])

    def _draft(self, reqs: list[_Request], seeds: torch.Tensor | None = None) -> DraftBlock:
        """One drafter pass for all requests: block [bonus, MASK...] -> drafts for positions 1..B-1 (a DFlash2
        drafter draws a sampled request's drafts from q at the request's temperature, with the seeded noise where
        ``seeds`` is given; greedy ones take the argmax)."""
        temperature = None
        if not all(r.params.greedy for r in reqs):
            temperature = torch.tensor([r.params.temperature for r in reqs], device=self.target.device)
        return propose_step(self.drafter, [r.out[-1] for r in reqs], [r.context for r in reqs],
                            self.target.embed_weight, self.target.lm_head_weight, temperature, self.generator, seeds)

    def _seeds(self, reqs: list[_Request]) -> torch.Tensor | None:
        """[n] int64 draw keys of a step with a seeded sampled request: each request's seed, a fresh random one from
        the engine's generator for the others (their draws stay random, by the same rule). None otherwise: the
        step keeps the generator's rules (verify_sampled, verify_sampled_q, verify_tree_sampled)."""
        if not any(r.params.seed is not None and not r.params.greedy for r in reqs):
            return None
        fresh = torch.randint(0, 1 << 62, (len(reqs),), generator=self.generator, device=self.target.device)
        given = torch.tensor([r.params.seed if r.params.seed is not None else 0 for r in reqs],
                             device=self.target.device)
        mine = torch.tensor([r.params.seed is not None for r in reqs], device=self.target.device)
        return torch.where(mine, given, fresh)

    def _fed(self, reqs: list[_Request]) -> torch.Tensor:
        """[n] the bonus tokens' sequence positions (the position of each request's verify row 0)."""
        return torch.tensor([r.fed for r in reqs], device=self.target.device)

    def _verify(self, reqs, draft: DraftBlock, logits, seeds: torch.Tensor | None = None):
        if all(r.params.greedy for r in reqs):
            return verify_greedy(draft.tokens, logits)
        n, b, v = logits.shape
        if seeds is not None:
            s = SamplingTensors.from_params([r.params for r in reqs], v, logits.device)
            return verify_seeded(draft.tokens, logits, s, seeds, self._fed(reqs))
        # The definition path on purpose, for every batch: this engine is the reference the server is compared with,
        # and the server's faster rule for unfiltered batches (verify_sampled_logits) is tested against this one's law
        s = SamplingTensors.from_params([r.params for r in reqs], v, logits.device).repeat_interleave(b)
        probs = processed_probs(logits.view(n * b, v), s).view(n, b, v)
        if draft.q is None:  # point-mass drafts (DFlash)
            return verify_sampled(draft.tokens, probs, self.generator)
        return verify_sampled_q(draft.tokens, probs, draft.candidates, draft.q, self.generator)

    # ---------------------------------------------------------------- helpers
    def _prefill(self, prompts, params, with_context: bool) -> list[_Request]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        reqs = []
        for prompt, p in zip(prompts, params):
            if not prompt:
                raise ValueError("empty prompt: give at least one token")
            r = _Request(list(prompt), p, self.target.new_cache())
            logits, features = self.target.forward(r.prompt, 0, r.cache)
            r.fed, r.forwards = len(r.prompt), 1
            if with_context:
                r.context = self.drafter.project_context(features)
            r.emit(self._sample([r], logits[-1:], len(r.prompt) - 1))
            reqs.append(r)
        return reqs

    def _sample(self, reqs: list[_Request], logits: torch.Tensor, position: int) -> list[int]:
        """One token per request from its row of logits, which the token at sequence position ``position`` scored
        (seeded requests: the seeded draw of that position)."""
        s = SamplingTensors.from_params([r.params for r in reqs], logits.shape[-1], logits.device)
        seed = reqs[0].params.seed if len(reqs) == 1 and not reqs[0].params.greedy else None
        if seed is not None:
            dev = logits.device
            return seeded_sample(logits, s, torch.tensor([seed], device=dev), torch.tensor([position], device=dev)
                                 ).tolist()
        return sample_next(logits, s, self.generator).tolist()
