"""posenc: Transformer position encodings behind one attention interface.

Shape notation used in every docstring and reshape comment:

====  ==========================================================
B     batch size
L     sequence length (``Lq`` queries, ``Lk`` keys)
D     model width
H     attention heads
Dh    head dimension (``D / H`` unless given)
i, j  query index / position, key index / position
R     number of relative distances in a table
A     coordinates per position (2: row, column; 3: time, row, column)
====  ==========================================================

Where position enters attention, for one head (see :mod:`posenc.base`)::

    x_i ──[input: embed]──► h_i ──W_Q──► q_i ──[q/k: rotate]──► q̃_i
    s_ij = scale·(q̃_i·k̃_j + score_terms_ij) + bias_ij + mask_ij
    o_i  = Σ_j softmax_j(s)_ij · v_j + value_term_i

Public names::

    posenc.available()                 # registered encodings
    posenc.build(name, heads=, head_dim=, max_len=None, causal=True, **options)
    posenc.register                    # class decorator for new encodings
    posenc.PositionEncoding, posenc.Stage, posenc.Needs   # the encoding contract (posenc.contract)
    posenc.Attention(dim, heads, encoding="rope", causal=True, **options)
    posenc.TransformerLM(vocab_size, dim, depth, heads, encoding="alibi", max_len=128)
    posenc.ModelConfig, posenc.LayerSpec          # TransformerLM.from_config(cfg)
    posenc.layers("rope*3,nope", depth=8)         # per-layer specs from a pattern / preset
    posenc.PRESETS                                # irope, smollm3, gemma3, gpt-oss
    posenc.AttentionMask                          # what each query may see
    posenc.scores(enc, q, k, q_pos, k_pos)        # the pre-softmax score sum
    posenc.BACKENDS[name](enc, q, k, v, q_pos, k_pos, mask)   # see posenc.attend.backends
    posenc.tune_allocator()                       # glibc keeps freed blocks (long CPU sequences)
"""

from . import (
    encodings,  # noqa: F401  (registers the built-in encodings)
    positions,
)
from ._version import __version__ as __version__  # (ground floor: submodules read it there)
from .allocator import tune_allocator
from .attend.backends import BACKENDS, BlockOptions, select_backend, supported_backends
from .attend.scores import scores
from .base import Needs, PositionEncoding, Stage
from .checkpoint import load_checkpoint, save_checkpoint
from .config import LayerSpec, ModelConfig
from .context import Context, InputRead, Tables
from .layer.attention import Attention, Projection
from .layer.cache import KVCache, ModelCache, SinkWindow
from .layer.memory import SegmentMemory
from .layer.qk_norm import QKNorm
from .mask import AttentionMask
from .model import TransformerLM
from .patterns import PRESETS, layers
from .registry import available, build, get_class, register

__all__ = [
    "Attention",
    "AttentionMask",
    "BACKENDS",
    "BlockOptions",
    "KVCache",
    "LayerSpec",
    "ModelCache",
    "ModelConfig",
    "Needs",
    "PRESETS",
    "PositionEncoding",
    "Projection",
    "QKNorm",
    "Context",
    "InputRead",
    "Tables",
    "SegmentMemory",
    "SinkWindow",
    "Stage",
    "TransformerLM",
    "available",
    "build",
    "get_class",
    "layers",
    "positions",
    "load_checkpoint",
    "save_checkpoint",
    "register",
    "scores",
    "select_backend",
    "supported_backends",
    "tune_allocator",
]
