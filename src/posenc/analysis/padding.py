"""``padding-probe``: where a CNN hides absolute position, in 1-D.

Islam, Jia, Bruce, "How Much Position Information Do Convolutional Neural Networks
Encode?", ICLR 2020: absolute position can be read out of the features of a CNN that
never saw position, and the source is zero padding. The 1-D version here:

1. a stack of ``Conv1d`` layers (kernel 9, ReLU; receptive field wide enough that every
   position sees a border) over an embedding of i.i.d. random tokens, trained on a
   position-free task: ``task="token"`` (default) predicts each position's own token
   through a shared linear head, ``task="majority"`` the most frequent token of the
   sequence through a global average pool (both equivariant to shifts);
2. the stack frozen, a linear probe (one ``Linear(C, L)``, softmax over positions) is
   trained to predict each feature vector's absolute position, and tested on fresh
   sequences.

With ``padding_mode="zeros"`` each position's distance to the borders leaks into the
features; with ``"circular"`` the stack is exactly equivariant to cyclic shifts and the
input is stationary, so every position has the same feature distribution and the probe
is at chance, ``1/L``. Torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..train import Trainer


class ConvStack(nn.Module):
    """Token embedding, then ``depth`` × (``Conv1d(k)`` + ReLU); ``(B, L)`` -> ``(B, C, L)``."""

    def __init__(self, vocab: int, channels: int, depth: int, kernel: int, padding_mode: str):
        super().__init__()
        if padding_mode not in ("zeros", "circular"):
            raise ValueError(f"padding_mode must be 'zeros' or 'circular', got {padding_mode!r}")
        if kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (same-length output), got {kernel}")
        self.emb = nn.Embedding(vocab, channels)
        layers = []
        for _ in range(depth):
            layers += [nn.Conv1d(channels, channels, kernel, padding=kernel // 2, padding_mode=padding_mode), nn.ReLU()]
        self.convs = nn.Sequential(*layers)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.convs(self.emb(tokens).transpose(1, 2))  # (B, C, L)


def _majority(tokens: Tensor, vocab: int) -> Tensor:
    counts = torch.nn.functional.one_hot(tokens, vocab).sum(1)  # (B, V)
    return counts.argmax(-1)


def probe_padding(
    padding_mode: str,
    *,
    task="token",
    length=64,
    vocab=8,
    channels=32,
    depth=8,
    kernel=9,
    train_steps=150,
    probe_steps=300,
    n_probe=128,
    n_test=64,
    seed=0,
) -> dict:
    """Train the stack, then the probe; return accuracies and per-position predictions.

    Raises:
        ValueError: an unknown ``task`` or ``padding_mode``, a count out of range, or a
            ``length`` shorter than the circular padding (``kernel // 2``).
    """
    if task not in ("token", "majority"):
        raise ValueError(f"task must be 'token' or 'majority', got {task!r}")
    counts = dict(vocab=(vocab, 2), channels=(channels, 1), depth=(depth, 1), kernel=(kernel, 1),
                  train_steps=(train_steps, 0), probe_steps=(probe_steps, 0), n_probe=(n_probe, 1),
                  n_test=(n_test, 1))  # fmt: skip
    for name, (v, lo) in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length < max(2, kernel // 2):
        raise ValueError(
            f"length must be an integer >= max(2, kernel // 2) = {max(2, kernel // 2)} (circular padding of "
            f"kernel {kernel} wraps at most once), got {length!r}"
        )
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    stack = ConvStack(vocab, channels, depth, kernel, padding_mode)
    head = nn.Linear(channels, vocab)
    opt = torch.optim.Adam([*stack.parameters(), *head.parameters()], lr=1e-3)

    def task_loss_of(net: nn.ModuleList, tokens: Tensor) -> Tensor:  # position-free tasks
        stack, head = net
        if task == "majority":  # the most frequent token of the sequence
            return nn.functional.cross_entropy(head(stack(tokens).mean(-1)), _majority(tokens, vocab))
        # per position: the token itself
        return nn.functional.cross_entropy(head(stack(tokens).transpose(1, 2)).reshape(-1, vocab), tokens.reshape(-1))

    # the step-th draw of g (fit calls in order from step 0)
    state = Trainer(nn.ModuleList([stack, head]), opt, loss=task_loss_of).fit(
        lambda step: torch.randint(0, vocab, (32, length), generator=g), train_steps
    )
    task_loss = state.losses[-1] if state.losses else float("nan")
    stack.requires_grad_(False)

    def features(n: int) -> Tensor:
        with torch.no_grad():
            f = stack(torch.randint(0, vocab, (n, length), generator=g))  # (n, C, L)
        return f.transpose(1, 2).reshape(n * length, channels)  # one row per (sequence, position)

    x_train, x_test = features(n_probe), features(n_test)
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    x_train, x_test = (x_train - mu) / sd, (x_test - mu) / sd
    y_train = torch.arange(length).repeat(n_probe)
    y_test = torch.arange(length).repeat(n_test)
    probe = nn.Linear(channels, length)
    popt = torch.optim.Adam(probe.parameters(), lr=1e-2)
    Trainer(probe, popt, loss=lambda net, b: nn.functional.cross_entropy(net(b[0]), b[1])).fit(
        lambda step: (x_train, y_train), probe_steps
    )  # full batch
    with torch.no_grad():
        pred = probe(x_test).argmax(-1)
    acc = float((pred == y_test).float().mean())
    pred_by_pos = pred.view(n_test, length).float()  # (n_test, L)
    return {
        "padding": padding_mode,
        "accuracy": acc,
        "chance": 1.0 / length,
        "mean_abs_error": float((pred - y_test).abs().float().mean()),
        "task_loss": task_loss,
        "pred_mean": pred_by_pos.mean(0).tolist(),
        "pred_std": pred_by_pos.std(0).tolist(),
        "length": length,
        "config": dict(task=task, vocab=vocab, channels=channels, depth=depth, kernel=kernel, seed=seed),
    }


def run_padding(*, seed=0, **kw) -> list[dict]:
    return [probe_padding(mode, seed=seed, **kw) for mode in ("zeros", "circular")]


def plot_padding(results: list[dict], path, *, subtitle: str | None = None) -> None:
    from ..output import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    for r, c in zip(results, ("tab:blue", "tab:orange"), strict=False):
        x = torch.arange(r["length"]).numpy()
        m, s = torch.tensor(r["pred_mean"]).numpy(), torch.tensor(r["pred_std"]).numpy()
        ax.plot(x, m, color=c, label=f"{r['padding']} padding: accuracy {r['accuracy']:.3f}")
        ax.fill_between(x, m - s, m + s, color=c, alpha=0.2)
    L = results[0]["length"]
    ax.plot([0, L - 1], [0, L - 1], "k:", lw=0.8, label="perfect")
    ax.axhline((L - 1) / 2, color="grey", lw=0.8, ls="--", label=f"chance (accuracy {1 / L:.3f})")
    ax.set_xlabel("true position")
    ax.set_ylabel("probe's predicted position (mean ± std)")
    ax.legend(fontsize=8)
    save_figure(fig, path, title="Linear probe of absolute position from 1-D CNN features", subtitle=subtitle)
