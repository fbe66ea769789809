"""Tests of ``posenc analyze``: the numerical claims and the command."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tests.conftest import assert_close

import posenc
from posenc.analysis import models, specs, stats
from posenc.analysis.decay import ones_curve, su_bound
from posenc.analysis.decompose import decompose_terms
from posenc.analysis.invariance import shift_change
from posenc.analysis.padding import probe_padding
from posenc.analysis.similarity import position_vectors

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def small_model(name: str, **kw) -> posenc.TransformerLM:
    return models.random_model(specs.Spec(name), dim=32, depth=2, heads=2, max_len=64, vocab_size=50, seed=0, **kw)


def tokens(B=2, L=16, vocab=50, seed=0):
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


# ============================================================================ invariance
@pytest.mark.parametrize("name", posenc.available())
def test_invariance_matches_relative_flag(name):
    """Relative encodings: logits and probabilities unchanged to 1e-5 under shifts up to 1000.

    Absolute ones must move by far more at some shift (so the test can fail both ways;
    FIRE, for one, is relative until positions pass its threshold). Shifts of
    non-extrapolating encodings stay inside max_len.
    """
    model = small_model(name)
    x = tokens()
    relative = all(e.relative for e in model.encodings)
    shifts = (1, 7, 1000) if all(e.extrapolates for e in model.encodings) else (1, 7, 40)
    if not relative and all(e.position_limit is None for e in model.encodings):
        shifts += (100_000,)  # (Llama 4's temperature steps every 8192 positions)
    largest = 0.0
    for s in shifts:
        d_logit, d_prob = shift_change(model, x, s)
        largest = max(largest, *d_logit)
        if relative:
            assert max(d_logit) < 1e-5, (name, s, d_logit)
            assert max(d_prob) < 1e-5, (name, s, d_prob)
    if not relative:
        assert largest > 1e-2, (name, largest)


# ============================================================================ similarity
def test_diagonal_share_toeplitz_and_noise():
    L = 48
    i = torch.arange(L)
    toeplitz = torch.cos(0.3 * (i[:, None] - i[None, :]).double()) + 0.01 * (i[:, None] - i[None, :]).double() ** 2
    assert stats.diagonal_share(toeplitz) == pytest.approx(1.0, abs=1e-12)
    noise = torch.randn(L, L, generator=torch.Generator().manual_seed(0))
    # 2L - 1 diagonal means fitted to L² i.i.d. entries: expected share (2L-1)/L² ≈ 0.04
    assert stats.diagonal_share(noise) < 0.1
    assert stats.diagonal_share(torch.ones(L, L)) is None  # nothing to explain


def test_sinusoidal_gram_is_a_function_of_distance():
    """p_i·p_j = Σ_k cos((i-j)ω_k) exactly, so the diagonal share is 1 up to float32.

    Threshold 0.9999: the table is float32 (relative error ~1e-7 per entry), which can
    leave at most ~1e-12 of unexplained variance; 1e-4 of slack also covers summation
    order. Learned vectors at initialisation are i.i.d. noise: off the main diagonal
    their share is near chance, (2L-1)/L² ≈ 0.03 at L = 64.
    """
    model = small_model("sinusoidal")
    p, how = position_vectors(model, 64)
    assert how == "embed(0, pos)"
    gram = p @ p.t()
    assert stats.diagonal_share(gram) > 0.9999
    assert stats.diagonal_share(gram, skip_main=True) > 0.9999
    learned, _ = position_vectors(small_model("learned"), 64)
    assert stats.diagonal_share(learned @ learned.t(), skip_main=True) < 0.1


# ============================================================================ decompose
@pytest.mark.parametrize("name", posenc.available())
def test_decomposition_terms_sum_to_the_logits(name):
    model = small_model(name)
    terms, how, residual = decompose_terms(model, tokens())
    assert residual < 1e-5, (name, residual)
    enc = model.blocks[0].attn.encoding
    additive_input = model.input_encoding is not None and model.tok_emb is not None
    pos_terms = ("content·position", "position·content", "position·position")
    if additive_input:
        assert all(float(terms[t].abs().max()) > 0 for t in pos_terms), how
    elif not enc.stages & posenc.Stage.INPUT:
        assert all(float(terms[t].abs().max()) == 0 for t in pos_terms), how
    assert ("bias" in terms) == bool(enc.stages & posenc.Stage.BIAS)
    assert ("query·rel (c2p)" in terms) == bool(enc.stages & posenc.Stage.TERMS)


def test_decomposition_of_sinusoidal_by_hand():
    """Layer 0 of a sinusoidal model: the four terms of the LN'd (x + p), transcribed directly."""
    model = small_model("sinusoidal")
    x = tokens(B=1, L=8)
    terms, _, _ = decompose_terms(model, x)
    attn, ln = model.blocks[0].attn, model.blocks[0].ln1
    c = model.tok_emb(x)[0].double()
    p = posenc.functional.sinusoidal_table(torch.arange(8), 32).double()
    h = c + p
    sigma = torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + ln.eps)
    cn = ln.weight.double() * (c - c.mean(-1, keepdim=True)) / sigma + ln.bias.double()
    pn = ln.weight.double() * (p - p.mean(-1, keepdim=True)) / sigma
    wq, wk = attn.q_proj.weight.double(), attn.k_proj.weight.double()
    head = slice(0, 16)  # head 0
    qc, qp = (cn @ wq.t())[:, head], (pn @ wq.t())[:, head]
    kc, kp = (cn @ wk.t())[:, head], (pn @ wk.t())[:, head]
    s = 16**-0.5
    expect = {
        "content·content": qc @ kc.t() * s,
        "content·position": qc @ kp.t() * s,
        "position·content": qp @ kc.t() * s,
        "position·position": qp @ kp.t() * s,
    }
    for k, v in expect.items():
        # float32 LayerNorm (2·D), projection (D) and a Dh-long product against float64
        assert_close(terms[k][0, 0].double(), v, n=3 * 32 + 16, dtype=torch.float32)


# ============================================================================ decay
def test_su_bound_direct_transcription():
    """(1/K) Σ_{j=1..K} |Σ_{k<j} e^{i m θ_k}|, written as loops (RoFormer §3.4.3)."""
    inv = posenc.functional.sinusoidal_inv_freq(16)  # K = 8
    got = su_bound(inv, 40)
    for m in (0, 1, 5, 40):
        total = 0.0
        for j in range(1, 9):
            re = sum(math.cos(m * float(inv[k])) for k in range(j))
            im = sum(math.sin(m * float(inv[k])) for k in range(j))
            total += math.hypot(re, im)
        assert float(got[m]) == pytest.approx(total / 8, rel=1e-6)
    assert float(got[0]) == pytest.approx((8 + 1) / 2)


def test_ones_curve_of_rope_is_mean_cosine():
    enc = posenc.build("rope", heads=2, head_dim=16)
    got = ones_curve(enc, 50)
    inv = posenc.functional.sinusoidal_inv_freq(16).double()
    m = torch.arange(51, dtype=torch.float64)
    # mean of 8 cosines of float32 angles m·θ (m <= 50) against float64
    assert_close(got, torch.cos(m[:, None] * inv).mean(-1), n=8, magnitude=50.0, dtype=torch.float32)


# ============================================================================ padding probe
def test_padding_probe_zero_far_above_circular():
    """Islam et al. in 1-D, fixed seed: zero padding decodes position, circular does not.

    Chance is 1/32. Circular padding makes the stack equivariant to cyclic shifts of a
    stationary input, so the probe cannot beat chance beyond sampling noise (2× chance
    allowed); zero padding must be at least 5× chance and 4× circular.
    """
    kw = dict(length=32, depth=4, kernel=9, channels=16, train_steps=30, probe_steps=150, n_probe=48, n_test=32)
    zero = probe_padding("zeros", seed=0, **kw)
    circ = probe_padding("circular", seed=0, **kw)
    chance = 1 / 32
    assert circ["accuracy"] < 2 * chance, circ["accuracy"]
    assert zero["accuracy"] > 5 * chance, zero["accuracy"]
    assert zero["accuracy"] > 4 * circ["accuracy"]


def test_padding_probe_rejects_bad_options():
    with pytest.raises(ValueError, match="padding_mode"):
        probe_padding("reflect", length=8, train_steps=0, probe_steps=1)
    with pytest.raises(ValueError, match="kernel must be odd"):
        probe_padding("zeros", kernel=4, length=8, train_steps=0, probe_steps=1)


# ============================================================================ checkpoints
def test_checkpoint_run_directory_and_attention_maps(tmp_path):
    """A tiny model trained a few steps, saved as posenc compare saves it, is analysed."""
    from posenc.analysis.attention_maps import run_attention_maps

    (tmp_path / "checkpoints").mkdir()
    for name in ("rope", "learned"):
        model, extra = models.train_tiny(specs.Spec(name), steps=3, length=16, batch=4, dim=32, heads=2, vocab_size=20)
        posenc.save_checkpoint(tmp_path / "checkpoints" / f"{name}.pt", model, **extra)
    notes: list[str] = []
    subjects = models.load_subjects([str(tmp_path)], notes)
    assert sorted(s.name for s in subjects) == ["learned", "rope"] and not notes
    assert all(s.train_len == 16 for s in subjects)
    res = {r["encoding"]: r for r in run_attention_maps(subjects, notes, factor=4)}
    assert [m["length"] for m in res["rope"]["maps"]] == [16, 64]
    assert all("attention" in m for m in res["rope"]["maps"])
    # learned cannot run at 4× its table: a note, not a crash
    assert "error" in res["learned"]["maps"][1] and "max_len" in res["learned"]["maps"][1]["error"]
    assert any("learned" in n for n in notes)
    probs = torch.tensor(res["rope"]["maps"][0]["attention"])
    assert_close(probs.sum(-1), torch.ones(16), n=16)  # a softmax row sums to 1 up to 16 roundings


def test_training_length_from_a_compare_checkpoint(tmp_path):
    """posenc compare stores its config under ``compare_config``; its train_len wins over max_len."""
    model = small_model("rope")
    posenc.save_checkpoint(tmp_path / "rope.pt", model, compare_config={"train_len": 24, "steps": 5})
    (sub,) = models.load_subjects([str(tmp_path / "rope.pt")], [])
    assert sub.train_len == 24 and sub.source == str(tmp_path / "rope.pt")


def test_checkpoint_path_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        models.checkpoint_paths(tmp_path / "nope")
    with pytest.raises(ValueError, match="no checkpoints"):
        models.checkpoint_paths(tmp_path)


# ============================================================================ specs and the command
def test_resolve_rejects_unknown_names_and_splits_lists():
    with pytest.raises(ValueError, match=r"unknown encoding 'no-such-encoding'; available: .*rope"):
        specs.resolve(["sinusoidal", "no-such-encoding"])
    kept, _ = specs.resolve(["rope,t5", "alibi", 'rope@{"base": 500, "partial_rotary_factor": 0.5},xpos'])
    assert [s.label for s in kept] == ["rope", "t5", "alibi", "rope base=500,partial_rotary_factor=0.5", "xpos"]


def test_spec_parse():
    assert specs.Spec.parse('rope@{"base": 500000}').options == {"base": 500000}
    with pytest.raises(ValueError, match="not valid JSON"):
        specs.Spec.parse("rope@{base}")
    with pytest.raises(ValueError, match="JSON object"):
        specs.Spec.parse("rope@[1]")


def test_command_writes_json_and_png(tmp_path, capsys):
    from posenc.cli import main

    rc = main(["analyze", "decompose", "--encodings", "sinusoidal", "t5", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "decompose.json").read_text())
    assert [r["encoding"] for r in data["results"]] == ["sinusoidal", "t5"]
    assert (tmp_path / "decompose.png").stat().st_size > 1000
    assert "content·content" in capsys.readouterr().out


@pytest.mark.parametrize("analysis", ["decompose", "invariance", "similarity", "decay", "attention-maps"])
def test_every_command_takes_comma_lists_and_rejects_unknown_names(analysis, tmp_path, capsys):
    """Issue 11: `--encodings rope,t5` was one unknown name, skipped, exit 0 with nothing to plot."""
    from posenc.cli import main

    rc = main(["analyze", analysis, "--encodings", "rope,foo", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown encoding 'foo'" in err and "available: " in err and "rope" in err
    if analysis in ("decompose", "invariance"):
        assert main(["analyze", analysis, "--encodings", "rope,t5", "--out", str(tmp_path)]) == 0
        data = json.loads((tmp_path / f"{analysis}.json").read_text())
        assert [r["encoding"] for r in data["results"]] == ["rope", "t5"]


@pytest.mark.parametrize("content", [b"", b"\x00\x01garbage" * 10, None])
def test_bad_checkpoint_is_an_error_not_random_weights(content, tmp_path, capsys):
    from posenc.cli import main

    path = tmp_path / "bad.pt"
    if content is None:  # a real checkpoint cut in half
        posenc.save_checkpoint(path, posenc.TransformerLM(16, 8, 1, 2, "rope"))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_bytes(content)
    rc = main(["analyze", "decompose", "--checkpoint", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.pt" in err and "not a readable posenc checkpoint" in err


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_unusable_out_is_one_line(where, tmp_path, capsys):
    from posenc.cli import main

    f = tmp_path / "f"
    f.write_text("x")
    out = f if where == "file" else f / "sub"
    assert main(["analyze", "decay", "--encodings", "rope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and "--out" in err


@pytest.mark.parametrize(
    "spec", ['rope@{"axes": 2}', 'rope@{"axes": 2, "rope_mixed": true}', "mrope", 'sinusoidal@{"axes": 2}']
)
def test_invariance_per_axis_for_positions_with_axes(spec):
    """Multi-axis encodings: grid positions, each axis shifted alone; relative ones stay put on
    every axis, absolute ones move on every axis."""
    from posenc.analysis.invariance import run_invariance

    (sub,) = models.build_subjects(
        [specs.Spec.parse(spec)], [], max_len=64, seed=0, dim=32, depth=2, heads=2, vocab_size=50
    )
    (res,) = run_invariance([sub], shifts=(1, 9, 300), length=16, batch=2)
    axes = sub.model.blocks[0].attn.encoding.axes
    assert res["axes"] == axes > 1 and res["length"] == round(16 ** (1 / axes)) ** axes
    for row in res["shifts"]:
        assert [p["axis"] for p in row["per_axis"]] == list(range(axes))
        for p in [row, *row["per_axis"]]:
            if res["relative"]:
                assert p["logits"] < 1e-5 and p["probs"] < 1e-5, (spec, row)
            else:
                assert p["logits"] > 1e-2, (spec, row)


def test_decay_draws_the_bias_of_a_hidden_state_encoding(tmp_path):
    """FoX's bias comes from the layer input: `analyze decay` draws the first layer's bias as its
    forward computes it (c_i - c_j <= 0, falling with distance), not a context-free call that fails."""
    from posenc.cli import main

    assert main(["analyze", "decay", "--encodings", "fox,alibi", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decay.json").read_text())
    fox = next(r for r in data["results"] if r["encoding"] == "fox")
    b = fox["bias"]
    assert b[0] == 0.0 and all(x <= 0.0 for x in b) and b[-1] < b[1]


@pytest.mark.parametrize("name", ["rope", "t5", "deberta", "sinusoidal", "fox"])
def test_decomposition_with_grouped_keys_sums_to_the_logits(name):
    """kv_heads < heads: position parts of the keys are projected with the grouped W_K."""
    torch.manual_seed(0)
    model = posenc.TransformerLM(50, 32, 2, 4, name, 64, kv_heads=2).eval()
    terms, _, residual = decompose_terms(model, tokens())
    assert residual < 1e-5, (name, residual)
    assert terms["content·content"].shape == (2, 4, 16, 16)


@pytest.mark.parametrize("fields", [{"qk_norm": "rms"}, {"softcap": 5.0}])
def test_decomposition_refuses_non_linear_logits(fields):
    torch.manual_seed(0)
    model = posenc.TransformerLM(50, 32, 2, 4, "rope", 64, **fields).eval()
    with pytest.raises(ValueError, match="not a sum of content and position terms"):
        decompose_terms(model, tokens())
