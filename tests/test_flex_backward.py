"""FlexAttention's backward on CUDA, checked without a GPU.

Inductor's CUDA backward refuses a ``score_mod`` that indexes one gradient-carrying tensor
more than once ("Using multiple indexing operations on the same tensor that requires
gradients ..."): its ``validate_joint_graph`` rejects the joint (forward + backward) graph of
the ``score_mod`` before lowering. Seen on an H200 (torch 2.11) for FIRE (causal and
bidirectional) and FoX (bidirectional), whose training on CUDA with ``backend="auto"`` failed
at the first backward.

Its lowering also needs each captured tensor's gradient as a buffer it can add into, which
only an indexed capture has (``zeros_and_scatter``): an unindexed captured scalar with a
gradient stops it at ``assert buf.name is not None`` (pytorch#145208; FIRE on the H200 with
torch 2.11, after the first fix; torch 2.13's lowering is the same).

Here every encoding with a ``score_mod`` runs posenc's ``flex`` backend with gradients through
``torch.compile`` on the CPU with an AOTAutograd backend whose backward compiler hands each
joint graph to that same inductor function and then reads where each captured gradient comes
from; nothing is executed past that check.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import mode_id, score_mod_modes

import posenc

SCALAR = score_mod_modes()


class _Checked(Exception):
    """Raised by the backward compiler once the joint graphs are checked (stops the step)."""


def _captured_grads_scattered(graph) -> str:
    """Returns "ok" when each captured tensor's gradient in the joint graph is a scatter (it was
    indexed in the ``score_mod``), else which are not: the backward lowering accumulates a captured
    gradient into a buffer that only ``zeros_and_scatter`` makes; an unindexed captured scalar with
    a gradient stops it with ``assert buf.name is not None`` (pytorch#145208, in torch 2.11 and
    2.13; FIRE on an H200 with torch 2.11). The joint graph's outputs: the score's gradient, then
    one per captured tensor (None without a gradient)."""
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    scatter = torch.ops.flex_lib.zeros_and_scatter.default
    bad = [str(o.target) for o in out[1:] if o is not None and o.target is not scatter]
    return "ok" if not bad else f"{len(bad)} captured gradients are no scatter: {sorted(set(bad))}"


def joint_graph_verdicts(name: str, causal: bool, monkeypatch) -> list[str]:
    """Inductor's verdict on each FlexAttention joint graph of one forward/backward of ``name``."""
    import torch.nn.attention.flex_attention as fa
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.kernel.flex.flex_attention import validate_joint_graph

    import posenc.attend.flex as flex_mod

    verdicts: list[str] = []

    def backward_compiler(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.higher_order.flex_attention_backward:
                joints = [a for a in node.args if isinstance(a, torch.fx.Node) and "joint" in str(a.target)]
                for j in joints:
                    graph = getattr(gm, j.target).graph
                    graph.eliminate_dead_code()  # as inductor does before its check
                    try:
                        validate_joint_graph(graph)
                        verdicts.append(_captured_grads_scattered(graph))
                    except NotImplementedError as e:
                        verdicts.append(str(e).splitlines()[0])
        raise _Checked

    compiled = torch.compile(
        fa.flex_attention, backend=aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=backward_compiler)
    )
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)  # the CPU refuses a flex backward
    monkeypatch.setattr(flex_mod, "_flex_attention", lambda device_type: compiled)
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn = posenc.Attention(32, 2, name, head_dim=16, causal=causal, max_len=64)
    x = torch.randn(2, 24, 32, requires_grad=True)
    try:
        with pytest.raises(_Checked):
            attn(x, backend="flex").sum().backward()
    finally:
        torch._dynamo.reset()
    assert verdicts, "no FlexAttention backward was compiled"
    return verdicts


@pytest.mark.parametrize("mode", SCALAR, ids=mode_id)
def test_flex_backward_joint_graph_lowers_on_cuda(mode, monkeypatch):
    name, causal = mode
    verdicts = joint_graph_verdicts(name, causal, monkeypatch)
    assert all(v == "ok" for v in verdicts), (name, verdicts)
