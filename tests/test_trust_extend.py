"""``posenc extend`` as hardened as ``compare`` (issue 61): its output folder never holds or
removes the model or another tool's files, ``--resume`` checks what it resumes, every size
from a file or a flag is bounded first, and every bad flag value or model file is one line,
exit 2. (Items 1-2, code in a model folder, are in test_trust_hostile.py.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.test_trust_hostile import TINY  # noqa: E402 - the smallest compare run, as the hostile suite trains it
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import posenc.hf as ph  # noqa: E402
from posenc.cli import main, make_parser  # noqa: E402
from posenc.fields import ListOf  # noqa: E402
from posenc.output.manifest import MANIFEST  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

L = 32
FAST = ["--windows", "1", "--passkey-trials", "0", "--chunk", "16"]


def llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=L)  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**(cfg | kw))).eval()


def run(*args) -> int:
    try:
        return main(["extend", *map(str, args)])
    except SystemExit as e:  # argparse's own errors
        return e.code


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("Writing model shards")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run1(tmp_path_factory) -> Path:
    """A finished one-seed ``compare`` run of rope (trained at 16 tokens)."""
    out = tmp_path_factory.mktemp("r") / "r1"
    assert main(["compare", *TINY, "--encodings", "rope", "--out", str(out)]) == 0
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ================================================================== data lost (items 3, 4)
@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_out_is_never_the_model_inside_it_or_around_it(run1, tmp_path, capsys, where):
    """Item 3: on 222d208 `--out MODEL --overwrite` deleted MODEL/checkpoints/, exit 0."""
    model = copy(run1, tmp_path / "outer" / "r1x")
    out = {"same": model, "inside": model / "sub", "around": tmp_path / "outer"}[where]
    before = files(model)
    assert run(model, "--encoding", "rope", "--lengths", "1x", "--methods", "none", *FAST, "--out", out,
               "--overwrite") == 2  # fmt: skip
    line = one_line(capsys)
    assert "--out" in line and "MODEL" in line, line
    assert files(model) == before


def test_overwrite_never_removes_another_tools_files(run1, ckpt, tmp_path, capsys):
    """Item 4: on 222d208 `extend --out <compare run> --overwrite` deleted the run's checkpoints."""
    theirs = copy(run1, tmp_path / "compare-run")
    before = files(theirs)
    assert run(ckpt, "--lengths", "1x", "--methods", "none", *FAST, "--out", theirs, "--overwrite") == 2
    assert "holds a posenc compare run" in one_line(capsys)
    assert run(ckpt, "--lengths", "1x", "--methods", "none", *FAST, "--out", theirs, "--resume") == 2
    assert "holds a posenc compare run" in one_line(capsys)
    assert files(theirs) == before
    ours = tmp_path / "extend-run"
    assert run(ckpt, "--lengths", "1x", "--methods", "none", *FAST, "--out", ours) == 0
    assert json.loads((ours / MANIFEST).read_text())["tool"] == "posenc extend"
    capsys.readouterr()
    before = files(ours)
    assert main(["compare", *TINY, "--encodings", "rope", "--out", str(ours), "--overwrite"]) == 2
    assert "holds a posenc extend run" in one_line(capsys)
    assert files(ours) == before
    # a manifest written by 222d208 names no tool: extend's folders are told by their config
    m = json.loads((ours / MANIFEST).read_text())
    (ours / MANIFEST).write_text(json.dumps({"written": m["written"]}))
    assert main(["compare", *TINY, "--encodings", "rope", "--out", str(ours), "--overwrite"]) == 2
    assert "holds a posenc extend run" in one_line(capsys)
    assert run(ckpt, "--lengths", "1x", "--methods", "none", *FAST, "--out", ours, "--overwrite") == 0


# ================================================================== reported as fine, but wrong (items 5-7, 9)
def test_resume_refuses_a_changed_model_or_text(ckpt, tmp_path, capsys):
    """Item 5: on 222d208 a resume after the model's rope_theta and the text changed mixed both in one table."""
    model, text, out = copy(ckpt, tmp_path / "m"), tmp_path / "t.txt", tmp_path / "o"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    args = (model, "--lengths", "1x", "--methods", "none,rerope", "--text", text, *FAST, "--out", out)
    assert run(*args) == 0
    full = json.loads((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps({**full, "cells": full["cells"][:1]}))  # as if killed
    config = (model / "config.json").read_text()
    c = json.loads(config)
    c["rope_parameters"]["rope_theta"] = 500.0
    (model / "config.json").write_text(json.dumps(c))
    capsys.readouterr()
    assert run(*args, "--resume") == 2
    assert "model_fingerprint: the model's config, weights or tokenizer changed" in one_line(capsys)
    (model / "config.json").write_text(config)
    text.write_text("Another text entirely, with other words in it. " * 40)
    assert run(*args, "--resume") == 2
    assert "text_fingerprint" in one_line(capsys)
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    assert run(*args, "--resume") == 0
    again = json.loads((out / "results.json").read_text())["cells"]
    assert [(c["method"], c["ppl"]) for c in again] == [(c["method"], c["ppl"]) for c in full["cells"]]


def test_a_run_folder_whose_config_was_edited_is_refused(run1, tmp_path, capsys):
    """Item 6: on 222d208 an edited train_len (16 -> 64) ran YaRN with original 64."""
    r = copy(run1, tmp_path / "r1t")
    c = json.loads((r / "config.json").read_text())
    c["train_len"] = 64
    (r / "config.json").write_text(json.dumps(c))
    assert (
        run(r, "--encoding", "rope", "--lengths", "1x", "--methods", "none,yarn", *FAST, "--out", tmp_path / "o") == 2
    )
    line = one_line(capsys)
    assert "train_len 16 in the checkpoint, 64 in config.json" in line, line


def test_the_checkpoints_own_training_length_is_used(run1, tmp_path):
    out = tmp_path / "o"
    assert run(run1, "--lengths", "1x", "--methods", "none,yarn", *FAST, "--out", out) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["train_len"] == 16 and res["settings"]["lengths"] == [16]
    yarn = next(c for c in res["cells"] if c["method"] == "yarn")
    assert yarn["options"]["rope_scaling"]["original_max_position_embeddings"] == 16


def test_a_seed_the_run_did_not_train_is_refused(run1, tmp_path, capsys):
    """Item 7: on 222d208 `--seed 7` evaluated seed 0 and titled the report "(rope, seed 7)"."""
    assert run(run1, "--seed", "7", "--lengths", "1x", *FAST, "--out", tmp_path / "o") == 2
    assert "--seed 7: the run trained seeds [0]" in one_line(capsys)


@pytest.mark.parametrize("flags", [["--encoding", "rope"], ["--seed", "0"]])
def test_compare_run_flags_on_an_hf_checkpoint_are_refused(ckpt, tmp_path, capsys, flags):
    """Item 9: on 222d208 `--encoding`/`--seed` were ignored on an HF folder."""
    assert run(ckpt, *flags, "--lengths", "1x", *FAST, "--out", tmp_path / "o") == 2
    assert f"{flags[0]}: only for a compare run directory" in one_line(capsys)


def test_convert_share_must_be_a_bool(ckpt, tmp_path, capsys):
    """Item 9: on 222d208 `share='yes'` and a saved `"posenc_share": "yes"` were taken as true."""
    model = LlamaForCausalLM.from_pretrained(ckpt)
    with pytest.raises(TypeError, match="share .* must be True, False or None, got 'yes'"):
        ph.convert(model, share="yes")
    saved = tmp_path / "conv"
    ph.convert(model, share=True).save_pretrained(saved)
    c = json.loads((saved / "config.json").read_text())
    c["posenc_share"] = "yes"
    (saved / "config.json").write_text(json.dumps(c))
    with pytest.raises(TypeError, match="got 'yes'"):
        transformers.AutoModelForCausalLM.from_pretrained(saved)
    capsys.readouterr()
    assert run(saved, "--lengths", "1x", *FAST, "--out", tmp_path / "o") == 2
    assert "posenc_share" in one_line(capsys)


# ================================================================== tracebacks and hangs (items 10, 11)
def _edited(ckpt: Path, dst: Path, edit) -> Path:
    model = copy(ckpt, dst)
    c = json.loads((model / "config.json").read_text())
    edit(c)
    (model / "config.json").write_text(json.dumps(c))
    return model


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(hidden_size=-32), "hidden_size -32; allowed: an int in 1..131072"),
        (lambda c: c["rope_parameters"].update(rope_type="bogus"), "rope_type 'bogus'; allowed: default, linear"),
        (lambda c: c.update(num_hidden_layers=10**9), "num_hidden_layers 1000000000; allowed: an int in 1..4096"),
        (
            lambda c: c.update(hidden_size=65536, intermediate_size=2**20, num_hidden_layers=4000),
            "more than this machine's memory",
        ),
        (lambda c: c.update(vocab_size="many"), "vocab_size"),
    ],
    ids=["negative-width", "bogus-rope-type", "a-billion-layers", "too-big-for-memory", "text-size"],
)
def test_a_hostile_config_is_one_line_before_anything_is_built(ckpt, tmp_path, capsys, edit, message):
    """Items 10-11: on 222d208 a RuntimeError, a KeyError, or still building after 120 s."""
    model = _edited(ckpt, tmp_path / "m", edit)
    assert run(model, "--lengths", "1x", *FAST, "--out", tmp_path / "o") == 2
    line = one_line(capsys)
    assert message in line and str(model) in line, line


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The grass is green. The sky is blue. " * 20, "the pass key is"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_tokenizer_of_another_model_is_refused(ckpt, tmp_path, capsys):
    """Item 10: on 222d208 ids >= the model's vocabulary were an IndexError."""
    model = copy(ckpt, tmp_path / "m")
    _tokenizer(300).save_pretrained(model)  # ids up to 299, the model has 256
    assert run(model, "--lengths", "1x", *FAST, "--out", tmp_path / "o") == 2
    assert "outside the model's vocabulary (ids 0..255)" in one_line(capsys)


def test_a_malformed_tokenizer_is_one_line(ckpt, tmp_path, capsys):
    """Item 10: on 222d208 a KeyError."""
    model = copy(ckpt, tmp_path / "m")
    _tokenizer(260).save_pretrained(model)
    t = json.loads((model / "tokenizer.json").read_text())
    del t["model"]["vocab"]
    (model / "tokenizer.json").write_text(json.dumps(t))
    assert run(model, "--lengths", "1x", *FAST, "--out", tmp_path / "o") == 2
    assert "the tokenizer cannot be read" in one_line(capsys)


def test_pickled_weights_are_refused_unexecuted(ckpt, tmp_path, capsys):
    """Item 10: a pytorch_model.bin that holds an object: one line, nothing run."""
    from tests.test_trust_hostile import _Payload

    model = copy(ckpt, tmp_path / "m")
    state = torch.load(ckpt / "pytorch_model.bin", weights_only=True) if (ckpt / "pytorch_model.bin").exists() else None
    from safetensors.torch import load_file

    state = state or load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    marker = tmp_path / "PWNED"
    torch.save({**state, "x": _Payload(marker)}, model / "pytorch_model.bin")
    assert run(model, "--lengths", "1x", *FAST, "--out", tmp_path / "o") == 2
    assert "refuses to load it (loading could run code; nothing was executed)" in one_line(capsys)
    assert not marker.exists()


def test_a_huge_text_is_read_only_as_far_as_the_run_needs(ckpt, tmp_path, monkeypatch):
    """Item 10: on 222d208 a 3 GB --text was read whole and held as int64 (24 GB)."""
    import posenc.data

    text = tmp_path / "big.txt"
    with open(text, "wb") as f:
        f.write(b"The grass is green. The sky is blue. " * 100)
        f.truncate(3 * 2**30)  # a sparse 3 GiB file: NUL bytes past the prose
    reads = []
    real = posenc.data.read_text

    def spy(path, **kw):
        data = real(path, **kw)
        reads.append(len(data))
        return data

    monkeypatch.setattr(posenc.data, "read_text", spy)
    assert run(ckpt, "--lengths", "1x,2x", "--methods", "none", "--text", text, *FAST, "--out", tmp_path / "o") == 0
    assert reads and max(reads) <= 2 * L  # one window of the longest length, bytes as tokens


# ================================================================== unclear (item 12)
def test_a_learned_table_is_na_past_its_length_not_the_end_of_the_run(tmp_path, capsys):
    """Item 12: on 222d208 GPT-2 stopped the whole run at 2x ("learned supports positions 0..31")."""
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=L)).save_pretrained(
        tmp_path / "gpt2"
    )
    out = tmp_path / "o"
    assert run(tmp_path / "gpt2", "--lengths", "1x,2x", "--methods", "none,yarn,sink-window", *FAST, "--out", out) == 0
    cells = {(c["method"], c["length"]): c for c in json.loads((out / "results.json").read_text())["cells"]}
    assert cells[("none", L)]["applicable"] and cells[("sink-window", 2 * L)]["applicable"]
    assert (
        not cells[("none", 2 * L)]["applicable"] and "learned supports positions < 32" in cells[("none", 2 * L)]["why"]
    )
    assert "n/a" in (out / "table.md").read_text()


def test_a_busy_out_names_the_tool_that_holds_it(ckpt, tmp_path, capsys):
    from posenc.output.rundir import RunDir

    out = tmp_path / "o"
    with RunDir(out, tool="posenc extend"):
        assert run(ckpt, "--lengths", "1x", *FAST, "--out", out) == 2
    assert "in use by another posenc extend (pid" in one_line(capsys)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_text_that_is_not_a_regular_file_is_named_so(ckpt, tmp_path, capsys, kind):
    """Item 12: on 222d208 a FIFO or /dev/zero was "no such file"."""
    text = tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(text)
    else:
        text = Path("/dev/zero")
    assert run(ckpt, "--lengths", "1x", "--text", text, *FAST, "--out", tmp_path / "o") == 2
    assert f"--text: {str(text)!r} is not a regular file" in one_line(capsys)


# ================================================================== every flag, bad values
HUGE = "1" + "0" * 30
POS = ["", "0", "-1", "nan", "inf", "abc", "1.5", "0x10"]
NONNEG = ["", "-1", "nan", "inf", "abc", "1.5"]
FLAGS: dict[str, list[str]] = {
    "--methods": ["", ",", "nosuch", "none,,yarn"],
    "--lengths": ["", ",", "0", "-1", "7", "nan", "0x", "-2x", "nanx", "infx", "abc", "1x,,2x", HUGE, "1e9x"],
    "--text": ["", "<missing>", "<dir>", "/dev/zero"],
    "--windows": [*POS, HUGE, "10001"],
    "--stride": [*POS, "1000000000"],
    "--chunk": POS,
    "--passkey-trials": [*NONNEG, "10001"],
    "--within": ["", "0", "-1", "nan", "inf", "abc", "1000"],
    "--budget": ["", "0", "0s", "-1m", "nans", "infs", "abc", "20x", "1 hour", "1e3s"],
    "--train-len": [*POS, "7"],
    "--encoding": ["", "rope"],  # MODEL is an HF checkpoint: refused
    "--seed": [*NONNEG, "0"],  # as --encoding
    "--device": ["", "tpu", "cuda:x", "cuda:99"],
    "--dtype": ["", "x"],
    "--out": ["", "<model>", "<file>"],
    "--tasks": ["", ",", "nosuch", "niah_single_1,,ruler_vt", "niah_single_2"],  # (an essay haystack: a download)
    "--task-samples": [*POS, "10001"],
    "--lm-eval": ["", ",", "a,,b"],
    "--lm-eval-limit": [*POS, "10001"],
    "--lm-eval-include": ["", "<missing>", "<file>", "<dir>"],  # (<dir>: given without --lm-eval)
    "--protocol": ["", ",", "nosuch", "sliding,,windows"],
    "--save": ["", "<file>", "<model>"],  # (and without --method/--length)
    "--method": ["", "nosuch"],
    "--length": ["", "0", "abc"],
}


@pytest.fixture
def no_work(monkeypatch):
    def started(*a, **k):
        raise AssertionError("the work started")

    monkeypatch.setattr("posenc.extend.run.run_cells", started)


CASES = [(flag, v) for flag, values in FLAGS.items() for v in values]


@pytest.mark.parametrize("flag,value", CASES, ids=[f"{f}={v!r}"[:40] for f, v in CASES])
def test_every_extend_flag_refuses_bad_values_in_one_line(ckpt, flag, value, tmp_path, capsys, no_work):
    """Exit 2, one line naming the flag, nothing written, before the work."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    subs = {"<file>": tmp_path / "file", "<dir>": tmp_path / "dir", "<missing>": tmp_path / "nope", "<model>": ckpt}
    out = tmp_path / "out"
    where = [] if flag == "--out" else ["--out", out]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run(ckpt, "--lengths", "1x", "--methods", "none", *where, f"{flag}={subs.get(value, value)}") == 2
    line = one_line(capsys)
    assert line.startswith("posenc extend") and (flag in line or "MODEL" in line), line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_flag_table_covers_every_extend_flag():
    sub = make_parser()._subparsers._group_actions[0].choices["extend"]
    found = {a.option_strings[-1] for a in sub._actions if a.option_strings and a.nargs != 0}
    assert found == set(FLAGS)
    # the one list rule (issue 62 item 4): every comma flag is fuzzed with an empty item
    lists = {a.option_strings[-1] for a in sub._actions if isinstance(getattr(a.type, "__self__", None), ListOf)}
    assert lists == {"--methods", "--lengths", "--tasks", "--lm-eval", "--protocol"}
    assert all(any(",," in v[1:-1] for v in FLAGS[f]) for f in lists)


CONVERT_BAD = [
    ({"encoding": "nosuch"}, ValueError, "nosuch"),
    ({"encoding": ""}, ValueError, ""),
    ({"encoding": ["rope"]}, ValueError, "lists 1 layers, the model has 2"),
    ({"encoding": 3}, TypeError, "got int"),
    ({"encoding": [("rope", {"base": -1.0}), "rope"]}, ValueError, "base"),
    ({"encoding": "rope", "base": float("nan")}, ValueError, "base"),
    ({"encoding": "rope", "nosuch": 1}, (TypeError, ValueError), "nosuch"),
    ({"encoding": "t5", "num_buckets": 0}, ValueError, "num_buckets"),
    ({"share": "yes"}, TypeError, "share"),
    ({"share": 1}, TypeError, "share"),
]


@pytest.mark.parametrize("kwargs,error,named", CONVERT_BAD, ids=[repr(k)[:40] for k, _, _ in CONVERT_BAD])
def test_convert_refuses_bad_arguments_naming_them(kwargs, error, named):
    """``posenc.hf.convert``'s arguments, as the flags: the error names the bad value, one line."""
    with pytest.raises(error) as e:
        ph.convert(llama(), **kwargs)
    msg = str(e.value)
    assert named in msg and len(msg.splitlines()) == 1, msg
