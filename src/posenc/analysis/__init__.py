"""``posenc analyze``: the properties papers argue about, measured and drawn.

One module per analysis, each a function over models (random or trained) that returns
plain data, plus a plot function; :mod:`posenc.analysis.cli` wires them to the command.

* :mod:`.decompose` — content/position terms of the attention logits;
* :mod:`.invariance` — change of logits and probabilities when every position shifts;
* :mod:`.similarity` — position-position structure and how much is a function of ``i - j``;
* :mod:`.decay` — long-range decay: RoPE's bound, biases and measured attention vs distance;
* :mod:`.padding` — Islam et al.'s padding probe in 1-D;
* :mod:`.attention_maps` — attention at the training length and at 4× it.

Shared by them, one concern each: :mod:`.specs` (which encodings, ``name@{options}``),
:mod:`.models` (random, checkpointed or tiny trained models), :mod:`.scores` (a layer's
logits split by stage), :mod:`.stats` (distances, diagonal share, relative change);
tables, JSON and figures come from :mod:`posenc.output`.
"""
