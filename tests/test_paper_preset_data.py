"""WikiText-103's word-level reader (``--data-dir``) and the paper preset's command-line refusals."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import tolerance
from posenc.cli import main
from posenc.compare.config import PRESETS, from_dict, preset_config
from posenc.data import DataError
from posenc.data.wikitext import build_vocab, encode_file, load_vocab, load_wikitext, save_vocab


def write_corpus(root, lines=(300, 60, 60), words=200, seed=0):
    """A stand-in for WikiText-103 in its format: `` = Title = `` headings, blank lines, and
    space-separated words with ``<unk>``, in ``wiki.{train,valid,test}.tokens``."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(words)] + ["<unk>", ",", "."]
    for split, n in zip(("train", "valid", "test"), lines, strict=True):
        out = []
        for i in range(n):
            if i % 12 == 0:
                out += ["", f" = Title {i} = ", ""]
            else:  # Zipf-like: low ids frequent
                out.append(" " + " ".join(vocab[min(int(rng.paretovariate(0.7)) - 1, len(vocab) - 1)]
                                          for _ in range(rng.randint(4, 20))) + " ")  # fmt: skip
        (root / f"wiki.{split}.tokens").write_text("\n".join(out) + "\n", encoding="utf-8")
    return root


def test_vocab_is_fairseq_preprocess_order(tmp_path):
    # fairseq Dictionary: <s> <pad> </s> <unk>, then by count descending, ties alphabetical,
    # padded with madeupwordNNNN to a multiple of 8; one </s> per line (empty lines too)
    f = tmp_path / "wiki.train.tokens"
    f.write_text(" b a c <unk>\n\n a b a\n d\n", encoding="utf-8")
    symbols = build_vocab(f)
    assert symbols == ["<s>", "<pad>", "</s>", "<unk>", "a", "b", "c", "d"]  # a:3, b:2, c and d: 1
    f.write_text("x y z\n", encoding="utf-8")
    assert build_vocab(f) == ["<s>", "<pad>", "</s>", "<unk>", "x", "y", "z", "madeupword0000"]
    index = {s: i for i, s in enumerate(symbols)}
    g = tmp_path / "v.tokens"
    g.write_text(" a zzz\n\n d\n", encoding="utf-8")
    assert encode_file(g, index).tolist() == [4, 3, 2, 2, 7, 2]  # an unseen word is <unk> (3); </s> is 2


def test_corpus_streams_and_cached_vocab(tmp_path):
    d = write_corpus(tmp_path / "wt")
    data = load_wikitext(d)
    n_lines = len((d / "wiki.train.tokens").read_text(encoding="utf-8").splitlines())
    assert int((data.train == 2).sum()) == n_lines  # one </s> per line
    assert data.vocab_size % 8 == 0 and data.symbols[:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    b = data.train_batch(3, 4, 16, seed=0)
    assert b.tokens.shape == (4, 16) and b.tokens.dtype == torch.int64
    torch.testing.assert_close(b.tokens[:, 1:], b.targets[:, :-1], rtol=0, atol=0)
    # the vocabulary file is JSON and read back as is; one from another training file is refused
    vf = tmp_path / "vocab.json"
    save_vocab(vf, data.symbols, data.train_bytes)
    assert json.loads(vf.read_text())["symbols"] == data.symbols
    assert load_wikitext(d, vocab_file=vf).symbols == data.symbols
    with pytest.raises(DataError, match="not the same corpus"):
        load_vocab(vf, data.train_bytes + 1)
    vf.write_text("[1, 2]")
    with pytest.raises(DataError, match="is not a posenc-wikitext-vocab/1 file"):
        load_wikitext(d, vocab_file=vf)


def test_missing_data_dir_or_file_is_one_line_exit_2(tmp_path, capsys):
    args = ["compare", "--preset", "paper", "--out", str(tmp_path / "run"), "--no-progress"]
    assert main([*args, "--data-dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--data-dir" in err and "is not a directory" in err
    d = write_corpus(tmp_path / "wt")
    (d / "wiki.valid.tokens").unlink()
    assert main([*args, "--data-dir", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "wiki.valid.tokens" in err and "not found" in err
    assert not (tmp_path / "run" / "config.json").exists()
    assert main(args) == 2  # no --data-dir: the preset's bands need a word-level vocabulary
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "give --data-dir DIR" in err and "256 tokens" in err


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--tokens-per-update", "100"], r"--tokens-per-update must equal batch_size x train_len \(144 x 512 = 73728\), got 100: give a multiple of 512"),
        (["--micro-batch", "5"], r"--micro-batch must divide batch_size=144, got 5"),
        (["--micro-batch", "0"], r"--micro-batch .*must be an int in \[1, "),
        (["--adaptive-cutoffs", "60000,20000"], "strictly increasing"),
        (["--task", "copy"], r"adaptive_cutoffs is for a word-level corpus"),
        (["--fsdp", "--val-points", "2"], r"--fsdp evaluates once, after training, .*: val_points must be 0, got 2"),
    ],
)  # fmt: skip
def test_paper_flags_are_refused_in_one_line(tmp_path, capsys, flags, match):
    d = write_corpus(tmp_path / "wt")
    rc = main(["compare", "--preset", "paper", "--data-dir", str(d), "--out", str(tmp_path / "r"), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0
    assert __import__("re").search(match, err), err


def test_paper_preset_is_press_et_al_setup():
    cfg = preset_config("paper", data_dir="/somewhere")
    assert (cfg.depth, cfg.dim, cfg.heads, cfg.mlp_ratio * cfg.dim) == (16, 1024, 8, 4096)
    assert cfg.final_norm is False and cfg.adaptive_cutoffs == [20000, 60000] and cfg.dropout == 0.3
    assert cfg.attn_dropout == cfg.activation_dropout == 0.1  # fairseq's attention/activation dropout
    assert cfg.train_len * cfg.batch_size == cfg.tokens_per_update == 73728 and cfg.steps == 286000
    assert cfg.grad_clip == 0.1 and cfg.dtype == "bfloat16"
    assert cfg.eval_lens == [512, 1012, 2512, 5512, 10512]
    assert "paper" in PRESETS
    # the new fields at their defaults are not written: an older config reads, fingerprints and
    # compares as it did (its run folders resume)
    quick = preset_config("quick")
    new = {"data_dir", "tokens_per_update", "micro_batch", "final_norm", "adaptive_cutoffs", "attn_dropout",
           "activation_dropout"}  # fmt: skip
    assert not new & set(quick.to_dict()) and new - {"micro_batch"} <= set(cfg.to_dict())
    assert from_dict(quick.to_dict()).fingerprint() == quick.fingerprint()
    assert cfg.differing_fields(quick.to_dict()) != [] and quick.differing_fields(quick.to_dict()) == []


def test_stride_1_sliding_evaluation_scores_each_token_with_up_to_L_minus_1_tokens_of_context(tmp_path):
    # Press et al.'s sliding-window evaluation, written from its definition: token t + 1 of the
    # validation stream is predicted from tokens max(0, t - L + 1) .. t (the first window scores
    # all its tokens); the mean of -log p over the scored tokens
    import math

    import posenc
    from posenc.compare.evaluate import EvalSettings, evaluate

    data = load_wikitext(write_corpus(tmp_path / "wt"))
    torch.manual_seed(0)
    model = posenc.TransformerLM(data.vocab_size, 16, 1, 2, "alibi", 8, adaptive_cutoffs=[20, 80]).eval()
    L, n = 8, 30  # 30 windows: tokens 1 .. 37 of the stream are scored
    settings = EvalSettings(batch_size=4, tokens=n, sliding=True, stride=1)
    got = evaluate(model, data, L, device=torch.device("cpu"), settings=settings)
    stream = data.val[: n + L].long()
    nll = []
    with torch.no_grad():
        for t in range(n + L - 1):  # predict stream[t + 1]
            ctx = stream[max(0, t - L + 1) : t + 1][None]
            nll.append(-float(model(ctx)[0, -1, stream[t + 1]]))
    assert got.tokens == len(nll) == n + L - 1
    # each log-prob: projections over D, attention over <= L keys, the softmax over the vocabulary
    tol = tolerance(n=2 * 16 + L + data.vocab_size + len(nll))
    assert got.loss == pytest.approx(sum(nll) / len(nll), rel=tol["rtol"], abs=tol["atol"])
    assert got.ppl == pytest.approx(math.exp(got.loss))
