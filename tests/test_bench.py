"""posenc bench: smoke test at L = 128, backend dispatch (CPU and CUDA logic, tested on
CPU), the CPU peak-memory measurement, and torch.compile of a whole TransformerLM for
every registered encoding (slow)."""

from __future__ import annotations

import json

import pytest
import torch
from tests.conftest import assert_close, attention_n, lm_n

import posenc
from posenc import Stage
from posenc.allocator import _glibc
from posenc.bench.measure import machine_record, peak_memory, time_runs


def _small(name: str, causal: bool = True):
    """Heads of 16 channels: the least FlexAttention's CUDA kernel runs (FLEX_MIN_HEAD_DIM)."""
    cls = posenc.get_class(name)
    return posenc.build(name, heads=2, head_dim=16, max_len=64, causal=causal or cls.causal_only)


@pytest.mark.parametrize("name", posenc.available())
def test_select_backend_dispatch(name):
    """auto picks sdpa (flash on GPU) / flex on CUDA / blockwise on CPU where the terms are
    per distance / maps on CPU where the scores are maps / dense / chunked, by stages."""
    enc = _small(name)
    st = enc.stages
    vector = bool(st & (Stage.TERMS | Stage.VALUE | Stage.SCORES | Stage.NORM)) or enc.defines("rotate_value")
    per_distance = enc.defines("distance_terms")
    cpu = posenc.select_backend(enc, "cpu")
    cuda = posenc.select_backend(enc, "cuda")
    if vector:
        assert cpu == ("blockwise" if per_distance else "maps" if enc.defines("score_maps") else "chunked")
        assert cuda == "chunked"
    elif st & Stage.BIAS:
        assert cpu == ("blockwise" if per_distance else "dense")
        assert cuda == ("flex" if enc.defines("score_mod") else "dense")
    else:
        assert cpu == cuda == "sdpa"
    assert cpu in posenc.supported_backends(enc) and cuda in posenc.supported_backends(enc)


@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_scalar_biases_go_to_flex_on_cuda(name):
    enc = _small(name)
    assert enc.defines("score_mod")
    assert posenc.select_backend(enc, "cuda") == "flex"
    assert posenc.select_backend(enc, "cpu") == "blockwise"


@pytest.mark.parametrize("name", ["alibi", "t5", "shaw", "kerple", "xl", "deberta"])
def test_blockwise_only_for_long_sequences(name):
    """On CPU blockwise runs only from BLOCKWISE_MIN_SCORES scores per head: at compare's
    training length (64) the one-shot backends measured faster; KV-cache decoding (one
    query over many keys) stays on them too."""
    enc = _small(name)
    side = int(posenc.attend.backends.BLOCKWISE_MIN_SCORES**0.5)
    short = posenc.select_backend(enc, "cpu", 64, 64)
    assert short != "blockwise" and short in posenc.supported_backends(enc)
    assert posenc.select_backend(enc, "cpu", 1, 4096) == short
    assert posenc.select_backend(enc, "cpu", side, side) == "blockwise"
    assert posenc.select_backend(enc, "cpu", side - 1, side) == short
    # on CUDA the blockwise threshold plays no part (the one length rule there: FLEX_MIN_QUERIES)
    assert posenc.select_backend(enc, "cuda", side - 1, side) == posenc.select_backend(enc, "cuda")
    attn = posenc.Attention(16, 2, encoding=name, causal=True)
    assert attn.resolve_backend(None, "cpu", 64, 64) == short
    assert attn.resolve_backend(None, "cpu", side, side) == "blockwise"


@pytest.mark.parametrize("name", ["alibi", "t5", "shaw", "kerple", "xl", "deberta"])
def test_blockwise_bidirectional_only_from_its_own_threshold(name):
    """Bidirectional calls take blockwise only from BLOCKWISE_MIN_SCORES_BIDIR scores per
    head (the one-shot backends measured faster below it); causal ones keep the causal rule,
    and a layer resolves with its own causality unless the call says otherwise."""
    enc = _small(name, causal=False)
    side = int(posenc.attend.backends.BLOCKWISE_MIN_SCORES_BIDIR**0.5)
    causal_side = int(posenc.attend.backends.BLOCKWISE_MIN_SCORES**0.5)
    assert side > causal_side
    short = posenc.select_backend(enc, "cpu", 64, 64, causal=False)
    assert short != "blockwise" and short in posenc.supported_backends(enc)
    assert posenc.select_backend(enc, "cpu", side - 1, side, causal=False) == short
    assert posenc.select_backend(enc, "cpu", side, side, causal=False) == "blockwise"
    assert posenc.select_backend(enc, "cpu", causal_side, causal_side, causal=False) == short
    assert posenc.select_backend(enc, "cpu", causal_side, causal_side, causal=True) == "blockwise"
    assert posenc.select_backend(enc, "cpu", causal_side, causal_side) == "blockwise"  # unknown: causal rule
    assert posenc.select_backend(enc, "cuda", side - 1, side, causal=False) == posenc.select_backend(enc, "cuda")
    bidir = posenc.Attention(16, 2, encoding=name, causal=False)
    assert bidir.resolve_backend(None, "cpu", causal_side, causal_side) == short
    assert bidir.resolve_backend(None, "cpu", side, side) == "blockwise"
    assert bidir.resolve_backend(None, "cpu", causal_side, causal_side, causal=True) == "blockwise"
    with pytest.raises(TypeError, match="causal must be a bool"):
        posenc.select_backend(enc, "cpu", 64, 64, causal="yes")


def test_layer_runs_the_backend_it_resolves(monkeypatch):
    """A bidirectional layer at 1024 x 1024 runs the one-shot backend (not blockwise), a causal
    one blockwise: the rule reaches the call, not only resolve_backend."""
    ran = []
    for name in ("blockwise", "dense"):
        fn = posenc.BACKENDS[name]
        monkeypatch.setitem(posenc.BACKENDS, name, lambda *a, _n=name, _f=fn, **kw: ran.append(_n) or _f(*a, **kw))
    x = torch.randn(1, 1024, 16)
    for causal in (False, True):
        attn = posenc.Attention(16, 2, encoding="alibi", causal=causal)
        with torch.no_grad():
            attn(x)
    assert ran == ["dense", "blockwise"]


def test_chunked_blocks_keep_to_a_score_budget(monkeypatch):
    """``chunked`` blocks hold at most CHUNKED_ROWS rows and CHUNKED_SCORES scores per head
    (at least 8 rows), so that the blocks of a long causal call have about one size; they
    cover every query once, in order, and the output equals one block over everything."""
    from posenc.attend import backends as B

    assert B.chunked_rows(64, 1024) == 256 and B.chunked_rows(1024, 1024) == 256
    assert B.chunked_rows(2048, 1024) == 128 and B.chunked_rows(4096, 1024) == 64
    assert B.chunked_rows(1 << 20, 1024) == 8 and B.chunked_rows(1024, 3) == 3
    monkeypatch.setattr(B, "CHUNKED_SCORES", 64 * 64)
    monkeypatch.setattr(B, "CHUNKED_ROWS", 32)
    blocks = []
    real = B.materialized

    def spy(enc, q, k, *a, **kw):
        blocks.append((q.shape[2], k.shape[2]))
        return real(enc, q, k, *a, **kw)

    monkeypatch.setattr(B, "materialized", spy)
    enc = _small("cope")
    L = 1000
    q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
    pos = torch.arange(L)[None]
    out = B.chunked(enc, q, k, v, pos, pos, posenc.AttentionMask(causal=True))
    rows = [r for r, _ in blocks]
    assert sum(rows) == L and max(rows) == 32 and min(rows[:-1]) == 8
    seen = 0
    for r, n in blocks:
        seen += r
        assert n == seen  # causal: a block sees the keys up to its last query
        assert r * n <= 64 * 64 or r <= 8  # (8: the least; fewer: the last block)
    sizes = [r * n for r, n in blocks[len(blocks) // 2 : -1]]
    assert max(sizes) <= 2 * min(sizes)  # the second half of the blocks: about one size
    whole = B.eager(enc, q, k, v, pos, pos, posenc.AttentionMask(causal=True))
    assert_close(out, whole, n=2 * L + 8)


def test_bench_resolves_auto_backend_per_device():
    from posenc.bench.layers import posenc_case, resolved_backend

    case = posenc_case("alibi", heads=2, head_dim=16, causal=True, max_len=64, device="cpu", dtype=torch.float32)
    module, _ = case.make(16)
    assert resolved_backend(case, module, torch.device("cpu"), 1024) == "blockwise"
    assert resolved_backend(case, module, torch.device("cpu"), 64) == "dense"
    assert resolved_backend(case, module, torch.device("cuda"), 1024) == "flex"
    assert resolved_backend(case, module, torch.device("cuda"), 64) == "dense"  # FLEX_MIN_QUERIES
    narrow = posenc_case("alibi", heads=2, head_dim=8, causal=True, max_len=64, device="cpu", dtype=torch.float32)
    assert resolved_backend(narrow, narrow.make(16)[0], torch.device("cuda"), 1024) == "dense"  # FLEX_MIN_HEAD_DIM


def test_peak_memory_cpu_counts_live_bytes():
    n = 1 << 20  # 1 Mi float32 = 4 MiB

    def two_at_once():
        a = torch.ones(n)
        b = torch.ones(n)
        return float(a[0] + b[0])

    def one_after_another():
        for _ in range(2):
            a = torch.ones(n)
            del a

    both = peak_memory(two_at_once, device=torch.device("cpu"))
    seq = peak_memory(one_after_another, device=torch.device("cpu"))
    assert 8 * 2**20 <= both < 8 * 2**20 + 2**16
    assert 4 * 2**20 <= seq < 4 * 2**20 + 2**16


def test_time_runs_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        time_runs(lambda: None, device=torch.device("cpu"), repeats=0)
    assert len(time_runs(lambda: None, device=torch.device("cpu"), warmup=0, repeats=3)) == 3


def test_machine_record_fields():
    rec = machine_record(torch.device("cpu"))
    for key in ("cpu", "cpu_count", "torch_threads", "torch", "device", "date_utc"):
        assert rec[key] not in (None, "")
    assert rec["torch"] == torch.__version__


def test_bench_smoke_l128(tmp_path, one_thread):
    """`posenc bench` end to end at L = 128: tables, JSON/CSV, plot, machine, Markdown."""
    from posenc.cli import main

    encs = [e for e in ("rope", "alibi", "t5") if e in posenc.available()]
    out = tmp_path / "out"
    md = tmp_path / "RESULTS.md"
    argv = ["bench", "--lengths", "128", "--encodings", ",".join(encs), "--warmup", "0", "--repeats", "1"]
    argv += ["--out", str(out), "--markdown", str(md), "--train-len", "32", "--train-batch", "1", "--quiet"]
    argv += ["--train-dim", "64", "--train-depth", "1", "--device", "cpu"]
    assert main(argv) == 0
    for f in ("layers.json", "layers.csv", "throughput.json", "throughput.csv", "machine.json", "time_vs_length.png"):
        assert (out / f).stat().st_size > 0, f
    data = json.loads((out / "layers.json").read_text())
    rows = data["rows"]
    assert data["machine"]["device"] == "cpu"
    labels = {r["label"] for r in rows}
    assert "sdpa (no position)" in labels
    assert {f"posenc:{e}" for e in encs} <= labels
    assert "hf:T5Attention" in labels and "x-transformers:AlibiPositionalBias" in labels
    for r in rows:
        assert r["status"] == "ok", (r["label"], r["status"])
        assert r["L"] == 128 and r["time_s"] > 0 and r["ratio"] > 0 and r["peak_bytes"] > 0
    backends = {r["label"]: r["backend"] for r in rows if r["impl"] == "posenc"}
    assert (
        backends["posenc:rope"] == "sdpa" and backends["posenc:alibi"] == "dense"
    )  # 128 x 128: below BLOCKWISE_MIN_SCORES
    trows = json.loads((out / "throughput.json").read_text())["rows"]
    assert {(r["impl"], r["encoding"]) for r in trows} >= {("posenc", "rope"), ("x-transformers", "rope")}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in trows), trows
    text = md.read_text()
    assert "| sdpa (no position) |" in text and "L=128" in text and data["machine"]["cpu"] in text
    if _glibc() is not None:  # --allocator tuned is the default: recorded in machine.json and the report
        assert data["machine"]["allocator"]["mmap_threshold"] == posenc.allocator.MMAP_THRESHOLD
        assert "tuned by `posenc.tune_allocator`" in text


def test_bench_rejects_unknown_encoding(tmp_path, capsys):
    from posenc.cli import main

    assert main(["bench", "--encodings", "nosuch", "--out", str(tmp_path), "--quiet"]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert main(["bench", "--masks", "diagonal", "--out", str(tmp_path), "--quiet"]) == 2
    assert "diagonal" in capsys.readouterr().err
    assert main(["bench", "--memory-only", "--out", str(tmp_path), "--quiet"]) == 2
    assert "--memory-lengths" in capsys.readouterr().err
    assert main(["bench", "--memory-method", "rss", "--device", "cuda", "--out", str(tmp_path), "--quiet"]) == 2
    assert "rss" in capsys.readouterr().err
    from posenc.bench import BenchConfig

    with pytest.raises(ValueError, match="masks"):
        BenchConfig(encodings=["rope"], lengths=[8], masks=("sideways",))
    with pytest.raises(ValueError, match="memory_method"):
        BenchConfig(encodings=["rope"], lengths=[8], memory_method="top")


def test_bench_memory_rss_runs_each_case_in_a_fresh_process():
    """``memory_method="rss"``: each memory-only case runs in a child process whose peak
    resident memory is the row's; a case that fails in the child is an error row."""
    from posenc.bench.rss import peak_rss
    from posenc.bench.runner import BenchConfig, run_layers

    cfg = BenchConfig(
        encodings=["alibi"], lengths=[], memory_lengths=[256], references=False, memory_method="rss", heads=2
    )
    rows = run_layers(cfg)
    assert [(r.label, r.status, r.memory_method) for r in rows] == [
        ("sdpa (no position)", "ok", "rss"),
        ("posenc:alibi", "ok", "rss"),
    ]
    base, alibi = rows
    assert alibi.backend in posenc.supported_backends(posenc.build("alibi", heads=2, head_dim=64))
    assert 100 * 2**20 < base.peak_bytes < 4 * 2**30 and base.peak_ratio == 1.0  # Python + torch, and the step
    spec = dict(
        encoding="alibi", backend="auto", options={"nosuch": 1}, causal=True, L=8, heads=2, head_dim=8,
        dtype="float32", batch=1, seed=0, chunk_size=64, max_len=8,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="exit 1.*nosuch"):
        peak_rss(spec)
    spec["options"] = {}
    assert peak_rss(spec)["allocator"] is None  # the child keeps the C library's settings ...
    if _glibc() is not None:  # ... unless the parent's tuned ones are passed on
        tuned = {"mmap_threshold": 32 * 2**20, "trim_threshold": 2**31 - 1}
        got = peak_rss({**spec, "allocator": tuned})["allocator"]
        assert got["mmap_threshold"] == 32 * 2**20 and got["trim_threshold"] == 2**31 - 1


def test_bench_masks_memory_profile_and_failures(tmp_path, one_thread, monkeypatch, capsys):
    """Causal and bidirectional rows in one run, memory-only rows at a longer L (posenc and
    the baseline only, untimed), profiles at the longest timed L; a failing case is a row with
    its error and makes the exit status 1."""
    from posenc.bench import layers
    from posenc.cli import main

    out, md = tmp_path / "out", tmp_path / "R.md"
    argv = ["bench", "--encodings", "alibi,xpos", "--lengths", "32,64", "--masks", "causal,bidir"]
    argv += ["--memory-lengths", "96", "--profile", "--warmup", "0", "--repeats", "1", "--no-throughput"]
    argv += ["--out", str(out), "--markdown", str(md), "--quiet", "--device", "cpu"]
    assert main(argv) == 0
    rows = json.loads((out / "layers.json").read_text())["rows"]
    timed = [r for r in rows if r["kind"] == "time"]
    memory = [r for r in rows if r["kind"] == "memory"]
    assert {(r["label"], r["causal"]) for r in memory} == {
        ("sdpa (no position)", True),
        ("posenc:alibi", True),
        ("posenc:xpos", True),
        ("sdpa (no position)", False),
        ("posenc:alibi", False),  # xpos is causal only
    }
    assert all(r["L"] == 96 and r["time_s"] is None and r["peak_bytes"] > 0 for r in memory)
    assert {r["causal"] for r in timed} == {True, False} and {r["L"] for r in timed} == {32, 64}
    assert not any(r["causal"] is False and r["encoding"] == "xpos" for r in timed)
    profiled = [r for r in timed if r["profile"]]
    assert profiled and all(r["L"] == 64 and r["impl"] == "posenc" for r in profiled)
    assert all(0 < op["share"] <= 1 and op["self_s"] >= 0 for r in profiled for op in r["profile"])
    text = md.read_text()
    assert "L=96" in text and "where the step goes" in text and "| bidir |" in text

    real = layers.posenc_case

    def broken(encoding, **kw):
        case = real(encoding, **kw)
        if encoding == "alibi":
            case.make = lambda L: (_ for _ in ()).throw(RuntimeError("no layer today"))
        return case

    monkeypatch.setattr("posenc.bench.runner.posenc_case", broken)
    argv = ["bench", "--encodings", "alibi", "--lengths", "32", "--warmup", "0", "--repeats", "1"]
    argv += ["--no-throughput", "--no-references", "--out", str(out), "--quiet", "--device", "cpu"]
    assert main(argv) == 1
    assert "no layer today" in capsys.readouterr().err
    rows = json.loads((out / "layers.json").read_text())["rows"]
    assert any(r["label"] == "posenc:alibi" and "no layer today" in r["status"] for r in rows)


def test_graph_breaks_rows():
    from posenc.bench.compile import explain_breaks
    from posenc.bench.report import breaks_table

    row = explain_breaks("nope")
    assert row["graphs"] >= 1 and row["breaks"] == row["graphs"] - 1 and "error" not in row
    head, body = breaks_table([row, {"encoding": "x", "error": "Boom: no"}])
    assert body[0][0] == "`nope`" and body[1][1] == "error" and "Boom" in body[1][3]


# --------------------------------------------------------------------------- torch.compile
_BLOCKWISE = [
    n
    for n in posenc.available()
    if "blockwise" in posenc.supported_backends(posenc.build(n, heads=2, head_dim=8, max_len=16))
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, backend", [(n, "auto") for n in posenc.available()] + [(n, "blockwise") for n in _BLOCKWISE]
)
def test_compile_transformer_lm(name, backend):
    """torch.compile of a whole TransformerLM equals eager in loss and gradients (auto picks
    dense at this length, so the blockwise backend, with its graph breaks, is forced once)."""
    torch.manual_seed(0)
    lm = posenc.TransformerLM(64, 32, 2, 2, encoding=name, max_len=32, backend=backend)
    tokens = torch.randint(0, 64, (2, 17))

    def loss_of(model):
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))

    ref = loss_of(lm)
    ref.backward()
    ref_grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(lm)
    got = loss_of(compiled)
    got.backward()
    # inductor fuses and reorders every reduction: the rule with the model's whole chain
    # (a loss: one more sum over B·L·vocab; gradients: the chain back)
    n = lm_n(dim=32, depth=2, length=16) + 2 * 16 * 64
    assert_close(got, ref, n=n)
    for g, r in zip((p.grad for p in lm.parameters()), ref_grads):
        assert_close(g, r, n=2 * n)


# --------------------------------------------------------------------------- blocked backends
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["alibi", "t5", "shaw"])
def test_blocked_backends_equal_eager(name, causal):
    """The query-blocked dense/relative paths (causal key truncation, recompute in
    backward) equal the eager oracle in outputs and gradients, with a cache offset and
    a key padding mask."""
    if name not in posenc.available():
        pytest.skip(f"{name} not registered")
    torch.manual_seed(0)
    attn = posenc.Attention(16, 2, name, causal=causal, chunk_size=5, max_len=64)
    attn.dense_chunk = 4
    attn.checkpoint_bytes = 0  # force the recompute path too
    x = torch.randn(2, 19, 16, requires_grad=True)
    kpm = torch.ones(2, 19, dtype=torch.bool)
    kpm[1, -3:] = False  # padding at the end: no query row is fully masked
    pos = torch.arange(19).unsqueeze(0) + 7
    for backend in [b for b in posenc.supported_backends(attn.encoding) if b in ("dense", "chunked")]:
        outs = {}
        for b in (backend, "eager"):
            x.grad = None
            attn.zero_grad(set_to_none=True)
            y = attn(x, pos, key_padding_mask=kpm, backend=b)
            y.square().sum().backward()
            outs[b] = (y.detach(), x.grad.clone(), [p.grad.clone() for p in attn.parameters()])
        (y0, gx0, gp0), (y1, gx1, gp1) = outs[backend], outs["eager"]
        n = attention_n(dim=16, head_dim=8, length=19) + 8 + 19  # + Shaw's terms at most
        assert_close(y0, y1, n=n)
        assert_close(gx0, gx1, n=2 * n)
        for a, b in zip(gp0, gp1):
            assert_close(a, b, n=2 * n + 2 * 19)
    # with a KV cache: a second call at offset 11 sees the cached keys
    if causal:
        cache = attn.init_cache(2, 19)
        with torch.no_grad():
            full = attn(x, backend="eager")
            a = attn(x[:, :11], cache=cache, backend=supported_fast(attn))
            b = attn(x[:, 11:], cache=cache, backend=supported_fast(attn))
        assert_close(torch.cat((a, b), 1), full, n=attention_n(dim=16, head_dim=8, length=19) + 8 + 19)


def supported_fast(attn) -> str:
    return [b for b in posenc.supported_backends(attn.encoding) if b in ("dense", "chunked")][0]


def test_throughput_packed_rows(one_thread):
    """``packed``: each posenc model also trains on packed documents (the former
    benchmarks/packed_step.py), and the table gives packed step / plain step."""
    from posenc.bench.report import throughput_table
    from posenc.bench.throughput import ThroughputConfig, packed_documents, run_throughput

    docs = packed_documents(4, 64, seed=0)
    assert docs.shape == (4, 64) and docs.dtype == torch.int64 and (docs[:, 0] == 0).all()
    assert (docs.diff(dim=1) >= 0).all() and docs.max() > 0 and torch.equal(docs, packed_documents(4, 64, seed=0))
    cfg = ThroughputConfig(["nope", "alibi"], seq_len=16, batch=2, dim=32, depth=1, heads=2, warmup=0, repeats=1)
    cfg.packed = True
    rows = run_throughput(cfg)
    assert {(r["impl"], r["encoding"]) for r in rows} >= {("posenc-packed", "alibi"), ("posenc", "alibi")}
    assert all(r["status"] == "ok" for r in rows), rows
    head, body = throughput_table(rows)
    assert "packed step / plain" in head
    col = head.index("packed step / plain")
    assert all(row[col].endswith("×") for row in body)


def test_throughput_hf_rows(one_thread):
    """``hf``: stock HF Llama and posenc.hf conversions take the same steps (the former
    benchmarks/hf_step.py); an encoding the converter refuses is a skipped row."""
    pytest.importorskip("transformers")
    from posenc.bench.report import hf_table
    from posenc.bench.throughput import ThroughputConfig, run_throughput

    cfg = ThroughputConfig(["rope", "alibi"], seq_len=16, batch=2, dim=32, depth=1, heads=2, warmup=0, repeats=1)
    cfg.hf = True
    rows = [r for r in run_throughput(cfg) if r["impl"] == "hf-llama"]
    assert [r["encoding"] for r in rows] == ["stock", "rope", "alibi"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows), rows
    head, body = hf_table(rows)
    assert body[0][2] == "1.00×" and all(b[2].endswith("×") for b in body)


def test_bench_windows(tmp_path, one_thread):
    """``--windows``: each posenc layer also with a sliding window (the former
    benchmarks/window_cost.py), timed against the same baseline."""
    from posenc.cli import main

    out = tmp_path / "out"
    argv = ["bench", "--encodings", "alibi,rope", "--lengths", "64", "--windows", "16", "--modes", "fwd"]
    argv += ["--warmup", "0", "--repeats", "1", "--no-throughput", "--no-references", "--no-memory"]
    argv += ["--out", str(out), "--quiet", "--device", "cpu"]
    assert main(argv) == 0
    rows = json.loads((out / "layers.json").read_text())["rows"]
    labels = {r["label"]: r for r in rows}
    assert {"posenc:alibi", "posenc:alibi[W=16]", "posenc:rope[W=16]"} <= set(labels)
    assert all(r["status"] == "ok" and r["ratio"] > 0 for r in rows)


def test_ratio_table_names_each_backend_a_case_ran():
    """Where auto changes backend with the length, the table's backend cell says so (a
    bidirectional ALiBi layer runs dense up to 1024, blockwise from 2048)."""
    from posenc.bench.report import ratio_table

    def row(label, causal, L, backend):
        return dict(label=label, causal=causal, L=L, mode="fwd", status="ok", ratio=1.0, time_s=0.01, backend=backend)

    rows = [row("posenc:alibi", False, L, b) for L, b in ((4096, "blockwise"), (1024, "dense"), (2048, "blockwise"))]
    rows += [row("posenc:alibi", True, L, "blockwise") for L in (1024, 2048)]
    rows += [row("posenc:t5", False, L, b) for L, b in ((1024, "dense"), (2048, "blockwise"), (4096, "dense"))]
    _, body = ratio_table(rows, "fwd")
    cells = {(r[0], r[1]): r[2] for r in body}
    assert cells[("posenc:alibi", "bidir")] == "dense; blockwise from 2048"
    assert cells[("posenc:alibi", "causal")] == "blockwise"
    assert cells[("posenc:t5", "bidir")] == "dense; blockwise from 2048; dense from 4096"
