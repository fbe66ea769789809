"""Kazemnejad et al. 2023's ordering over their whole suite, from finished ``posenc compare
--task kaz-*`` run folders (one per task; merge a task's shards with ``--merge`` first).

    python scripts/kazemnejad_suite.py runs/kaz-copy runs/kaz-reverse ...

Prints the markdown table (mean rank per task and over the suite, mean reciprocal rank) and
the reading (``posenc.compare.suite``). Reads each folder's ``results.json``; writes nothing.
A folder without one, or a run of another task, is one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from posenc.compare.suite import suite_finding, suite_ranks, suite_table_md


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: kazemnejad_suite.py RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    runs = []
    for d in argv:
        path = Path(d) / "results.json"
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            print(f"kazemnejad_suite: {str(path)!r} cannot be read as a finished run's results ({e})", file=sys.stderr)
            return 2
    try:
        suite = suite_ranks(runs)
    except ValueError as e:
        print(f"kazemnejad_suite: {e}", file=sys.stderr)
        return 2
    print(suite_table_md(suite))
    f = suite_finding(suite)
    print(
        f"Reading: **{f['verdict']}** ({f['evidence']})"
        if f
        else "Reading: none (fewer than two of the paper's encodings ranked)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
