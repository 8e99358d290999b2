"""The algorithm-level tests prove their own power: each test here plants one plausible bug into the REAL code (a
one-line edit of the function's own source, compiled and monkeypatched in for the duration of the test) and asserts
that the real test body fails on it. If a mutation site disappears from the source, `plant` fails loudly: move the
mutation to the new code rather than deleting the test.

Verifying DFlash2's q-drafts with the point-mass rule (accept d with p(d), else draw from p without d) is exact in
law for drafts from any q; it only accepts less. So its mutant (`test_dflash2_acceptance_rate_test_catches_...`) is
caught by an acceptance-rate check, not by a distribution test.

Not planted, on purpose: "residual not renormalised". sample_from_probs draws argmax(p / E), which is invariant to
scaling p, so the unnormalised residual yields the same tokens: an equivalent mutant, not a bug.
"""

import inspect
import sys
import textwrap

import pytest
import torch

import test_acceptance as acceptance_tests
import test_dflash_oracle as oracle_tests
import test_drafter as drafter_tests
import test_reference_engine as engine_tests
import test_tree_acceptance as tree_tests
import test_train_dflash2 as train_dflash2_tests
import test_tree_engine as tree_engine_tests
from sglang_dflash import acceptance, dflash2, drafter, tree_acceptance
from sglang_dflash.reference import engine, target
from sglang_dflash.train import dflash2 as train_dflash2


def plant(monkeypatch, owner, name: str, old: str, new: str) -> None:
    """Replace `old` by `new` (once) in the source of owner.name, compile it with the original globals and patch it
    in, on the owner and on every module that imported the same function by name."""
    original = getattr(owner, name)
    src = textwrap.dedent(inspect.getsource(inspect.unwrap(original)))  # decorators stay in the source
    assert src.count(old) == 1, f"mutation site {old!r} is not in {owner.__name__}.{name} exactly once: update it"
    namespace = dict(inspect.unwrap(original).__globals__)
    exec(compile(src.replace(old, new), inspect.getsourcefile(inspect.unwrap(original)), "exec"), namespace)
    mutant = namespace[name]
    monkeypatch.setattr(owner, name, mutant)
    for module in list(sys.modules.values()):
        mod_name = getattr(module, "__name__", "")
        if (mod_name.startswith("sglang_dflash") or mod_name.startswith("test_")) \
                and getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, mutant)


# ---------------------------------------------------------------- verify_sampled on its own (test_acceptance.py)
VERIFY_BUGS = {
    "accepts 15% too often": ("u < p_draft", "u < 1.15 * p_draft", "first token"),
    "bonus loses the last draft's mass": ("torch.where(rejected,", "torch.where(rejected | True,", "bonus"),
    "replacement keeps the rejected draft's mass": (
        "torch.zeros_like(p_next[rows, rejected_draft])", "p_next[rows, rejected_draft]", "equal to its rejected draft"),
    "bonus from the last draft's row": ("target_probs[rows, accepted]", "target_probs[rows, accepted.clamp(max=b - 2)]",
                                        "bonus"),
}


@pytest.mark.parametrize("bug", list(VERIFY_BUGS))
def test_verify_distribution_test_catches(monkeypatch, bug):
    old, new, role = VERIFY_BUGS[bug]
    plant(monkeypatch, acceptance, "verify_sampled", old, new)
    with pytest.raises(AssertionError, match=role):
        acceptance_tests.test_verify_sampled_emits_target_distribution()


# ---------------------------------------------------------------- verify_tree_sampled (test_tree_acceptance.py)
# Unlike the chain rule's final draw, the tree rule's acceptance test divides by the residual's sum: there, not
# renormalising is a real bug (a later sibling accepted with p(x) instead of p'(x)), and it is planted.
TREE_BUGS = {
    "sibling accepted with p(x), residual not renormalised": (
        "u[:, i - 1] * residual.sum(dim=-1) < mass", "u[:, i - 1] < mass"),
    "rejected sibling keeps its mass": ("torch.where(candidate & ~accept, torch.zeros_like(mass), mass)", "mass"),
    "final draw from p_u, forgetting the rejections": ("torch.where(empty, target_probs", "torch.where(empty | True, "
                                                                                          "target_probs"),
    "accepted child walks on with its parent's row": (
        "torch.where(accept[:, None], target_probs[:, i], residual)", "residual"),
}


@pytest.mark.parametrize("bug", list(TREE_BUGS))
def test_tree_distribution_test_catches(monkeypatch, bug):
    old, new = TREE_BUGS[bug]
    plant(monkeypatch, tree_acceptance, "verify_tree_sampled", old, new)
    with pytest.raises(AssertionError, match="target"):
        tree_tests.test_tree_sampled_emits_target_distribution()


# ---------------------------------------------------------------- the engine's tree mode (test_tree_engine.py)
TREE_ENGINE_BUGS = {
    "keeps the first rows of the tree, not the accepted path": (
        engine.ReferenceEngine, "_tree_step", "rows = path[i, :n]", "rows = torch.arange(n)"),
    "tree rows see every earlier row (a causal mask, not the tree's)": (
        target.HFTarget, "forward_tree", "ancestors.to(self.device)]", "torch.ones_like(ancestors).tril()]"),
}


@pytest.mark.parametrize("bug", list(TREE_ENGINE_BUGS))
def test_tree_engine_distribution_test_catches(monkeypatch, bug):
    owner, name, old, new = TREE_ENGINE_BUGS[bug]
    plant(monkeypatch, owner, name, old, new)
    with pytest.raises(AssertionError, match="do not follow"):
        tree_engine_tests.test_tree_sampled_output_follows_target_distribution()


# ---------------------------------------------------------------- verify_sampled_q (drafts drawn from q)
VERIFY_Q_BUGS = {
    "accepts 15% too often": ("u * q_draft < p_draft", "u * q_draft < 1.15 * p_draft", "first token"),
    "q read at the first candidate, not the draft's": (
        "(draft_q * (candidates == drafts[:, :, None])).sum(dim=-1)", "draft_q[:, :, 0]", "first token"),
    "residual ignores q": ("-rejected * draft_q[rows, at]", "0 * draft_q[rows, at]", "equal to its rejected draft"),
    "residual not clamped at 0": (".clamp_(min=0)", ".clamp_(min=-1)", "first token"),
    "accepts with p(d), not p(d) / q(d)": ("u * q_draft < p_draft", "u < p_draft", "first token"),
    "bonus row loses the last draft's q": ("(accepted < b - 1)[:, None]", "(accepted <= b - 1)[:, None]", "bonus"),
}


@pytest.mark.parametrize("bug", list(VERIFY_Q_BUGS))
def test_verify_q_distribution_test_catches(monkeypatch, bug):
    old, new, role = VERIFY_Q_BUGS[bug]
    plant(monkeypatch, acceptance, "verify_sampled_q", old, new)
    with pytest.raises(AssertionError, match=role):
        acceptance_tests.test_verify_sampled_q_emits_target_distribution()


# ---------------------------------------------------------------- DFlash2 against the dflash package (oracle)
ORACLE_BUGS = {  # bug: (owner, function, old source, new source)
    "selector's transitions always from the anchor": (
        dflash2.CandidateSelector, "walk", "projected[:, i], previous, candidates[:, i]",
        "projected[:, i], anchor_ids, candidates[:, i]"),
    "selector's codebooks swapped": (
        dflash2.CandidateSelector, "transition", "self.successor_codebook[candidates]",
        "self.predecessor_codebook[candidates]"),
    "selector's transitions use the first position's hidden state": (
        dflash2.CandidateSelector, "walk", "self.transition(projected[:, i]", "self.transition(projected[:, 0]"),
    "convolution one position late": (
        dflash2.GroupedCausalConv, "_convolve", "F.pad(x[:, :, :-s], (0, 0, 0, 0, s, 0))",
        "F.pad(x[:, :, :-s - 1], (0, 0, 0, 0, s + 1, 0))"),
    "convolution without its dynamic coefficients": (
        dflash2.GroupedCausalConv, "_convolve", "(base[s] + dyn[:, :, :, s])", "base[s]"),
    "output convolution with the input's base kernel": (
        dflash2.GroupedCausalConv, "finish", "self._convolve(y, dyn, 1)", "self._convolve(y, dyn, 0)"),
    "projection read as [taps, 2, groups]": (
        dflash2.GroupedCausalConv, "prepare", "view(*x.shape[:-1], 2, self.taps, self.groups)",
        "view(*x.shape[:-1], self.taps, 2, self.groups).transpose(-3, -2)"),
    "no convolution around the MLP": (
        drafter.DraftLayer, "forward", "_convolved(self.mlp_conv, self.mlp)", "self.mlp"),
}


@pytest.mark.parametrize("bug", list(ORACLE_BUGS))
def test_oracle_comparison_catches(monkeypatch, bug):
    """Each bug is planted in our DFlash2 code after the package ran (its checkpoints are written first); our
    reference engine must then differ from the dflash package's decoder on the tiny Qwen3 DFlash2 checkpoint."""
    owner, name, old, new = ORACLE_BUGS[bug]
    oracle_tests.oracle_runs()  # install the oracle, train, save and run it outside the mutation
    plant(monkeypatch, owner, name, old, new)
    with pytest.raises(AssertionError, match="differs from the dflash package"):
        oracle_tests.test_tiny_checkpoints_equal_the_packages_decoder(("qwen3", "dflash2"))


# ---------------------------------------------------------------- the engine (test_reference_engine.py)
ENGINE_BUGS = {  # bug: (owner, function, old source, new source, SAMPLED index, the role whose check must fail)
    # the verify step samples at temperature 1 whatever the request asked (the prefill sample stays right)
    "verify ignores temperature": (engine.ReferenceEngine, "_verify", "processed_probs(logits.view(n * b, v), s)",
                                   "processed_probs(logits.view(n * b, v), SamplingTensors("
                                   "(s.temperature > 0).float(), s.top_k, s.top_p, s.min_p))", 0, "d_1"),
    "verify ignores top-k / top-p / min-p": (engine.ReferenceEngine, "_verify",
                                             "processed_probs(logits.view(n * b, v), s)",
                                             "processed_probs(logits.view(n * b, v), s, filtered=False)", 1, "d_1"),
    "accepts 15% too often": (acceptance, "verify_sampled", "u < p_draft", "u < 1.15 * p_draft", 0, "d_1"),
    "replacement keeps the rejected draft's mass": (acceptance, "verify_sampled",
                                                    "torch.zeros_like(p_next[rows, rejected_draft])",
                                                    "p_next[rows, rejected_draft]", 0, "d_1"),
    "bonus loses the last draft's mass": (acceptance, "verify_sampled", "torch.where(rejected,",
                                          "torch.where(rejected | True,", 0, "bonus"),
    "bonus from the last draft's row": (acceptance, "verify_sampled", "target_probs[rows, accepted]",
                                        "target_probs[rows, accepted.clamp(max=b - 2)]", 0, "bonus"),
    # the target cache keeps the KV of the first rejected draft: the next step conditions on a token never emitted
    "cache keeps a rejected token": (engine.ReferenceEngine, "_speculative_step", "r.cache.crop(r.fed + n)",
                                     "r.cache.crop(r.fed + n + 1)", 0, "d_1"),
}


@pytest.mark.parametrize("bug", list(ENGINE_BUGS))
def test_engine_distribution_test_catches(monkeypatch, bug):
    """300 requests instead of the test's 1,500 keep this fast (~0.5 s each); every bug still fails its role far
    below the 1e-4 threshold (largest p-value seen: 5e-9, accepting 15% too often, at d_1)."""
    owner, name, old, new, params, role = ENGINE_BUGS[bug]
    engine_tests.markov_pair()  # train outside the mutation
    plant(monkeypatch, owner, name, old, new)
    with pytest.raises(AssertionError, match=f"do not follow the target.*{role}"):
        engine_tests.test_sampled_output_follows_target_distribution(engine_tests.SAMPLED[params], n_requests=300)


DFLASH2_ENGINE_BUGS = {  # bug: (owner, function, old source, new source)
    # the selector draws its drafts at temperature 1 but hands the verify q at the request's temperature
    "drafts not drawn from the q handed to the verify": (
        dflash2.CandidateSelector, "walk", "best = sample_from_probs(q, generator)",
        "best = sample_from_probs(torch.where(greedy[:, None], q, torch.softmax(scores, dim=-1)), generator)"),
}


@pytest.mark.parametrize("bug", list(DFLASH2_ENGINE_BUGS))
def test_dflash2_engine_distribution_test_catches(monkeypatch, bug):
    owner, name, old, new = DFLASH2_ENGINE_BUGS[bug]
    engine_tests.markov_dflash2()  # train outside the mutation
    plant(monkeypatch, owner, name, old, new)
    with pytest.raises(AssertionError, match="do not follow the target"):
        engine_tests.test_dflash2_sampled_output_follows_target_distribution(engine_tests.SAMPLED[0], n_requests=300)


def test_dflash2_acceptance_rate_test_catches_point_mass_verify(monkeypatch):
    """Verifying q-drafts with the point-mass rule keeps the law (so the distribution test passes) but accepts
    d with p(d) instead of min(1, p(d) / q(d))."""
    engine_tests.markov_dflash2()
    plant(monkeypatch, engine.ReferenceEngine, "_verify", "if draft.q is None:", "if True:")
    with pytest.raises(AssertionError, match="kept at rate"):
        engine_tests.test_dflash2_sampled_first_draft_acceptance_rate()


# ---------------------------------------------------------------- the drafter and the greedy baseline
def test_context_test_catches_first_layer_only_injection(monkeypatch):
    """EAGLE-style injection: only the first draft layer sees the target's context (the others get zeros)."""
    plant(monkeypatch, drafter.DFlashDrafter, "forward",
          "x = layer(x, context,", "x = layer(x, context if layer is self.layers[0] else 0 * context,")
    with pytest.raises(AssertionError, match="layer 2 ignores the context"):
        drafter_tests.test_context_reaches_every_layer()


@pytest.mark.parametrize("arch", engine_tests.ARCHS)
def test_no_cache_recompute_catches_a_decode_position_bug(monkeypatch, arch):
    """The cached decode step feeds its token one position too far (RoPE sees a gap after the prompt)."""
    plant(monkeypatch, engine.ReferenceEngine, "generate_target_only",
          "self.target.forward([r.out[-1]], r.fed, r.cache)", "self.target.forward([r.out[-1]], r.fed + 1, r.cache)")
    with pytest.raises(AssertionError, match="cached greedy != no-cache recompute"):
        engine_tests.test_target_only_greedy_equals_no_cache_recompute(arch)


# ---------------------------------------------------------------- DFlash2 training: the selector loss
SELECTOR_LOSS_BUGS = {  # bug: (function of train/dflash2.py, old source, new source)
    "previous token is the true token itself": (
        "previous_tokens", "return torch.cat([ids[:, :1], true[:, :-1]], dim=1)", "return true"),
    "position 1's previous token is the mask, not the anchor": (
        "previous_tokens", "true = torch.cat([ids[:, :1], labels[:, 1:]], dim=1)",
        "true = torch.cat([ids[:, 1:2], labels[:, 1:]], dim=1)"),
    "rows whose token is no candidate kept": (
        "selector_loss", "[1:].repeat(n) * covered", "[1:].repeat(n) * (y != IGNORE)"),
    "position weights one position late": (
        "selector_loss", "position_weights(b, gamma, logits.device)[1:]",
        "position_weights(b, gamma, logits.device)[:-1]"),
    "scores without the unary term": (
        "selector_loss", "scores = unary + selector.transition", "scores = 0 * unary + selector.transition"),
}


@pytest.mark.parametrize("bug", list(SELECTOR_LOSS_BUGS))
def test_selector_loss_reference_test_catches(monkeypatch, bug):
    name, old, new = SELECTOR_LOSS_BUGS[bug]
    plant(monkeypatch, train_dflash2, name, old, new)
    with pytest.raises(AssertionError, match="differs from the"):
        train_dflash2_tests.test_selector_loss_is_the_per_row_definition_value_and_gradients(
            train_dflash2_tests.tiny_pair_target())
