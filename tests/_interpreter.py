"""Run a test module's Triton kernels under Triton's CPU interpreter, in a subprocess.

``TRITON_INTERPRET=1`` must be set before triton is first imported, which another test may already have done in the
pytest process. So the module runs itself as ``python FILE --interpret`` with the variable set, and prints one JSON
line last: the per-case results its module-scoped fixture hands to the tests.
"""

import json
import os
import subprocess
import sys


def run_interpreted(test_file: str, timeout_s: float = 300) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, test_file, "--interpret"], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
