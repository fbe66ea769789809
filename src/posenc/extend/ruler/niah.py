"""RULER's needle-in-a-haystack tasks, as lm-eval 0.4.13 generates them (``tasks/ruler/prepare_niah.py``).

Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(COLM 2024); NVIDIA/RULER ``scripts/data/synthetic/niah.py``. The haystacks that need no
download: ``repeat`` (the noise sentences "The grass is green. ...") and ``needle`` (every
haystack line a distractor needle). The essay haystack (Paul Graham's essays) is a download
and is not offered.

A sample is sized to a token length as lm-eval sizes it: the haystack grows by ``incremental``
units until prompt + answer + ``tokens_to_generate`` would pass ``length`` (tokens of the
model's tokenizer, special tokens included), then every sample shrinks it until it fits.
Random draws come from ``rng`` (Python's ``random.Random``) in the order lm-eval's module-level
``random`` makes them, so the same seed gives the same samples.
"""

from __future__ import annotations

import random
import uuid

from .words import niah_keys

__all__ = ["TEMPLATE", "NEEDLE", "NOISE", "niah_samples"]

TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
    "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for "
    "{query} mentioned in the provided text?"
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE_SEED = 42  # lm-eval's RANDOM_SEED: the needles' order is shuffled with a fresh Random(42)


def _random(rng: random.Random, kind: str) -> str:
    if kind == "numbers":  # seven digits
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(niah_keys())
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r}; allowed: numbers, words, uuids")


def _input_output(rng, num_haystack: int, haystack: str, *, type_haystack, num_needle_k, type_needle_k,
                  num_needle_v, type_needle_v, num_needle_q) -> tuple[str, list[str], str]:  # fmt: skip
    keys, values, needles = [], [], []
    for _ in range(num_needle_k):
        keys.append(_random(rng, type_needle_k))
        value = []
        for _ in range(num_needle_v):
            value.append(_random(rng, type_needle_v))
            needles.append(NEEDLE.format(type_needle_v=type_needle_v, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(NEEDLE_SEED).shuffle(needles)
    if type_haystack == "repeat":
        sentences = [haystack] * num_haystack
    else:  # "needle": distractor needles with their own keys and values
        sentences = [haystack.format(type_needle_v=type_needle_v, key=_random(rng, type_needle_k),
                                     value=_random(rng, type_needle_v)) for _ in range(num_haystack)]  # fmt: skip
    for index, element in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles):
        sentences.insert(index, element)
    context = "\n".join(sentences)
    indices = rng.sample(range(num_needle_k), num_needle_q)
    queries = [keys[i] for i in indices]
    answers = [a for i in indices for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template = TEMPLATE
    if num_needle_q * num_needle_v == 1:  # one answer: the singular wording
        for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(a, b)
        type_needle_v = type_needle_v[:-1]
    return template.format(type_needle_v=type_needle_v, context=context, query=query), answers, query


def niah_samples(tokenizer, length: int, num_samples: int, rng: random.Random, *, type_haystack: str,
                 type_needle_k: str, type_needle_v: str, num_needle_k: int = 1, num_needle_v: int = 1,
                 num_needle_q: int = 1, tokens_to_generate: int = 128) -> list[dict]:  # fmt: skip
    """``num_samples`` samples of at most ``length`` tokens (generation budget included).

    Each is ``{"index", "input", "outputs", "length", "max_length", "gen_prefix"}`` as lm-eval's.

    Raises:
        ValueError: ``length`` leaves no room for the prompt, the needles and the answer.
    """
    haystack = {"repeat": NOISE, "needle": NEEDLE}.get(type_haystack)
    if haystack is None:
        raise ValueError(f"haystack {type_haystack!r}; allowed: repeat, needle (the essay haystack is a download)")
    num_needle_k = max(num_needle_k, num_needle_q)
    num_needles = num_needle_k * num_needle_v
    incremental = 25 if length >= 4096 else 5
    kw = dict(type_haystack=type_haystack, num_needle_k=num_needle_k, type_needle_k=type_needle_k,
              num_needle_v=num_needle_v, type_needle_v=type_needle_v, num_needle_q=num_needle_q)  # fmt: skip

    def count(text: str) -> int:
        return len(tokenizer(text).input_ids)

    num_haystack, total = max(incremental, num_needles), 0
    while total + tokens_to_generate < length:  # the largest haystack that fits
        text, answer, _ = _input_output(rng, num_haystack, haystack, **kw)
        total = count(text + " ".join(answer))
        if total + tokens_to_generate > length:
            num_haystack -= incremental
            break
        if num_haystack > length:
            raise ValueError(f"the {type_haystack} haystack grew past {length} units without reaching {length} "
                             "tokens: the tokenizer under-counts")  # fmt: skip
        num_haystack += incremental
    num_haystack = max(num_haystack, num_needles)
    out = []
    for index in range(num_samples):
        used, sample = num_haystack, None
        while used > 0:  # shrink until the sample fits
            try:
                text, answer, query = _input_output(rng, used, haystack, **kw)
            except ValueError:  # fewer haystack lines than needles: rng.sample refuses
                used -= incremental
                continue
            n = count(text) + tokens_to_generate
            if n <= length:
                sample = (text, answer, query, n)
                break
            used -= incremental
        if sample is None:
            continue
        text, answer, query, n = sample
        one = num_needle_q * num_needle_v == 1
        prefix = (f"The special magic {type_needle_v[:-1]} for {query} mentioned in the provided text is" if one
                  else f"The special magic {type_needle_v} for {query} mentioned in the provided text are")  # fmt: skip
        out.append({"index": index, "input": text, "outputs": answer, "length": n, "max_length": length,
                    "gen_prefix": prefix})  # fmt: skip
    if not out:
        raise ValueError(f"length {length} leaves no room for the prompt, {num_needles} needle(s) and "
                         f"{tokens_to_generate} generated tokens; allowed: a longer length for this task")  # fmt: skip
    return out
