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

``trust_remote_code=True`` runs whatever that file holds, so ``config.json`` also records its
sha256 (``posenc_remote_sha256``): ``sha256sum posenc_remote.py`` checks it without posenc,
and where posenc is imported every load of a posenc model from a folder
(:func:`check_remote_code`) refuses a module that is not the one posenc writes for that
model, before the weights are read. (A process that loads with ``trust_remote_code=True``
imports the module before any posenc code can look at it: check the hash first.)
"""

from __future__ import annotations

import hashlib
import os
import pathlib

__all__ = ["MODULE", "HASH_FIELD", "save_remote_code", "check_remote_code", "remote_source"]

MODULE = "posenc_remote"
HASH_FIELD = "posenc_remote_sha256"  # the config.json field that records the module's sha256

_SOURCE = '''"""posenc model classes for trust_remote_code=True (written by posenc.hf's save_pretrained).

Loading this model needs posenc installed (pip install 'posenc[hf]'); the client need not import it.
"""

from posenc.hf.models import posenc_classes

{config}, {model} = posenc_classes({model_type!r})
'''


def remote_source(config_cls: type, model_cls: type, family) -> tuple[str, dict]:
    """``(text, auto_map)`` of the module posenc writes for a family's posenc classes."""
    text = _SOURCE.format(config=config_cls.__name__, model=model_cls.__name__, model_type=family.model_type)
    auto = "AutoModelForMaskedLM" if family.auto == "masked" else "AutoModelForCausalLM"
    return text, {"AutoConfig": f"{MODULE}.{config_cls.__name__}", auto: f"{MODULE}.{model_cls.__name__}"}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def save_remote_code(save_directory, family, config_cls: type, model_cls: type) -> tuple[dict, str]:
    """Write :data:`MODULE` ``.py`` into ``save_directory``; return the ``auto_map`` naming it and
    the module's sha256 (for :data:`HASH_FIELD`).

    Raises:
        ValueError: ``save_directory`` is an existing file.
    """
    root = pathlib.Path(os.fspath(save_directory))
    if root.is_file():
        raise ValueError(f"save_directory {str(root)!r} is a file; give a directory")
    root.mkdir(parents=True, exist_ok=True)
    text, auto_map = remote_source(config_cls, model_cls, family)
    (root / f"{MODULE}.py").write_text(text)
    return auto_map, _sha256(text)


def check_remote_code(folder, config: dict, source) -> None:
    """Refuse a posenc model folder whose remote code is not what posenc writes for it.

    ``folder``'s :data:`MODULE` ``.py`` (when there is one) must be, byte for byte, the
    module posenc writes for the folder's model type, and the sha256 that ``config.json``
    records must be its; the ``auto_map`` may name that module's classes only. ``config``:
    the folder's ``config.json`` as read; ``source()``: ``(text, auto_map)`` of the module
    posenc writes for it (:func:`remote_source`), asked only when the folder has remote code.

    Raises:
        ValueError: one sentence naming what differs.
    """
    root = pathlib.Path(os.fspath(folder))
    module = root / f"{MODULE}.py"
    auto_map, recorded = config.get("auto_map"), config.get(HASH_FIELD)
    if not module.exists() and not auto_map and recorded is None:
        return  # nothing to run: a folder saved without remote code
    text, expected_map = source()
    if auto_map is not None and auto_map != expected_map:
        raise ValueError(f"config.json's auto_map {auto_map} is not the one posenc writes ({expected_map})")
    if recorded is not None and recorded != _sha256(text):
        raise ValueError(f"config.json's {HASH_FIELD} is not the sha256 of the module posenc writes for this model")
    if module.exists():
        try:
            same = module.is_file() and module.read_bytes() == text.encode()
        except OSError:
            same = False
        if not same:
            raise ValueError(
                f"{MODULE}.py is not the module posenc writes for this model (sha256 {_sha256(text)[:16]}...): "
                "trust_remote_code=True would run it; delete it and save the model again"
            )
