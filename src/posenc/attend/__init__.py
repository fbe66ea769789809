"""The attend step and its backends: from ``q, k, v`` after the q/k stage to the attention output.

* :mod:`~posenc.attend.backends` — :data:`posenc.BACKENDS` and :func:`~posenc.attend.backends.attend`,
  the one attend step posenc's layer and ``posenc.hf`` call;
* :mod:`~posenc.attend.choice` — which backends can run an encoding, and which ``"auto"`` runs;
* :mod:`~posenc.attend.scores` — the score sum ``posenc.scores`` and the materialised block
  (mask, softmax or the encoding's own normaliser, values);
* :mod:`~posenc.attend.flex` — FlexAttention; :mod:`~posenc.attend.sinks` — learned sinks.
The fused CPU kernels of the ``blockwise`` backend are :mod:`posenc.kernels`.
"""
