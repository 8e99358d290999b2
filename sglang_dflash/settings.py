"""THE switches: every `SGLANG_DFLASH_*` environment variable the package reads, parsed and checked in one place.

`Settings.from_env(env)` parses a mapping (tests hand it a dict) into one frozen `Settings`; a bad value raises
`SettingsError` naming the variable, the value and the fix. `current()` is the process's settings from `os.environ`
now, and `get(NAME)` one switch of it: the modules call them where they use a switch (not at import), so a test that
sets a variable with monkeypatch after import is obeyed. Each value is parsed once (cached by its text): `get` is
one dict look-up, cheap enough for the eager verify hooks that ask per layer.

`SWITCHES` is the table of them (name, parser, default, values, what it does); docs/SETTINGS.md is generated from it
(`python -m sglang_dflash.settings`) and tests/test_settings.py checks the file and that the code reads no
`SGLANG_DFLASH_*` variable missing here. This module imports nothing heavy: the plugin imports it in every SGLang
process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKER = "SGLANG_DFLASH_WORKER"
ALLOW_UNTESTED_SGLANG = "SGLANG_DFLASH_ALLOW_UNTESTED_SGLANG"
CAPTURE = "SGLANG_DFLASH_CAPTURE"
VERIFY_ATTENTION = "SGLANG_DFLASH_VERIFY_ATTENTION"
VERIFY_METADATA = "SGLANG_DFLASH_VERIFY_METADATA"
GRAPH_HEAD = "SGLANG_DFLASH_GRAPH_HEAD"
K = "SGLANG_DFLASH_K"
ADAPTIVE = "SGLANG_DFLASH_ADAPTIVE"
WIDTHS = "SGLANG_DFLASH_WIDTHS"
K_SCHEDULE = "SGLANG_DFLASH_K_SCHEDULE"
SHORT_DRAFT = "SGLANG_DFLASH_SHORT_DRAFT"
LOG_EVERY_S = "SGLANG_DFLASH_LOG_EVERY_S"
STEP_TRACE = "SGLANG_DFLASH_STEP_TRACE"
STEP_COSTS = "SGLANG_DFLASH_STEP_COSTS"
CACHE = "SGLANG_DFLASH_CACHE"
TREE = "SGLANG_DFLASH_TREE"
DUMMY_WEIGHTS = "SGLANG_DFLASH_DUMMY_WEIGHTS"
REPLAY_SSM = "SGLANG_DFLASH_REPLAY_SSM"
K0_STATE_IN_PLACE = "SGLANG_DFLASH_K0_STATE_IN_PLACE"
PD = "SGLANG_DFLASH_PD"
ORACLE_DRAFTS = "SGLANG_DFLASH_ORACLE_DRAFTS"
ORACLE_PROFILE = "SGLANG_DFLASH_ORACLE_PROFILE"

WORKERS = ("ours", "builtin")
CAPTURE_MODES = ("auto", "generic", "check")
KERNELS = ("ours", "sglang")
DUMMY_INITS = ("sglang", "model", "chain")
REDRAWN_DUMMY_INITS = ("model", "chain")  # the ones the plugin re-draws (targets/random_weights.py)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A switch with a value it cannot take; the message names the variable, the value and the fix."""


def _text(name: str, raw: str | None) -> str | None:
    value = (raw or "").strip()
    return value or None


def _choice(*choices: str):
    def parse(name: str, raw: str | None) -> str:
        value = (_text(name, raw) or choices[0]).lower()
        if value not in choices:
            raise SettingsError(f"{name}={value!r}: not one of {choices}. Fix: set it to one of them "
                                f"(or unset it for {choices[0]})")
        return value
    return parse


def _flag(default: bool):
    def parse(name: str, raw: str | None) -> bool:
        value = (_text(name, raw) or "").lower()
        if not value:
            return default
        if value not in _TRUE + _FALSE:
            raise SettingsError(f"{name}={value!r}: expected 1 or 0 (on / off). Fix: set it to 1 or 0, or unset it "
                                f"(default {int(default)})")
        return value in _TRUE
    return parse


def _ints(one: bool):
    def parse(name: str, raw: str | None) -> int | tuple[int, ...] | None:
        text = _text(name, raw)
        if text is None:
            return None
        try:
            values = tuple(int(p) for p in text.split(","))
        except ValueError:
            raise SettingsError(f"{name}={text!r}: not {'an integer' if one else 'a comma-separated list of integers'}"
                                f". Fix: {'a number' if one else 'numbers'} of drafts in 0..B-1 (B = the drafter's "
                                "block size), or unset it") from None
        if one and len(values) != 1:
            raise SettingsError(f"{name}={text!r}: one number of drafts expected. Fix: e.g. {name}={values[0]}")
        return values[0] if one else values
    return parse


def _tree_size(name: str, raw: str | None) -> int:
    """0 (off) or a node count N >= 2; N <= the drafter's block size is checked where B is known (tree_size)."""
    text = _text(name, raw)
    if text is None:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value == 1 or value < 0:
        raise SettingsError(f"{name}={text!r}: expected 0 (off) or a tree of N nodes, 2 <= N <= B (the drafter's "
                            f"block size). Fix: e.g. {name}=16 for B = 16, or {name}=0 / unset for the chain")
    return value


def tree_size(block: int, env: Mapping[str, str] | None = None) -> int:
    """SGLANG_DFLASH_TREE checked against the drafter's block size B: 0 (chain) or N with 2 <= N <= B (a tree of N
    nodes fits the B KV slots the scheduler reserves per step, and every depth 1..B-1 has a drafted position)."""
    size = _tree_size(TREE, (os.environ if env is None else env).get(TREE))
    if size > block:
        raise SettingsError(f"{TREE}={size}: a draft tree of {size} nodes exceeds the drafter's block size {block} "
                            f"(its nodes take the block's KV slots). Fix: {TREE}={block} or smaller (2..{block}), "
                            "or 0 for the chain")
    return size


@dataclass(frozen=True)
class OracleProfile:
    """SGLANG_DFLASH_ORACLE_PROFILE: each drafted position is kept (its draft = the recorded token) with probability
    p, independently per (seed, prompt, output position); a step's accepted drafts then stop at its first miss, so
    P(accept >= j) = p^j (geometric). Given as p (``geometric:P``) or as the mean commit per full-block step
    (``tau:T``, p solved for the drafter's block size at start-up)."""

    p: float | None
    tau: float | None
    seed: int

    def keep_probability(self, block: int) -> float:
        """p; for ``tau:T``, the p whose full-block tau 1 + p + ... + p^(B-1) is T (bisection: monotone in p)."""
        if self.p is not None:
            return self.p
        if not 1.0 <= self.tau <= block:
            raise SettingsError(f"{ORACLE_PROFILE}: tau:{self.tau:g} is outside 1..{block} (the block size {block} "
                                f"commits at most {block} tokens per step). Fix: a tau in 1..{block}")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if oracle_tau(mid, block) < self.tau else (lo, mid)
        return (lo + hi) / 2

    def describe(self, block: int) -> str:
        p = self.keep_probability(block)
        return (f"geometric p={p:.4f}, seed {self.seed}: full-block tau {oracle_tau(p, block):.3f} "
                f"(mean accepted drafts {oracle_tau(p, block) - 1:.3f} of {block - 1})")


def oracle_tau(p: float, block: int) -> float:
    """Mean commit per full-block step under the geometric profile: 1 + sum_{j=1}^{B-1} p^j."""
    return 1.0 + sum(p ** j for j in range(1, block))


def _oracle_profile(name: str, raw: str | None) -> OracleProfile:
    text = _text(name, raw) or "geometric:0.85,seed:0"
    fix = f"Fix: e.g. {name}=geometric:0.85,seed:0 (p in 0..1) or {name}=tau:6.5,seed:0 (mean commit per full block)"
    fields = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition(":")
        if not sep or key not in ("geometric", "tau", "seed") or key in fields:
            raise SettingsError(f"{name}={text!r}: {part.strip()!r} is not geometric:P, tau:T or seed:S (each "
                                f"once). {fix}")
        fields[key] = value
    if ("geometric" in fields) == ("tau" in fields):
        raise SettingsError(f"{name}={text!r}: give exactly one of geometric:P and tau:T. {fix}")
    try:
        p = float(fields["geometric"]) if "geometric" in fields else None
        tau = float(fields["tau"]) if "tau" in fields else None
        seed = int(fields.get("seed", "0"))
    except ValueError:
        raise SettingsError(f"{name}={text!r}: not a number. {fix}") from None
    if p is not None and not 0.0 <= p <= 1.0:
        raise SettingsError(f"{name}={text!r}: p={p:g} is not a probability. {fix}")
    if tau is not None and not tau >= 1.0:
        raise SettingsError(f"{name}={text!r}: tau={tau:g} < 1 (every step commits at least one token). {fix}")
    if not 0 <= seed < 2 ** 32:
        raise SettingsError(f"{name}={text!r}: seed {seed} is not in 0..2^32-1. {fix}")
    return OracleProfile(p=p, tau=tau, seed=seed)


def _seconds(default: float):
    def parse(name: str, raw: str | None) -> float:
        text = _text(name, raw)
        if text is None:
            return default
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0:
            raise SettingsError(f"{name}={text!r}: expected a number of seconds > 0. Fix: e.g. {name}={default:g}, "
                                "or unset it")
        return value
    return parse


def _directory(default: Path):
    def parse(name: str, raw: str | None) -> Path:
        return Path(_text(name, raw) or default)
    return parse


@dataclass(frozen=True)
class Switch:
    """One row of the table: the variable, the Settings field it fills, its parser, its default and values as
    documented."""

    name: str
    field: str
    parse: Callable[[str, str | None], Any]
    default: str
    values: str
    what: str


SWITCHES: tuple[Switch, ...] = (
    Switch(WORKER, "worker", _choice(*WORKERS), "ours", "ours, builtin",
           "which DFLASH worker SGLang runs: ours, or SGLang's own (same install, for comparisons)"),
    Switch(ALLOW_UNTESTED_SGLANG, "allow_untested_sglang", _flag(False), "0", "0, 1",
           "1 lets the plugin run on an SGLang release it was not tested with (refused at start-up otherwise)"),
    Switch(CAPTURE, "capture", _choice(*CAPTURE_MODES), "auto", "auto, generic, check",
           "how the target's hidden states are captured: SGLang's native hook where the model class has one, our "
           "generic hooks, or both compared every forward (tests)"),
    Switch(VERIFY_ATTENTION, "verify_attention", _choice(*KERNELS), "ours", "ours, sglang",
           "the GPU attention kernel of the target's verify: ours (kernels/verify_attention.py) or SGLang's"),
    Switch(VERIFY_METADATA, "verify_metadata", _choice(*KERNELS), "ours", "ours, sglang",
           "the verify's graph-replay attention metadata: one launch of ours, or SGLang's eight (and a host sync on "
           "sliding-window targets)"),
    Switch(GRAPH_HEAD, "graph_head", _flag(True), "1", "0, 1",
           "0 keeps the greedy draft head (lm_head + argmax) out of the draft CUDA graphs"),
    Switch(K, "k", _ints(one=True), "unset", "0 .. B-1",
           "pin every step to k drafts (0 = plain decode steps that keep the drafter's context); B = block size"),
    Switch(ADAPTIVE, "adaptive", _flag(True), "1", "0, 1",
           "0: always the full block (no adaptive width)"),
    Switch(WIDTHS, "widths", _text, "0,3,7,B-1", "increasing k list ending at B-1",
           "the widths k the adaptive policy may choose (each gets CUDA graphs); checked against B at start-up"),
    Switch(K_SCHEDULE, "k_schedule", _ints(one=False), "unset", "k list, e.g. 15,0,3",
           "tests: cycle through these k values step after step"),
    Switch(SHORT_DRAFT, "short_draft", _flag(False), "0", "0, 1",
           "1: a step that verifies k < B - 1 drafts runs the drafter on [bonus, MASK x k] (k + 1 positions, with "
           "draft CUDA graphs of its own at every width) instead of the whole block, so a narrow step pays for the "
           "draft positions it verifies (issue #45: at c = 128 the draft pass is ~36% of a k = 3 step's GEMM work on "
           "the Qwen3-8B shape). The drafts differ from the whole block's first k (bidirectional attention over "
           "fewer positions): on CPU with the SmolLM2 pair, 0.07 fewer accepted drafts per step at k = 3 and 0.08 at "
           "k = 7 (benchmarks/results/width-acceptance-smollm2-cpu). Output unchanged (the verify decides). "
           "Experimental: not yet measured on a GPU"),
    Switch(LOG_EVERY_S, "log_every_s", _seconds(30.0), "30", "seconds > 0",
           "period of the adaptive policy's summary line in the server log"),
    Switch(STEP_TRACE, "step_trace", _text, "unset", "file path",
           "one JSON line per decode step, for benchmarks/step_trace.py ({pid} becomes the scheduler's process id)"),
    Switch(STEP_COSTS, "step_costs", _text, "unset", "JSON file",
           "benchmarks: a fixed step-time table {k: {batch size: seconds}} for the adaptive policy (no exploration, "
           "no timing), so its choices follow the acceptance alone and repeat from run to run"),
    Switch(CACHE, "cache", _directory(Path.home() / ".cache" / "sglang_dflash"), "~/.cache/sglang_dflash",
           "directory", "where converted targets (SmolLM2, Gemma-3), their GGUF parts and the stub libcuda are kept"),
    Switch(TREE, "tree", _tree_size, "0", "0, or N with 2 <= N <= B",
           "tree verify (issue #38, serving/tree_step.py): N > 0 lets a step verify a best-first draft tree of N "
           "nodes from the same drafter pass instead of the chain, in batches (greedy or sampled) without penalties, "
           "grammar, logit_bias or logprobs (others keep the chain); the adaptive policy chooses the tree where its "
           "measured tokens per second beat the chain's (docs/CONTROLS.md), adaptivity off or a pinned k > 0 "
           "takes it at every drafted step; DFlash drafters, --tp-size 1, --page-size 1, no "
           "hybrid targets, GPU: --attention-backend triton; under CUDA graphs the tree is built in the draft graph and "
           "verified by tree verify graphs of width N (serving/tree_graphs.py; eager past the captured sizes)"),
    Switch(DUMMY_WEIGHTS, "dummy_weights", _choice(*DUMMY_INITS), "sglang", "sglang, model, chain",
           "benchmarks: what `--load-format dummy` (and the drafter's) leaves in the weights: SGLang's uniform +-1e-3 "
           "(greedy outputs loop on one or two tokens), or `model`: seeded weights scaled like a trained model's, "
           "whose greedy outputs depend on the context and whose MoE routing spreads (targets/random_weights.py; "
           "their Gaussian logits tie in bf16 every ~20 tokens), or `chain`: the `model` weights plus a decisive head "
           "(targets/chain_head.py): each greedy step emits a fixed random map of the current token, which no rounding "
           "flips (what oracle drafts and exact equality checks need); "
           "applies to plain servers too, whichever worker runs, so every method of a run serves the same target"),
    Switch(REPLAY_SSM, "replay_ssm", _flag(True), "1", "0, 1",
           "hybrid Gated DeltaNet targets (Qwen3.5) get SGLang's --enable-linear-replayssm-spec at start-up where it "
           "applies: the verify records each token's inputs and the commit replays the accepted ones, instead of a "
           "recurrent-state snapshot per draft position and request, so as many requests run at once as with plain "
           "decoding (serving/recurrent_state.py; H200, Qwen3.5-35B-A3B shape: 64 running requests where snapshots "
           "allowed 16-18, greedy 212 / 212 equal to plain decoding at c = 1-64, benchmarks/results/"
           "floor-qwen3.5-replay-chain-h200). 0 keeps the snapshots. Passing the flag itself turns it on as well"),
    Switch(K0_STATE_IN_PLACE, "k0_state_in_place", _flag(True), "1", "0, 1",
           "with the replay commit (hybrid Gated DeltaNet targets): a k = 0 step's verify (one token per request) runs "
           "SGLang's own GDN decode kernels (conv window and recurrent state updated in place) and its commit has no "
           "fold or conv scatter to run, so the step's linear-attention layers do what plain decoding's do. H200, "
           "Qwen3.5-35B-A3B shape, one bracketed run: 0.97 / 1.05 / 0.98 / 0.99x plain decoding at c = 1 / 8 / 32 / 64 "
           "against 0.90 / 0.87 / 0.92 / 0.90 with the fold, greedy 212 / 212 equal (benchmarks/results/"
           "floor-qwen3.5-inplace-v2-h200); exact against plain decoding of the token in the simulation with SGLang's "
           "kernels. 0 folds at k = 0 too; where this SGLang's GDN backend lacks the replay verify the default folds "
           "and an explicit 1 is refused at start-up (serving/recurrent_state.py)"),
    Switch(PD, "pd", _flag(False), "0", "0, 1",
           "1: serve --disaggregation-mode prefill / decode (issue #49, serving/disagg.py, docs/notes-pd.md): the "
           "prefill server writes the drafter's context K/V, SGLang's transfer moves the drafter's pool beside the "
           "target's, the decode server starts each relayed request from its first token. Experimental until its GPU "
           "equality run: without it both modes are refused at start-up. Both servers must run the same target, "
           "drafter and --tp-size (the transfer pairs their pools by position)"),
    Switch(ORACLE_DRAFTS, "oracle_drafts", _text, "unset", "recording file (JSON)",
           "benchmarks only, issue #45: oracle drafts. The drafter runs its real forward, then our worker replaces the "
           "drafts of each recorded request by the plain run's greedy continuation, cut by "
           f"{ORACLE_PROFILE} (serving/oracle_drafts.py; the verify still decides what is committed). Refused unless "
           "the target is served with --load-format dummy and SGLANG_DFLASH_DUMMY_WEIGHTS=model or chain (chain: the "
           "target follows its recording at every batch shape); SGLANG_DFLASH_WORKER"
           "=builtin refuses a DFLASH start with it. Recording: `python -m sglang_dflash.serving.oracle_drafts record "
           "PLAIN.outputs.jsonl.gz OUT.json`"),
    Switch(ORACLE_PROFILE, "oracle_profile", _oracle_profile, "geometric:0.85,seed:0",
           "geometric:P or tau:T, then ,seed:S",
           "with oracle drafts: each drafted position keeps the recorded token with probability P (else a token "
           "certain to be rejected), drawn from a hash of (seed, prompt, output position), so every method, batch "
           "and rank sees the same misses; full-block tau = 1 + P + ... + P^(B-1) (0.85 at B = 16: 6.17); tau:T "
           "solves P for that tau"),
)
NAMES = tuple(s.name for s in SWITCHES)
_BY_NAME = {s.name: s for s in SWITCHES}


@dataclass(frozen=True)
class Settings:
    """The switches of one process, parsed and checked (defaults: each Switch's parser given an unset variable).
    Widths that depend on the drafter's block size (k, widths, k_schedule) are range-checked where the block is
    known (serving/width_control.py)."""

    worker: str
    allow_untested_sglang: bool
    capture: str
    verify_attention: str
    verify_metadata: str
    graph_head: bool
    k: int | None
    adaptive: bool
    widths: str | None  # parsed against the block size by adaptive.parse_widths
    k_schedule: tuple[int, ...] | None
    short_draft: bool
    log_every_s: float
    step_trace: str | None
    step_costs: str | None
    cache: Path
    tree: int  # range-checked against the block size by tree_size
    dummy_weights: str
    replay_ssm: bool
    k0_state_in_place: bool
    pd: bool
    oracle_drafts: str | None
    oracle_profile: OracleProfile

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        return cls(**{s.field: s.parse(s.name, env.get(s.name)) for s in SWITCHES})


_parsed: dict[tuple[str, str | None], Any] = {}


def get(name: str) -> Any:
    """One switch's value from os.environ now (one look-up; each text is parsed once)."""
    raw = os.environ.get(name)
    try:
        return _parsed[name, raw]
    except KeyError:
        value = _parsed[name, raw] = _BY_NAME[name].parse(name, raw)
        return value


def current() -> Settings:
    """The settings of this process, from os.environ now."""
    return Settings(**{s.field: get(s.name) for s in SWITCHES})


def markdown_table() -> str:
    """The switches as the Markdown table of docs/SETTINGS.md."""
    rows = ["| variable | default | values | what it does |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.default} | {s.values} | {s.what} |" for s in SWITCHES]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
