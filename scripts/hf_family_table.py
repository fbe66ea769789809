"""Measure the family table of docs/hf.md: family x (stock parity, cached = uncached, round trip,
swap + one Trainer step, windows/sinks), the max abs difference per cell, from the tiny random
configs of tests/test_hf_families.py (the installed transformers, no download).

    OMP_NUM_THREADS=1 python scripts/hf_family_table.py            # prints the markdown table

Cells:

Each difference is followed by the suite's float32 bound for it (``≤``: tests/conftest.py's
``tolerance`` with the reduction length of tests/test_hf_families.py's ``family_n``).

* stock parity: max |logits(posenc, model's own scheme) - logits(stock HF)| over 2 x 20 tokens
  (every window of the tiny configs is 6 or 9 keys, so the windows are in play); VL families
  with image-like 3-row position ids.
* cached = uncached: greedy generation of 14 tokens from 5 with ``DynamicCache(config=...)`` (HF's
  sliding-window layers where the config has them) vs ``use_cache=False``: max |step logits
  difference|, and whether the tokens are equal; encoders: none.
* round trip: max |logits difference| after ``save_pretrained`` -> ``Auto*.from_pretrained``
  (ALiBi and RoPE alternating, encoding parameters perturbed).
* swap + Trainer: the ALiBi swap's training loss of one HF ``Trainer`` step and the largest
  parameter change.
* windows/sinks: decoders: a posenc ``rope(window=4, sinks=true)`` on every layer, cached vs
  uncached generation past the window (max |step logits difference|); ModernBERT: its
  inclusive local window as posenc ``window=5``, and the max logits change when read as 4.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.conftest import tolerance  # noqa: E402
from tests.test_hf import greedy  # noqa: E402
from tests.test_hf_families import (  # noqa: E402
    FAMILIES,
    VL,
    V,
    family_n,
    image_positions,
    logits,
    stock_model,
    trainer_step,
)
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, DynamicCache  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

import posenc.hf as ph  # noqa: E402


def _bound(expected: torch.Tensor, cfg, length: int) -> float:
    """The suite's float32 atol for these logits (tests/conftest.py tolerance, family_n)."""
    magnitude = max(1.0, float(expected.abs().amax()))
    return tolerance(torch.float32, n=family_n(cfg, length), magnitude=magnitude)["atol"]


def _cached_vs_uncached(model) -> str:
    ids = torch.randint(1, V, (2, 5))
    cached, a = greedy(model, ids, 14, cache=DynamicCache(config=model.config))
    uncached, b = greedy(model, ids, 14, use_cache=False)
    same = "tokens equal" if torch.equal(cached, uncached) else "TOKENS DIFFER"
    return f"{(a - b).abs().max().item():.1e} (≤ {_bound(b, model.config, 19):.0e}), {same}"


def _parity(family: str, stock, ours) -> str:
    ids = torch.randint(1, V, (2, 20 if family not in VL else 12))
    kw = {"position_ids": image_positions(2)} if family in VL else {}
    want = logits(stock, ids, **kw)
    diff = (logits(ours, ids, **kw) - want).abs().max().item()
    return f"{diff:.1e} (≤ {_bound(want, stock.config, ids.shape[1]):.0e})"


def _round_trip(family: str, stock) -> str:
    model = ph.convert(stock, encoding="alibi,rope").eval()
    with torch.no_grad():
        for p in model.posenc_stack.parameters():
            p.add_(0.1 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        auto = AutoModelForMaskedLM if family == "modernbert" else AutoModelForCausalLM
        loaded = auto.from_pretrained(d).eval()
    ids = torch.randint(1, V, (2, 11))
    return f"{(logits(loaded, ids) - logits(model, ids)).abs().max().item():.1e}"


def _trainer(stock) -> str:
    with tempfile.TemporaryDirectory() as d:
        try:
            loss, change = trainer_step(ph.convert(stock, encoding="alibi"), pathlib.Path(d))
        except RuntimeError as e:
            return f"FAILS: {str(e).split(':')[0]}"
    return f"loss {loss:.2f}, max Δparam {change:.1e}"


def _modernbert_window(stock, ours) -> str:
    ids = torch.randint(1, V, (1, 20))
    want = logits(stock, ids)

    def narrow(*args, **kwargs):
        m = ph.mask_interface(*args, **kwargs)
        if m.window is not None:
            m.window -= 1
        return m

    AttentionMaskInterface.register("posenc", narrow)
    try:
        off = logits(ours, ids)
    finally:
        AttentionMaskInterface.register("posenc", ph.mask_interface)
    return f"±4 inclusive = posenc window=5 (in parity); read as 4: {(off - want).abs().max().item():.1e}"


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = ["| family | stock parity | cached = uncached | round trip | swap + one Trainer step | windows/sinks |"]
    rows.append("|---|---|---|---|---|---|")
    for family in FAMILIES:
        stock = stock_model(family)
        ours = ph.convert(stock).eval()
        decoder = family != "modernbert"
        cached = _cached_vs_uncached(ours) if decoder else "— (encoder)"
        if decoder:
            own_sinks = family == "gpt_oss"  # (HF's own sinks there; posenc adds none)
            windowed = ph.convert(stock, encoding="rope(window=4)" if own_sinks else "rope(window=4,sinks=true)").eval()
            with torch.no_grad():
                for p in windowed.posenc_stack.sinks.values():
                    p.copy_(torch.randn_like(p))
            label = "posenc window=4 (HF's sinks)" if own_sinks else "posenc window=4 + sinks"
            windows = f"{label}: " + _cached_vs_uncached(windowed)
        else:
            windows = _modernbert_window(stock, ours)
        cells = [_parity(family, stock, ours), cached, _round_trip(family, stock), _trainer(stock), windows]
        rows.append(f"| {family} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    print()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
