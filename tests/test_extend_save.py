"""``posenc extend MODEL --save DIR --method M --length L`` (issue 65, part 1).

Each method is saved from test_extend's tiny checkpoint; one fresh Python process (no posenc on
its path for the stock ones: it is asserted absent from ``sys.modules``) loads every saved
folder with plain transformers and computes logits past the training length, which must equal
the logits of the model ``extend`` measures under that method (``Subject.variant``). The
remote-code folders load with ``trust_remote_code=True`` in the same process, after the stock
ones. Then: what DIR may be, and the refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import assert_close, attention_n

pytest.importorskip("transformers")
from tests.test_extend import L, llama, run  # noqa: E402 (the tiny checkpoint and the CLI runner)

from posenc.extend.model import load_subject  # noqa: E402
from posenc.output.manifest import MANIFEST  # noqa: E402

STOCK = ("none", "linear", "ntk", "dynamic", "yarn")
REMOTE = ("self-extend", "rerope", "leaky-rerope", "dca")
LONGEST = 4 * L
SRC = Path(__file__).resolve().parents[1] / "src"

# run in a fresh interpreter: argv = [out.pt, ids.json, stock dirs..., "--remote", remote dirs...]
_LOADER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

out, ids = sys.argv[1], torch.tensor(json.load(open(sys.argv[2])))
cut = sys.argv.index("--remote")
got = {}
for i, d in enumerate(sys.argv[3:]):
    if d == "--remote":
        continue
    remote = i + 3 > cut
    m = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, trust_remote_code=remote).eval()
    with torch.no_grad():
        got[d] = m(input_ids=ids[None]).logits[0]
    if not remote:
        assert "posenc" not in sys.modules, "a stock folder imported posenc"
got["max_pos"] = torch.tensor([AutoModelForCausalLM.from_pretrained(d, local_files_only=True,
    trust_remote_code=True).config.max_position_embeddings for d in sys.argv[3:] if d != "--remote"])
torch.save(got, out)
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    llama(initializer_range=0.3).save_pretrained(path)  # (wider weights: the methods' logits differ visibly)
    return path


def n_of(length: int) -> int:
    D, I = 32, 64  # noqa: E741 (hidden, intermediate of test_extend's llama)
    layer = attention_n(dim=D, length=length, head_dim=8) + D + I + 2 * D
    return 2 * layer + 2 * D


@pytest.fixture(scope="module")
def saved(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    for m in (*STOCK, *REMOTE):
        assert run(ckpt, "--save", root / m, "--method", m, "--length", "4x") == 0, m
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (3 * L,))  # past the training length: the methods differ here
    (root / "ids.json").write_text(json.dumps(ids.tolist()))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(SRC)  # posenc importable (the remote ones need it), never imported by the stock ones
    dirs = [str(root / m) for m in STOCK] + ["--remote"] + [str(root / m) for m in REMOTE]
    r = subprocess.run([sys.executable, "-c", _LOADER, str(root / "got.pt"), str(root / "ids.json"), *dirs],
                       capture_output=True, text=True, env=env, cwd=root, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = torch.load(root / "got.pt", weights_only=True)
    return root, ids, got


@pytest.mark.slow  # (the module's saves and one fresh interpreter: ~15 s)
@pytest.mark.parametrize("method", [*STOCK, *REMOTE])
def test_saved_model_gives_the_logits_extend_measured(ckpt, saved, method):
    root, ids, got = saved
    subject = load_subject(str(ckpt), device=torch.device("cpu"), dtype=torch.float32)
    model, _, why = subject.variant(method, LONGEST)
    assert why is None
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits[0]
    assert_close(got[str(root / method)], want, n=n_of(3 * L))
    with torch.no_grad():
        plain = subject.model(input_ids=ids[None]).logits[0]
    assert method == "none" or not torch.allclose(want, plain, atol=1e-3)  # the method matters at this length
    info = json.loads((root / method / "posenc_extend.json").read_text())
    assert info["kind"] == ("stock" if method in STOCK else "remote") and info["length"] == LONGEST
    assert info["versions"]["transformers"] and info["ran_with"]["dtype"] == "float32"


@pytest.mark.slow
def test_stock_folders_hold_stock_rope_parameters(saved):
    root, _, got = saved
    cfg = {m: json.loads((root / m / "config.json").read_text()) for m in (*STOCK, *REMOTE)}
    assert cfg["yarn"]["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": L}  # fmt: skip
    assert cfg["linear"]["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    assert cfg["ntk"]["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0 * 4 ** (8 / 6)}
    assert cfg["dynamic"]["rope_parameters"] == {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0}
    for m in STOCK:
        assert (
            cfg[m]["model_type"] == "llama"
            and "auto_map" not in cfg[m]
            and not (root / m / "posenc_remote.py").exists()
        )
    for m in REMOTE:
        assert "auto_map" in cfg[m] and (root / m / "posenc_remote.py").is_file()
    # lm-eval reads the context length from max_position_embeddings: raised to L, but dynamic's
    # stays the training length (HF's dynamic NTK reads its original length there)
    want = [L if m == "dynamic" else LONGEST for m in (*STOCK, *REMOTE)]
    assert got["max_pos"].tolist() == want


def test_save_dir_is_new_empty_or_its_own(ckpt, tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert run(ckpt, "--save", theirs, "--method", "yarn", "--length", "2x") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty (notes.txt)" in err
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]  # nothing written, nothing removed
    own = tmp_path / "own"
    assert run(ckpt, "--save", own, "--method", "self-extend", "--length", "2x") == 0
    assert run(ckpt, "--save", own, "--method", "yarn", "--length", "2x") == 0  # its own folder: replaced
    assert not (own / "posenc_remote.py").exists()  # the earlier save's files went
    assert json.loads((own / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    assert {p.name for p in own.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                               "posenc_extend.json", MANIFEST}  # fmt: skip
    (own / "extra.bin").write_bytes(b"x")  # a file no save listed: the folder is no longer only ours
    assert run(ckpt, "--save", own, "--method", "yarn", "--length", "2x") == 2
    assert (own / "extra.bin").read_bytes() == b"x"


def test_a_learned_table_saves_stock_within_it_and_is_refused_past_it(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=4, n_positions=L,
                               bos_token_id=None, eos_token_id=None)).save_pretrained(tmp_path / "gpt2")  # fmt: skip
    assert run(tmp_path / "gpt2", "--save", tmp_path / "far", "--method", "none", "--length", "2x") == 2
    assert (
        "--length 64: past what the model's positions hold (learned supports positions < 32" in capsys.readouterr().err
    )
    assert not (tmp_path / "far").exists()
    assert run(tmp_path / "gpt2", "--save", tmp_path / "in", "--method", "none", "--length", "1x") == 0
    cfg = json.loads((tmp_path / "in" / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["n_positions"] == L and "auto_map" not in cfg


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--method", "yarn", "--length", "2x"), "missing --save"),
        (("--save", "{tmp}/a", "--method", "yarn"), "missing --length"),
        (("--save", "{tmp}/a", "--method", "sink-window", "--length", "2x"), "sink-window is a cache policy"),
        (("--save", "{tmp}/a", "--method", "longrope", "--length", "2x"), "not applicable"),
        (("--save", "{tmp}/a", "--method", "warp", "--length", "2x"), "--method 'warp'; allowed: none"),
        (("--save", "{tmp}/a", "--method", "yarn", "--length", "2x,4x"), "one length"),
        (("--save", "{ckpt}/inner", "--method", "yarn", "--length", "2x"), "is inside MODEL"),
    ],
)
def test_save_refusals_are_one_line_exit_2(ckpt, tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path, ckpt=ckpt) for a in args]
    assert run(ckpt, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "a").exists() and not (ckpt / "inner").exists()
