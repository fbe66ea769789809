"""One training loop for every tool: ``posenc compare``, ``posenc analyze`` and ``posenc bench``.

Setup first, then a loop that receives what it needs::

    from posenc.train import Every, Progress, Trainer, adamw, cosine_schedule, setup

    rt = setup("auto")                             # device; joins the torchrun process group
    model = TransformerLM(...).to(rt.device)
    trainer = Trainer(
        model, adamw(model, lr=3e-3, weight_decay=0.01), runtime=rt,
        schedule=cosine_schedule(3e-3, steps=400, warmup=30), grad_clip=1.0,
        autocast_dtype=None,                       # or torch.bfloat16
    )
    state = trainer.fit(batch_at, 400, callbacks=[
        Progress("[1/7] rope", 400),
        Every(100, lambda s: trainer.save("rope.pt", s, done=False), until=400),
    ])

What the pieces are:

* :func:`setup` → :class:`Runtime`: the device, and under ``torchrun`` this process's rank
  (gloo on CPU, nccl on CUDA). ``runtime.shard(batch)`` keeps this process's rows of the
  global batch and moves them to the device; ``runtime.mean`` averages a value over the
  processes; ``runtime.broadcast`` hands rank 0's Python object to every rank.
* :class:`Trainer`: ``step(batch, step)`` is one optimizer step (learning rate from the
  schedule, the loss under autocast, backward, gradient clipping, update) and returns
  the detached loss; ``fit(batch_at, steps, state=, callbacks=)`` runs steps
  ``state.step .. steps - 1``. With several processes the model is wrapped in
  ``DistributedDataParallel``, so gradients are averaged and the run matches one
  process with the same global batch.
* The data: ``batch_at(step)`` returns the global batch of a step (:class:`posenc.data.Batch`
  for :func:`lm_loss`, or anything a custom ``loss(net, batch)`` takes: a tensor or a
  tuple of tensors). Make it a function of the step alone (:func:`posenc.data.step_generator`)
  and the run is deterministic and resumable.
* The schedule: any ``lr_at(step) -> float``; :func:`cosine_schedule` is warmup + cosine,
  :func:`wsd_schedule` warmup, a constant rate and a final cooldown.
* :class:`TrainState`: ``step``, every step's loss (``losses``), time in steps
  (``seconds``) and tokens seen. ``trainer.save(path, state, **extra)`` writes the weights,
  :meth:`Trainer.state_dict` (optimizer, CPU and CUDA RNG, step, losses, time) and
  ``extra`` atomically, on rank 0 only (a full disk is a :class:`CheckpointWriteError` naming
  the file, the previous checkpoint kept); ``trainer.load_state_dict(extra)`` restores them and
  returns the state to pass to ``fit``. A run killed and resumed this way ends bit-identical
  to one that never stopped (``tests/test_compare.py``, slow).
* :class:`Callback`: ``on_step(state)`` after every step and ``on_end(state)``;
  :class:`Every` calls a function every ``n`` steps; :class:`Progress` is a tqdm bar on a
  terminal and plain lines otherwise.

Extending it (what the converged, seeded ``compare`` needs):

* validation at a few points during training: ``Every(n, validate)`` or a
  :class:`Callback` whose ``on_step`` checks ``state.step``;
* the slope of the training loss over the last 20 % of steps: from ``state.losses``;
* a fused or foreach optimizer: pass it (``adamw(model, lr=..., fused=True)``);
* ``torch.compile`` of the step: compile the loss function or the model before giving
  it to :class:`Trainer` (``loss=torch.compile(lm_loss)``);
* several seeds: one model, optimizer and ``batch_at`` per seed, one ``fit`` each.
"""

from .loop import (
    Callback,
    CheckpointWriteError,
    Every,
    Trainer,
    TrainState,
    adamw,
    autocast,
    cosine_schedule,
    lm_loss,
    masked_loss,
    wsd_schedule,
)
from .progress import Progress
from .runtime import Runtime, map_tensors, resolve_device, setup

__all__ = [
    "Callback",
    "CheckpointWriteError",
    "Every",
    "Progress",
    "Runtime",
    "TrainState",
    "Trainer",
    "adamw",
    "autocast",
    "cosine_schedule",
    "lm_loss",
    "map_tensors",
    "masked_loss",
    "resolve_device",
    "setup",
    "wsd_schedule",
]
