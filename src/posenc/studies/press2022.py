"""Press et al. 2022, "Train Short, Test Long" (ALiBi): ``--preset paper`` and Table 5's reading.

``--preset paper`` is their WikiText-103 setup (fairseq ``transformer_lm_wiki103``); what it
holds, and what differs from Press et al. (docs/studies/press2022.md):

* the model: 16 blocks, D = 1024, 8 heads, FFN 4096, pre-norm without a final norm, adaptive
  input and adaptive softmax with cutoffs 20 000 / 60 000 (factor 4; the tail bands tied to
  the input bands), dropout 0.3, attention dropout 0.1 and activation dropout 0.1 (fairseq's
  ``attention_dropout``/``activation_dropout``); fairseq's adaptive-softmax dropout (0.2,
  inside the tail bands' projections) is not reproduced;
* the data: ``wiki.{train,valid,test}.tokens`` from ``--data-dir`` (:mod:`posenc.data.wikitext`);
* training: 512 tokens, 73 728 tokens per update whatever the number of processes
  (gradient accumulation: :func:`posenc.compare.train.accumulation_steps`), 286 000 updates,
  gradient clipping 0.1, bf16 autocast (position tables stay float32). The optimizer is AdamW
  (posenc has no NAG): lr 1e-3 after 16 000 warmup steps (fairseq's warmup length), cosine to
  0 without restarts — Press et al. used NAG at lr 1.0 with cosine restarts: our setting is an
  assumption, not theirs;
* evaluation: non-overlapping windows of L_valid = 512, 1012, 2512, 5512, 10512 tokens
  (Press et al.'s L + k columns for L = 512) over the validation set; ``--sliding --stride 1``
  is their sliding-window evaluation (each token scored with up to L - 1 tokens of context,
  one forward of L tokens per scored token: L times the cost of the non-overlapping one).

The preset's own fields (``data_dir``, ``tokens_per_update``, ``micro_batch``, ``final_norm``,
``adaptive_cutoffs``, ``fsdp``) are configuration: :class:`~posenc.compare.CompareConfig`
holds and checks them (:func:`posenc.compare.checks.check_paper_fields`).

:func:`findings` reads Table 5 on any text run that reaches 8x its training length; their
Table 2 (the ordering past the training length) is one of the general readings of
:func:`posenc.compare.reading.findings`.
"""

from __future__ import annotations

from typing import Any

from ..compare.config import register_preset
from ..compare.reading import Check, Finding, Summary, register_findings
from ..compare.results import tied

__all__ = ["PRESET", "findings"]

# ``--preset paper``: CompareConfig fields over the dataclass defaults
PRESET: dict[str, Any] = dict(
    encodings=["sinusoidal", "rope", "t5", "alibi"],  # Press et al.'s Table 2 rows
    dim=1024, depth=16, heads=8, mlp_ratio=4.0, dropout=0.3, attn_dropout=0.1, activation_dropout=0.1,
    tie_embeddings=True,
    final_norm=False, adaptive_cutoffs=[20000, 60000],
    train_len=512, batch_size=144, tokens_per_update=73728, steps=286000,
    lr=1e-3, warmup=16000, min_lr_ratio=0.0, weight_decay=0.0, grad_clip=0.1,
    dtype="bfloat16", workers=1, checkpoint_every=1000, val_points=0,
    eval_lens=[512, 1012, 2512, 5512, 10512], eval_tokens=250000, eval_batch_size=4,
)  # fmt: skip


def findings(s: Summary, task: str | None) -> list[Finding]:
    """Table 5: ALiBi trained at 64 keeps improving to 48x (28.46 at 64, 24.70, 22.88, 22.09,
    21.73, 21.53 at 3072): each longer length no worse than the last. Read on text runs that
    reach 8x the training length (none otherwise)."""
    cells = s.cells.get("alibi", {})
    lens = [n for n in [s.train_len, *s.past] if cells.get(n) is not None]
    if s.metric != "ppl" or "alibi" in s.flagged or s.train_len not in lens or max(lens) < 8 * s.train_len:
        return []
    checks = []
    for a, b in zip(lens, lens[1:]):
        agrees = None if tied(cells[a], cells[b]) else cells[b].mean < cells[a].mean
        checks.append(Check((a, b), agrees, (cells[a].mean, cells[b].mean)))
    evidence = ", ".join(f"{n / s.train_len:g}x {cells[n].mean:.3f}" for n in lens)
    first, last = cells[lens[0]], cells[lens[-1]]
    best = min(lens, key=lambda n: cells[n].mean)
    # the shape: still improving at the longest length (agrees); better than at 1x there but
    # past its lowest (partly); no better than at 1x (disagrees)
    verdict = (
        "disagrees" if tied(first, last) or last.mean >= first.mean else "agrees" if best == lens[-1] else "partly"
    )
    evidence += f" (lowest at {best / s.train_len:g}x; {lens[-1] / s.train_len:g}x is {last.mean / first.mean - 1:+.1%} from 1x)"
    return [
        Finding(
            "Press et al. 2022, Table 5",
            "ALiBi trained short keeps improving far past its training length (their L=64 row: "
            "28.46 -> 21.53 at 48x, every step lower)",
            verdict,
            f"alibi ppl at {evidence}",
            tuple(checks),
        )
    ]


register_preset("paper", PRESET)
register_findings(findings)
