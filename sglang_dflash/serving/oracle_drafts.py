"""Oracle drafts: benchmarks at a stated acceptance on random-weight targets (issue #45 item 2).

On random weights the drafter is always wrong, so a speculative run measures the step's cost but never a speedup.
With ``SGLANG_DFLASH_ORACLE_DRAFTS=<recording>`` our worker keeps every cost of a real step (the drafter's real
forward, the verify at the step's width, the accept) and only changes the drafts' values: after the draft, one launch
(kernels/oracle_drafts.py) overwrites them with the target's own greedy continuation of that prompt, recorded from a
plain run, cut at the misses of a stated profile (``SGLANG_DFLASH_ORACLE_PROFILE``, geometric: each output position
is an easy token with probability p, drawn from a hash of (seed, prompt, position)). The verify still decides what
is committed, so the outputs stay plain decoding's; the realised tau is the profile's while the target follows the
recording.

- Refused at start-up (``check_allowed``) unless the target is served with ``--load-format dummy`` and
  ``SGLANG_DFLASH_DUMMY_WEIGHTS=chain`` or ``model`` (SGLang's own dummy weights loop on one token, which would make
  the recording, and so the oracle, trivial). Use ``chain`` (targets/chain_head.py): the ``model`` weights' logits
  tie in bf16 every ~20 tokens, so on a GPU the target left its own recording after ~20 tokens and the first run
  realised tau 1.07 (benchmarks/results/oracle-first-try-h200). The plugin refuses a DFLASH start of SGLang's builtin
  worker with it: its drafts come from its draft graph's sampler buffer inside ``DFlashWorkerV2``'s one step
  method, which also builds the verify inputs, and the plugin does not hook there (a possible point:
  ``DFlashVerifyInput.prepare_for_verify``, which sees the drafts and the batch, plus the builtin's prefill for the
  slot rows), so the builtin's row of an oracle run is its step cost from a plain random-weight run, labelled as a
  projection.
- Recording: ``python -m sglang_dflash.serving.oracle_drafts record PLAIN.outputs.jsonl.gz OUT.json`` (the outputs
  benchmarks/bench.py writes for greedy levels); a JSON file, one row per prompt, keyed by a hash of its token ids;
  where plain decoding disagreed with itself across rows of one prompt only the common prefix is kept.
- In the worker: the whole recording is one device table [prompts, tokens], loaded at start-up. At each prefill the
  host looks each new request's prompt up once and points its request-pool slot at its row (one small pinned,
  non-blocking copy per prefill batch, no sync); at each chain step with point-mass drafts ``replace`` runs right
  after the draft (after the draft CUDA graph's replay, outside it, like the accept), on the verify ids. Requests
  without a recording, positions past its end, tree steps and DFlash2 drafts drawn from q keep the drafter's drafts.
- Reported in the server log (``sglang-dflash oracle drafts:`` lines, every SGLANG_DFLASH_LOG_EVERY_S): the realised
  accepted drafts per step by width (SGLang's host-side per-request counts: no device read), requests without a
  recording, and the prompts whose committed tokens left the recording (checked at each bonus token by the same
  launch; those counters are read at log time only).

Zero cost when off: the worker holds ``None`` and tests it at three places.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from ..settings import (DUMMY_WEIGHTS, ORACLE_DRAFTS, ORACLE_PROFILE, REDRAWN_DUMMY_INITS, OracleProfile,
                        current as settings)
from .errors import DFlashStartupError

logger = logging.getLogger("sglang_dflash")

FORMAT = "sglang-dflash-oracle-recording/1"


class OracleDraftsError(DFlashStartupError):
    """Oracle drafts asked for where they cannot run, or a bad recording; the message names the fix."""


def prompt_key(ids) -> str:
    """The recording's key of a prompt: 16 hex digits of blake2b over its token ids."""
    return hashlib.blake2b(",".join(str(int(i)) for i in ids).encode(), digest_size=8).hexdigest()


def key_seed(key: str) -> int:
    """The prompt's input to the position hash (31 bits of its key)."""
    return int(key[:8], 16) & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------------- recording
def record(outputs_path: str | Path, out_path: str | Path) -> dict:
    """A recording from a plain run's greedy outputs (bench.py's ``<method>.outputs.jsonl.gz``: rows of
    {dataset, uid, prompt, ids}). Rows of one prompt (concurrency levels, repeats) keep their common prefix: where
    plain decoding disagreed with itself the oracle has no single truth. Returns counts."""
    opener = gzip.open if str(outputs_path).endswith(".gz") else open
    rows: dict[str, dict] = {}
    with opener(outputs_path, "rt") as f:
        for line in f:
            r = json.loads(line)
            if not r.get("prompt"):
                raise OracleDraftsError(f"{outputs_path}: a row without its prompt ids (uid {r.get('uid')}). Fix: "
                                        "record from an outputs file of benchmarks/bench.py, which saves them")
            key = prompt_key(r["prompt"])
            ids = [int(i) for i in r["ids"]]
            seen = rows.get(key)
            if seen is None:
                rows[key] = {"key": key, "dataset": r.get("dataset"), "uid": r.get("uid"),
                             "prompt_len": len(r["prompt"]), "ids": ids, "rows": 1, "cut": False}
                continue
            seen["rows"] += 1
            m = min(len(ids), len(seen["ids"]))
            n = 0
            while n < m and ids[n] == seen["ids"][n]:
                n += 1
            if n < m:  # plain decoding disagreed with itself: only the common prefix is a truth
                seen["ids"], seen["cut"] = seen["ids"][:n], True
            elif len(ids) > len(seen["ids"]) and not seen["cut"]:  # a longer run of the same continuation
                seen["ids"] = ids
    prompts = [{k: v for k, v in r.items() if k not in ("rows", "cut")} for r in rows.values()]
    counts = {"prompts": len(prompts), "rows": sum(r["rows"] for r in rows.values()),
              "cut_where_plain_disagreed": sum(r["cut"] for r in rows.values()),
              "tokens": sum(len(r["ids"]) for r in prompts)}
    Path(out_path).write_text(json.dumps({"format": FORMAT, "source": str(outputs_path), "counts": counts,
                                          "prompts": prompts}) + "\n")
    return counts


def load_recording(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise OracleDraftsError(f"{ORACLE_DRAFTS}={path}: no such file. Fix: record one from a plain run's outputs "
                                "(python -m sglang_dflash.serving.oracle_drafts record OUT/none.outputs.jsonl.gz "
                                f"{path})")
    data = json.loads((gzip.open if path.suffix == ".gz" else open)(path, "rt").read())
    if data.get("format") != FORMAT:
        raise OracleDraftsError(f"{ORACLE_DRAFTS}={path}: not a recording ({FORMAT!r} expected, got "
                                f"{data.get('format')!r}). Fix: python -m sglang_dflash.serving.oracle_drafts record")
    return data["prompts"]


# ------------------------------------------------------------------------------------------------- start-up
def check_allowed(server_args, dummy_weights: str) -> None:
    """Oracle drafts only where real drafts cannot be measured anyway: a dummy-weight target whose outputs depend on
    its input (`model`, or `chain`, whose outputs no rounding flips). Anything else is refused, naming the fix."""
    load_format = str(getattr(server_args, "load_format", "") or "")
    if load_format != "dummy" or dummy_weights not in REDRAWN_DUMMY_INITS:
        raise OracleDraftsError(
            f"{ORACLE_DRAFTS} is set (oracle drafts, a benchmark-only mode that replaces the drafter's drafts by a "
            f"recorded continuation) but the target is served with --load-format {load_format or 'auto'} and "
            f"{DUMMY_WEIGHTS}={dummy_weights}: it runs only on random-weight benchmark targets (--load-format dummy "
            f"and {DUMMY_WEIGHTS}=chain or model). Fix: unset {ORACLE_DRAFTS} (and {ORACLE_PROFILE}), or serve the "
            f"target with --load-format dummy and {DUMMY_WEIGHTS}=chain (benchmarks.driver --dummy --dummy-weights "
            "chain)")


def check_at_launch(server_args, block: int) -> None:
    """The launcher's check (startup.handle_dflash_args), before any model loads: allowed here, a readable
    recording, a profile that fits the block size."""
    s = settings()
    if not s.oracle_drafts:
        return
    check_allowed(server_args, s.dummy_weights)
    load_recording(s.oracle_drafts)
    s.oracle_profile.keep_probability(block)


class OracleDrafts:
    """The worker's oracle: the recording as a device table, each request slot's row, the replacement launch and
    the counts it reports."""

    def __init__(self, path: str, profile: OracleProfile, block: int, vocab: int, pool_rows: int, device):
        from ..kernels.oracle_drafts import NO_DIVERGENCE, oracle_drafts_torch

        prompts = load_recording(path)
        self.path, self.profile, self.block, self.vocab, self.device = path, profile, block, vocab, device
        self.p = profile.keep_probability(block)
        self.keep = min(int(round(self.p * 2 ** 32)), 2 ** 32)  # a position is kept where its hash is below this
        self._row = {r["key"]: (i, int(r["prompt_len"])) for i, r in enumerate(prompts)}
        self._names = [f"{r.get('dataset')}/{r.get('uid')} (key {r['key']})" for r in prompts]
        width = max([len(r["ids"]) for r in prompts] + [1])
        table = torch.zeros((max(len(prompts), 1), width), dtype=torch.int32)
        for i, r in enumerate(prompts):
            table[i, :len(r["ids"])] = torch.tensor(r["ids"], dtype=torch.int32)
        self.table = table.to(device)
        self.table_len = torch.tensor([len(r["ids"]) for r in prompts] or [0], dtype=torch.int64, device=device)
        self.div_first = torch.full_like(self.table_len, NO_DIVERGENCE)
        self.div_count = torch.zeros_like(self.table_len)
        self._no_div = NO_DIVERGENCE
        self.slot_row = torch.full((pool_rows,), -1, dtype=torch.int64, device=device)
        self.slot_plen = torch.zeros((pool_rows,), dtype=torch.int64, device=device)
        self.slot_key = torch.zeros((pool_rows,), dtype=torch.int64, device=device)
        self._launch = oracle_drafts_torch
        if torch.device(device).type != "cpu":
            from ..kernels.oracle_drafts import oracle_drafts

            self._launch = oracle_drafts
        self._slot_rid: dict[int, str] = {}
        self.requests = {"with a recording": 0, "without": 0}
        self._steps: collections.deque = collections.deque()  # (bs, k) of decode steps awaiting their acceptance
        self._accepted: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])  # k: [request-steps, drafts]
        self._last_log = time.monotonic()
        logger.info("sglang-dflash: ORACLE DRAFTS ON (%s, benchmarks only): drafts replaced by the recorded "
                    "greedy continuation of %d prompts (%s, up to %d tokens) where it exists; profile %s=%s: %s",
                    ORACLE_DRAFTS, len(prompts), path, width, ORACLE_PROFILE, _profile_text(profile),
                    profile.describe(block))

    def warm(self, widths) -> None:
        """Compile the replacement launch for every drafted width now (its block size is a compile-time constant):
        otherwise each width's first step compiles it on the clock of a benchmark's first level."""
        slot = torch.zeros(1, dtype=torch.int64, device=self.device)  # a slot without a recording: nothing written
        for k in sorted({int(k) for k in widths if int(k) > 0}):
            ids = torch.zeros((1, k + 1), dtype=torch.int64, device=self.device)
            saved = self.slot_row[:1].clone()
            self.slot_row[:1] = -1
            self.replace(ids, slot, slot)
            self.slot_row[:1] = saved

    def on_prefill(self, batch) -> None:
        """Point each request's slot at its recording (once per request and slot: a chunked prefill's later chunks
        and a retracted request's re-prefill find it done). Host look-up; one pinned non-blocking copy."""
        slots, rows, plens, keys = [], [], [], []
        for req in batch.reqs:
            slot, rid = int(req.req_pool_idx), str(req.rid)
            if self._slot_rid.get(slot) == rid:
                continue
            self._slot_rid[slot] = rid
            key = prompt_key(req.origin_input_ids)
            row, plen = self._row.get(key, (-1, -1))
            if plen != len(req.origin_input_ids):
                row = -1
            self.requests["with a recording" if row >= 0 else "without"] += 1
            slots.append(slot), rows.append(row), plens.append(len(req.origin_input_ids)), keys.append(key_seed(key))
        if not slots:
            return
        on_gpu = torch.device(self.device).type == "cuda"
        host = torch.tensor([slots, rows, plens, keys], dtype=torch.int64, pin_memory=on_gpu)
        slot, row, plen, key = host.to(self.device, non_blocking=True)
        self.slot_row[slot], self.slot_plen[slot], self.slot_key[slot] = row, plen, key

    def note_step(self, bs: int, k: int) -> None:
        """A decode step of width k was launched (every step, k = 0 too: SGLang reports each one's acceptance)."""
        self._steps.append((bs, k))

    def replace(self, verify_ids: torch.Tensor, prefix: torch.Tensor, pool_rows: torch.Tensor) -> None:
        """verify_ids [bs, k + 1] = [bonus, drafts]: the recorded drafts, cut by the profile (in place, one launch)."""
        self._launch(verify_ids, prefix, pool_rows, self.slot_row, self.slot_plen, self.slot_key, self.table,
                     self.table_len, self.div_first, self.div_count, self.profile.seed, self.keep, self.vocab)

    def on_verify(self, accepted: list[int], batch_size: int) -> None:
        """SGLang's host-side accepted-draft counts of the oldest unreported step (as width_control pairs them)."""
        while self._steps:
            bs, k = self._steps.popleft()
            if bs == batch_size:
                break
        else:
            return
        if k > 0:
            entry = self._accepted[k]
            entry[0] += len(accepted)
            entry[1] += sum(accepted)
        now = time.monotonic()
        if now - self._last_log >= settings().log_every_s:
            self._last_log = now
            self.log()

    def summary(self) -> dict:
        """The counts so far; reads the divergence counters (a device read: log time only)."""
        first, count = self.div_first.tolist(), self.div_count.tolist()
        diverged = {self._names[i]: {"first_position": first[i], "bonus_tokens": count[i]}
                    for i in range(len(self._names)) if count[i]}
        by_k = {k: {"request_steps": n, "mean_commit": round(1 + a / n, 3)} for k, (n, a) in
                sorted(self._accepted.items()) if n}
        return {"profile_tau": round(_tau(self.p, self.block), 3), "by_k": by_k, "requests": dict(self.requests),
                "diverged": diverged}

    def log(self) -> None:
        s = self.summary()
        logger.info("sglang-dflash oracle drafts: realised mean commit per step by width %s (profile: %.3f at the "
                    "full block); requests %s; prompts whose committed tokens left the recording: %d %s",
                    json.dumps(s["by_k"]), s["profile_tau"], s["requests"], len(s["diverged"]),
                    json.dumps(s["diverged"]) if s["diverged"] else "")


def _tau(p: float, block: int) -> float:
    from ..settings import oracle_tau

    return oracle_tau(p, block)


def _profile_text(profile: OracleProfile) -> str:
    head = f"geometric:{profile.p:g}" if profile.p is not None else f"tau:{profile.tau:g}"
    return f"{head},seed:{profile.seed}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m sglang_dflash.serving.oracle_drafts",
                                description="oracle-draft recordings (benchmarks only, issue #45)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="a recording from a plain run's <method>.outputs.jsonl.gz (bench.py)")
    r.add_argument("outputs")
    r.add_argument("out")
    args = p.parse_args(argv)
    counts = record(args.outputs, args.out)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
