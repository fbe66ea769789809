"""RULER's variable tracking and aggregation tasks, as lm-eval 0.4.13 generates them.

``vt_utils.py`` (variable tracking: chains ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in
noise; name every variable that holds the value), ``cwe_utils.py`` (common-words extraction:
the ten words repeated most in a numbered list) and ``fwe_utils.py`` (frequent-words
extraction: the three most frequent coded words of a Zipf-distributed text, alpha 2).
Hsieh et al., RULER (COLM 2024), NVIDIA/RULER ``scripts/data/synthetic/``.

Random draws come from ``rng`` (``random.Random``: lm-eval's module-level ``random``) and, for
variable tracking's values, ``np_rng`` (``numpy.random.RandomState``: lm-eval's ``np.random``),
in lm-eval's order, so the same seeds give the same samples. CWE's second generator (lm-eval's
module-level ``RNG = random.Random(42)``, first used to shuffle the word list) starts afresh for
every call here, as it does in a fresh lm-eval process. Where lm-eval would loop forever (no
haystack fits the length) these raise ``ValueError`` naming the length.
"""

from __future__ import annotations

import random
import string

import numpy as np

from .words import cwe_words

__all__ = ["vt_samples", "cwe_samples", "fwe_samples"]

VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")  # fmt: skip
VT_ANSWER = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are: "
)  # fmt: skip  (RULER's spelling)
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")  # fmt: skip
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")  # fmt: skip
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
ZETA_2 = np.pi**2 / 6  # Riemann zeta(2) (scipy.special.zeta(2.0) gives the same float)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


def _letters(rng: random.Random, k: int) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=k)).upper()


def _vt_chains(rng, np_rng, num_chains: int, num_hops: int, icl: bool):
    k, hops = (3, min(10, num_hops)) if icl else (5, num_hops)
    names = [_letters(rng, k) for _ in range((hops + 1) * num_chains)]
    while len(set(names)) < num_chains * (hops + 1):
        names.append(_letters(rng, k))
    vars_, chains = [], []
    for i in range(0, len(names), hops + 1):
        v = names[i : i + hops + 1]
        vars_.append(v)
        chains.append([f"VAR {v[0]} = {np_rng.randint(10000, 99999)}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(hops)])  # fmt: skip
    return vars_, chains


def _vt_input(rng, np_rng, num_noises: int, num_chains: int, num_hops: int, icl: bool):
    vars_, chains = _vt_chains(rng, np_rng, num_chains, num_hops, icl)
    sentences = [NOISE_LINE] * num_noises
    if len(sentences) <= len(chains[0]):  # too little noise: one sentence a line
        sentences = [n + "." if len(n.strip()) > 0 else n for n in [x for s in sentences for x in s.split(".")]]
        if len(sentences) <= len(chains[0]):
            chains = [c[: len(sentences) - 1] for c in chains]
    for chain in chains:
        for j, p in enumerate(sorted(rng.sample(range(len(sentences)), len(chain)))):
            sentences.insert(p + j, chain[j])
    context = " ".join(sentences).replace(". \n", ".\n")
    value = chains[0][0].split("=")[-1].strip()
    return (VT_TEMPLATE + VT_ANSWER).format(context=context, query=value, num_v=num_hops + 1), vars_[0]


def _vt(tokenizer, length, num_samples, rng, np_rng, *, incremental, icl_example=None, num_chains=1, num_hops=4,
        tokens_to_generate=30) -> list[dict]:  # fmt: skip
    icl = icl_example is None  # (lm-eval: add_fewshot & (icl_example is None))
    example_tokens, example = 0, None
    if icl_example is not None:
        example = icl_example["input"] + " " + " ".join(icl_example["outputs"]) + "\n\n"
        example_tokens = _count(tokenizer, example)
    num_noises, total = incremental, 0
    while total + tokens_to_generate + example_tokens < length:
        text, answer = _vt_input(rng, np_rng, num_noises, num_chains, num_hops, icl)
        total = _count(tokenizer, text + f" {answer}")
        if total + tokens_to_generate + example_tokens > length:
            num_noises -= incremental
            break
        num_noises += incremental
    out = []
    for index in range(num_samples):
        used = num_noises
        while True:
            try:
                text, answer = _vt_input(rng, np_rng, used, num_chains, num_hops, icl)
                n = _count(tokenizer, text) + tokens_to_generate + example_tokens
            except ValueError:  # no noise left to hide the chain in
                n = length + 1
            if n <= length:
                break
            if used <= incremental:
                raise ValueError(f"length {length} leaves no room for variable tracking's prompt and its "
                                 f"{tokens_to_generate} generated tokens; allowed: a longer length for this task")  # fmt: skip
            used -= incremental
        if example is not None:  # the example, its answers renamed, before the prompt
            cut = text.index(VT_TEMPLATE[:20])
            tgt = example[example.index(VT_ANSWER[-10:]) + 10 :].strip().split()
            shown = example
            for item in tgt:
                shown = shown.replace(item, _letters(rng, len(item)))
            text = text[:cut] + shown + "\n\n" + text[cut:]
        at = text.rfind(" Answer: According to the chain(s) of variable assignment")
        prefix = text[at:].strip()
        if example is not None:
            text = text[:at]
        out.append({"index": index, "input": text, "outputs": answer, "length": n, "max_length": length,
                    "gen_prefix": prefix})  # fmt: skip
    return out


def vt_samples(
    tokenizer, length: int, num_samples: int, rng: random.Random, np_rng: np.random.RandomState
) -> list[dict]:
    """Variable tracking (1 chain, 4 hops, 30 generated tokens), with lm-eval's one-shot example
    (itself a 500-token sample drawn first from the same generators)."""
    example = _vt(tokenizer, 500, 1, rng, np_rng, incremental=5)[0]
    return _vt(tokenizer, length, num_samples, rng, np_rng, incremental=10, icl_example=example)


def _cwe_example(rng, shuffle, words, num_words, common_repeats, uncommon_repeats, common_nums=10):
    full = rng.sample(words, num_words)
    common, uncommon = full[:common_nums], full[common_nums:]
    word_list = common * int(common_repeats) + uncommon * int(uncommon_repeats)
    shuffle.shuffle(word_list)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common


def _cwe_input(rng, shuffle, words, num_words, length):
    if length < 4096:
        ex, ex_answer = _cwe_example(rng, shuffle, words, 20, 3, 1)
        context, answer = _cwe_example(rng, shuffle, words, num_words, 6, 1)
    else:
        ex, ex_answer = _cwe_example(rng, shuffle, words, 40, 10, 3)
        context, answer = _cwe_example(rng, shuffle, words, num_words, 30, 3)
    template = CWE_TEMPLATE + CWE_ANSWER
    example = template.format(context=ex) + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer))
    return example, template.format(context=context), answer


def cwe_samples(tokenizer, length: int, num_samples: int, rng: random.Random, *, incremental: int = 10,
                tokens_to_generate: int = 120) -> list[dict]:  # fmt: skip
    """Common-words extraction: ten words repeated 30 times (6 below 4096 tokens) among others
    repeated 3 (1); lm-eval keeps the worked example in ``input_example`` and does not prompt with it."""
    words, state = cwe_words()
    shuffle = random.Random()
    shuffle.setstate(state)
    num_words, total = incremental, 0
    while total + tokens_to_generate < length:
        example, text, answer = _cwe_input(rng, shuffle, words, num_words, length)
        total = _count(tokenizer, example + "\n" + text + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer)))
        if total + tokens_to_generate > length:
            num_words -= incremental
            break
        num_words += incremental
        if num_words > len(words):
            num_words = len(words)
            break
    if num_words < 10:  # (lm-eval goes on with no common word: every answer empty)
        raise ValueError(f"length {length} leaves no room for common-words extraction's ten common words and its "
                         f"{tokens_to_generate} generated tokens; allowed: a longer length for this task")  # fmt: skip
    out = []
    for index in range(num_samples):
        used = num_words
        while True:
            example, text, answer = _cwe_input(rng, shuffle, words, used, length)
            n = _count(tokenizer, text) + tokens_to_generate
            if n <= length:
                break
            if used <= incremental:
                raise ValueError(f"length {length} leaves no room for common-words extraction's prompt and its "
                                 f"{tokens_to_generate} generated tokens; allowed: a longer length for this task")  # fmt: skip
            used -= incremental
        out.append({"index": index, "input": text[: text.rfind(CWE_ANSWER)].strip(), "input_example": example,
                    "outputs": answer, "length": n, "max_length": length, "gen_prefix": CWE_ANSWER.strip()})  # fmt: skip
    return out


def _fwe_input(rng, tokenizer, max_len, num_words, vocab_size, incremental, coded_wordlen=6, alpha=2.0):
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
    vocab = sorted(set(vocab))
    random.Random(42).shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise

    def text_of(n: int):
        counts = n * (np.arange(1, len(vocab) + 1) ** -alpha) / ZETA_2  # Zipf: count of rank k ~ n k^-alpha
        words = [w for w, c in zip(vocab, counts.astype(int)) for _ in range(c)]
        random.Random(42).shuffle(words)
        return (FWE_TEMPLATE + FWE_ANSWER).format(context=" ".join(words)), vocab[1:4]

    if num_words > 0:
        text, answer = text_of(num_words)
        while _count(tokenizer, text) > max_len:
            num_words -= incremental
            text, answer = text_of(num_words)
    else:
        num_words = max_len // coded_wordlen
        text, answer = text_of(num_words)
        while _count(tokenizer, text) < max_len:
            num_words += incremental
            text, answer = text_of(num_words)
        num_words -= incremental
    text, answer = text_of(num_words)
    return text, answer, num_words


def fwe_samples(
    tokenizer, length: int, num_samples: int, rng: random.Random, *, tokens_to_generate: int = 50
) -> list[dict]:
    """Frequent-words extraction: coded words drawn Zipf(2) from a vocabulary of ``length // 50``.

    As lm-eval sizes it, the prompt itself fills up to ``length`` tokens and the 50 generated
    tokens come on top (``"length"`` of a sample may pass ``max_length`` by up to 50)."""
    if length < 200:
        raise ValueError(f"length {length}: frequent-words extraction needs at least 200 tokens (a vocabulary of "
                         "length // 50 >= 4 words: noise and the three answers); allowed: a longer length")  # fmt: skip
    vocab_size, step = length // 50, length // 32
    _, _, num_words = _fwe_input(rng, tokenizer, length, -1, vocab_size, step)
    out = []
    for index in range(num_samples):
        text, answer, _ = _fwe_input(rng, tokenizer, length, num_words, vocab_size, step)
        n = _count(tokenizer, text) + tokens_to_generate
        out.append({"index": index, "input": text[: text.rfind(FWE_ANSWER)].strip(), "outputs": answer, "length": n,
                    "max_length": length, "gen_prefix": FWE_ANSWER.strip()})  # fmt: skip
    return out
