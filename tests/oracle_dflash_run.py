"""Runs the `dflash` package's own decoder (z-lab's `dflash_generate`, PyPI dflash==0.1.0) greedily; the oracle of
tests/test_dflash_oracle.py. Not a test: that test starts it in a subprocess whose PYTHONPATH puts the package and
the transformers release it needs (5.15) in front of ours, so nothing of this project is imported here.

    python oracle_dflash_run.py JOBS.json  ->  stdout: one JSON line (the last)
    JOBS: [{"target": dir, "drafter": dir, "prompts": [[ids]], "max_new_tokens": M}, ...]
    out:  {"transformers": version, "jobs": [[per prompt {"output_ids": [generated ids], "acceptance_lengths":
           [per verify step], "drafts": [[the B-1 drafted ids of each step]]}]]}

The package times its steps with CUDA events (`_cuda_time` synchronises CUDA): replaced by the host clock here, as
this runs on a CPU. Its drafts are recorded by wrapping the draft head it calls (DFlash2: `propose`; DFlash: the
logits it takes the argmax of); nothing else is changed.
"""

import json
import sys
import time

import torch


def main(jobs_file: str) -> None:
    import transformers
    from dflash import model as dm

    dm._cuda_time = time.perf_counter  # CPU: no CUDA to synchronise
    torch.set_num_threads(1)  # as our side runs (tests/conftest.py)
    jobs = [run_job(dm, transformers, spec) for spec in json.loads(open(jobs_file).read())]
    print(json.dumps(dict(transformers=transformers.__version__, jobs=jobs)))


def run_job(dm, transformers, spec: dict) -> list[dict]:
    target = transformers.AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32).eval()
    archs = json.loads(open(f"{spec['drafter']}/config.json").read())["architectures"]
    cls = dm.DFlash2DraftModel if any(a.startswith("DFlash2") for a in archs) else dm.DFlashDraftModel
    drafter, info = cls.from_pretrained(spec["drafter"], dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise SystemExit(f"the package did not load every drafter tensor: {problems}")
    drafter = drafter.eval()

    drafts: list[list[int]] = []
    if cls is dm.DFlash2DraftModel:
        propose = drafter.propose

        def recording_propose(*args, **kwargs):
            out = propose(*args, **kwargs)
            drafts.append(out[0][0].tolist())
            return out

        drafter.propose = recording_propose
    else:
        compute_logits = drafter.compute_logits

        def recording_logits(*args, **kwargs):
            logits = compute_logits(*args, **kwargs)
            drafts.append(logits[0].argmax(dim=-1).tolist())
            return logits

        drafter.compute_logits = recording_logits

    results = []
    for prompt in spec["prompts"]:
        drafts.clear()
        ids = torch.tensor([prompt])
        out = dm.dflash_generate(drafter, target, ids, spec["max_new_tokens"], None, temperature=0.0,
                                 return_stats=True)
        results.append(dict(output_ids=out.output_ids[0, len(prompt):].tolist(),
                            acceptance_lengths=[int(n) for n in out.acceptance_lengths], drafts=list(drafts)))
    return results


if __name__ == "__main__":
    main(sys.argv[1])
