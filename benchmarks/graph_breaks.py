"""List torch.compile graph breaks of a whole TransformerLM forward, per encoding.

Run:  PYTHONPATH=src python benchmarks/graph_breaks.py [--encodings a,b] [--out benchmarks/graph_breaks.md]

Uses ``torch._dynamo.explain`` on a small model (2 layers, D = 32, L = 16): the number of
graphs, the number of breaks and each break's reason (deduplicated).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import posenc


def explain(name: str) -> dict:
    torch._dynamo.reset()
    lm = posenc.TransformerLM(64, 32, 2, 2, encoding=name, max_len=32)
    tokens = torch.randint(0, 64, (2, 16))
    ex = torch._dynamo.explain(lm)(tokens)
    reasons = []
    for b in ex.break_reasons:
        where = b.user_stack[-1] if b.user_stack else None
        loc = f"{Path(where.filename).name}:{where.lineno}" if where is not None else "?"
        text = f"{loc}: {b.reason.splitlines()[0][:160]}"
        if text not in reasons:
            reasons.append(text)
    return {"encoding": name, "graphs": ex.graph_count, "breaks": ex.graph_break_count, "reasons": reasons}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--encodings", default=None)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    names = a.encodings.split(",") if a.encodings else posenc.available()
    lines = ["| encoding | graphs | breaks | reasons |", "|---|---|---|---|"]
    for n in names:
        try:
            r = explain(n)
            lines.append(f"| `{n}` | {r['graphs']} | {r['breaks']} | {'<br>'.join(r['reasons']) or '—'} |")
        except Exception as e:  # report, do not hide: a failing compile is a finding
            lines.append(f"| `{n}` | error | | {type(e).__name__}: {str(e).splitlines()[0][:160]} |")
        print(lines[-1], flush=True)
    if a.out:
        a.out.write_text(
            f"# torch.compile graph breaks (torch {torch.__version__})\n\n"
            "`PYTHONPATH=src python benchmarks/graph_breaks.py --out benchmarks/graph_breaks.md`\n\n"
            + "\n".join(lines)
            + "\n"
        )


if __name__ == "__main__":
    main()
