"""``posenc extend --save`` on the real SmolLM2-135M checkpoint (issue 65, part 1; marker ``real``).

YaRN at 2x the training length (8192 -> 16384) is saved as a stock checkpoint; a fresh Python
process that never imports posenc loads it with transformers alone and scores 256 tokens of the
held-out corpus; its logits equal those of the model ``posenc extend`` measures under ``yarn``
(the converted model of :meth:`posenc.extend.model.Subject.variant`). See tests/test_real_smollm2.py
for how the checkpoint is prepared and when these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from tests.test_real_smollm2 import SHORT, checkpoint, ids, logits, real  # noqa: F401 (fixtures)

_LOAD = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

m = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True, dtype=torch.float32).eval()
assert "posenc" not in sys.modules
with torch.no_grad():
    out = m(input_ids=torch.tensor(json.load(open(sys.argv[2])))).logits
torch.save({"logits": out, "rope": m.config.rope_parameters, "max": m.config.max_position_embeddings}, sys.argv[3])
"""


@real
def test_yarn_2x_saves_as_a_stock_checkpoint_that_matches(checkpoint, ids, tmp_path):  # noqa: F811
    from posenc.cli import main
    from posenc.extend.model import load_subject

    out = tmp_path / "smollm2-yarn-2x"
    assert main(["extend", str(checkpoint), "--save", str(out), "--method", "yarn", "--length", "2x"]) == 0
    x = ids[:, :SHORT]
    (tmp_path / "ids.json").write_text(json.dumps(x.tolist()))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (posenc not importable there at all)
    r = subprocess.run([sys.executable, "-c", _LOAD, str(out), str(tmp_path / "ids.json"), str(tmp_path / "got.pt")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert got["rope"] == {
        "rope_type": "yarn",
        "rope_theta": 1e5,
        "factor": 2.0,
        "original_max_position_embeddings": 8192,
    }
    assert got["max"] == 16384
    subject = load_subject(str(checkpoint), device=torch.device("cpu"), dtype=torch.float32)
    model, _, why = subject.variant("yarn", 16384)
    assert why is None
    want = logits(model, x)
    assert not torch.allclose(want, logits(subject.model, x), atol=1e-2)  # yarn changes the model
    assert torch.equal(got["logits"], want)  # HF's own yarn and posenc's are the same arithmetic
