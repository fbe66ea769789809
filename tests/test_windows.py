"""The window / chunk / sink-token visibility rule and the key runs the CPU backends keep."""

from __future__ import annotations

import itertools

import pytest
import torch

from posenc.windows import Window, key_ranges, visible


def _grid(n: int, causal: bool, win: Window, k_index=None) -> torch.Tensor:
    i = torch.arange(n)[:, None]
    j = (torch.arange(n) if k_index is None else k_index)[None, :]
    return visible(i, j, causal=causal, win=win)


@pytest.mark.parametrize("W", [1, 3, 8])
def test_window_matches_hf_sliding_window(W):
    from transformers.masking_utils import sliding_window_causal_mask_function

    n = 12
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = sliding_window_causal_mask_function(W)(0, 0, i, j)
    assert torch.equal(_grid(n, True, Window(window=W)), ref)
    assert int(_grid(n, True, Window(window=W))[-1].sum()) == W  # W keys, the query included


@pytest.mark.parametrize("C", [1, 4, 5])
def test_chunk_matches_hf_chunked(C):
    from transformers.masking_utils import chunked_causal_mask_function

    n = 13
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = chunked_causal_mask_function(C, torch.zeros(1, dtype=torch.long))(0, 0, i, j)
    assert torch.equal(_grid(n, True, Window(chunk=C)), ref)


def test_bidirectional_window_matches_gemma3_overlay():
    from transformers.models.gemma3.modeling_gemma3 import _bidirectional_window_overlay

    n, W = 12, 3
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(_grid(n, False, Window(window=W)), _bidirectional_window_overlay(W)(0, 0, i, j))


def test_sink_tokens_stay_visible_but_not_ahead():
    g = _grid(10, True, Window(window=3, sink_tokens=2))
    assert g[9].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    assert g[0].nonzero().flatten().tolist() == [0]  # causality is never lifted
    assert torch.equal(_grid(10, True, Window(sink_tokens=2)), _grid(10, True, Window()))  # no window: no-op


def test_span():
    assert Window().span() is None and Window(window=8).span() == 8 and Window(window=8, chunk=4).span() == 4


CASES = list(
    itertools.product(
        [True, False],  # causal
        [None, 1, 3, 7],  # window
        [None, 4],  # chunk
        [0, 2],  # sink tokens
    )
)


@pytest.mark.parametrize("causal,W,C,S", CASES)
def test_key_ranges_cover_every_visible_key(causal, W, C, S):
    win = Window(window=W, chunk=C, sink_tokens=S)
    g = torch.Generator().manual_seed(0)
    for k_index in (
        torch.arange(20),  # a plain prefix cache
        torch.cat((torch.arange(2), torch.arange(9, 20))),  # sinks kept, the middle evicted
        torch.arange(6, 20),  # a rolling buffer
    ):
        n = len(k_index)
        for _ in range(8):
            q_lo = int(torch.randint(0, 20, (1,), generator=g))
            q_hi = q_lo + int(torch.randint(0, 6, (1,), generator=g))
            qi = torch.arange(q_lo, q_hi + 1)[:, None]
            vis = visible(qi, k_index[None, :], causal=causal, win=win)  # (Lq, Lk)
            for ki in (k_index, int(k_index[0])) if bool((k_index.diff() == 1).all()) else (k_index,):
                runs = key_ranges(q_lo, q_hi, ki, n, causal=causal, win=win)
                covered = torch.zeros(n, dtype=torch.bool)
                for a, b in runs:
                    assert 0 <= a < b <= n
                    covered[a:b] = True
                assert not (vis.any(0) & ~covered).any(), (runs, vis.any(0))
                if W is not None and C is None:
                    # tight: a window block needs at most its queries plus W - 1 (and the sinks)
                    extra = (W - 1) * (1 if causal else 2)
                    assert int(covered.sum()) <= (q_hi - q_lo + 1) + extra + S


def test_window_validation():
    with pytest.raises(ValueError, match="window must be a positive int or None, got 0"):
        Window(window=0)
    with pytest.raises(ValueError, match="chunk must be a positive int or None, got 1.5"):
        Window(chunk=1.5)
    with pytest.raises(ValueError, match="sink_tokens must be an int >= 0, got -1"):
        Window(sink_tokens=-1)
