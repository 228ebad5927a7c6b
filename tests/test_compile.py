"""The op is a torch custom op: torch.compile traces it without graph breaks, and opcheck passes."""
import pytest
import torch

from sagebwd_hf import interface, sagebwd_attn_func, sagebwd_attn_varlen_func
from sagebwd_hf.testing import make_qkv, run_with_grads


@pytest.mark.parametrize("softcap, with_sinks", [(0.0, False), (5.0, True)], ids=["plain", "softcap_sinks"])
def test_opcheck_forward_and_backward(softcap, with_sinks):
    q, k, v, _ = make_qkv(1, 4, 2, 40, 40, 64, torch.float16, "cpu")
    sinks = torch.randn(4, requires_grad=True) if with_sinks else None
    args = (None, None, 40, 40, 0.125, -1, 0, True, False, "naive", softcap, None, sinks)   # (None: deterministic)
    for x in (q, k, v):
        x.requires_grad_()
    torch.library.opcheck(interface._attn_fwd_op, (q, k, v) + args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_fullgraph_matches_eager(varlen):
    q, k, v, do = make_qkv(2, 4, 2, 48, 48, 64, torch.float16, "cpu")
    if varlen:
        cu = torch.tensor([0, 30, 96], dtype=torch.int32)
        q, k, v, do = (x.transpose(1, 2).reshape(-1, x.shape[1], 64) for x in (q, k, v, do))
        fn = lambda a, b, c: sagebwd_attn_varlen_func(a, b, c, cu, cu, 66, 66, causal=True)  # noqa: E731
    else:
        fn = lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)   # fullgraph: a break would raise
    got, want = run_with_grads(compiled, q, k, v, do), run_with_grads(fn, q, k, v, do)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_eager_calls_run_the_registered_ops_functions():
    """Eager calls skip torch.library's dispatch (its autograd wrapper costs ~80 us of host time a call) but run
    the same forward, setup and backward: outputs and every gradient, the sinks' included, equal the op's."""
    q, k, v, do = make_qkv(1, 4, 2, 40, 56, 64, torch.float16, "cpu")
    sinks = torch.randn(4)
    args = (None, None, 40, 56, 0.125, -1, 0, True, False, "naive", 5.0, None)

    def run(fn):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, sinks)]
        out, lse = fn(*leaves[:3], *args, leaves[3])
        out.backward(do)
        return out, lse, [x.grad for x in leaves]

    eager_out, eager_lse, eager_grads = run(interface._attn)
    assert type(eager_out.grad_fn).__name__.startswith("SageBwdAttention")
    assert not eager_lse.requires_grad
    op_out, op_lse, op_grads = run(interface._attn_fwd_op)
    assert torch.equal(eager_out, op_out) and torch.equal(eager_lse, op_lse)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), eager_grads, op_grads):
        assert a is not None and torch.equal(a, b), name
