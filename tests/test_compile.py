"""The op is a torch custom op: torch.compile traces it without graph breaks, and opcheck passes."""
import pytest
import torch

from sagebwd_hf import interface, sagebwd_attn_func, sagebwd_attn_varlen_func
from sagebwd_hf.testing import make_qkv, run_with_grads


@pytest.mark.parametrize("softcap, with_sinks", [(0.0, False), (5.0, True)], ids=["plain", "softcap_sinks"])
def test_opcheck_forward_and_backward(softcap, with_sinks):
    q, k, v, _ = make_qkv(1, 4, 2, 40, 40, 64, torch.float16, "cpu")
    sinks = torch.randn(4, requires_grad=True) if with_sinks else None
    args = (None, None, 40, 40, 0.125, -1, 0, True, False, "naive", softcap, None, "accurate", sinks)
    # (None: deterministic; "accurate": precision)
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
    args = (None, None, 40, 56, 0.125, -1, 0, True, False, "naive", 5.0, None, "accurate")

    def run(fn):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, sinks)]
        out, lse, row_max = fn(*leaves[:3], *args, leaves[3])
        assert row_max.numel() == 0     # (kept by the Gluon forward under a ds_bound rule only)
        out.backward(do)
        return out, lse, [x.grad for x in leaves]

    eager_out, eager_lse, eager_grads = run(interface._attn)
    assert type(eager_out.grad_fn).__name__.startswith("SageBwdAttention")
    assert not eager_lse.requires_grad
    op_out, op_lse, op_grads = run(interface._attn_fwd_op)
    assert torch.equal(eager_out, op_out) and torch.equal(eager_lse, op_lse)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), eager_grads, op_grads):
        assert a is not None and torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, deterministic", [(64, None), (64, True), (128, None)],
                         ids=["d64-one-launch", "d64-deterministic", "d128"])
def test_forward_and_backward_replay_from_a_cuda_graph(head_dim, deterministic):
    """A forward + backward captured in a CUDA graph (no host sync inside the op; its buffers come from PyTorch's
    allocator) replays on new inputs to what the eager call gives them: what torch.compile's
    mode="reduce-overhead" needs to take the host's launch cost out of short calls."""
    from sagebwd_hf.interface import backward_rule
    from sagebwd_hf.testing import assert_equal_but_summation_order
    one_launch = backward_rule(torch.device("cuda"), head_dim, head_dim,
                               deterministic=deterministic).one_launch
    q, k, v, do = make_qkv(2, 4, 2, 700, 700, head_dim, torch.bfloat16, "cuda", seed=0)
    fresh = make_qkv(2, 4, 2, 700, 700, head_dim, torch.bfloat16, "cuda", seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    static_do = do.clone()

    def step():
        for x in leaves:
            x.grad = None
        out = sagebwd_attn_func(*leaves, causal=True, deterministic=deterministic)
        out.backward(static_do)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):      # warm-up off the capture: compiles, fills the launch cache
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    with torch.no_grad():
        for x, new in zip(leaves + [static_do], fresh):
            x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    want = run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True, deterministic=deterministic),
                          *fresh)
    for name, got in zip(("O", "dQ", "dK", "dV"), [static_out] + [x.grad for x in leaves]):
        if name == "dQ" and one_launch:      # its reduce-adds land in any order
            assert_equal_but_summation_order(got, want[name], name)
        else:
            assert torch.equal(got, want[name]), name
