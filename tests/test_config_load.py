"""One drafter config per process (`DFlashConfig.load`) and one writer of the published layout
(`published_drafter_config`): issue #14, item 3."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from sglang_dflash.config import DFlashConfig, published_drafter_config
from sglang_dflash.targets import shapes
from sglang_dflash.targets.tiny import tiny_drafter, tiny_drafter_config, tiny_target

TARGET = tiny_target("qwen3")


@pytest.fixture
def parses(monkeypatch):
    """Counts the config.json files parsed (every parse from a file goes through from_pretrained)."""
    calls = []
    original = DFlashConfig.from_pretrained.__func__

    def counting(cls, path):
        calls.append(path)
        return original(cls, path)

    monkeypatch.setattr(DFlashConfig, "from_pretrained", classmethod(counting))
    return calls


def _drafter_dir(tmp_path):
    DFlashConfig.from_dict(tiny_drafter_config(TARGET.config)).save(tmp_path / "draft")
    return tmp_path / "draft"


def test_load_parses_once_and_again_after_a_rewrite(tmp_path, parses):
    draft = _drafter_dir(tmp_path)
    first = DFlashConfig.load(draft)
    assert DFlashConfig.load(str(draft)) is first and DFlashConfig.load(draft / "config.json") is first
    assert DFlashConfig.load(tmp_path / "." / "draft") is first and len(parses) == 1
    # a drafter rewritten in place (training writes into the same directory) is read again
    DFlashConfig.from_dict(tiny_drafter_config(TARGET.config, block_size=8)).save(draft)
    os.utime(draft / "config.json", ns=(1, 1))  # a different mtime even on coarse clocks
    assert DFlashConfig.load(draft).block_size == 8 and len(parses) == 2


def test_serving_loads_dflash2_drafters(tmp_path):
    """DFlash2 configs load for serving as for the reference engine (the worker drafts with their selector)."""
    from sglang_dflash.targets.tiny import TINY_DFLASH2

    DFlashConfig.from_dict(tiny_drafter_config(TARGET.config, **TINY_DFLASH2)).save(tmp_path / "draft")
    assert DFlashConfig.load(tmp_path / "draft").is_dflash2


def test_startup_worker_and_draft_model_share_one_parse(tmp_path, parses):
    """The scheduler process: the worker loads the config (startup.load_draft_config), then SGLang builds the draft
    model from the HF config it read from the same path (its own get_config); the model gets the worker's object."""
    pytest.importorskip("sglang")
    from sglang.srt.utils.hf_transformers.config import get_config

    from sglang_dflash.serving.draft_model import drafter_config
    from sglang_dflash.serving.startup import load_draft_config

    draft = _drafter_dir(tmp_path)
    server_args = SimpleNamespace(speculative_draft_model_path=str(draft))
    worker_cfg = load_draft_config(server_args)
    hf_config = get_config(str(draft), trust_remote_code=False)
    assert drafter_config(hf_config) is worker_cfg
    assert load_draft_config(server_args) is worker_cfg  # startup's checks in the launcher: the same one loader
    assert len(parses) == 1
    # a dict (tests build the model directly) is parsed, to the same values
    assert drafter_config(worker_cfg.to_dict()) == worker_cfg


# ------------------------------------------------------------------------------------- one writer of the layout
def _tiny_args(**over):
    h = TARGET.config.hidden_size
    args = dict(hidden=h, inter=2 * h, layers=1, heads=4, kv=2, head_dim=h // 4, vocab=TARGET.config.vocab_size,
                ids=[1, TARGET.config.num_hidden_layers - 2], mask=TARGET.config.vocab_size - 1, rope_theta=10000.0,
                max_pos=2048, torch_dtype=None)
    args.update(over)
    return args


def test_tiny_drafter_config_is_the_published_writer():
    n = TARGET.config.num_hidden_layers
    assert tiny_drafter_config(TARGET.config) == published_drafter_config(n, **_tiny_args())
    assert (tiny_drafter_config(TARGET.config, num_layers=2, block_size=8, target_layer_ids=[0, 2], mask_token_id=5,
                                layer_types=["sliding_attention", "full_attention"], sliding_window=4)
            == published_drafter_config(n, **_tiny_args(layers=2, block=8, ids=[0, 2], mask=5, sliding_window=4,
                                                        layer_types=["sliding_attention", "full_attention"])))


def test_saved_test_drafter_is_the_published_writer(tmp_path):
    """save_drafter_dir (the CPU server tests' and gpu_e2e's drafter) writes exactly what the writer writes."""
    from sglang_dflash.testing import save_drafter_dir

    (tmp_path / "target").mkdir()  # no tokenizer files to copy
    save_drafter_dir(tiny_drafter(TARGET.config, mask_token_id=4), tmp_path / "target", tmp_path / "draft")
    written = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert written == published_drafter_config(TARGET.config.num_hidden_layers, **_tiny_args(
        mask=4, mask_token="<|mask|>", torch_dtype="float32", dtype="float32"))


@pytest.mark.parametrize("name", sorted(n for n, s in shapes.SHAPES.items() if s.drafter))
def test_to_dict_round_trips_the_writer(name):
    """Parsing what the writer wrote and writing it again changes nothing (to_dict goes through the writer)."""
    d = shapes.get(name).drafter
    assert DFlashConfig.from_dict(d).to_dict() == d
    tiny = tiny_drafter_config(TARGET.config, layer_types=["sliding_attention"], sliding_window=3, is_causal=True)
    assert DFlashConfig.from_dict(tiny).to_dict() == tiny
