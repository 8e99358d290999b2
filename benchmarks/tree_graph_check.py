"""Did a tree server's tree steps run under CUDA graphs? Read from its log (issue #38, serving/tree_graphs.py).

The worker logs one start-up line ("tree steps (N nodes): verify replays tree verify CUDA graphs for batch sizes
[...]; tree build inside the draft CUDA graphs for batch sizes [...]") and counts its tree steps at steps 1, 2, 4,
8, ...: "tree steps: S (verify graphed G, eager E; tree built in the draft graph D, eagerly X; ...)". The last
count line is the run's (to within a factor of two of its steps).

    python -m benchmarks.tree_graph_check LOG [LOG ...]   # one verdict line per log; exit 1 if any tree server
                                                         # ran no graphed tree verify
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

COUNTS = re.compile(r"tree steps: (\d+) \(verify graphed (\d+), eager (\d+); tree built in the draft graph (\d+), "
                    r"eagerly (\d+)")
STARTUP = re.compile(r"tree steps \((\d+) nodes\): verify (.*?); tree build (.*)")


def tree_counts(log_text: str) -> dict | None:
    """The last tree-step count of a server log: steps, verify_graphed, verify_eager, built_in_graph,
    built_eagerly; None when the log has none (tree off, or no tree step ran)."""
    found = COUNTS.findall(log_text)
    if not found:
        return None
    keys = ("steps", "verify_graphed", "verify_eager", "built_in_graph", "built_eagerly")
    return dict(zip(keys, map(int, found[-1])))


def startup_line(log_text: str) -> str | None:
    m = STARTUP.search(log_text)
    return m.group(0).strip() if m else None


def main(argv=None) -> int:
    ok = True
    for path in argv if argv is not None else sys.argv[1:]:
        if not Path(path).is_file():  # an unmatched shell glob
            print(f"{path}: no such log")
            continue
        text = Path(path).read_text(errors="replace")
        counts, start = tree_counts(text), startup_line(text)
        if start is None:
            print(f"{path}: no tree server (no tree start-up line)")
            continue
        graphed = bool(counts and counts["verify_graphed"] > 0)
        ok &= graphed
        print(f"{path}: {'TREE GRAPHS OK' if graphed else 'NO GRAPHED TREE VERIFY'}; {start}; last count {counts}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
