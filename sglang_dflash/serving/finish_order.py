"""A request's finish rules applied in token order when one decode step commits several tokens.

SGLang's ``Req.update_finish_state(new_accepted_len)`` judges a multi-token commit at once: the length limit first,
then stop strings over all the new tokens, then stop tokens. Plain decoding applies the same rules one token at a
time, so a speculative commit can finish where plain decoding would not:
- a commit that reaches ``max_new_tokens`` finishes by length, though a stop string or stop token among its tokens
  had stopped plain decoding earlier (found by benchmarks/soak.py on CPU: a stop string completed at token 2 of a
  12-token request whose second step committed 11 tokens; the answer ran on to 12 tokens);
- a stop token before a stop string in the same commit: SGLang's rule prefers the string, plain decoding stops at
  the token.
``update_finish_state_in_token_order`` (an AROUND hook, plugin.py) replays such a commit token by token through
SGLang's own one-token rule, so the request finishes exactly where plain decoding finishes. Only commits where the
two can differ are replayed (they reach the length limit, or the request has stop strings / regexes: plain decoding
decodes a tail per token there too); any other commit keeps SGLang's single call, whose stop-token rule already
stops at the first stop token in order.
"""

from __future__ import annotations


def update_finish_state_in_token_order(original, req, new_accepted_len: int = 1):
    if new_accepted_len <= 1 or req.finished():
        return original(req, new_accepted_len)
    sp = req.sampling_params
    ids = req.output_ids
    reaches_limit = len(ids) >= sp.max_new_tokens
    if not reaches_limit and not sp.stop_strs and not getattr(sp, "stop_regex_strs", None):
        return original(req, new_accepted_len)
    start = len(ids) - new_accepted_len
    tail = ids[start:]
    # the same list object, shortened and grown again: SGLang may edit its last token in place (out-of-vocabulary
    # ids become a stop token), and other holders of the list see the final contents
    del ids[start:]
    try:
        for token in tail:
            ids.append(token)
            original(req, 1)
            if req.finished():
                break
    finally:
        ids.extend(tail[len(ids) - start:])
