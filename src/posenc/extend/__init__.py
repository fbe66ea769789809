"""``posenc extend``: a trained checkpoint past its training length, per training-free method.

* :mod:`.model` reads ``MODEL`` (an HF checkpoint directory or a compare run directory) and
  builds the model under each method;
* :mod:`.methods` the methods, their settings and the layers they apply to;
* :mod:`.evaluate` perplexity (sliding and non-overlapping windows) with chunked prefill;
* :mod:`.passkey` passkey retrieval, the Self-Extend / LongLoRA prompt;
* :mod:`.run` the (method, length) cells, resumable; :mod:`.report` the files;
* :mod:`.cli` the command.
"""

from .model import ModelError, Subject, load_subject

__all__ = ["ModelError", "Subject", "load_subject"]
