"""Use any posenc encoding inside a Hugging Face model (``pip install 'posenc[hf]'``).

::

    import posenc.hf
    from transformers import LlamaConfig, LlamaForCausalLM

    model = posenc.hf.convert(LlamaForCausalLM(LlamaConfig(...)), encoding="alibi")
    model.generate(ids, max_new_tokens=32)                  # HF caches, greedy or sampled
    model.save_pretrained("out")                            # config.json records the encodings
    model = AutoModelForCausalLM.from_pretrained("out")     # a PosencLlamaForCausalLM again
    # (or, in a process without posenc imported: from_pretrained("out", trust_remote_code=True))

Importing this module registers ``attn_implementation="posenc"`` with HF's
``AttentionInterface`` and ``AttentionMaskInterface`` (:mod:`posenc.hf.attention`,
:mod:`posenc.hf.masks`) and one model type ``posenc_<model_type>`` per family with
``AutoConfig`` and ``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` (:mod:`posenc.hf.models`).
Nothing else global changes: :func:`convert` returns a new model and leaves the one it was
given as it was.

Covered: the families of :data:`posenc.hf.families.FAMILIES` (Llama, GPT-2, Qwen2, Qwen3,
Mistral, Phi-3, Gemma 2/3/4, gpt-oss, Qwen2-VL, Qwen3-VL, ModernBERT, the MLA families DeepSeek-V2/V3,
Kimi K2.5, Mistral 4, GLM-4 MoE Lite, Youtu, MiniCPM3; with DeepSeek Sparse Attention DeepSeek-V3.2,
GLM-5 and Mistral Large 4 (LeRoPE), and Inkling-2; the model's own encoding
switched off), every registered encoding (``complex-order`` without a vocabulary; one that
builds the token embedding from ids is refused), per-layer windows, chunks and sinks.
"""

from __future__ import annotations

TESTED = ">=5.23,<6"  # the transformers versions this adapter is tested with (posenc[hf])

try:
    import transformers
except ImportError as e:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(f"posenc.hf needs Hugging Face transformers{TESTED}: pip install 'posenc[hf]'") from e


def _check_version() -> None:
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 23) or major >= 6:
        raise ImportError(
            f"posenc.hf is tested with transformers{TESTED}, found {transformers.__version__}: pip install 'posenc[hf]'"
        )


_check_version()

from .attention import NAME, PosencMask, attention_forward, mask_interface, register  # noqa: E402
from .convert import SUPPORTED, convert, layer_specs  # noqa: E402
from .families import FAMILIES, Family, family_of  # noqa: E402
from .layout import rope_layout  # noqa: E402
from .models import (  # noqa: E402
    PosencGPT2Config,
    PosencGPT2LMHeadModel,
    PosencLlamaConfig,
    PosencLlamaForCausalLM,
    posenc_classes,
    register_auto,
)
from .rope_config import rope_options, rope_options_for  # noqa: E402

register()
register_auto()

__all__ = [
    "FAMILIES",
    "Family",
    "NAME",
    "PosencGPT2Config",
    "PosencGPT2LMHeadModel",
    "PosencLlamaConfig",
    "PosencLlamaForCausalLM",
    "PosencMask",
    "SUPPORTED",
    "attention_forward",
    "convert",
    "family_of",
    "posenc_classes",
    "layer_specs",
    "mask_interface",
    "register",
    "rope_layout",
    "rope_options",
    "rope_options_for",
]
