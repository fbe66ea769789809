"""Coverage of ``posenc.hf.convert`` over every model type of the installed transformers, measured.

Walks the model types with a causal-LM or masked-LM head (transformers' auto mappings, plus the
families of ``posenc.hf.FAMILIES`` reached otherwise, such as the VL ones), builds a tiny random
config of each from its config class (no download: small sizes set, everything else the class's
defaults), and for each one whose class a family row covers:

* stock parity: max |logits(``convert(model)``, the model's own scheme) - logits(stock)| over
  2 x 20 tokens, against the suite's float32 bound (tests/conftest.py ``tolerance``);
* cached = uncached: 8 greedy tokens from 5 with ``DynamicCache(config=...)`` against
  ``use_cache=False`` (tokens equal, step logits within the bound); encoders: none;
* round trip: ``save_pretrained`` -> ``Auto*.from_pretrained`` logits, max difference;
* swap + step: ``convert(model, encoding="alibi")``, one AdamW step: the loss, and whether
  every attention layer's ``W_Q`` moved.

A model type no row covers, or whose tiny model cannot be built, gets its reason in one line.

    OMP_NUM_THREADS=1 python scripts/hf_coverage.py             # print the table
    OMP_NUM_THREADS=1 python scripts/hf_coverage.py --write     # and write it into docs/hf-coverage.md
    OMP_NUM_THREADS=1 python scripts/hf_coverage.py llama olmo2 # some model types only (print)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import pathlib
import sys
import tempfile
import warnings
import zlib
from dataclasses import dataclass

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from tests.conftest import attention_n, tolerance  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, DynamicCache  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

import posenc.hf as ph  # noqa: E402
from posenc.hf.families import FAMILIES  # noqa: E402

DOC = ROOT / "docs" / "hf-coverage.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
V, L, PROMPT, NEW = 96, 20, 5, 8
SMALL = dict(  # the sizes every tiny config takes where its class has the field
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    num_local_experts=2,
    num_experts=2,
    n_routed_experts=2,
    num_experts_per_tok=1,
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
HEADS = ("causal", "masked")


@dataclass(frozen=True)
class Row:
    """One model type's line of the table. ``reason``: why it does not convert (None: it does)."""

    model_type: str
    cls: str
    reason: str | None = None
    parity: float | None = None
    parity_bound: float | None = None
    cached: float | None = None  # max step logits difference; None for an encoder
    cached_tokens: bool | None = None
    round_trip: float | None = None
    loss: float | None = None
    moved: bool | None = None

    @property
    def ok(self) -> bool:
        """Converts with stock parity, cached = uncached (decoders), round trip and a training step."""
        if self.reason is not None:
            return False
        cached = self.cached is None or (self.cached_tokens and self.cached <= self.parity_bound)
        return (
            self.parity <= self.parity_bound
            and cached
            and self.round_trip <= self.parity_bound
            and self.loss == self.loss
            and self.moved
        )

    def verdicts(self) -> tuple:
        """What a test compares exactly: the cells' pass/fail and the reason (not the floats,
        which the CPU's kernels may move within the bound)."""
        if self.reason is not None:
            return (self.model_type, self.reason)
        b = self.parity_bound
        return (
            self.model_type,
            self.cls,
            self.parity <= b,
            None if self.cached is None else bool(self.cached_tokens and self.cached <= b),
            self.round_trip <= b,
            bool(self.loss == self.loss and self.moved),
        )

    def markdown(self) -> str:
        b = self.parity_bound

        def mark(ok: bool) -> str:
            return "✓" if ok else "✗"

        cached = (
            "— (encoder)"
            if self.cached is None
            else f"{mark(self.cached_tokens and self.cached <= b)} {self.cached:.0e}"
            + ("" if self.cached_tokens else ", tokens differ")
        )
        step = f"{mark(self.loss == self.loss and self.moved)} loss {self.loss:.2f}"
        return (
            f"| `{self.model_type}` | `{self.cls}` | {mark(self.parity <= b)} {self.parity:.0e} (≤ {b:.0e}) "
            f"| {cached} | {mark(self.round_trip <= b)} {self.round_trip:.0e} | {step} |"
        )


def model_types() -> list[tuple[str, str, str]]:
    """``(model_type, class name, head)`` of every type with a causal-LM (else masked-LM) head,
    and the family rows' own types, sorted."""
    out = {t: (t, c, "causal") for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    for t, c in MODEL_FOR_MASKED_LM_MAPPING_NAMES.items():
        out.setdefault(t, (t, c, "masked"))
    for fam in FAMILIES.values():
        out.setdefault(fam.model_type, (fam.model_type, fam.lm, fam.auto))
    return [out[t] for t in sorted(out)]


# where the class's defaults would leave a family's mechanism idle in a 2-layer model
OVERRIDES = {
    "smollm3": dict(no_rope_layer_interval=2),  # layer 1 without RoPE
    "modernbert-decoder": dict(pad_token_id=0),  # (the class's pad id lies past a vocabulary of 96)
    "mllama": dict(pad_token_id=0, cross_attention_layers=[1]),  # a cross-attention layer, as its checkpoints have
    "dots1": dict(n_shared_experts=1),  # (the class leaves it None and multiplies by it)
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # (not derived from num_hidden_layers)
}
MIXED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)


def tiny_config(model_type: str):
    """The config of the family's own tests (tests/test_hf_families.py, test_hf_mla.py,
    test_inkling2.py, test_hf_dsa.py) where it has one; else the
    config class's defaults with :data:`SMALL`'s sizes (on its text config for a composite one),
    built through the constructor so derived fields (``layer_types``, ...) follow. A class with
    sliding and full layers gets one of each (window 6) where it takes them."""
    from tests.test_hf_families import _configs

    for _, cfg in _configs().values():
        if cfg.model_type == model_type:
            return cfg
    from tests import test_hf_dsa, test_inkling2
    from tests import test_hf_mla as mla

    own = {"deepseek_v3": mla.deepseek_config, "mistral4": mla.mistral4_config}
    own["inkling2_text"] = lambda: test_inkling2.config(vocab_size=V, unpadded_vocab_size=V)
    own["mistral_large4"] = test_hf_dsa.config
    own |= {t: (lambda t=t: test_hf_dsa.dsa_config(t)) for t in test_hf_dsa.DSA_ROWS}
    own |= {t: (lambda t=t: mla.shared_config(t)) for t in mla.SHARED}
    if model_type in own:  # (the MLA and Inkling-2 tests' configs: their sizes follow each other)
        return own[model_type]()
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    text = default.get_text_config()
    fields = set(text.to_dict()) | set(getattr(text, "attribute_map", {}))
    small = {k: v for k, v in SMALL.items() if k in fields}
    for name in ("layer_types", "mlp_layer_types", "no_rope_layers", "layers_block_type", "hybrid_override_pattern"):
        if name in fields and not isinstance(getattr(type(text), name, None), property):
            small[name] = None  # rebuilt for num_hidden_layers where the class derives it
    small |= OVERRIDES.get(model_type, {})
    types = set(getattr(text, "layer_types", None) or ())
    if {"sliding_attention", "full_attention"} <= types and "sliding_window" in fields:
        small |= MIXED
    if text is default:
        return _build(cls, small)
    sub = next(k for k in getattr(default, "sub_configs", {}) if getattr(default, k, None) is text)
    return _build(cls, {sub: _build(type(text), small).to_dict()})


def _build(cls, small: dict):
    try:
        return cls(**small)
    except Exception:  # noqa: BLE001 - a field it wants given (or not None): keep the class's own
        return cls(**{k: v for k, v in small.items() if v is not None})


MAX_PARAMS = 10_000_000  # a tiny model above this kept large sizes :data:`SMALL` does not reach


def stock_model(model_type: str, cls_name: str):
    """The tiny stock model, seeded by its type, 1-d parameters moved off their init.

    Raises:
        ValueError: the config keeps sizes SMALL does not reach (sized on the meta device first).
    """
    cls, cfg = getattr(transformers, cls_name), tiny_config(model_type)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"over {MAX_PARAMS // 10**6}M parameters: sub-configs or sizes the walk does not shrink")
    torch.manual_seed(zlib.crc32(model_type.encode()))
    model = cls(cfg).eval()
    with torch.no_grad():  # norms, biases and sinks off their ones/zeros init, so a dropped one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def reduction_n(cfg, length: int) -> int:
    """Reduction length behind the logits (tests/conftest.py): per layer the attention, q/k norms,
    the MLP and four norms; then the final norm and the head (as tests/test_hf_families.py)."""
    cfg = cfg.get_text_config()
    D = cfg.hidden_size
    I = max(getattr(cfg, k, None) or 0 for k in ("intermediate_size", "moe_intermediate_size")) or 4 * D
    per = getattr(cfg, "per_layer_config", None)  # (Gemma 4: head sizes per layer; the widest counts)
    Dh = max(getattr(c, "head_dim", None) or D // c.num_attention_heads for c in per or [cfg])
    layer = attention_n(dim=D, length=length, head_dim=Dh) + 2 * Dh + D + I + 4 * D
    return cfg.num_hidden_layers * layer + 3 * D


def _bound(expected: torch.Tensor, cfg, length: int) -> float:
    magnitude = max(1.0, float(expected.abs().amax()))
    return tolerance(torch.float32, n=reduction_n(cfg, length), magnitude=magnitude)["atol"]


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _greedy(model, ids, **kw):
    out = model.generate(
        ids,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
    )
    return out.sequences, torch.stack(out.logits, 1)


def measure(model_type: str, cls_name: str, head: str) -> Row:
    """The row of one model type (see the module docstring)."""
    row = dict(model_type=model_type, cls=cls_name)
    try:
        stock = stock_model(model_type, cls_name)
    except Exception as e:  # noqa: BLE001 - the reason is the row
        return Row(**row, reason=f"no tiny model from the config class's defaults ({_one_line(e)})")
    try:
        ph.family_of(stock)
    except TypeError:
        return Row(**row, reason=no_row_reason(stock, head))
    try:
        ph.convert(stock)
    except Exception as e:  # noqa: BLE001
        return Row(**row, reason=f"convert refuses: {_one_line(e)}")
    try:
        return Row(**row, **checks(stock, head))
    except Exception as e:  # noqa: BLE001
        return Row(**row, reason=f"converts, but a check fails: {_one_line(e)}")


def checks(stock, head: str, only_parity: bool = False) -> dict:
    """The measured cells of a model whose class a family row covers."""
    ours = ph.convert(stock).eval()
    torch.manual_seed(0)
    ids = torch.randint(1, V, (2, L))
    want = _logits(stock, ids)
    bound = _bound(want, stock.config, L)
    out = dict(parity=float((_logits(ours, ids) - want).abs().amax()), parity_bound=bound)
    if only_parity:
        return out
    if head == "causal":
        prompt = ids[:, :PROMPT]
        a, la = _greedy(ours, prompt, past_key_values=DynamicCache(config=ours.config))
        b, lb = _greedy(ours, prompt, use_cache=False)
        out.update(cached=float((la - lb).abs().amax()), cached_tokens=bool(torch.equal(a, b)))
    auto = AutoModelForMaskedLM if head == "masked" else AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        back = auto.from_pretrained(d).eval()
        out["round_trip"] = float((_logits(back, ids) - _logits(ours, ids)).abs().amax())
    out["loss"], out["moved"] = train_step(ph.convert(stock, encoding="alibi").train(), ids, head)
    return out


def train_step(model, ids, head: str) -> tuple[float, bool]:
    """One AdamW step on next-token (masked: every 4th token) labels: the loss, and whether every
    attention layer's ``W_Q`` moved (the gradient went through posenc's attention)."""
    fam = ph.family_of(model)
    labels = ids.clone()
    if head == "masked":
        labels[:, 1::4] = -100
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(ids, labels=labels).loss
    loss.backward()
    opt.step()
    base = model
    for part in fam.base.split("."):
        base = getattr(base, part)
    q_name = fam.qk[0] if fam.qk[0] not in ("fused", "conv1d") else fam.qk[1]
    moved = []
    for n, p in model.named_parameters():
        if f".{fam.attention}.{q_name}." in n and n.endswith("weight"):
            moved.append(bool((p.detach() - before[n]).abs().amax() > 0))
    if not moved:  # (MLA: the query through q_a_proj/q_b_proj, no q_proj)
        for n, p in model.named_parameters():
            inner = n.split(f".{fam.attention}.", 1)[-1]
            if inner != n and inner.startswith("q_") and "norm" not in inner and n.endswith("weight"):
                moved.append(bool((p.detach() - before[n]).abs().amax() > 0))
    return float(loss), bool(moved) and all(moved)


@contextlib.contextmanager
def candidate(stock, **fields):
    """A plain row ``Family(model_type, class, **fields)`` in :data:`FAMILIES` for the block."""
    from posenc.hf import models

    t = stock.config.model_type
    FAMILIES[t] = ph.Family(t, type(stock).__name__, **fields)
    try:
        yield FAMILIES[t]
    finally:
        del FAMILIES[t]
        models._CLASSES.pop(t, None)


# what a plain row misses, read in the modeling files of the types whose plain row fails parity
MISSED = {
    "beam": "its NoPE full layers' position-dependent query scale",
    "granite_swa": "a RoPE θ per layer (`position_embeddings_by_theta`, θ = 0: NoPE)",
    "granitemoe_swa": "a RoPE θ per layer (`position_embeddings_by_theta`, θ = 0: NoPE)",
}


# types whose plain row passes parity but fails another check, found by running it (no row for them)
BLOCKED: dict[str, str] = {}


def no_row_reason(stock, head: str) -> str:
    """Why a model type has no family row: what a plain row ``Family(model_type, class)`` (Llama's
    layout) does not find in the model, or, where it finds it all, how that row fails."""
    if stock.config.model_type in BLOCKED:
        return BLOCKED[stock.config.model_type]
    base = getattr(stock, "model", None)
    if base is None or not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        return "no decoder layers at `model.layers` (another layout: no row)"
    attn = [getattr(b, "self_attn", None) for b in base.layers]
    if not any(isinstance(a, torch.nn.Module) for a in attn):
        return "no `self_attn` in its layers (another attention layout: no row)"
    if not all(isinstance(a, torch.nn.Module) for a in attn):
        return "`self_attn` in some layers only (recurrent, convolutional or cross-attention layers between: no row)"
    if not all(hasattr(a, "q_proj") and hasattr(a, "k_proj") for a in attn):
        return "no `q_proj`/`k_proj` (fused or latent projections: no row)"
    if not isinstance(getattr(base, "rotary_emb", None), torch.nn.Module):
        return "no rotary embedding at `model.rotary_emb` (no row)"
    try:
        with candidate(stock):
            got = checks(stock, head, only_parity=True)
    except Exception as e:  # noqa: BLE001
        return f"a plain row fails: {_one_line(e)}"
    if got["parity"] > got["parity_bound"]:
        what = MISSED.get(stock.config.model_type, "part of its attention")
        return f"a plain row converts but misses {what} (stock parity above the bound)"
    return f"a plain row reaches stock parity ({got['parity']:.0e}) but is not in FAMILIES yet"


def rows(types=None, progress: bool = False) -> list[Row]:
    wanted = model_types() if types is None else [t for t in model_types() if t[0] in set(types)]
    out = []
    for i, (t, c, head) in enumerate(wanted):
        if progress:
            print(f"[{i + 1}/{len(wanted)}] {t}", file=sys.stderr, flush=True)
        quiet = io.StringIO()
        with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append(measure(t, c, head))
    return out


def table(found: list[Row]) -> str:
    """The converting model types as a table, then the others grouped by their reason."""
    n_ok = sum(r.ok for r in found)
    converting = [r for r in found if r.reason is None]
    lines = [
        f"**{n_ok} of {len(found)} model types** convert with stock parity, cached = uncached generation, "
        f"round trip and a training step (transformers {transformers.__version__}, {len(FAMILIES)} family rows).",
        "",
        "| model type | class | stock parity | cached = uncached | round trip | swap (alibi) + step |",
        "|---|---|---|---|---|---|",
        *(r.markdown() for r in converting),
        "",
        f"The other {len(found) - len(converting)}, by reason:",
        "",
    ]
    reasons: dict[str, list[str]] = {}
    for r in found:
        if r.reason is not None:
            reasons.setdefault(r.reason, []).append(r.model_type)
    for reason, types in sorted(reasons.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"* {reason}: " + ", ".join(f"`{t}`" for t in types))
    return "\n".join(lines)


def write(text: str, path: pathlib.Path = DOC) -> None:
    doc = path.read_text(encoding="utf-8")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}", encoding="utf-8")


def documented(path: pathlib.Path = DOC) -> str:
    """The table between the markers of docs/hf-coverage.md."""
    doc = path.read_text(encoding="utf-8")
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def verdicts_of(text: str) -> dict[str, tuple]:
    """``{model_type: Row.verdicts()}`` read back from a table :func:`table` wrote."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            t, cls = cells[0].strip("`"), cells[1].strip("`")
            cached = None if cells[3].startswith("—") else cells[3].startswith("✓")
            out[t] = (t, cls, cells[2].startswith("✓"), cached, cells[4].startswith("✓"), cells[5].startswith("✓"))
        elif line.startswith("* "):
            reason, _, types = line[2:].rpartition(": ")
            for t in types.split(", "):
                out[t.strip("`")] = (t.strip("`"), reason)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types to measure (default: all)")
    parser.add_argument("--write", action="store_true", help=f"write the table between the markers of {DOC.name}")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    known = {t for t, _, _ in model_types()}
    bad = sorted(set(args.types) - known)
    if bad:
        print(f"unknown model type(s) {bad}: choose among the {len(known)} of transformers' LM mappings")
        return 2
    found = rows(args.types or None, progress=True)
    text = table(found)
    print(text)
    if args.write:
        if args.types:
            print("--write needs the full walk (no model types given)")
            return 2
        write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
