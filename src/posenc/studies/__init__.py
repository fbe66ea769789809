"""The paper studies: one module per paper whose claims ``posenc compare`` checks.

Each holds the study's preset (:class:`~posenc.compare.CompareConfig` overrides), the
reading of its paper's claims from a run's numbers (``findings(summary, task)``), and names
its data generator (in :mod:`posenc.data`):

* :mod:`.press2022`: Press et al. 2022 ("Train Short, Test Long"): ``--preset paper``
  (their WikiText-103 setup) and Table 5's reading;
* :mod:`.kazemnejad2023`: Kazemnejad et al. 2023: the ``kaz-*`` tasks' budgets, the reading
  per task and over the suite, and where a model's answers go wrong;
* :mod:`.cope2024`: CoPE's counting task and Flip-Flop (``count``, ``flip-flop``).

The studies stand above :mod:`posenc.compare`: importing them registers their presets
(:func:`posenc.compare.config.register_preset`, :func:`~posenc.compare.config.register_task_defaults`)
and their readings (:func:`posenc.compare.reading.register_findings`). ``posenc.compare``
imports this package last, so the presets and readings are there whenever it is imported.
``posenc study`` (:mod:`.cli`) runs the studies' own commands. docs/studies/ has a page per study.
"""

from . import cope2024, kazemnejad2023, press2022

__all__ = ["cope2024", "kazemnejad2023", "press2022"]
