"""What a client needs to load a converted model without importing posenc (HF's ``auto_map``).

``save_pretrained`` of a converted model writes :data:`MODULE` next to the weights and
records it in ``config.json``::

    "auto_map": {"AutoConfig": "posenc_remote.PosencQwen2Config",
                 "AutoModelForCausalLM": "posenc_remote.PosencQwen2ForCausalLM"}

so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` works in a process
that never imports posenc: HF imports the module, which imports ``posenc.hf`` (posenc must be
installed where the model is loaded) and names the family's classes. Without
``trust_remote_code``, ``import posenc.hf`` first registers the same classes with the
``Auto*`` classes.
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["MODULE", "save_remote_code"]

MODULE = "posenc_remote"

_SOURCE = '''"""posenc model classes for trust_remote_code=True (written by posenc.hf's save_pretrained).

Loading this model needs posenc installed (pip install 'posenc[hf]'); the client need not import it.
"""

from posenc.hf.models import posenc_classes

{config}, {model} = posenc_classes({model_type!r})
'''


def save_remote_code(save_directory, family, config_cls: type, model_cls: type) -> dict:
    """Write :data:`MODULE` ``.py`` into ``save_directory`` and return the ``auto_map`` naming it.

    Raises:
        ValueError: ``save_directory`` is an existing file.
    """
    root = pathlib.Path(os.fspath(save_directory))
    if root.is_file():
        raise ValueError(f"save_directory {str(root)!r} is a file; give a directory")
    root.mkdir(parents=True, exist_ok=True)
    text = _SOURCE.format(config=config_cls.__name__, model=model_cls.__name__, model_type=family.model_type)
    (root / f"{MODULE}.py").write_text(text)
    auto = "AutoModelForMaskedLM" if family.auto == "masked" else "AutoModelForCausalLM"
    return {"AutoConfig": f"{MODULE}.{config_cls.__name__}", auto: f"{MODULE}.{model_cls.__name__}"}
