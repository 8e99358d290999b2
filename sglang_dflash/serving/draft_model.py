"""The DFlash drafter built from SGLang layers, registered for the published ``DFlashDraftModel`` architecture.

Same maths as :class:`sglang_dflash.drafter.DFlashDrafter` (the oracle; ``tests/test_drafter_parity.py`` checks the
two agree), but with SGLang's parallel linears, RMSNorm, RoPE and ``RadixAttention``, so the draft runs in a draft
ModelRunner on the backend chosen by ``--speculative-draft-attention-backend`` and can be captured in CUDA graphs.
The classes carry an ``SGLang`` prefix (``SGLangDraftAttention`` ...) to tell them from the plain-torch ones.

The draft's KV cache holds, for every committed token, each layer's K/V of that token's *context row*
``hidden_norm(fc(target features))`` (``write_context_kv``), and for the block being drafted the K/V of the block
tokens themselves (written by the attention call). Block queries see all of it: full-attention layers are
non-causal (ENCODER_ONLY), sliding layers causal within their window, as ``DFlashConfig.layer_is_causal`` says.

Embedding and lm_head belong to the target: ``bind_target`` hands them over after both models are loaded
(``TargetVocab``). The forward embeds ``input_ids`` itself, so no ``input_embeds`` (which SGLang's runner casts to
bfloat16) crosses the runner and float32 serving stays float32.

Tensor parallelism (``--tp-size`` N) shards the drafter as SGLang shards a target: attention heads and the MLP's
intermediate columns split over the ranks (QKV / MergedColumn / Row parallel linears; a Row linear all-reduces), each
rank's draft KV pool holds its own K/V heads, and ``fc`` / ``hidden_norm`` / the norms are replicated (the context
row is H wide and every rank needs all of it). Sharded rather than replicated: SGLang sizes the draft KV pool per
rank from the draft config's heads, so a replicated drafter would not fit its pool, and sharding halves the weight
reads of the memory-bound draft pass at the price of two all-reduces per layer. The target's vocabulary is sharded
by SGLang's ``VocabParallelEmbedding`` / ``ParallelLMHead`` (Gemma's scaled embeddings stay replicated):
``TargetVocab`` looks token rows up in this rank's slice and all-reduces, and the greedy draft head takes each
rank's best token and all-gathers the (score, id) pairs, so every rank drafts the same tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DFlashConfig
from ..drafter import draft_logits

logger = logging.getLogger(__name__)


def _sglang():
    # Imported lazily: this module is imported by the worker inside the scheduler process only.
    from sglang.srt.layers import layernorm, linear, radix_attention, rotary_embedding

    return layernorm, linear, radix_attention, rotary_embedding


def _tp_size() -> int:
    """Ranks of the tensor-parallel group, as SGLang's parallel linears read it when they are built."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_size)


def rank_heads(cfg: DFlashConfig, ranks: int) -> tuple[int, int]:
    """(query heads, K/V heads) of one rank at ``ranks``-way tensor parallelism, as SGLang's QKVParallelLinear splits
    them: query heads evenly; K/V heads evenly, or each replicated on ranks / kv ranks when there are fewer K/V heads
    than ranks."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % ranks or (kv % ranks and ranks % kv):
        raise ValueError(f"drafter with {heads} attention heads / {kv} K/V heads cannot be split over --tp-size "
                         f"{ranks}: the heads must divide evenly (and K/V heads divide or be divided by the ranks). "
                         "Fix: a --tp-size that divides both")
    return heads // ranks, max(1, kv // ranks)


def _norm(dim: int, eps: float, gemma: bool):
    layernorm = _sglang()[0]
    return layernorm.GemmaRMSNorm(dim, eps=eps) if gemma else layernorm.RMSNorm(dim, eps=eps)


def drafter_config(config) -> DFlashConfig:
    """The DFlashConfig of the HF config SGLang hands the model class: the worker's own object, not a second parse.

    SGLang builds that HF config from --speculative-draft-model-path (the draft TpModelWorker's ModelConfig), and
    transformers records the directory it read as ``name_or_path``. ``DFlashConfig.load`` of that directory returns
    the object the worker loaded a moment earlier in this scheduler process (memoised per file), so worker and draft
    model run on one parsed, checked config, and the worker checks that they do. A plain dict (tests build the model
    directly) or a config that was not read from a local directory is parsed here."""
    if isinstance(config, Mapping):
        return DFlashConfig.from_dict(config)
    source = getattr(config, "name_or_path", None)
    if source and (Path(source) / "config.json").is_file():
        return DFlashConfig.load(source)
    return DFlashConfig.from_dict(config.to_dict())


def cpu_draft_head(weight: torch.Tensor) -> torch.Tensor:
    """The lm_head weight the draft head multiplies with: `weight` itself, or on a CPU serving float32 a bfloat16
    copy when this CPU runs it at least 1.5x faster (AVX512-BF16 / AMX; measured once here, ~0.1 s).

    Why: on CPU the draft head is a memory- and compute-bound [k, H] x [H, V] product over the target's whole
    vocabulary, and float32 GEMMs with an odd row count ran 2x slower than with an even one (oneDNN's choice): on
    the 2-core CI machine, SmolLM2's head (49,152 x 576) took 33 ms at k = 3 and 7, against 4 ms in bfloat16, in a
    137 ms step (py-spy, issue #47 item 1). Drafts only choose what the target verifies, so their precision moves
    acceptance, never the output."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return weight
    import time

    low = weight.to(torch.bfloat16)
    x = torch.randn(7, weight.shape[1])

    def best(w):
        F.linear(x.to(w.dtype), w)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            F.linear(x.to(w.dtype), w)
            times.append(time.perf_counter() - t)
        return min(times)

    fp32, bf16 = best(weight), best(low)
    chosen = low if bf16 * 1.5 < fp32 else weight
    logger.info("sglang-dflash: CPU draft head in %s (a [7, %d] x [%d, %d] product: float32 %.1f ms, bfloat16 %.1f ms)",
                "bfloat16" if chosen is low else "float32", weight.shape[1], weight.shape[1], weight.shape[0],
                fp32 * 1e3, bf16 * 1e3)
    return chosen


class TargetVocab:
    """The target's token embedding and lm_head as the drafter uses them, on this tensor-parallel rank.

    A module SGLang shards by vocabulary (``VocabParallelEmbedding`` / ``ParallelLMHead``, at --tp-size > 1) holds
    the rows [start, start + rows) of the vocabulary (then padding); an unsharded one (nn.Embedding, Gemma's scaled
    embeddings, any module at --tp-size 1) holds them all. The lookup and the greedy head work on this rank's rows and
    combine across ranks only where the rows are sharded, so the single-GPU path is a plain lookup and argmax."""

    def __init__(self, embed: nn.Module, lm_head: nn.Module, vocab_size: int):
        self.embed_weight, self.lm_head_weight = embed.weight, lm_head.weight
        self.embed_rows, self.embed_sharded = self._rows(embed, vocab_size)
        self.head_rows, self.head_sharded = self._rows(lm_head, vocab_size)
        # the weight the DRAFT head reads: the target's, or on a CPU a bfloat16 copy where that is faster
        self.draft_head_weight = cpu_draft_head(self.lm_head_weight)

    @staticmethod
    def _rows(module: nn.Module, vocab_size: int) -> tuple[tuple[int, int], bool]:
        shard = getattr(module, "shard_indices", None)
        if shard is None or getattr(module, "tp_size", 1) == 1:  # replicated (or one rank): the whole vocabulary
            return (0, vocab_size), False
        return (shard.org_vocab_start_index, shard.org_vocab_end_index - shard.org_vocab_start_index), True

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the target's embedding table (unscaled: the drafter's config scales them)."""
        start, rows = self.embed_rows
        if not self.embed_sharded:
            return F.embedding(ids, self.embed_weight)
        local = ids - start
        mine = (local >= 0) & (local < rows)
        x = F.embedding(torch.where(mine, local, 0), self.embed_weight) * mine[:, None].to(self.embed_weight.dtype)
        from sglang.srt.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(x)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """[R] token ids: the argmax of [R, V] draft logits, from this rank's [R, rows (+ padding)] logits. Sharded:
        each rank's best (score, id) is all-gathered and the best score wins, the lowest rank on a tie (the lowest
        id, as argmax over the whole vocabulary picks), so every rank drafts the same tokens."""
        start, rows = self.head_rows
        score, idx = logits[:, :rows].max(dim=-1)  # padding rows (zero weights) never win
        if not self.head_sharded:
            return idx
        from sglang.srt.distributed import tensor_model_parallel_all_gather

        # one collective: ids below 2^24 are exact in float32 (vocabularies are ~2^18)
        pairs = torch.stack([score.float(), (idx + start).float()], dim=-1)  # [R, 2]
        every = tensor_model_parallel_all_gather(pairs[None], dim=0)  # [ranks, R, 2]
        best = every[..., 0].argmax(dim=0)  # first maximum: the lowest rank
        return every[..., 1].gather(0, best[None])[0].to(torch.int64)


class SGLangDraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_id: int, max_position: int = 0):
        super().__init__()
        _, linear, radix_attention, rotary_embedding = _sglang()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        heads, kv_heads = rank_heads(cfg, _tp_size())  # this rank's share (all of them without TP)
        self.q_size, self.kv_size = heads * d, kv_heads * d
        self.qkv_proj = linear.QKVParallelLinear(h, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                 bias=cfg.attention_bias, prefix=f"layers.{layer_id}.qkv_proj")
        self.o_proj = linear.RowParallelLinear(cfg.num_attention_heads * d, h, bias=cfg.attention_bias,
                                               prefix=f"layers.{layer_id}.o_proj")
        self.q_norm = _norm(d, cfg.rms_norm_eps, cfg.gemma_norm)
        self.k_norm = _norm(d, cfg.rms_norm_eps, cfg.gemma_norm)
        rope_cfg = cfg.rope_config()  # the plain drafter's rope settings, parsed once by transformers
        rope = dict(rope_cfg.rope_parameters)
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        # positions up to the target's context (a drafter may be served past its own max_position_embeddings with
        # SGLang's SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN: startup.check_context_length)
        max_position = max(rope_cfg.max_position_embeddings, max_position)
        self.rotary_emb = rotary_embedding.get_rope(d, rotary_dim=d, max_position=max_position,
                                                    base=rope["rope_theta"], rope_scaling=scaling, is_neox_style=True)
        causal, window = cfg.layer_is_causal(layer_id), cfg.layer_window(layer_id)
        attn_type = radix_attention.AttentionType.DECODER if causal else radix_attention.AttentionType.ENCODER_ONLY
        if window is not None and not causal:
            raise ValueError(f"drafter layer {layer_id}: a non-causal sliding-window layer (is_causal=false with "
                             "sliding_attention) has no SGLang attention mode. Fix: drop is_causal=false")
        self.attn = radix_attention.RadixAttention(
            heads, d, d ** -0.5, kv_heads, layer_id=layer_id,
            sliding_window_size=(window - 1) if window else -1, attn_type=attn_type)

    def _qk_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        return norm(x.reshape(-1, self.head_dim)).view_as(x)

    def forward(self, positions, x, forward_batch):
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, self._qk_norm(q, self.q_norm), self._qk_norm(k, self.k_norm))
        out, _ = self.o_proj(self.attn(q, k, v, forward_batch))
        return out


class SGLangDraftMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_id: int):
        super().__init__()
        _, linear, _, _ = _sglang()
        from sglang.srt.layers.activation import SiluAndMul

        if cfg.hidden_act != "silu":
            raise ValueError(f"drafter hidden_act={cfg.hidden_act!r}: only silu is supported. Fix: use a SwiGLU drafter")
        self.gate_up_proj = linear.MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                              bias=False, prefix=f"layers.{layer_id}.gate_up_proj")
        self.down_proj = linear.RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False,
                                                  prefix=f"layers.{layer_id}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(gate_up))
        return out


class SGLangDraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_id: int, max_position: int = 0):
        super().__init__()
        self.self_attn = SGLangDraftAttention(cfg, layer_id, max_position)
        self.mlp = SGLangDraftMLP(cfg, layer_id)
        self.input_layernorm = _norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norm)
        self.post_attention_layernorm = _norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norm)

    def forward(self, positions, x, forward_batch):
        x = x + self.self_attn(positions, self.input_layernorm(x), forward_batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """SGLang model class for ``architectures: ["DFlashDraftModel"]`` (weights: layers.*, fc, hidden_norm, norm)."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        if quant_config is not None:
            raise ValueError("quantized DFlash drafters are not supported. Fix: serve the drafter unquantized")
        self.dflash = cfg = drafter_config(config)
        self.config = config
        h = cfg.hidden_size
        # SGLang sets context_len on the draft's HF config: the target's context length
        context = int(getattr(config, "context_len", 0) or 0) if not isinstance(config, Mapping) else 0
        self.layers = nn.ModuleList(SGLangDraftLayer(cfg, i, context) for i in range(cfg.num_hidden_layers))
        self.norm = _norm(h, cfg.rms_norm_eps, cfg.gemma_norm)
        self.fc = nn.Linear(cfg.num_context_features * h, h, bias=False)
        self.hidden_norm = _norm(h, cfg.rms_norm_eps, cfg.gemma_norm)
        self.vocab: TargetVocab | None = None  # the target's embedding and lm_head, set by bind_target
        self.target_name = "the target"  # its model class, for errors (bind_target)
        self._context_weights = None  # stacked K/V projections of all layers (write_context_kv)

    # ------------------------------------------------------------------------------------------ wiring
    def bind_target(self, embed: nn.Module, lm_head: nn.Module, target_name: str = "the target") -> None:
        """The target's embedding and lm_head modules (tied targets: the embedding twice)."""
        self.vocab = TargetVocab(embed, lm_head, self.dflash.vocab_size)
        self.target_name = target_name

    def check_features(self, target_features: torch.Tensor) -> None:
        """The captured rows must be one hidden state per target_layer_id. Checked on every write (a shape compare,
        no sync), so the first forward that would feed the drafter wrong features stops the server with the widths
        and the fix, at start-up: SGLang's warm-up request and the verify graphs' capture run it before the server
        reports healthy (else a request died later on a matmul shape error deep in the drafter)."""
        cfg = self.dflash
        want = cfg.num_context_features * cfg.hidden_size
        got = target_features.shape[-1]
        if got != want:
            raise RuntimeError(
                f"sglang-dflash: the hidden-state capture of {self.target_name} handed the drafter {got} features per "
                f"token, but the drafter needs {cfg.num_context_features} layers x hidden {cfg.hidden_size} = {want} "
                f"(target_layer_ids {list(cfg.target_layer_ids)})"
                + (" : one layer's width, i.e. the final hidden state instead of the captured layers"
                   if got == cfg.hidden_size else "")
                + ". Fix: run with SGLANG_DFLASH_CAPTURE=check on a CPU server to compare the capture with the "
                "native one, or with --disable-cuda-graph; report the model class")

    def get_attention_sliding_window_size(self):
        windows = [self.dflash.layer_window(i) for i in range(self.dflash.num_hidden_layers)]
        windows = [w for w in windows if w]
        return (windows[0] - 1) if windows else None

    # ------------------------------------------------------------------------------------------- maths
    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """[N, K*H] captured target hidden states -> [N, H] context rows."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    @torch.no_grad()
    def write_context_kv(self, target_features: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor,
                         kv_pool) -> None:
        """Write every layer's context K/V of these tokens into the draft KV pool at cache_loc.

        Context rows skip input_layernorm: K = rope(k_norm(W_k ctx)), V = W_v ctx. All layers at once (one K and one
        V matmul over stacked weights, one norm, one rope), because this runs eagerly in every decode step and its
        launch count is host time."""
        self.check_features(target_features)
        ctx = self.project_context(target_features)
        n, layers = ctx.shape[0], len(self.layers)
        attn0 = self.layers[0].self_attn
        kvh, d = attn0.attn.tp_k_head_num, attn0.head_dim
        w_k, w_v, b_k, b_v, k_norm_w = self._stacked_context_weights()
        k = F.linear(ctx, w_k, b_k).view(n, layers, kvh, d)
        v = F.linear(ctx, w_v, b_v).view(n, layers, kvh, d)
        k = (F.rms_norm(k.float(), (d,), eps=self.dflash.rms_norm_eps) * k_norm_w[:, None, :]).to(v.dtype)
        k = k.view(n, layers * kvh * d)
        _, k = attn0.rotary_emb(positions, torch.empty_like(k), k)  # the rope op needs a Q; same rope in every layer
        k = k.view(n, layers, kvh, d).transpose(0, 1).contiguous()  # [layers, n, kvh, d]: one slab per layer
        v = v.transpose(0, 1).contiguous()
        for i, layer in enumerate(self.layers):
            kv_pool.set_kv_buffer(layer.self_attn.attn, cache_loc, k[i], v[i])

    def prepare_context_kv(self) -> None:
        """Build the stacked context weights now (after loading), so no graph capture ever allocates them."""
        self._context_weights = None
        self._stacked_context_weights()

    def _stacked_context_weights(self):
        """K and V rows of every layer's fused qkv_proj, stacked (built once, after the weights are loaded)."""
        if self._context_weights is None:
            attns = [layer.self_attn for layer in self.layers]
            q, kv = attns[0].q_size, attns[0].kv_size
            w_k = torch.cat([a.qkv_proj.weight[q:q + kv] for a in attns])
            w_v = torch.cat([a.qkv_proj.weight[q + kv:] for a in attns])
            bias = [a.qkv_proj.bias for a in attns]
            b_k = torch.cat([b[q:q + kv] for b in bias]) if bias[0] is not None else None
            b_v = torch.cat([b[q + kv:] for b in bias]) if bias[0] is not None else None
            k_norm_w = torch.stack([a.k_norm.weight.float() for a in attns])  # [layers, head_dim]
            if self.dflash.gemma_norm:
                k_norm_w = k_norm_w + 1.0
            self._context_weights = (w_k, w_v, b_k, b_v, k_norm_w)
        return self._context_weights

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, *_, **__):
        # No ``input_embeds`` parameter, on purpose: SGLang's decode graph runner captures a DFLASH draft model that
        # takes one with a static embeds buffer that it refills only when the batch brings embeds, so a graph
        # captured that way would replay stale embeddings. Embedding the ids here keeps the lookup inside the graph.
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        x = self.vocab.embed(input_ids)
        if self.dflash.input_embedding_scale != 1.0:
            x = x * self.dflash.input_embedding_scale
        x = x.to(self.fc.weight.dtype)
        for layer in self.layers:
            x = layer(positions, x, forward_batch)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=self.norm(x))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits through the bound target lm_head (``drafter.draft_logits``, shared with the plain drafter),
        in the head's dtype; float32 where a CPU reads its bfloat16 copy (``cpu_draft_head``). This rank's
        vocabulary rows under tensor parallelism."""
        w, target_dtype = self.vocab.draft_head_weight, self.vocab.lm_head_weight.dtype
        return draft_logits(hidden, w, self.dflash, target_dtype if w.dtype != target_dtype else None)

    def greedy_drafts(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[bs * k, H] final draft hidden rows of block positions 1..k -> [bs * k] greedy draft tokens, the same on
        every tensor-parallel rank. anchor_ids [bs] (the blocks' bonus tokens) matter to DFlash2's selector only."""
        return self.vocab.greedy(self.draft_logits(hidden))

    # ----------------------------------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        fused = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        params = dict(self.named_parameters())
        loaded = set()
        from ..checkpoint import check_finite  # THE finite check of the plain loader (NaN / inf refused, named)

        source = getattr(self.config, "name_or_path", None) or "the drafter checkpoint"
        for name, tensor in weights:
            check_finite(name, tensor, source)
            if name.startswith("model."):
                name = name[len("model."):]
            name = {"encoder.fc.weight": "fc.weight",
                    "encoder.output_norm_enc.weight": "hidden_norm.weight"}.get(name, name)
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in fused:
                parts[-2], shard = fused[parts[-2]]
                name = ".".join(parts)
            if name not in params:
                raise ValueError(f"drafter weight {name!r} has no place in DFlashDraftModel "
                                 f"({self.dflash.num_hidden_layers} layers). Fix: check the checkpoint's config.json")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if shard is not None:
                loader(param, tensor, shard)
            elif loader is not None:
                loader(param, tensor)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"drafter weight {name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}. "
                                     "Fix: the checkpoint does not match its config.json")
                param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"drafter checkpoint lacks {missing[:6]}. Fix: check the checkpoint files")
        return loaded


EntryClass = [DFlashDraftModel]
