"""RULER's tasks in ``posenc extend --tasks`` (issue 65): posenc's generators against lm-eval's own
(``lm_eval/tasks/ruler``, 0.4.13) for the same seeds and tokenizer, RULER's scoring, the command."""

from __future__ import annotations

import importlib
import random
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from posenc.extend import ruler  # noqa: E402
from posenc.extend.ruler.score import postprocess, prompt_of, string_match_all  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    """A small byte-level BPE (no download): only its token counts matter to the generators."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from posenc.extend.ruler.aggregate import CWE_TEMPLATE, FWE_TEMPLATE, VT_ANSWER, VT_TEMPLATE
    from posenc.extend.ruler.niah import NEEDLE, NOISE, TEMPLATE

    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator([NOISE * 5, TEMPLATE, NEEDLE, VT_TEMPLATE, VT_ANSWER, CWE_TEMPLATE, FWE_TEMPLATE], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t)


def _seed():
    random.seed(ruler.PY_SEED)
    np.random.seed(ruler.NP_SEED)


def test_vt_equals_lm_eval(tok):
    pytest.importorskip("lm_eval")
    vt = importlib.import_module("lm_eval.tasks.ruler.vt_utils")
    for length in (1200, 2000):  # (the one-shot example alone is ~500 tokens; lm-eval loops forever below)
        _seed()  # lm-eval's get_dataset: the one-shot example (500 tokens), then the samples
        example = vt.sys_vartrack_w_noise_random(tokenizer=tok, num_samples=1, max_seq_length=500, incremental=5)[0]
        theirs = vt.sys_vartrack_w_noise_random(tokenizer=tok, num_samples=6, max_seq_length=length,
                                                icl_example=example)  # fmt: skip
        ours = ruler.samples("ruler_vt", tok, length, 6)
        assert ours == theirs
        assert all(s["length"] <= length for s in ours) and len({s["input"] for s in ours}) == 6


def test_cwe_equals_lm_eval(tok):
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    cwe = importlib.import_module("lm_eval.tasks.ruler.cwe_utils")  # reloaded below: its RNG(42) afresh
    for length in (2500, 6000):  # below 4096 tokens: 6 repeats of each common word; from 4096: 30
        cwe = importlib.reload(cwe)
        _seed()
        theirs = cwe.sys_word_pair_random(num_samples=4, max_seq_length=length, tokenizer=tok)
        assert ruler.samples("ruler_cwe", tok, length, 4) == theirs
        assert len(theirs[0]["outputs"]) == 10 and all(s["length"] <= length for s in theirs)


def test_fwe_equals_lm_eval(tok):
    pytest.importorskip("lm_eval")
    pytest.importorskip("scipy")
    fwe = importlib.import_module("lm_eval.tasks.ruler.fwe_utils")
    for length in (400, 1000):
        _seed()
        theirs = fwe.sys_kwext(tokenizer=tok, max_seq_length=length, num_samples=4)
        assert ruler.samples("ruler_fwe", tok, length, 4) == theirs
        assert theirs[0]["outputs"][0] in theirs[0]["input"]


@pytest.fixture(scope="module")
def prepare_niah():
    """lm-eval's module, imported with nltk's download made a no-op (the noise and needle
    haystacks never split sentences; nothing may reach the network). Builds its 6.2 M key words."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    nltk = pytest.importorskip("nltk")
    mp = pytest.MonkeyPatch()
    mp.setattr(nltk, "download", lambda *a, **k: False)
    sys.modules.pop("lm_eval.tasks.ruler.prepare_niah", None)
    try:
        yield importlib.import_module("lm_eval.tasks.ruler.prepare_niah")
    finally:
        mp.undo()


NIAH = {  # lm-eval niah_utils' arguments; the two *_noise tasks: multivalue / multiquery on the noise haystack
    "niah_single_1": dict(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers"),
    "niah_multikey_2": dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers"),
    "niah_multikey_3": dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids"),
    "niah_multivalue_noise": dict(
        type_haystack="repeat", type_needle_k="words", type_needle_v="numbers", num_needle_v=4
    ),  # fmt: skip
    "niah_multiquery_noise": dict(
        type_haystack="repeat", type_needle_k="words", type_needle_v="numbers", num_needle_q=4
    ),  # fmt: skip
}


@pytest.mark.slow
def test_niah_keys_equal_lm_eval_words(prepare_niah):
    from posenc.extend.ruler.words import niah_keys

    theirs, ours = prepare_niah.WORDS, niah_keys()
    assert len(ours) == len(theirs)
    rng = random.Random(7)
    for i in [0, len(theirs) - 1, *rng.sample(range(len(theirs)), 20000)]:
        assert ours[i] == theirs[i], i
    for w in ("blue", "high", "old", "teeny", "wide"):  # the interleaved groups ("blue-eyed" ...), in full
        lo = next(i for i, x in enumerate(ours.starts) if isinstance(ours.blocks[i], list) and ours.blocks[i][0].startswith(w + "-"))  # fmt: skip
        a = ours.starts[lo]
        assert [ours[i] for i in range(a, a + len(ours.blocks[lo]))] == theirs[a : a + len(ours.blocks[lo])]


@pytest.mark.slow
@pytest.mark.parametrize("task", list(NIAH))
def test_niah_equals_lm_eval(prepare_niah, tok, task):
    niah_utils = importlib.import_module("lm_eval.tasks.ruler.niah_utils")
    kw = NIAH[task]
    for length in (600, 1100):
        _seed()
        theirs = prepare_niah.generate_samples(prepare_niah.get_haystack(type_haystack=kw["type_haystack"]),
                                               max_seq_length=length, template=niah_utils.TEMPLATE, num_samples=5,
                                               TOKENIZER=tok, **kw)  # fmt: skip
        assert ruler.samples(task, tok, length, 5) == theirs
        assert all(
            set(s["outputs"]) <= set(s["input"].split(" ")) | {o.rstrip(".") for o in s["outputs"]} for s in theirs
        )


def test_scoring_is_rulers():
    pytest.importorskip("lm_eval")
    from lm_eval.tasks.ruler.common_utils import postprocess_pred
    from lm_eval.tasks.ruler.common_utils import string_match_all as theirs

    preds = [" 1234567 and\x01 7654321 ", "nothing", "ABC, abd", ""]
    refs = [["1234567", "7654321"], ["1"], ["abc", "ABD", "x"], ["q"]]
    for p, r in zip(preds, refs):
        assert string_match_all(postprocess(p), r) == pytest.approx(theirs(postprocess_pred([p]), [r]))
    assert string_match_all("abc, abd", ["abc", "ABD", "x"]) == pytest.approx(2 / 3)  # part credit
    s = {"input": "text?", "gen_prefix": "Answer:"}
    assert prompt_of(s) == "text? Answer:" and prompt_of(s, "\n\n") == "text?\n\nAnswer:"
    assert prompt_of({"input": "text\n", "gen_prefix": "Answer:"}) == "text\nAnswer:"


def test_effective_length_is_the_longest_above_the_threshold():
    assert ruler.THRESHOLD == 85.6
    # RULER's README: GPT-4-1106 96.6 (4K) ... 87.0 (64K), 81.2 (128K) -> 64K
    gpt4 = {4096: 96.6, 8192: 96.3, 16384: 95.2, 32768: 93.2, 65536: 87.0, 131072: 81.2}
    assert ruler.effective_length(gpt4) == 65536
    assert ruler.effective_length({4096: 85.6}) is None  # "above": equal is not enough
    assert ruler.effective_length({}) is None


def test_unknown_task_and_short_length_are_one_line(tok):
    with pytest.raises(ValueError, match=r"'niah_single_2'.*allowed: niah_single_1"):
        ruler.check_tasks(["niah_single_1", "niah_single_2"])
    with pytest.raises(ValueError, match=r"length 100.*allowed"):
        ruler.samples("ruler_fwe", tok, 100, 1)
    with pytest.raises(ValueError, match=r"length 40 leaves no room"):
        ruler.samples("ruler_vt", tok, 40, 1)
    with pytest.raises(ValueError, match=r"length 300 leaves no room.*ten common words"):
        ruler.samples("ruler_cwe", tok, 300, 1)


@pytest.mark.real
def test_generators_equal_lm_eval_with_smollm2s_tokenizer():
    """The real tokenizer (SmolLM2's, cached by scripts/smollm2.py) at RULER's own shortest length, 4096:
    variable tracking, common words (its 30-repeat branch) and frequent words."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    from tests.test_real_smollm2 import smollm2
    from transformers import AutoTokenizer

    try:
        path = smollm2.prepare(offline=True)
    except smollm2.Unavailable as e:
        pytest.skip(f"SmolLM2 checkpoint cannot be prepared: {e}")
    tok = AutoTokenizer.from_pretrained(path)
    vt = importlib.import_module("lm_eval.tasks.ruler.vt_utils")
    cwe = importlib.reload(importlib.import_module("lm_eval.tasks.ruler.cwe_utils"))
    fwe = importlib.import_module("lm_eval.tasks.ruler.fwe_utils")
    _seed()
    example = vt.sys_vartrack_w_noise_random(tokenizer=tok, num_samples=1, max_seq_length=500, incremental=5)[0]
    assert ruler.samples("ruler_vt", tok, 4096, 3) == vt.sys_vartrack_w_noise_random(
        tokenizer=tok, num_samples=3, max_seq_length=4096, icl_example=example
    )
    _seed()
    assert ruler.samples("ruler_cwe", tok, 4096, 3) == cwe.sys_word_pair_random(3, 4096, tokenizer=tok)
    _seed()
    assert ruler.samples("ruler_fwe", tok, 4096, 3) == fwe.sys_kwext(tokenizer=tok, max_seq_length=4096, num_samples=3)


def test_tasks_without_wonderwords_are_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wonderwords", None)
    with pytest.raises(ValueError, match=r"^--tasks: RULER's tasks draw words from the `wonderwords` package"):
        ruler.check_tasks(["ruler_vt", "niah_single_1"])
    assert ruler.check_tasks(["ruler_vt", "ruler_fwe", "niah_multikey_3"])  # (no word lists)
