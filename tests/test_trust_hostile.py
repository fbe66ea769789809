"""Hostile input (issue 24): a checkpoint that would run code when unpickled is refused by
every entry point that reads checkpoints, unexecuted; a checkpoint posenc writes always
loads safely; nothing is written outside ``--out``."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posenc
from posenc.checkpoint import CheckpointError
from posenc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "2", "--dim", "16", "--depth", "1", "--heads", "2", "--train-len", "16", "--eval-lens", "16",
        "--eval-tokens", "64", "--batch-size", "2", "--val-points", "0", "--workers", "1", "--no-progress"]  # fmt: skip


class _Payload:
    """Unpickling this creates ``marker``: the stand-in for an attacker's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _evil_checkpoint(path: Path, marker: Path, *, zip_format: bool = True, base: Path | None = None) -> Path:
    """A file that looks like a posenc checkpoint (the real one at ``base``, if given) plus a payload."""
    ckpt = torch.load(base, weights_only=True) if base is not None else {"model_config": {}, "model": {}}
    ckpt["payload"] = _Payload(marker)
    if zip_format:
        torch.save(ckpt, path)
    else:  # the legacy (non-zip) format: a bare pickle stream
        with open(path, "wb") as f:
            pickle.dump(ckpt, f)
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "run"
    assert main(["compare", *TINY, "--encodings", "rope", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("zip_format", [True, False])
def test_load_checkpoint_refuses_a_payload_unexecuted(tmp_path, zip_format):
    marker = tmp_path / "PWNED"
    evil = _evil_checkpoint(tmp_path / "evil.pt", marker, zip_format=zip_format)
    with pytest.raises(CheckpointError, match="refuses to load .*nothing was executed"):
        posenc.load_checkpoint(evil)
    assert not marker.exists()


def test_every_checkpoint_posenc_writes_loads_with_weights_only(run_dir):
    # the compare checkpoint holds the optimizer, RNG state, losses, config and result
    ckpt = torch.load(run_dir / "checkpoints" / "rope.pt", weights_only=True)
    assert {"model_config", "model", "optimizer", "rng_state", "result", "fingerprint"} <= set(ckpt)
    model, extra = posenc.load_checkpoint(run_dir / "checkpoints" / "rope.pt")
    assert extra["done"] is True and model.encoding_name == "rope"


def test_save_checkpoint_refuses_what_would_not_load_safely(tmp_path):
    lm = posenc.TransformerLM(vocab_size=8, dim=8, depth=1, heads=2, encoding="rope", max_len=8)
    with pytest.raises(CheckpointError, match=r"entry note\[0\] is a _Payload"):
        posenc.save_checkpoint(tmp_path / "x.pt", lm, note=[_Payload(tmp_path / "m")])
    assert not (tmp_path / "x.pt").exists()
    posenc.save_checkpoint(tmp_path / "ok.pt", lm, step=3, losses=[1.0, 0.5], meta={"a": (1, "b", None)})
    assert posenc.load_checkpoint(tmp_path / "ok.pt")[1] == {
        "step": 3,
        "losses": [1.0, 0.5],
        "meta": {"a": (1, "b", None)},
    }


def test_compare_resume_refuses_a_payload_checkpoint(run_dir, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns(".lock"))
    marker = tmp_path / "PWNED"
    _evil_checkpoint(run / "checkpoints" / "rope.pt", marker, base=run_dir / "checkpoints" / "rope.pt")
    assert main(["compare", "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "refuses to load" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()


@pytest.mark.parametrize("as_dir", [False, True])
def test_analyze_refuses_a_payload_checkpoint(run_dir, tmp_path, capsys, as_dir):
    marker = tmp_path / "PWNED"
    folder = tmp_path / "ckpts"
    folder.mkdir()
    evil = _evil_checkpoint(folder / "rope.pt", marker, base=run_dir / "checkpoints" / "rope.pt")
    target = folder if as_dir else evil
    code = main(["analyze", "decay", "--checkpoint", str(target), "--out", str(tmp_path / "out")])
    assert code == 2
    assert "refuses to load" in capsys.readouterr().err
    assert not marker.exists()


def test_streaming_example_refuses_a_payload_checkpoint(run_dir, tmp_path):
    marker = tmp_path / "PWNED"
    evil = _evil_checkpoint(tmp_path / "evil.pt", marker, base=run_dir / "checkpoints" / "rope.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "streaming_sinks.py"), "--ckpt", str(evil), "--windows", "1"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "refuses to load" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_random_bytes_are_one_checkpoint_error_whatever_the_unpickler_raises(tmp_path):
    """Random files reach torch's restricted unpickler in many ways (IndexError, KeyError,
    EOFError, RuntimeError ...): each is the one CheckpointError naming the file."""
    g = torch.Generator().manual_seed(0)
    real = tmp_path / "real.pt"
    posenc.save_checkpoint(real, posenc.TransformerLM(8, 8, 1, 2, "rope", max_len=8))
    head = real.read_bytes()
    for i in range(200):
        n = int(torch.randint(1, 400, (1,), generator=g))
        data = bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist())
        if i % 2:  # a real zip header, then garbage: reaches the unpickler more often
            data = head[:n] + data
        path = tmp_path / f"r{i}.pt"
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=f"r{i}.pt"):
            posenc.load_checkpoint(path)


def test_links_planted_in_a_run_folder_are_never_written_through(run_dir, tmp_path):
    """A shared run folder resumed with links planted at every name posenc writes (the old
    temporary checkpoint name, the outputs): the files they point to, outside
    --out, stay as they were; the links are replaced by posenc's own files."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns(".lock"))
    (run / "checkpoints" / "rope.pt").unlink()  # the model trains again, so its checkpoint is written
    victims = {}
    for name in ["checkpoints/rope.tmp", "results.json", "table.md", "report.md"]:
        victim = tmp_path / f"victim-{name.replace('/', '-')}"
        victim.write_text("mine")
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(victim)
        victims[name] = victim
    assert main(["compare", "--resume", "--out", str(run)]) == 0
    assert all(v.read_text() == "mine" for v in victims.values())
    for name in ["checkpoints/rope.pt", "results.json", "table.md", "report.md"]:
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 0, name
    posenc.load_checkpoint(run / "checkpoints" / "rope.pt")


# ============================================================ code in an HF model folder (issue 61, items 1-2)
_EVIL = "import pathlib\npathlib.Path({marker!r}).touch()\n"


def _tiny_llama_dir(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _auto_map_config(folder: Path, marker: Path) -> None:
    import json

    c = json.loads((folder / "config.json").read_text())
    c["model_type"], c["auto_map"] = "evilmodel", {"AutoConfig": "evilmod.C", "AutoModelForCausalLM": "evilmod.M"}
    (folder / "config.json").write_text(json.dumps(c))
    (folder / "evilmod.py").write_text(_EVIL.format(marker=str(marker)) + "from transformers import LlamaConfig as C\n")


def _auto_map_tokenizer(folder: Path, marker: Path) -> None:
    import json

    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil_tok.T", None]}, "tokenizer_class": "T"})
    )
    (folder / "evil_tok.py").write_text(
        _EVIL.format(marker=str(marker)) + "from transformers import PreTrainedTokenizer as T\n"
    )


@pytest.mark.parametrize("plant", [_auto_map_config, _auto_map_tokenizer], ids=["config", "tokenizer"])
def test_extend_runs_no_code_from_the_model_folder_even_on_yes(plant, tmp_path, capsys, monkeypatch):
    """transformers would ask "Do you wish to run the custom code?" and run it on a `y`:
    posenc refuses the folder in one line before transformers reads it (fails on 222d208)."""
    import io

    model, marker = _tiny_llama_dir(tmp_path / "m"), tmp_path / "PWNED"
    plant(model, marker)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 5))
    capsys.readouterr()
    code = main(["extend", str(model), "--lengths", "1x", "--windows", "1", "--passkey-trials", "0", "--methods",
                 "none", "--out", str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "posenc runs no code from a model folder" in err
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_an_edited_remote_module_is_refused_where_posenc_loads(tmp_path, capsys):
    """The posenc_remote.py of a saved converted model, edited: loading through posenc
    (Auto* after `import posenc.hf`, `posenc extend`) refuses it before the weights are read;
    config.json records the module's sha256 so a client without posenc can check it."""
    import hashlib
    import json

    transformers = pytest.importorskip("transformers")
    import posenc.hf as ph

    saved = tmp_path / "conv"
    ph.convert(transformers.LlamaForCausalLM.from_pretrained(_tiny_llama_dir(tmp_path / "m"))).save_pretrained(saved)
    module = saved / "posenc_remote.py"
    config = json.loads((saved / "config.json").read_text())
    assert config["posenc_remote_sha256"] == hashlib.sha256(module.read_bytes()).hexdigest()
    transformers.AutoModelForCausalLM.from_pretrained(saved)  # as written: loads
    marker = tmp_path / "PWNED"
    module.write_text(module.read_text() + _EVIL.format(marker=str(marker)))
    with pytest.raises(ValueError, match="posenc_remote.py is not the module posenc writes"):
        transformers.AutoModelForCausalLM.from_pretrained(saved)
    capsys.readouterr()
    code = main(["extend", str(saved), "--lengths", "1x", "--windows", "1", "--passkey-trials", "0", "--methods",
                 "none", "--out", str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err
    assert (
        code == 2 and "posenc_remote.py is not the module posenc writes" in err and len(err.strip().splitlines()) == 1
    )
    config["posenc_remote_sha256"] = hashlib.sha256(module.read_bytes()).hexdigest()  # the hash edited to match
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is not the sha256 of the module posenc writes"):
        transformers.AutoModelForCausalLM.from_pretrained(saved)
    assert not marker.exists()
