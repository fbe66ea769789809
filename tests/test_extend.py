"""``posenc extend MODEL`` on a tiny HF checkpoint made here (issue 27): outputs, bad input, resume."""

from __future__ import annotations

import json

import pytest
import torch
from tests.conftest import assert_close, attention_n

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import posenc.hf as ph  # noqa: E402
from posenc.cli import main  # noqa: E402
from posenc.extend.passkey import Tokens, min_length, passkey_ids  # noqa: E402
from posenc.extend.run import parse_lengths, resolve_lengths  # noqa: E402

L = 32  # training length of the tiny checkpoints


def llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=L, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**(cfg | kw))).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    llama().save_pretrained(path)
    return path


def run(*args) -> int:
    try:
        return main(["extend", *map(str, args)])
    except SystemExit as e:  # argparse's own errors: a flag's value out of its declared range
        return e.code


FAST = ("--windows", "1", "--passkey-trials", "1", "--chunk", "16")


def test_extend_writes_every_output(ckpt, tmp_path, capsys):
    out = tmp_path / "run"
    rc = run(
        ckpt, "--lengths", "1x,2x", "--methods", "none,rerope,self-extend,sink-window,longrope", "--out", out, *FAST
    )
    assert rc == 0
    for name in ("config.json", "results.json", "results.csv", "table.md", "report.md", "ppl.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "results.json").read_text())
    assert res["train_len"] == L and res["settings"]["lengths"] == [L, 2 * L]
    cells = {(c["method"], c["length"]): c for c in res["cells"]}
    assert len(cells) == 10
    assert not cells[("longrope", L)]["applicable"] and "short_factor" in cells[("longrope", L)]["why"]
    none = cells[("none", L)]
    # (a cache holding rotated keys keeps no flag tensor while its rows are known finite: posenc.hf.keys)
    assert none["ppl"] > 1 and none["stride"] == L // 2 and none["kv_bytes"] == 2 * 2 * 2 * L * 8 * 4
    # sink-window's cache holds sinks + window = L tokens: at L its windows are the plain model's
    assert cells[("sink-window", L)]["ppl_windows"] == pytest.approx(none["ppl_windows"], rel=1e-5)
    report = (out / "report.md").read_text()
    assert "In-window reference: `none` at L=32" in report and "Furthest within +10 %" in report
    printed = capsys.readouterr().out
    assert "perplexity by length" in printed and "self-extend" in printed


def test_passkey_cells_and_heatmap(ckpt, tmp_path):
    n = min_length(Tokens()) + 20  # the shortest prompt that holds some filler
    out = tmp_path / "pk"
    assert run(ckpt, "--lengths", str(n), "--methods", "none,self-extend", "--passkey-trials", "2", "--windows", "1",
               "--out", out) == 0  # fmt: skip
    cell = json.loads((out / "results.json").read_text())["cells"][0]
    assert set(cell["passkey"]) == {"0", "0.25", "0.5", "0.75", "1"}
    assert all(v in (0.0, 0.5, 1.0) for v in cell["passkey"].values())
    assert (out / "passkey.png").is_file()


def test_passkey_prompt_is_the_papers():
    ids, where = passkey_ids(Tokens(), 400, 0.5, "68513")
    text = bytes(ids.tolist()).decode()
    assert len(ids) == 400 and text.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert "The pass key is 68513. Remember it. 68513 is the pass key." in text
    assert text.endswith("What is the pass key? The pass key is 68513")
    assert bytes(ids[where].tolist()) == b" 68513"
    assert passkey_ids(Tokens(), 40, 0.5, "68513") is None  # no room for filler


def test_resume_keeps_the_cells_it_has(ckpt, tmp_path):
    out = tmp_path / "run"
    args = (ckpt, "--lengths", "1x", "--methods", "none,ntk", "--out", out, *FAST)
    assert run(*args) == 0
    first = json.loads((out / "results.json").read_text())
    partial = {**first, "cells": first["cells"][:1]}  # as if interrupted after the first cell
    (out / "results.json").write_text(json.dumps(partial))
    assert run(*args, "--resume") == 0
    again = json.loads((out / "results.json").read_text())
    assert [c["method"] for c in again["cells"]] == ["none", "ntk"]
    assert again["cells"][0] == first["cells"][0]  # the kept cell is not recomputed
    assert run(ckpt, "--lengths", "2x", "--methods", "none,ntk", "--out", out, *FAST, "--resume") == 2


def test_run_folder_guarantees(ckpt, tmp_path, capsys):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = (ckpt, "--lengths", "1x", "--methods", "none", "--out", out, *FAST)
    assert run(*args) == 2  # not empty: neither --resume nor --overwrite
    assert "is not empty (notes.txt); continue that run with --resume" in capsys.readouterr().err
    (out / "report.md").write_text("their report")
    assert run(*args, "--overwrite") == 2  # would replace a file no run listed as its own
    assert "holds report.md, which this run would replace" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "their report"
    (out / "report.md").unlink()
    assert run(*args, "--overwrite") == 0 and run(*args, "--overwrite") == 0  # its own files: replaced
    assert (out / "notes.txt").read_text() == "mine"  # never removed: no run wrote it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--lengths", "3y"), "--lengths: '3y' is not a token count or a multiple"),
        (("--lengths", "4"), "--lengths: '4' is not a token count"),
        (("--lengths=-2x",), "--lengths: '-2x'"),
        (("--methods", "none,warp"), "--methods: unknown method 'warp'; allowed: none, linear"),
        (("--windows", "0"), "--windows: must be an integer in 1..10000, got '0'"),  # names the upper bound too
        (("--passkey-trials", "-1"), "--passkey-trials: must be an integer in 0..10000"),
    ],
)
def test_bad_input_is_one_line_exit_2(ckpt, tmp_path, capsys, args, message):
    assert run(ckpt, "--out", tmp_path / "x", *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("posenc extend: error: ") and message in err
    assert not (tmp_path / "x").exists()


def test_bad_model_paths_exit_2(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    cases = {
        tmp_path / "missing": "does not exist (posenc extend reads local directories, never the hub)",
        tmp_path / "file.txt": "is not a directory",
        tmp_path / "empty": "has no config.json",
        tmp_path / "odd": "model_type 'bert' is not one posenc.hf converts",
        "meta-llama/Llama-2-7b-hf": "does not exist",
    }
    for path, message in cases.items():
        assert run(path, "--out", tmp_path / "o") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_lengths_parse_and_resolve():
    assert parse_lengths("2x, 4096,0.5x") == [("x", 2.0), ("tokens", 4096), ("x", 0.5)]
    assert resolve_lengths(parse_lengths("1x,2x,64,0.1x"), 32) == [8, 32, 64]
    with pytest.raises(ValueError, match=r"--lengths: 'nanx' is not a token count"):
        parse_lengths("nanx")


def test_converted_and_gpt2_models(tmp_path):
    # a model saved after conversion (RoPE on 1 layer, NoPE on the other): the methods change the RoPE layer
    conv = ph.convert(llama(), encoding=["rope", "nope"])
    conv.save_pretrained(tmp_path / "conv")
    assert run(tmp_path / "conv", "--lengths", "2x", "--methods", "none,yarn", "--out", tmp_path / "o1", *FAST) == 0
    cells = json.loads((tmp_path / "o1" / "results.json").read_text())["cells"]
    assert all(c["applicable"] for c in cells) and cells[0]["ppl"] != cells[1]["ppl"]
    # stock GPT-2 (learned positions): no rotary method applies; sink-window does (positions in the cache)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=4, n_positions=L, attn_pdrop=0.0,
                               bos_token_id=None, eos_token_id=None)).save_pretrained(tmp_path / "gpt2")  # fmt: skip
    assert run(tmp_path / "gpt2", "--lengths", "1x", "--methods", "none,yarn,sink-window", "--out", tmp_path / "o2",
               *FAST) == 0  # fmt: skip
    got = {c["method"]: c for c in json.loads((tmp_path / "o2" / "results.json").read_text())["cells"]}
    assert got["none"]["applicable"] and got["sink-window"]["applicable"] and not got["yarn"]["applicable"]


def test_compare_run_directory(tmp_path):
    from posenc import TransformerLM
    from posenc.checkpoint import save_checkpoint
    from posenc.compare.config import preset_config
    from posenc.compare.train import checkpoint_path
    from posenc.extend import load_subject
    from posenc.extend.evaluate import token_scores

    run_dir = tmp_path / "cmp"
    cfg = preset_config("quick", encodings=["rope", "alibi"], dim=16, depth=1, heads=2, train_len=L, eval_lens=[L])
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.manual_seed(0)
    save_checkpoint(checkpoint_path(run_dir / "checkpoints", cfg, "rope", cfg.seeds[0]),
                    TransformerLM(256, 16, 1, 2, encoding="rope", max_len=4 * L))  # fmt: skip
    out = tmp_path / "o"
    assert run(run_dir, "--lengths", "1x,2x", "--methods", "none,self-extend,sink-window", "--out", out, *FAST) == 0
    cells = {(c["method"], c["length"]): c for c in json.loads((out / "results.json").read_text())["cells"]}
    assert all(c["applicable"] for c in cells.values()) and len(cells) == 6
    # the posenc model's own caches: chunked prefill (self-extend) and SinkWindow equal the full forward in-window
    sub = load_subject(str(run_dir))
    assert sub.kind == "run" and sub.train_len == L and sub.rope == {"base": 10000.0, "rotary_dim": 8}
    ids = torch.randint(0, 256, (2 * L,))
    n = attention_n(dim=16, length=2 * L, head_dim=8) + 16 + 64 + 2 * 16  # one block, the MLP (ratio 4), norm, head
    tol = {"n": n, "dtype": torch.float32, "magnitude": 10.0}  # nll of a random model: ~log 256 = 5.5
    for method in ("self-extend", "sink-window"):
        model, opts, _ = sub.variant(method, 2 * L)
        sink = opts if method == "sink-window" else None
        whole, _, _ = token_scores("run", model, ids, chunk=2 * L)
        part, _, _ = token_scores("run", model, ids, chunk=5, sink=sink)
        if sink is None:
            assert_close(part, whole, **tol)
        else:
            plain, _, _ = token_scores("run", sub.model, ids, chunk=2 * L)
            assert_close(part[: L - 1], plain[: L - 1], **tol)
            assert not torch.allclose(part[L:], plain[L:], atol=1e-4)
    assert run(run_dir, "--encoding", "t5", "--out", tmp_path / "o3") == 2


def test_a_tokenizer_saved_in_model_is_used(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from posenc.extend.passkey import FILLER, KEY_LINE, PREFIX, QUESTION

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PREFIX, FILLER * 3, KEY_LINE.format(key="12345"), QUESTION], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    llama(vocab_size=320).save_pretrained(tmp_path / "m")
    fast.save_pretrained(tmp_path / "m")
    tokens = Tokens(PreTrainedTokenizerFast.from_pretrained(tmp_path / "m"))
    n = min_length(tokens) + 10
    assert n < min_length(Tokens()) - 50  # merged tokens: shorter than the byte prompt
    out = tmp_path / "o"
    assert run(tmp_path / "m", "--lengths", f"1x,{n}", "--methods", "none", "--out", out, *FAST) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["tokens_source"].startswith("tokenizer ")  # AutoTokenizer, read from MODEL
    cell = next(c for c in res["cells"] if c["length"] == n)
    assert set(cell["passkey"]) == {"0", "0.25", "0.5", "0.75", "1"} and None not in cell["passkey"].values()


def test_the_example_trains_saves_and_extends(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "extend_tiny_llama.py"
    spec = importlib.util.spec_from_file_location("extend_tiny_llama", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "ex"
    rc = example.main(["--out", str(out), "--steps", "4", "--batch-size", "2", "--seq-len", "256", "--threads", "1",
                       "--dim", "16", "--check", "2", "--lengths", "1x,2x", "--methods", "none,rerope,yarn",
                       "--windows", "1", "--passkey-trials", "1"])  # fmt: skip
    assert rc == 0 and (out / "model" / "config.json").is_file()
    res = json.loads((out / "extend" / "results.json").read_text())
    assert res["train_len"] == 256 and {c["method"] for c in res["cells"]} == {"none", "rerope", "yarn"}
    assert all(set(c["passkey"]) == {"0", "0.25", "0.5", "0.75", "1"} for c in res["cells"])
    printed = capsys.readouterr().out
    assert "perplexity by length" in printed and "in-window passkey check: " in printed


def test_another_family_needs_no_code_of_its_own(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=L, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "qwen")
    out = tmp_path / "o"
    assert run(tmp_path / "qwen", "--lengths", "2x", "--methods", "none,yarn,self-extend", "--out", out, *FAST) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert all(c["applicable"] for c in cells) and len({round(c["ppl"], 6) for c in cells}) == 3


def test_a_failure_before_the_first_cell_leaves_the_folder_as_it_was(ckpt, tmp_path, monkeypatch):
    import posenc.extend.run as runmod

    def boom(*a, **k):
        raise ValueError("the first cell failed")

    monkeypatch.setattr(runmod, "perplexity", boom)
    out = tmp_path / "o"
    assert run(ckpt, "--lengths", "1x", "--methods", "none", "--out", out, *FAST) == 2
    assert not out.exists()  # config.json, the manifest, the lock and the folder this run made: gone


def test_a_text_shorter_than_the_longest_length_is_refused(ckpt, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("a short text " * 4)
    assert run(ckpt, "--text", tmp_path / "short.txt", "--lengths", "2x", "--out", tmp_path / "o") == 2
    assert "--text: 52 tokens, fewer than the longest length 64" in capsys.readouterr().err


def test_the_reading_is_computed_from_the_numbers():
    from posenc.extend.report import reading

    def cell(m, n, ppl, pk):
        return {"method": m, "length": n, "applicable": True, "ppl": ppl, "passkey": {"0": pk, "1": pk}}

    results = {"train_len": 32, "settings": {"methods": ["none", "rerope", "linear"]}, "cells": [
        cell("none", 32, 10.0, 1.0), cell("none", 64, 10.9, 0.5), cell("none", 128, 30.0, 0.0),
        cell("rerope", 32, 10.0, 1.0), cell("rerope", 64, 9.5, 1.0), cell("rerope", 128, 10.5, 0.75),
        cell("linear", 32, 12.0, 0.5), cell("linear", 64, 12.0, 0.5), cell("linear", 128, 12.0, 0.0)]}  # fmt: skip
    text = "\n".join(reading(results, within=10))
    assert (
        "In-window reference: `none` at L=32, perplexity 10.000; a method holds while its perplexity stays <= 11.000"
        in text
    )
    assert "Furthest within +10 %: `rerope` up to L=128 (4x the training length)." in text
    assert "Held up to (tokens): `none` 64, `rerope` 128." in text
    assert "`linear` is above +10 % already at its shortest length." in text
    assert "At L=128: `rerope` 10.500 < `linear` 12.000 < `none` 30.000." in text
    assert "Passkey `none`: 100 % within the window; breaks (below half of that) at L=128." in text
    assert "Passkey `rerope`: 100 % within the window; does not break up to L=128." in text
    assert "Passkey `linear`: 50 % within the window; breaks (below half of that) at L=128." in text
    results["cells"][0]["passkey"] = {"0": 0.0, "1": 0.25}
    assert "`none` retrieves 12 % within its training window; this model does not do the task" in "\n".join(
        reading(results, within=10)
    )
