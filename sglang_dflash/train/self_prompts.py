"""User requests written by the target itself (self-prompting, the idea of Magpie: Xu et al. 2024, "Alignment Data
Synthesis from Scratch by Prompting Aligned LLMs with Nothing"), for chat data of the kinds MT-Bench asks.

Why: a drafter learns the target's answers, so its chat acceptance depends on answers to chat requests like the ones
it will serve. ShareGPT, our only chat source, runs out at ~37k turns and is mostly one kind of request; MT-Bench's
held-out questions are writing, roleplay, reasoning, math, coding, extraction, STEM and humanities tasks.

How: an instruct model trained on chat turns, handed its own chat template up to the point where the user's text
starts, continues with a plausible user request and closes the turn with the template's end-of-turn token. A system
message that describes a kind of assistant steers the request's kind. Sampled at T = 1 the requests are as varied as
the target's own idea of a user; no MT-Bench text is shown, so the held-out questions stay unseen. The requests are
then answered like any other prompt (`train generate`), with the template's default system message.

Pure helpers here (prefix from the chat template, request cleaning); the CLI is `train self-prompts`
(`pipeline.self_prompts`), which samples through an SGLang server with `generate.generate_with_server`.
"""

from __future__ import annotations

import re

# One system message per MT-Bench category (our wording): the kind of assistant whose user is being imagined.
QUERY_STYLES = {
    "writing": "You are an assistant for creative and practical writing: stories, poems, essays, blog posts, "
               "speeches, letters and emails. Users ask you to write or rewrite a piece of text.",
    "roleplay": "You are an assistant that plays characters and imagined situations. Users ask you to pretend to be "
                "someone, a famous person, a profession or a fictional character, and to answer in that role.",
    "reasoning": "You are an assistant that solves logic puzzles, riddles and common-sense reasoning questions. "
                 "Users give you a puzzle or a tricky question to think through.",
    "math": "You are an assistant that solves math problems: arithmetic, algebra, geometry, probability and "
            "word problems. Users give you a problem to solve.",
    "coding": "You are an assistant for programming. Users ask you to write a function or a program, to explain "
              "a piece of code, or to find the bug in it.",
    "extraction": "You are an assistant that extracts information from text. Users paste a passage, a review, a "
                  "table or a report and ask you to pull out names, dates, numbers or facts, often as a list or JSON.",
    "stem": "You are an assistant that explains science, technology, engineering and medicine. Users ask how "
            "something works or why something happens.",
    "humanities": "You are an assistant for history, philosophy, economics, law, literature and the arts. Users "
                  "ask you for an explanation, a comparison or an analysis.",
}

_MARK = "QQSELFPROMPTMARKQQ"  # stands for the user's text while the template is rendered


def query_prefix(tokenizer, system: str | None = None) -> tuple[list[int], int]:
    """(the token ids of the chat template up to where the user's text starts, the token id that ends the user's
    text), from the tokenizer's own chat template. With `system`, the prefix carries that system message; without,
    what the template writes by default.

    The template is rendered with a marker as the user's text and cut there. Trailing spaces are dropped from the
    prefix ("Question: " -> "Question:"): the model writes the space itself, as in the tokenization of a whole prompt.
    Checked against the target's full prompts in tests/test_self_prompts.py."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _MARK}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    if not isinstance(text, str) or text.count(_MARK) != 1:
        raise ValueError("the tokenizer's chat template does not write the user's text once as it is; self-prompting "
                         "needs a template with a user turn. Fix: give the tokenizer a chat template")
    head, tail = text.split(_MARK)
    prefix = tokenizer(head.rstrip(" "), add_special_tokens=False)["input_ids"]
    end = tokenizer(tail, add_special_tokens=False)["input_ids"]
    if not prefix or not end:
        raise ValueError(f"chat template around the user's text: {head!r} ... {tail!r}: no tokens before or after it; "
                         "self-prompting needs both (the prefix to continue, the token that ends the request)")
    return [int(t) for t in prefix], int(end[0])


def style_systems(styles: str) -> dict[str, str | None]:
    """--styles -> {name: system message or None}: 'mtbench' = every QUERY_STYLES entry, 'none' = the template's
    default system message only, or a comma list of QUERY_STYLES names."""
    if styles == "mtbench":
        return dict(QUERY_STYLES)
    if styles == "none":
        return {"default": None}
    names = [s.strip() for s in styles.split(",") if s.strip()]
    bad = [s for s in names if s not in QUERY_STYLES]
    if bad or not names:
        raise ValueError(f"--styles {styles!r}: unknown {bad or 'empty list'}; use 'mtbench', 'none' or a comma list "
                         f"of {', '.join(QUERY_STYLES)}")
    return {s: QUERY_STYLES[s] for s in names}


def request_text(tokenizer, sampled: list[int], end_id: int) -> str | None:
    """The text of one sampled request (the ids after the prefix), stripped, or None unless it ended the user's turn
    cleanly: the last id is `end_id` and no other special token comes before it (a sample that writes its own
    assistant header is not a request)."""
    if not sampled or sampled[-1] != end_id:
        return None
    body = sampled[:-1]
    if set(body) & set(tokenizer.all_special_ids):
        return None
    return tokenizer.decode(body).strip()


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def clean_requests(requests: list[str | None], held_out: set[str], min_chars: int = 16,
                   max_chars: int = 1500) -> tuple[list[int], dict[str, int]]:
    """Which sampled requests to keep: indices into `requests`, and a count per reason for the rest.

    A request is None when its sample did not end the user's turn cleanly (`request_text`: cut by the token limit,
    ended by another stop token, or a special token inside). Dropped: those, requests shorter than min_chars or longer than max_chars (stripped), repeats (same text
    up to case and whitespace; the first is kept), and any equal to a held-out prompt."""
    held = {_normalised(t) for t in held_out}
    keep, seen = [], set()
    dropped = {"unfinished": 0, "too_short": 0, "too_long": 0, "repeat": 0, "held_out": 0}
    for i, r in enumerate(requests):
        if r is None:
            dropped["unfinished"] += 1
            continue
        text = r.strip()
        key = _normalised(text)
        reason = ("too_short" if len(text) < min_chars else "too_long" if len(text) > max_chars
                  else "held_out" if key in held else "repeat" if key in seen else None)
        if reason:
            dropped[reason] += 1
            continue
        seen.add(key)
        keep.append(i)
    return keep, dropped
