"""Run a test module's Triton kernels under Triton's CPU interpreter, in a subprocess.

``TRITON_INTERPRET=1`` must be set before triton is first imported, which another test may already have done in the
pytest process. So the module runs itself as ``python FILE --interpret`` with the variable set, and prints one JSON
line last: the per-case results its module-scoped fixture hands to the tests.

For a module whose cases are a ``kernel_vs_twin(device) -> {case: equal}`` function, ``print_interpreted`` is the
child's side, ``assert_all_equal`` the check, and ``needs_gpu`` marks the same cases' native CUDA run.
"""

import json
import os
import subprocess
import sys

import pytest
import torch


def run_interpreted(test_file: str, timeout_s: float = 300) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, test_file, "--interpret"], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_interpreted(kernel_vs_twin) -> None:
    """``python FILE --interpret``: every case's result on the CPU, as the JSON line ``run_interpreted`` reads."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    torch.set_num_threads(1)
    print(json.dumps(kernel_vs_twin("cpu")))


def assert_all_equal(results: dict) -> None:
    assert all(results.values()), f"cases that differ: {[k for k, ok in results.items() if not ok]}"


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="needs a CUDA GPU")
