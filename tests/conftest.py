import re
from pathlib import Path

import pytest
import torch

# The tests run tiny models: on 2 cores, intra-op thread hand-offs cost more than the maths (4x slower measured).
torch.set_num_threads(1)

# The two pytest-xdist workers of the README's test command (`-n 2 --dist loadscope`, pyproject.toml): every test
# file that asks for a package-scoped server of tests/serving (`baseline`, `smollm2_plain`: a parameter of one of its
# functions, tests or fixtures) runs on one worker, in collection order, so each of those servers starts once; the
# other files go, file by file, to whichever worker is free. Most of them are one-threaded Python (interpreted
# kernels, reference engines, CLI checks) that the server tests' bursts leave room for on 2 cores. (A scheduler, not
# `xdist_group` marks: with pytest 9.2, xdist 3.8's `--dist loadgroup` no longer sees them.)
SHARED_SERVERS = ("baseline", "smollm2_plain")


def shared_server_files(root: Path) -> set[str]:
    """The test files (paths relative to root) with a top-level function taking one of SHARED_SERVERS."""
    uses = re.compile(r"\b(" + "|".join(SHARED_SERVERS) + r")\b")
    files = set()
    for path in (root / "tests").rglob("test_*.py"):
        if any(uses.search(params) for params in re.findall(r"^def \w+\(([^)]*)\)", path.read_text(), re.M)):
            files.add(path.relative_to(root).as_posix())
    return files


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (-p no:xdist, the GPU machine) there is no such hook
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    shared = shared_server_files(config.rootpath)

    class SharedServersApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            """One unit of work for all shared-server files, one per other file: a worker that runs out takes the
            next file, so both finish about together."""
            path = nodeid.split("::", 1)[0]
            return "shared-servers" if path in shared else path

    return SharedServersApart(config, log)
