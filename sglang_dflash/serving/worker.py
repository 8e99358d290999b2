"""Our DFLASH speculative worker for SGLang's V2 (overlap-capable) scheduler.

The scheduler owns requests, KV reservation (``DFlashDraftInputV2.prepare_for_decode`` reserves committed + 2B
slots per request, one step ahead under overlap; finish/abort/retract release them) and the radix cache. This
worker owns one model step:

    prefill  target extend with hidden capture -> first token (SGLang's sampler) -> the prompt's draft context K/V
    decode   width   k = how many drafts this step verifies (0..B-1): the adaptive policy (width_control.py)
             draft   one drafter pass over [bonus, MASK x (B-1)]             -> B-1 drafts (skipped if k = 0):
                     the argmax head; a DFlash2 drafter draws sampled rows' drafts from its selector's q
             verify  one target pass over [bonus, d_1..d_k], hidden capture  -> logits [bs, k+1, V]
             process penalties, min_new_tokens, grammar, logit_bias per row   (controls.py; exact per position)
             accept  acceptance.verify_greedy / verify_sampled(_logits)       -> commit_lens, tokens
                     / verify_sampled_q (drafts drawn from q)
                     (greedy: rule + the step's outputs in one launch on the GPU, kernels/greedy_accept.py)
             commit  write context K/V of the k+1 verified rows, INSIDE the verify forward (context_commit.py:
                     captured in the verify CUDA graphs, no launches of its own); rows past commit_len are
                     rewritten by the next step's block, which starts at the new length; a hybrid target's
                     recurrent state := its state after the committed tokens (recurrent_state.py); publish new lengths

A step with k = 0 is a plain decode step of the target that still captures its hidden state and writes the
drafter's context K/V, so speculation can resume at any later step without re-prefilling anything. A step with
0 < k < B-1 drafts the whole block (the draft pass costs the same, and the drafter was trained on full blocks)
and verifies its first k drafts (benchmarks/results/width-acceptance-smollm2-cpu compares this with drafting a
shorter block).

Tree verify (SGLANG_DFLASH_TREE=N, issue #38; tree_step.py): a step whose batch has no per-request controls
(``tree_step.applies``: greedy and sampled rows qualify) may verify an N-node draft tree built from the same drafter
pass instead of the chain, accepts with the greedy tree rule (all-greedy batches) or the exact sampled one, and
commits the accepted path by permuting the request's req_to_token slots (``_tree_decode_step``). Which
shape runs is the width policy's choice (width_control.py): the tree is one more shape next to k = 0 and every
chain width, priced by its own step time and expected commit, so it runs where it pays (with adaptivity off, or a
pinned k > 0: always, where the batch qualifies). Every other step is the chain step above, unchanged. On the GPU
the tree is built inside the draft CUDA graph (its capture tail, with the greedy head) and the verify replays tree
verify graphs of width N whose attention reads the tree mask from static buffers (tree_graphs.py); without graphs,
or past their batch sizes, either part runs eagerly. An all-greedy batch's accept, the path's commit and the step's
outputs are one launch on the GPU (kernels/tree_accept.py), as the chain's greedy accept is; a batch with sampled rows
takes the sampled tree rule in torch (``_tree_accept_sampled``).

Seeded sampling (issue #46 item 3, seeds.py): while a live request has a ``sampling_seed``, sampled steps draw with
counter-based noise keyed by (seed, position) instead of the global generator: the target's own seeded sample X at
every verified row (acceptance.seeded_targets), then the greedy accept against X (the same one-launch kernels, chain
or tree), DFlash2 drafts drawn with the same noise; the prefill's token of a seeded request is drawn again the same
way (``_seeded_first_tokens``). A seeded request's output is then its seeded target-only stream whatever the widths,
trees and batches (acceptance.verify_seeded). Unseeded rows of such steps get random keys (same rule, same law).

Oracle drafts (SGLANG_DFLASH_ORACLE_DRAFTS, benchmarks on random weights only; oracle_drafts.py): after the
drafter's real pass (after its graph replay, outside the graph) one launch replaces the chain's drafts by the plain
run's recorded continuation, cut at the misses of a stated profile; the verify still decides what is committed.

No host synchronisation and no per-request Python in the decode step: every per-step tensor is sliced from a
buffer allocated once for max_running_requests, and the only host-side values are sizes SGLang already has. (With
the tree switch on, a tree step may read the requests' top_k on the host (``tree_step.all_greedy``), and an eager
tree build or verify allocates its few [bs, N] tensors per step; neither syncs.)
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..acceptance import seeded_targets, verify_sampled, verify_sampled_logits, verify_sampled_q
from ..dflash2 import DraftBlock
from ..kernels.block_inputs import block_inputs_torch
from ..kernels.greedy_accept import commit_outputs, greedy_accept_torch, plain_accept
from ..kernels.tree_accept import tree_accept_torch
from ..sampling import SamplingTensors, processed_probs, seeded_sample
from ..tree_acceptance import commit_path, verify_tree_sampled
from . import compat, disagg, tree_step
from .context_commit import ContextCommitInVerify
from .controls import SamplingControls
from .kernel_warmup import warm_kv_slot_kernels, warm_tree_accept
from .oracle_drafts import OracleDrafts, check_allowed as check_oracle_allowed
from .profiling import phase as _phase
from .recurrent_state import RecurrentStateCommit, install_replay_pool_hook
from .seeds import RequestSeeds
from .errors import DFlashStartupError
from .startup import load_draft_config
from .tree_graphs import TreeBuffers, TreeVerifyGraphs, capture_sizes
from .verify_widths import VerifyWidths
from .width_control import TableShare, WidthControls, WidthController

logger = logging.getLogger("sglang_dflash")

# The greedy draft head (lm_head + argmax) runs inside the draft CUDA graph for captured batches of at most this many
# draft rows (bs x (B-1)); larger batches keep it eager, where it computes only the k rows a step verifies (at large
# batch the head is compute, not launches). SGLANG_DFLASH_GRAPH_HEAD=0 keeps it eager always (for comparison).
GRAPH_HEAD_MAX_ROWS = 1024
# The tree head (SGLANG_DFLASH_TREE) joins it for batches of at most this many draft rows: it holds the draft logits'
# float32 log-softmax ([rows, V]: 290 MB at 480 rows of a 152k vocabulary) in the graph memory pool, and trees pay at
# small batch only (benchmarks/results/tree-h100); larger batches build the tree eagerly.
GRAPH_TREE_MAX_ROWS = 512

from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker  # noqa: E402
from sglang.srt.speculative.dflash_info import DFlashVerifyInput  # noqa: E402
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2  # noqa: E402
from sglang.srt.speculative.draft_worker_common import build_draft_tp_worker, make_draft_input_v2  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402


def register_draft_model() -> None:
    """Make SGLang build our draft model for the published DFlashDraftModel architecture."""
    from sglang.srt.models.registry import ModelRegistry

    from .draft_model import DFlashDraftModel
    from .draft_model2 import DFlash2BeamDraftModel, DFlash2DraftModel

    for cls in (DFlashDraftModel, DFlash2DraftModel, DFlash2BeamDraftModel):
        ModelRegistry.models[cls.__name__] = cls


class DFlashWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker, ps=None, **_):  # ps: 0.5.17 only (compat)
        super().__init__()
        self.server_args, self._target_worker = server_args, target_worker
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        # the process's one drafter config (DFlashConfig.load); the draft model built below gets the same object
        self.cfg = load_draft_config(server_args)
        self.cfg.validate_against_target(self.model_runner.model_config.hf_config)
        self.block = B = int(server_args.speculative_num_draft_tokens)
        if B != self.cfg.block_size:  # startup.handle_dflash_args already enforced this; keep the invariant local
            raise ValueError(f"speculative_num_draft_tokens={B} != drafter block_size={self.cfg.block_size}")

        # tree verify (SGLANG_DFLASH_TREE, tree_step.py): N nodes per qualifying step, 0 = the chain always
        from ..settings import tree_size

        self._tree_size = tree_size(B)
        if self._tree_size and self.cfg.is_dflash2:  # startup.check_tree refused it in the launcher already
            raise DFlashStartupError("SGLANG_DFLASH_TREE with a DFlash2 drafter: tree verify needs a DFlash drafter")

        register_draft_model()
        # hybrid targets with --enable-linear-replayssm-spec: SGLang builds the target's pools after this constructor
        # and refuses that pool for DFLASH + a non-KDA target; our commit serves it (recurrent_state.py)
        install_replay_pool_hook(server_args)
        bundle = build_draft_tp_worker(
            server_args=server_args, gpu_id=gpu_id, **compat.draft_worker_parallel_kwargs(ps), nccl_port=nccl_port,
            target_model_config=self.model_runner.model_config, algo_label="DFLASH(sglang-dflash)",
            attention_backend_override=server_args.speculative_draft_attention_backend)
        self._draft_worker = bundle.draft_worker
        self.draft_runner = bundle.draft_model_runner
        self.draft_model = bundle.draft_model
        if self.draft_model.dflash != self.cfg:  # one config for worker and draft model (draft_model.drafter_config)
            raise ValueError(f"the draft model was built from another drafter config than the worker's: "
                             f"{self.draft_model.dflash} != {self.cfg}. Fix: serve the drafter from a local directory")
        target = self.model_runner.model
        self.draft_model.bind_target(target.get_input_embeddings(), _lm_head(target), type(target).__name__)
        # the commit runs inside the target's verify forward, so the verify graphs capture it (context_commit.py);
        # the stacked K/V weights are built now, eagerly, not lazily inside a graph capture
        self.draft_model.prepare_context_kv()
        self._commit = ContextCommitInVerify(target, self.draft_model, lambda: self.draft_runner.token_to_kv_pool)
        pd_mode = str(getattr(server_args, "disaggregation_mode", None) or "null")
        if pd_mode == "decode":
            # a decode-side retraction copies the drafter's rows to host memory with the target's (disagg.py)
            disagg.keep_draft_pool(lambda: self.draft_runner.token_to_kv_pool)
        # a PD prefill server only prefills (the target's capture and the drafter's context K/V, then the transfer):
        # it never drafts or verifies, so it builds none of their graphs or warm-ups (issue #49 item 1)
        self._prefill_server = pd_mode == "prefill"

        # verify widths: the policy's choices, each with its own target graphs (captured in init_cuda_graphs)
        from ..settings import current as _settings

        controls = WidthControls.from_env(B)
        # with SGLANG_DFLASH_TREE the policy prices the tree as one more shape next to every chain width (issue #38
        # item 4: width_control.py); the tree's verify has its own graphs (tree_graphs.py), not a VerifyWidths width
        self._widths = VerifyWidths(self.model_runner, B, controls.ks)
        # SGLANG_DFLASH_SHORT_DRAFT: a step of k < B - 1 drafts runs the drafter on k + 1 positions, with the
        # drafter's own graphs per width (the same class on the draft runner); off: every draft pass is the block
        self._short_draft = _settings().short_draft
        short_ks = [k for k in controls.ks if 0 < k < B - 1] if self._short_draft else []
        self._draft_widths = VerifyWidths(self.draft_runner, B, short_ks, role="draft")
        # under tensor parallelism every rank must choose the same width: the ranks share rank 0's step-time table
        self._control = WidthController(controls, B, share=TableShare.for_tp_group(),
                                        enable_metrics=bool(getattr(server_args, "enable_metrics", False)))

        # benchmarks only: oracle drafts (SGLANG_DFLASH_ORACLE_DRAFTS, oracle_drafts.py), refused now unless the
        # target has model-like dummy weights; built with the request pool (alloc_memory_pool). None = off, no cost
        oracle = _settings()
        self._oracle_switch, self._oracle = (oracle.oracle_drafts, oracle.oracle_profile), None
        if oracle.oracle_drafts:
            check_oracle_allowed(server_args, oracle.dummy_weights)

        from sglang.srt.distributed import get_tp_group

        self._tp_group = get_tp_group() if int(server_args.tp_size) > 1 else None
        # per-step buffers, sized once (bs never exceeds max_running_requests)
        cap = max(int(server_args.max_running_requests or 48), 1)
        dev = self.device
        self._block_ids = torch.empty((cap, B), dtype=torch.int64, device=dev)  # every column written per step
        self._positions = torch.empty((cap, B), dtype=torch.int64, device=dev)
        self._cache_loc = torch.empty((cap, B), dtype=torch.int64, device=dev)
        self._verify_ids = torch.empty((cap * B,), dtype=torch.int64, device=dev)
        self._plain_positions = torch.empty((cap, 1), dtype=torch.int64, device=dev)  # k = 0 steps
        self._plain_cache_loc = torch.empty((cap, 1), dtype=torch.int64, device=dev)
        self._graph_drafts = torch.empty((cap, B - 1), dtype=torch.int64, device=dev)  # the draft graphs' head output
        # (draft width, captured batch size) of the draft graphs that compute their drafts ([:bs, :width - 1])
        self._graph_head_bs: set[tuple[int, int]] = set()
        self._logged_q_drafts = False  # the first step drawing DFlash2 drafts from q says so in the log, once
        self._logged_short_draft = False  # so does the first short draft pass (SGLANG_DFLASH_SHORT_DRAFT)
        self._logged_tree_step = False  # the first tree step says so in the log, once (tests look for it)
        self._logged_sampled_tree = False  # so does the first tree step with sampled rows
        # tree steps under CUDA graphs (tree_graphs.py; set up in init_cuda_graphs): the static tree buffers, the
        # tree verify graphs, the draft-graph batch sizes whose replay builds the tree, and how each tree step ran
        self._tree_buffers: TreeBuffers | None = None
        self._tree_graphs: TreeVerifyGraphs | None = None
        self._graph_tree_bs: set[int] = set()
        self._tree_counts = {"verify graphed": 0, "verify eager": 0, "built in graph": 0, "built eagerly": 0}
        # one launch each on the GPU for the block inputs, for the greedy accept + its bookkeeping and for a tree
        # step's accept + commit + bookkeeping (kernels/); their torch twins on CPU
        self._fill_block_inputs, self._greedy_accept = block_inputs_torch, greedy_accept_torch
        self._tree_accept = tree_accept_torch
        if self.device != "cpu":
            from ..kernels.block_inputs import block_inputs
            from ..kernels.greedy_accept import greedy_accept
            from ..kernels.tree_accept import tree_accept

            self._fill_block_inputs, self._greedy_accept, self._tree_accept = block_inputs, greedy_accept, tree_accept
        # the draft forward is a TARGET_VERIFY-shaped pass of B tokens per request (of k + 1 with short drafts) with
        # no hidden capture; one spec info per width (the attention backends read the width from it)
        self._draft_spec_infos = {w: DFlashVerifyInput(
            draft_token=torch.empty(0, dtype=torch.int64, device=dev),
            positions=torch.empty(0, dtype=torch.int64, device=dev), draft_token_num=w,
            capture_hidden_mode=CaptureHiddenMode.NULL) for w in [*self._draft_widths.widths, B]}
        self._draft_spec_info = self._draft_spec_infos[B]
        logger.info("sglang-dflash worker ready: block=%d, draft layers=%d, target_layer_ids=%s, mask_token_id=%d, "
                    "draft attention=%s, overlap=%s, speculation: %s", B, self.cfg.num_hidden_layers,
                    list(self.cfg.target_layer_ids), self.cfg.mask_token_id, bundle.resolved_attention_backend,
                    not server_args.disable_overlap_schedule, controls.describe())
        if self._tree_size:
            logger.info("sglang-dflash: tree verify on (SGLANG_DFLASH_TREE=%d): steps of batches (greedy or "
                        "sampled) without penalties, grammar, logit_bias or logprobs may verify a draft tree of %d "
                        "nodes, where the width policy chooses it (CUDA graphs or eager: the tree graph line at "
                        "start-up says which); other steps verify the chain", self._tree_size, self._tree_size)

    # ------------------------------------------------------------------------------ scheduler plumbing
    @property
    def draft_worker(self):
        return self._draft_worker

    @property
    def spec_v2_attn_backends(self) -> tuple:
        return (self.model_runner.attn_backend, self.draft_runner.attn_backend)

    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        # The draft shares the target's slot space (req_to_token + allocator): a radix prefix hit is a hit for the
        # draft's context K/V too, and one reservation covers both caches.
        self._draft_worker.alloc_memory_pool(memory_pool_config=memory_pool_config,
                                             req_to_token_pool=req_to_token_pool,
                                             token_to_kv_pool_allocator=token_to_kv_pool_allocator)
        self.req_to_token_pool, self.token_to_kv_pool_allocator = req_to_token_pool, token_to_kv_pool_allocator
        # per-request sampling controls, one row per request slot of the shared req_to_token pool
        self._controls = SamplingControls(req_to_token_pool.req_to_token.shape[0],
                                          self.model_runner.model_config.vocab_size, self.device)
        self._seeds = RequestSeeds(req_to_token_pool.req_to_token.shape[0], self.device)  # sampling_seed per slot
        self._logged_first_token_skip = False
        if self._oracle_switch[0]:
            self._oracle = OracleDrafts(*self._oracle_switch, self.block, self.model_runner.model_config.vocab_size,
                                        req_to_token_pool.req_to_token.shape[0], self.device)
            self._oracle.warm(self._control.controls.ks)
        # SGLang's KV-slot writers compile per batch size on first use: do it now, not on a time to first token (a
        # PD prefill server too: a prefill's writer is one of them)
        warm_kv_slot_kernels(req_to_token_pool.req_to_token, self._block_ids.shape[0])
        if not self._prefill_server:  # and ours, with trees on (no tree step runs on a prefill server)
            warm_tree_accept(self._tree_size, req_to_token_pool.req_to_token)

    def init_attention_backends(self):
        self._draft_worker.init_attention_backends()
        # hybrid targets: the linear-attention state after a verify must be the state after the committed tokens
        self._recurrent = RecurrentStateCommit(self.model_runner)
        if self._tree_size and self._recurrent.active:
            raise DFlashStartupError(
                f"SGLANG_DFLASH_TREE={self._tree_size} with a hybrid target "
                f"({type(self.model_runner.model).__name__}: recurrent layers): their state after a verify is kept per "
                "block position, not per tree node, so a tree verify would not be lossless. Fix: SGLANG_DFLASH_TREE=0")

    def init_cuda_graphs(self):
        from sglang.srt.runtime_context import get_exec

        graph_cfg = get_exec().graph.cuda_graph_config
        from sglang.srt.model_executor.cuda_graph_config import Backend

        enabled = graph_cfg is not None and graph_cfg.decode.backend != Backend.DISABLED and self.device != "cpu"
        if enabled and self._prefill_server:  # SGLang turns decode graphs off there unless the operator forced them
            logger.info("sglang-dflash: PD prefill server: no draft, verify-width or tree CUDA graphs (it never runs "
                        "a decode step), whatever the decode graph flags say")
            enabled = False
        hooks = getattr(self.draft_runner, "capture_tail_hooks", None)
        from ..settings import current as settings

        self._graph_greedy_head = settings().graph_head
        if enabled and self._tree_size:
            # the tree's static buffers, sized for every batch size the draft (width B) and tree verify (width N)
            # graphs capture (SGLang's list, from the same server arguments and request pool for both runners)
            max_bs = max([self._graph_drafts.shape[0], *capture_sizes(self.model_runner, self._tree_size),
                          *capture_sizes(self.model_runner, self.block)])
            self._tree_buffers = TreeBuffers(max_bs, self._tree_size, self.device)
        if enabled and hooks is not None and (self._graph_greedy_head or self._tree_buffers is not None):
            hooks.append(self._capture_draft_head)
        self._draft_worker.init_cuda_graphs(capture_decode_cuda_graph=enabled)
        logger.info("sglang-dflash: draft CUDA graphs %s; greedy draft head %s", "captured" if enabled else "off",
                    f"inside them for batch sizes {sorted(b for _, b in self._graph_head_bs)}" if self._graph_head_bs
                    else "eager")
        if enabled:
            self._widths.capture()
            logger.info("sglang-dflash: extra target verify graphs for widths %s: %.2f GB", self._widths.widths,
                        self._widths.graph_memory_gb)
            if self._draft_widths.widths:
                self._draft_widths.capture()
                logger.info("sglang-dflash: short drafts (SGLANG_DFLASH_SHORT_DRAFT=1): draft graphs for widths %s: "
                            "%.2f GB", self._draft_widths.widths, self._draft_widths.graph_memory_gb)
        if self._tree_buffers is not None:
            self._tree_graphs = TreeVerifyGraphs(self.model_runner, self._tree_buffers)
            self._tree_graphs.capture()
        if self._tree_size:
            self._log_tree_graphs()
        if self.model_runner.decode_cuda_graph_runner is not None and self._commit.calls == 0:
            raise RuntimeError("the target's verify CUDA graphs were captured without the DFLASH context commit "
                               "(the target's forward was not called through model.forward). Fix: run with "
                               "--disable-cuda-graph and report the target model class")

    def _log_tree_graphs(self):
        """One start-up line: whether tree steps run under CUDA graphs, and for which batch sizes."""
        graphs = self._tree_graphs
        verify = (f"replays tree verify CUDA graphs for batch sizes {list(graphs.runner.capture_bs)} (larger: eager)"
                  if graphs is not None and graphs.runner is not None else "eager (no target verify graphs)")
        build = (f"inside the draft CUDA graphs for batch sizes {sorted(self._graph_tree_bs)} (others: eager)"
                 if self._graph_tree_bs else "eager")
        logger.info("sglang-dflash: tree steps (%d nodes): verify %s; tree build %s", self._tree_size, verify, build)

    def _capture_draft_head(self, runner, out, forward_batch, num_tokens):
        """A capture tail hook of the draft runner: the greedy draft head (the target's lm_head + argmax over block
        positions 1..B-1) recorded into the draft CUDA graph, writing self._graph_drafts, so a replay leaves no
        eager launches for the drafts. Batch sizes over GRAPH_HEAD_MAX_ROWS draft rows (or over the buffer) are
        left out and keep the eager head. With tree steps on, the tree head joins it (GRAPH_TREE_MAX_ROWS): the same
        draft logits -> tree_step.tree_of_logits -> the static tree buffers (tree_graphs.py), so a draft replay
        leaves the step's tree, its verify inputs and its kernel mask ready."""
        B = self.block
        W = getattr(runner, "speculative_num_draft_tokens", None) or B  # the graph's block: B, or a short draft's
        bs = num_tokens // W
        greedy = self._graph_greedy_head and bs * (W - 1) <= GRAPH_HEAD_MAX_ROWS and bs <= self._graph_drafts.shape[0]
        buffers = self._tree_buffers
        tree = W == B and buffers is not None and bs * (B - 1) <= GRAPH_TREE_MAX_ROWS and bs <= buffers.max_bs
        if not (greedy or tree):
            return
        hidden = out.hidden_states[:num_tokens].view(bs, W, -1)[:, 1:].reshape(bs * (W - 1), -1)
        anchors = forward_batch.input_ids[:num_tokens].view(bs, W)[:, 0]  # the blocks' bonus tokens
        if not tree:
            self._graph_drafts[:bs, :W - 1].copy_(self.draft_model.greedy_drafts(hidden, anchors).view(bs, W - 1))
            self._graph_head_bs.add((W, bs))
            return
        logits = self.draft_model.draft_logits(hidden)  # one lm_head pass for both heads
        if greedy:  # greedy_drafts = vocab.greedy(draft_logits) for a DFlash drafter (trees refuse DFlash2)
            self._graph_drafts[:bs].copy_(self.draft_model.vocab.greedy(logits).view(bs, B - 1))
            self._graph_head_bs.add((B, bs))
        # the draft pass's seq_lens are the committed lengths (the prefix), its req_pool_indices the requests' rows:
        # static buffers of the draft graph, refilled by each replay
        buffers.store(tree_step.tree_of_logits(self.draft_model, logits, anchors, self._tree_size),
                      forward_batch.seq_lens[:bs], forward_batch.req_pool_indices[:bs],
                      self.req_to_token_pool.req_to_token)
        self._graph_tree_bs.add(bs)

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size=0):
        # the scheduler's host-side report of a finished decode step: feeds the width policy with no sync
        self._control.on_verify_complete(num_correct_drafts_per_req, batch_size)
        if self._oracle is not None:
            self._oracle.on_verify(num_correct_drafts_per_req, batch_size)

    def __getattr__(self, name):
        # everything the scheduler asks a TP worker for (and we do not override) is the target's
        if name.startswith("__") or name in ("_target_worker",):
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    # ------------------------------------------------------------------------------------------- steps
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, **_):
        # grammar_barrier (overlap scheduling): advances the grammar matchers over the previous step's committed
        # tokens, so this step's masks start from the right state (controls.process calls it)
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            self._control.interrupt()  # the open decode step's cycle now holds a prefill: not its own cost
            return self._prefill(batch, on_publish)
        if batch.forward_mode.is_idle():
            self._control.interrupt()
            return self._idle(on_publish)
        with _phase("dflash.step"):
            return self._decode_step(batch, on_publish, grammar_barrier)

    def _prefill(self, batch, on_publish):
        self._controls.before_prefill(batch)  # a retracted request's penalties cover its earlier output
        if self._oracle is not None:  # benchmarks only: each new request's slot -> its recorded continuation
            self._oracle.on_prefill(batch)
        out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        features = out.logits_output.hidden_states
        if features is None:
            raise RuntimeError("target prefill returned no captured hidden states; the target model's DFLASH "
                               "capture is not configured (set_dflash_layers_to_capture was not called)")
        pos = _extend_positions(batch.prefix_lens, batch.extend_lens, self.device)
        self.draft_model.write_context_kv(features, pos, batch.out_cache_loc, self.draft_runner.token_to_kv_pool)
        out.logits_output.hidden_states = None  # never ship [N, K*H] to the host
        seeded = self._seeds.on_prefill(batch)
        if seeded is not None:
            out.next_token_ids = self._seeded_first_tokens(batch, out, seeded)
        # SGLang's sampler applied the prefill's controls; from here on they are ours, per request slot
        self._controls.on_prefill(batch, out.next_token_ids)
        out.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(batch.seq_lens)
        out.next_draft_input = make_draft_input_v2(bonus_tokens=out.next_token_ids, new_seq_lens=batch.seq_lens)
        return out

    def on_relayed(self, batch):
        """Prefill-decode disaggregation, decode side: requests whose prefill (and our `_prefill`) ran on the
        prefill server join here without a forward; their slots' controls and seeds are set as a prefill would
        (disagg.py). Their draft input is `disagg.relayed_draft_input`'s; the drafter's context came with the KV."""
        self._controls.on_relay(batch)
        self._seeds.on_prefill(batch)

    def _idle(self, on_publish):
        empty64 = torch.empty((0,), dtype=torch.int64, device=self.device)
        nxt = make_draft_input_v2(bonus_tokens=empty64, new_seq_lens=empty64)
        if on_publish is not None:
            on_publish(nxt.new_seq_lens)
        return GenerationBatchResult(logits_output=None, next_token_ids=empty64,
                                     accept_lens=torch.empty((0,), dtype=torch.int32, device=self.device),
                                     next_draft_input=nxt, speculative_num_draft_tokens=self.block,
                                     new_seq_lens=nxt.new_seq_lens, can_run_cuda_graph=False)

    def _decode_step(self, batch, on_publish, grammar_barrier=None):
        B, bs = self.block, batch.batch_size()
        state = batch.spec_info
        if not isinstance(state, DFlashDraftInputV2):
            raise RuntimeError(f"DFLASH decode expected DFlashDraftInputV2 state, got {type(state).__name__}")
        prefix = batch.seq_lens  # committed lengths; the bonus token sits at position prefix
        # the step's shape: k drafts of the chain (W = k + 1 tokens per request), or the draft tree where the batch
        # qualifies and the policy prices it best (width_control.py; its own key, its own acceptance statistics)
        k = self._control.choose(bs, tree_ok=bool(self._tree_size) and tree_step.applies(batch))
        if self._oracle is not None:
            self._oracle.note_step(bs, k)
        if k == self._control.tree:
            self._control.step_begin(bs, k)
            return self._tree_decode_step(batch, state, prefix, bs, on_publish)
        W = k + 1
        self._control.step_begin(bs, k)  # a step's cost is its cycle: from here to the next decode step's start

        # 1) draft: one drafter pass over [bonus, MASK...] (the block, or k + 1 positions with short drafts), drafts
        #    for positions 1..k (none when k = 0): point masses, except a DFlash2 drafter's for sampled rows, drawn
        #    from its selector's q (kept for the accept)
        draft_width = W if self._short_draft else B
        draft_lens = None  # host-side lengths at the draft's width: the draft's, and the verify's at that width
        draft = None
        keys = self._step_keys(batch)  # the draws' keys while a live request has a seed (seeds.py), else None
        if k > 0:
            draft_lens = self._host_lens(batch, state, draft_width)
            verify_ids = self._verify_ids[:bs * W].view(bs, W)  # contiguous for every width
            block_ids, positions, cache_loc = self._block_inputs(batch, state.bonus_tokens, prefix, bs, verify_ids)
            with _phase("dflash.draft"):
                draft = self._draft(batch, block_ids, positions, cache_loc, prefix, draft_lens, bs, k,
                                    self._draft_temperature(batch), keys, width=draft_width)
            verify_ids[:, 1:] = draft.tokens
            if self._oracle is not None and draft.q is None:  # benchmarks only: after the drafter's real pass, the
                # recorded continuation cut by the profile, one launch (oracle_drafts.py; not for drafts drawn from q)
                self._oracle.replace(verify_ids, prefix, batch.req_pool_indices)
            # contiguous: a [bs, W] slice of a [bs, B] buffer flattens to a stride-B view, which kernels refuse
            positions, cache_loc = positions[:, :W].contiguous(), cache_loc[:, :W].contiguous()
        else:  # a plain step verifies the bonus alone: no block inputs (its host time is what it costs over a plain
            # decode step: benchmarks/results/k0-step-qwen3-8b-h100)
            verify_ids, positions, cache_loc = self._plain_inputs(batch, state.bonus_tokens, prefix, bs)
        grammar_chain = self._controls.grammar_chain(batch, verify_ids)  # host copy of the chain, grammars only

        # 2) verify: one target pass over [bonus, d_1..d_k], logits for every position + hidden capture
        # (the verify forward also commits the rows' context K/V into the draft cache: context_commit.py)
        self._recurrent.before_verify(batch)
        with _phase("dflash.verify"), self._widths.target_at(W):
            verify_lens = draft_lens if k > 0 and W == draft_width else self._host_lens(batch, state, W)
            logits, graphed = self._verify(batch, verify_ids, positions, cache_loc, verify_lens, bs, W)
            verify_backend = self.model_runner.attn_backend  # this width's (verify_widths.py)

        # 3) accept: the foundation's rules (greedy rows are a point mass, so one sampled call serves mixed batches;
        #    drafts drawn from q are accepted with min(1, p/q)) on the rows processed as plain decoding would
        #    (penalties, min_new_tokens, grammar, logit_bias: each row with the state behind its own drafted prefix),
        #    then the controls' state advances over what was committed
        with _phase("dflash.accept"):
            logits, pending = self._controls.process(batch, logits.view(bs, W, -1), verify_ids, grammar_chain,
                                                     grammar_barrier)
            commit_lens, tokens, next_ids, bonus, accept_lens, new_seq_lens = self._accept(batch, verify_ids, logits,
                                                                                          prefix, draft, keys)
            self._controls.commit(pending, tokens, commit_lens)
        # 4) commit: the verified rows' target K/V and draft context K/V are written (by the verify forward); a
        #    hybrid target's recurrent state is set to the state after the committed tokens; publish
        self._recurrent.after_accept(verify_backend, batch, prefix, commit_lens, W)
        if on_publish is not None:
            on_publish(new_seq_lens)
        self._control.step_end()
        return GenerationBatchResult(
            logits_output=self._controls.logprobs(batch, logits, tokens),  # None unless a request asked for logprobs
            next_token_ids=next_ids,
            accept_lens=accept_lens,
            next_draft_input=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=W, new_seq_lens=new_seq_lens, can_run_cuda_graph=graphed)

    def _tree_decode_step(self, batch, state, prefix, bs, on_publish):
        """A decode step that verifies a draft tree of N nodes (SGLANG_DFLASH_TREE; tree_step.py says why and how):
        the chain's drafter pass -> best-first tree -> one target pass under the tree mask (it also writes every
        node's draft context K/V at its slot and position) -> the accept. An all-greedy batch: the target's argmax
        -> ``_tree_accept``: the greedy tree rule (tree_acceptance.verify_tree_greedy), req_to_token permuted so the
        path's slots come first (commit_path) and the step's outputs (commit_outputs of (commit_lens,
        tokens), as the chain's), in one launch on the GPU (kernels/tree_accept.py), its torch twin (those three
        functions) on CPU. A batch with sampled rows: ``_tree_accept_sampled``, the same three steps with the sampled
        tree rule (tree_acceptance.verify_tree_sampled) on the target's processed probabilities.

        Under CUDA graphs (tree_graphs.py) the draft replay builds the tree into the static buffers (where its batch
        size's draft graph has the tree head; else the eager build is stored there) and the verify replays the tree
        verify graph; past the captured sizes, or without graphs, both run eagerly as on the CPU."""
        B, N = self.block, self._tree_size
        req_to_token = self.req_to_token_pool.req_to_token
        buffers, graphs = self._tree_buffers, self._tree_graphs
        verify_graphed = graphs is not None and graphs.fits(bs)
        if not self._logged_tree_step:
            self._logged_tree_step = True
            logger.info("sglang-dflash: first tree verify step (%d nodes, batch of %d)", N, bs)
        with _phase("dflash.draft"):
            block_ids, positions, cache_loc = self._block_inputs(batch, state.bonus_tokens, prefix, bs,
                                                                 self._verify_ids[:bs * B].view(bs, B))
            out = self._draft_forward(batch, block_ids, positions, cache_loc, prefix, self._host_lens(batch, state, B),
                                      bs)
            draft_graph_bs = getattr(self.draft_runner.decode_cuda_graph_runner, "bs", None)  # padded bs replayed
            built_in_graph = buffers is not None and out.can_run_graph and draft_graph_bs in self._graph_tree_bs
            if not built_in_graph:
                hidden = out.logits_output.hidden_states[: bs * B].view(bs, B, -1)[:, 1:].reshape(bs * (B - 1), -1)
                tree = tree_step.build_tree(self.draft_model, hidden, block_ids[:, 0], N)
                if verify_graphed:  # the verify graphs read the tree mask from the static buffers
                    buffers.store(tree, prefix, batch.req_pool_indices, req_to_token)
        if built_in_graph or verify_graphed:
            tree, tree_verify = buffers.tree(bs), buffers.verify(bs)
            ids, positions, cache_loc = buffers.verify_inputs(bs)
        else:
            tree_verify = tree_step.TreeVerify.of(tree)
            ids, positions, cache_loc = tree_step.verify_inputs(tree, prefix, batch.req_pool_indices, req_to_token)
        # the tree verify graphs, or eager (the chain's verify graphs carry no tree mask: tree_step.eager); an eager
        # forward's attention hooks read the tree (a replay reads the mask from the static buffers)
        target = graphs.target() if verify_graphed else tree_step.eager(self.model_runner)
        with _phase("dflash.verify"), target, tree_step.verifying(tree_verify):
            logits, graphed = self._verify(batch, ids, positions, cache_loc, self._host_lens(batch, state, N), bs, N)
            tree_verify.replayed = graphed
        self._count_tree_step(bs, graphed, built_in_graph)
        with _phase("dflash.accept"):
            if tree_step.all_greedy(batch):  # two launches on the GPU: the argmax, then the rule + commit + outputs
                _, _, next_ids, bonus, accept_lens, new_seq_lens = self._tree_accept(
                    logits.view(bs, N, -1).argmax(dim=-1), tree, prefix, batch.req_pool_indices, req_to_token)
            else:
                next_ids, bonus, accept_lens, new_seq_lens = self._tree_accept_sampled(
                    batch, logits.view(bs, N, -1), tree, prefix, req_to_token, self._step_keys(batch))
        if on_publish is not None:
            on_publish(new_seq_lens)
        self._control.step_end()
        return GenerationBatchResult(
            logits_output=None, next_token_ids=next_ids, accept_lens=accept_lens,
            next_draft_input=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=N, new_seq_lens=new_seq_lens, can_run_cuda_graph=graphed)

    def _tree_accept_sampled(self, batch, logits, tree, prefix, req_to_token, keys=None):
        """A tree step's accept for a batch with sampled rows: (next_ids, bonus, accept_lens, new_seq_lens).

        The target's processed distribution at every node (``logits`` [bs, N, V]: row i scores node i's children),
        built as the chain's sampled accept builds it per block position (``_batch_sampling``: temperature, top-k,
        top-p, min-p; SGLang's greedy rows are top_k = 1, so point masses on the argmax, which the sampled rule
        accepts exactly as the greedy one), then the exact rule (tree_acceptance.verify_tree_sampled: recursive
        rejection over siblings, the reference engine's), the path's commit (commit_path) and the
        step's outputs (commit_outputs), the three steps of the greedy one-launch path. Dense [bs * N, V] float32
        probabilities: no logits-only form of the tree rule exists (the chain has one for unfiltered batches).
        The draws are this rank's own: no rank-0 broadcast as in ``_rank0_outcome``, because trees are refused at
        --tp-size > 1 at start-up (startup.check_tree), as are DFlash2 drafters (so every node is a point-mass
        draft, the case verify_tree_sampled serves)."""
        bs, N, V = logits.shape
        if not self._logged_sampled_tree:
            sampled = sum(r.sampling_params.top_k != 1 for r in batch.reqs)  # host pass, until logged once
            if sampled:  # SGLang's is_all_greedy is sticky: this path may run with greedy rows only
                self._logged_sampled_tree = True
                logger.info("sglang-dflash: first sampled tree step (%d nodes, batch of %d, %d sampled rows%s)", N,
                            bs, sampled, ", seeded draws" if keys is not None else "")
        s, filtered = _batch_sampling(batch.sampling_info, V)
        if keys is not None:  # seeded (seeds.py): tree_acceptance.verify_tree_seeded, the greedy launch on X
            target_ids = seeded_targets(logits, s, keys, prefix.to(torch.int64)[:, None] + tree.depth, filtered)
            return self._tree_accept(target_ids, tree, prefix, batch.req_pool_indices, req_to_token)[2:]
        probs = processed_probs(logits.reshape(bs * N, V), s.repeat_interleave(N), filtered).view(bs, N, V)
        commit_lens, tokens, path = verify_tree_sampled(tree, probs)
        commit_path(req_to_token, batch.req_pool_indices, prefix, path)
        return commit_outputs(commit_lens, tokens, prefix)

    def _count_tree_step(self, bs, graphed, built_in_graph):
        """How tree steps ran (verify graphed or eager, tree built in the draft graph or eagerly), logged at tree
        steps 1, 2, 4, 8, ...: the benchmarks and the GPU tests read the last line."""
        counts = self._tree_counts
        counts["verify graphed" if graphed else "verify eager"] += 1
        counts["built in graph" if built_in_graph else "built eagerly"] += 1
        steps = counts["verify graphed"] + counts["verify eager"]
        if steps & (steps - 1) == 0:
            logger.info("sglang-dflash: tree steps: %d (verify graphed %d, eager %d; tree built in the draft graph "
                        "%d, eagerly %d; this one: batch of %d)", steps, counts["verify graphed"],
                        counts["verify eager"], counts["built in graph"], counts["built eagerly"], bs)

    # ----------------------------------------------------------------------------------- step helpers
    def _block_inputs(self, batch, bonus, prefix, bs, verify_ids):
        """[bonus, MASK...] ids, their positions, and their KV slots (already reserved by prepare_for_decode); the
        bonus also goes to verify_ids[:, 0]."""
        block_ids, positions, cache_loc = self._block_ids[:bs], self._positions[:bs], self._cache_loc[:bs]
        self._fill_block_inputs(bonus, prefix, batch.req_pool_indices, self.req_to_token_pool.req_to_token,
                                self.cfg.mask_token_id, block_ids, positions, cache_loc, verify_ids)
        return block_ids, positions, cache_loc

    def _plain_inputs(self, batch, bonus, prefix, bs):
        """The k = 0 step's [bs, 1] ids, positions and KV slots: the bonus token at position prefix; a block of one
        token, so the block-inputs launch writes them all (ids into our buffer: the verify's input ids must not
        alias the scheduler's state)."""
        ids, positions, cache_loc = self._verify_ids[:bs, None], self._plain_positions[:bs], self._plain_cache_loc[:bs]
        self._fill_block_inputs(bonus, prefix, batch.req_pool_indices, self.req_to_token_pool.req_to_token,
                                self.cfg.mask_token_id, ids, positions, cache_loc, ids)
        return ids, positions, cache_loc

    def _host_lens(self, batch, state, width):
        """Host-side upper bounds of the attended lengths (committed + width), for backends that plan on the host."""
        if batch.seq_lens_cpu is not None:
            lens = batch.seq_lens_cpu + width
        elif compat.reserved_lens_cpu(state) is not None:
            lens = compat.reserved_lens_cpu(state)
        else:
            return None, None
        return lens, int(lens.sum())

    def _draft_temperature(self, batch):
        """[bs] float32: the temperature DFlash2's selector draws each row's drafts at (0: its argmax path), or None
        when every draft is a point mass: DFlash drafters (their head is the argmax whatever the request), and
        batches without a sampled row (SGLang's host-side flag: no sync). Greedy rows of a mixed batch get 0, as
        the reference engine's greedy requests do (reference/engine.propose_step takes the same [n] temperatures)."""
        info = batch.sampling_info
        if not self.cfg.is_dflash2 or info is None or info.is_all_greedy:
            return None
        # SGLang encodes a greedy request as top_k = 1 at temperature 1: its target is a point mass on the argmax,
        # which the argmax path drafts best
        return torch.where(info.top_ks.reshape(-1) <= 1, 0.0, info.temperatures.reshape(-1).float())

    def _draft(self, batch, block_ids, positions, cache_loc, prefix, host_lens, bs, k, temperature, keys=None,
               width=None):
        """The drafts of block positions 1..k, a DraftBlock of [bs, k] tokens: point masses where temperature
        (``_draft_temperature``) is None; else the DFlash2 selector's path, drawn from q at each row's temperature,
        with the candidates and q the accept needs (with the seeded noise of (keys, prefix + i) where the step has
        keys: ``_step_keys``). The pass covers ``width`` block positions: the whole block (None, B), or k + 1 with
        short drafts (the drafter's graphs at that width; host_lens are that width's)."""
        width = width or self.block
        if width != self.block and not self._logged_short_draft:
            self._logged_short_draft = True
            logger.info("sglang-dflash: first short draft pass (k = %d: %d block positions of %d)", k, width, self.block)
        widths = self._draft_widths.target_at(width) if width != self.block else contextlib.nullcontext()
        with widths:
            out = self._draft_forward(batch, block_ids, positions, cache_loc, prefix, host_lens, bs, width)
            replayed = getattr(self.draft_runner.decode_cuda_graph_runner, "bs", None)  # this width's graph runner
        graph_head = out.can_run_graph and (width, replayed) in self._graph_head_bs
        if graph_head and temperature is None:
            return DraftBlock(self._graph_drafts[:bs, :k])  # computed by the replayed graph (_capture_draft_head)
        # The draft graphs record the argmax head only. A DFlash2 batch with sampled rows runs its head eagerly on
        # the replayed graph's hidden states (the graph's argmax drafts are left unread): drawing from q inside the
        # graph would need the rows' temperatures in a static buffer and the draws captured, not done yet. The cost:
        # the selector's walk, a few launches per block position, in sampled DFlash2 steps only.
        hidden = out.logits_output.hidden_states
        # Contiguous 2-D rows for the lm_head: a strided 3-D view sent cuBLAS to a kernel 20x slower (profiled:
        # 14 ms of a 38 ms step at bs=32 on an 8B-shaped pair).
        # Only the k rows that will be verified go through the lm_head (its [V, H] read dominates at small batch).
        hidden = hidden[: bs * width].view(bs, width, -1)[:, 1:k + 1].reshape(bs * k, -1)
        anchors = block_ids[:, 0]  # the blocks' bonus tokens, where DFlash2's selector path starts
        if temperature is None:
            return DraftBlock(self.draft_model.greedy_drafts(hidden, anchors).view(bs, k))
        if not self._logged_q_drafts:
            self._logged_q_drafts = True
            logger.info("sglang-dflash: DFlash2 drafts of sampled requests drawn from the selector's q, verified with "
                        "min(1, p/q), or against the target's own draw where the step is seeded (draft head eager in "
                        "these steps)")
        # THE draft head of the reference engine (DFlashDrafter.propose: CandidateSelector.walk), one definition. The
        # draws are this rank's own: DFlash2 is refused at --tp-size > 1 (startup.py), where ranks would verify
        # different drafts
        if keys is None:
            return self.draft_model.propose(hidden, anchors, temperature)
        return self.draft_model.propose(hidden, anchors, temperature, None, keys, prefix)

    def _draft_forward(self, batch, block_ids, positions, cache_loc, prefix, host_lens, bs, width=None):
        """The drafter's one pass over the blocks [bonus, MASK x (B-1)] (a TARGET_VERIFY-shaped batch, the draft
        CUDA graphs where captured); its output holds the final draft hidden rows of every block position. width < B
        (short drafts): the first width positions of each block, the same ids, positions and KV slots."""
        width = width or self.block
        if width != self.block:  # contiguous [bs, width] rows of the [bs, B] block inputs
            block_ids, positions, cache_loc = (t[:, :width].contiguous() for t in (block_ids, positions, cache_loc))
        seq_lens_cpu, seq_lens_sum = host_lens
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.reshape(-1),
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix, out_cache_loc=cache_loc.reshape(-1),
            seq_lens_sum=seq_lens_sum if seq_lens_sum is not None else 0, seq_lens_cpu=seq_lens_cpu,
            positions=positions.reshape(-1), spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_spec_infos[width] if width != self.block else self._draft_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL)
        with torch.inference_mode():
            return self.draft_runner.forward(fb)

    def _verify(self, batch, verify_ids, positions, cache_loc, host_lens, bs, width):
        vin = DFlashVerifyInput(draft_token=verify_ids.reshape(-1), positions=positions.reshape(-1),
                                draft_token_num=width, capture_hidden_mode=CaptureHiddenMode.FULL)
        batch.out_cache_loc = cache_loc.reshape(-1)
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        if host_lens[0] is not None:
            batch.seq_lens_cpu, batch.seq_lens_sum = host_lens
        try:
            with _phase("dflash.prepare"):  # SGLang's ForwardBatch + graph-replay metadata: host work only
                fb, _ = vin.prepare_for_verify(batch, self.target_worker)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = saved
        commits = self._commit.calls
        out = self.target_worker.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True,
                                                          skip_attn_backend_init=True)
        graphed = bool(out.can_run_cuda_graph)
        if not graphed and self._commit.calls == commits:  # eager: the wrapper must have run (graphs: at capture)
            raise RuntimeError("DFLASH verify ran eagerly without committing the drafter's context K/V: the target's "
                               "forward was bypassed (context_commit.py)")
        lo = out.logits_output
        lo.hidden_states = None  # consumed inside the forward; never shipped to the host
        return lo.next_token_logits[:bs * width], graphed

    def _accept(self, batch, verify_ids, logits, prefix, draft, keys=None):
        """(commit_lens, tokens, next_ids, bonus, accept_lens, new_seq_lens) of the step: the acceptance rule, then
        the outputs SGLang's scheduler reads (kernels/greedy_accept.commit_outputs defines them). ``draft``: the
        step's DraftBlock (None at k = 0); its q, when set, is the distribution the drafts were drawn from.
        ``keys`` ([bs], ``_step_keys``): a seeded step, acceptance.verify_seeded: the target's seeded sample X of
        every verified row, then the greedy accept against X (its one launch on the GPU)."""
        info = batch.sampling_info
        if info is None or info.is_all_greedy or keys is not None:  # the rule and the outputs in one launch on GPU
            if keys is None:
                target_ids = logits.argmax(dim=-1)
            else:
                s, filtered = _batch_sampling(info, logits.shape[-1])
                rows = prefix.to(torch.int64)[:, None] + torch.arange(logits.shape[1], device=prefix.device)
                target_ids = self._rank0_ids(seeded_targets(logits, s, keys, rows, filtered))
            if verify_ids.shape[1] == 1:  # k = 0: the argmax is the commit; cheaper than any kernel launch
                return plain_accept(target_ids, prefix)
            return self._greedy_accept(target_ids, verify_ids[:, 1:], prefix)
        drawn_from = draft if draft is not None and draft.q is not None else None
        commit_lens, tokens = self._rank0_outcome(*self._sampled(info, verify_ids[:, 1:], logits, drawn_from))
        return (commit_lens, tokens) + commit_outputs(commit_lens, tokens, prefix)

    def _rank0_outcome(self, commit_lens, tokens):
        """Tensor parallelism: the sampled rule draws random numbers, and ranks whose draws differed would commit
        different tokens (different KV, then different collectives: a hang). Every rank takes rank 0's outcome, one
        broadcast of [bs, W + 1] ints per sampled step (greedy steps agree by construction: every rank holds the same
        gathered logits)."""
        group = self._tp_group
        if group is None:
            return commit_lens, tokens
        packed = torch.cat([commit_lens.to(torch.int64)[:, None], tokens.to(torch.int64)], dim=1)
        group.broadcast(packed, src=0)
        return packed[:, 0].to(commit_lens.dtype), packed[:, 1:].to(tokens.dtype)

    def _rank0_ids(self, target_ids):
        """Tensor parallelism, seeded steps: every rank takes rank 0's seeded samples [bs, W] (its unseeded rows'
        random keys are rank 0's), one broadcast; then the greedy accept agrees by construction."""
        if self._tp_group is not None:
            self._tp_group.broadcast(target_ids, src=0)
        return target_ids

    def _step_keys(self, batch):
        """The draw keys of a decode step ([bs] int64, seeds.RequestSeeds.keys) when it samples and a live request
        has a seed; None otherwise (all-greedy steps, or no seeded request: the generator's rules, as before)."""
        info = batch.sampling_info
        if info is None or info.is_all_greedy:
            return None
        return self._seeds.keys(batch)

    def _seeded_first_tokens(self, batch, out, seeded):
        """The prefill's tokens with each seeded sampled row's drawn again by sampling.seeded_sample with the noise of
        (seed, seq_len - 1), the position of the last prompt token (the decode steps' convention), so the first
        output token is reproducible too. SGLang's sampler has left softmax(logits / T) in next_token_logits (after
        penalties, logit_bias and the grammar mask, in place: its standard path), so the draw runs on their log at
        temperature 1 with each row's top-k, top-p, min-p. Where that does not hold (an all-greedy batch, a
        sampler of another kind, SGLang's RL on-policy path) or the batch returns logprobs (they were computed for
        SGLang's token), SGLang's token stays: seeded by SGLang under --enable-deterministic-inference, random
        without (logged once)."""
        info, probs = batch.sampling_info, out.logits_output.next_token_logits
        if info is None or info.is_all_greedy or probs is None or batch.return_logprob or not _probs_after_sampling(
                self.model_runner):
            if not self._logged_first_token_skip:
                self._logged_first_token_skip = True
                logger.info("sglang-dflash: a seeded request's first token is SGLang's own draw (logprobs requested "
                            "or a sampler path that keeps no probabilities): reproducible only under "
                            "--enable-deterministic-inference")
            return out.next_token_ids
        s, filtered = _batch_sampling(info, probs.shape[-1])
        s = SamplingTensors(torch.ones_like(s.temperature), s.top_k, s.top_p, s.min_p)  # probs are tempered already
        drawn = seeded_sample(probs.float().log(), s, self._seeds.of(batch), batch.seq_lens.to(torch.int64) - 1,
                              filtered)
        return torch.where(seeded, drawn.to(out.next_token_ids.dtype), out.next_token_ids)

    def _sampled(self, info, drafts, logits, drawn_from=None):
        """The sampled rule for the batch: point-mass drafts (drawn_from None) by verify_sampled(_logits); drafts
        drawn from q (drawn_from = their DraftBlock: candidates, q) by verify_sampled_q."""
        bs, B, V = logits.shape
        s, filtered = _batch_sampling(info, V)
        if not filtered and drawn_from is None:
            # Every row samples softmax(logits / T) (no greedy rows either: those are top_k = 1): the same rule on
            # the logits, without the [bs x B, V] float32 probabilities (tests/test_acceptance_logits.py: same law).
            return verify_sampled_logits(drafts, logits, s.temperature)
        probs = processed_probs(logits.reshape(bs * B, V), s.repeat_interleave(B), filtered).view(bs, B, V)
        if drawn_from is None:
            return verify_sampled(drafts, probs)
        # Drafts drawn from q (DFlash2, sampled rows; greedy rows' q is one-hot, which gives verify_sampled's rule):
        # accept d with min(1, p(d) / q(d)), on rejection draw from (p - q)+; the dense probabilities, as no
        # logits-only form of this rule exists yet
        return verify_sampled_q(drafts, probs, drawn_from.candidates, drawn_from.q)


def _batch_sampling(info, vocab: int) -> tuple[SamplingTensors, bool]:
    """SGLang's sampling info of a batch as our SamplingTensors (one row per request) and whether any row filters
    (processed_probs' ``filtered``): the one mapping the chain's and the tree's sampled accepts share."""
    # SGLang encodes greedy as top_k = 1 (temperature 1): processed_probs then gives the argmax point mass.
    s = SamplingTensors(temperature=info.temperatures.reshape(-1).float(),
                        top_k=info.top_ks.reshape(-1).to(torch.int64).clamp(max=vocab),
                        top_p=info.top_ps.reshape(-1).float(), min_p=info.min_ps.reshape(-1).float())
    # SGLang's host-side flags say whether any row filters (greedy rows, top_k = 1, count as filtering)
    return s, bool(info.need_top_k_sampling or info.need_top_p_sampling or info.need_min_p_sampling)


def _probs_after_sampling(model_runner) -> bool:
    """Whether SGLang's sampler leaves softmax(logits / T) in next_token_logits after a sampled batch: its own
    Sampler's standard path (not Ascend's, not the RL on-policy one, whose logits stay as they were)."""
    from sglang.srt.layers.sampler import Sampler

    sampler = getattr(model_runner, "sampler", None)
    return (type(sampler) is Sampler and not getattr(sampler, "use_ascend_backend", False)
            and not getattr(sampler, "use_log_softmax_logprob", False))


def _extend_positions(prefix_lens: list[int], extend_lens: list[int], device) -> torch.Tensor:
    """Positions of a prefill's extended tokens, request after request, built on the device from two [bs] lists.

    A host-built [tokens] tensor would be a pageable copy as large as the prefill. And a pageable copy of any size
    (``torch.tensor(list, device=cuda)``) waits for the stream to drain: the host then idled through the target's
    prefill forward instead of preparing the next batch, which put ~6 ms on every time to first token on an H100
    (issue #34). So the two lists go through pinned memory, asynchronously, and expand on the device."""
    total = int(sum(extend_lens))
    on_gpu = torch.device(device).type == "cuda"
    lists = torch.tensor([prefix_lens, extend_lens], dtype=torch.int64, pin_memory=on_gpu)
    prefix, lens = lists.to(device, non_blocking=True)  # the pinned source stays alive until the copy ran
    first = prefix - (torch.cumsum(lens, 0) - lens)
    return torch.repeat_interleave(first, lens, output_size=total) + torch.arange(total, device=device)


def _lm_head(model) -> torch.nn.Module:
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "weight"):
        return head
    return model.get_input_embeddings()  # tied embeddings (e.g. Gemma, SmolLM2)
