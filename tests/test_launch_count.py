"""What one attention call launches, and that the fused preparation passes give the same bytes as the separate ones.

The counts (tests/launch_counting.py: Triton/Gluon launches and torch kernels of one call after a first, launches
stubbed) are the op's at N=1K, causal, on the Hopper path (its host code on CPU tensors, dispatch answering as on
an H100) and the portable one (CPU tile configs: D=128's dK/dV is one launch here, two on a GPU). They are upper
bounds the op must not exceed: a new launch has to change this file.
"""
import pytest
import torch

from conftest import kernel_devices
from launch_counting import count_call
from sagebwd_hf.kernels.layout import SeqLayout
from sagebwd_hf.kernels.quantize import (STATS_CHUNK, aligned_starts, prepare_backward, prepare_forward, quantize,
                                         quantize_qk, quantize_v)


def _layout(lengths, heads, head_dim, device, gen):
    """Packed ``[1, H, T, D]`` (as_bhnd of ``[T, H, D]``) for a list of lengths, padded ``[B, H, N, D]`` (token-major
    memory, as Transformers' q/k/v) for an int pair (batch, length)."""
    if isinstance(lengths, tuple):
        batch, n = lengths
        x = torch.randn(batch, n, heads, head_dim, generator=gen).to(device, torch.bfloat16).transpose(1, 2)
        return x, SeqLayout(batch, n, None)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    x = torch.randn(sum(lengths), heads, head_dim, generator=gen).to(device, torch.bfloat16)
    return x.permute(1, 0, 2).unsqueeze(0), SeqLayout(len(lengths), max(lengths), cu)


def _equal(a, b, name):
    if a is None or b is None:
        assert a is None and b is None, name
        return
    assert a.shape == b.shape and a.dtype == b.dtype, name
    assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a, b.view(torch.uint8)
                       if b.dtype == torch.int8 else b), f"{name} differs"


# (lengths, heads, kv heads): past one statistics chunk (the fused passes combine), within one, packed with an empty
# sequence and GQA
SHAPES = [((2, STATS_CHUNK + 88), 4, 2), ((1, 200), 2, 2), ([700, 0, STATS_CHUNK + 1, 37], 4, 1)]


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("shape", SHAPES, ids=["padded", "short", "packed_gqa"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("k_smoothing", [True, False])
@pytest.mark.parametrize("q_smoothing", [False, True])
def test_fused_preparation_is_bit_identical(device, shape, head_dim, k_smoothing, q_smoothing):
    """The forward's and backward's preparation, fused (``quantize_qk(fused=True)``, ``quantize_v(v_parts=)``,
    counters and dQ's accumulator zeroed by Q's pass) against the separate passes: every byte the same."""
    if device == "cpu" and head_dim == 128 and q_smoothing:
        pytest.skip("the interpreter's time; D=128 is covered without Q-smoothing, Q-smoothing at D=64")
    lengths, heads, kv_heads = shape
    gen = torch.Generator().manual_seed(head_dim)
    q4, lay = _layout(lengths, heads, head_dim, device, gen)
    k4, _ = _layout(lengths, kv_heads, head_dim, device, gen)
    v4, _ = _layout(lengths, kv_heads, head_dim, device, gen)
    if k_smoothing:     # an outlier channel, the case K-smoothing is for
        k4 = k4 + 4.0
    scale = head_dim ** -0.5
    starts = aligned_starts(lay) if lay.is_varlen else None
    for transposed in (False, True):   # the forward's (with V) and the backward's
        common = dict(transposed=transposed, row_shift=k_smoothing, operand_order=starts is not None or transposed,
                      t_starts_q=starts if transposed else None, t_starts_k=starts if transposed else None)
        if not transposed:
            common = dict(row_shift=k_smoothing, v4=v4)
        ref = quantize_qk(q4, k4, lay, lay, scale, k_smoothing, q_smoothing, **common)
        counters = torch.full((16,), 7, dtype=torch.int32, device=device)
        rows = torch.full(q4.shape, float("nan"), device=device)
        new = quantize_qk(q4, k4, lay, lay, scale, k_smoothing, q_smoothing, fused=True, zero_ints=counters,
                          zero_rows=rows, **common)
        for field in ref._fields:
            if field not in ("v_scale", "v_parts"):
                _equal(getattr(ref, field), getattr(new, field), field)
        assert not counters.any() and not rows.isnan().any() and not rows.any()
        if not transposed:
            ref_v = quantize_v(v4, lay, starts, ref.v_scale, operand_order=starts is not None)
            new_v = quantize_v(v4, lay, starts, new.v_scale, operand_order=starts is not None, v_parts=new.v_parts)
            _equal(ref_v[0], new_v[0], "v8t")
            _equal(ref_v[1], new_v[1], "v_scale")
            # V in Q's launch
            counters.fill_(7)
            both, v8t, v_scale = prepare_forward(q4, k4, v4, lay, lay, scale, k_smoothing, q_smoothing,
                                                 row_shift=k_smoothing, v_starts=starts,
                                                 v_operand_order=starts is not None, zero_ints=counters)
            for field in ref._fields:
                if field not in ("v_scale", "v_parts"):
                    _equal(getattr(ref, field), getattr(both, field), field)
            _equal(ref_v[0], v8t, "v8t in Q's launch")
            _equal(ref_v[1], v_scale, "v_scale in Q's launch")
            assert not counters.any()
        else:
            # dO (with delta) in Q's launch
            do4, _ = _layout(lengths, heads, head_dim, device, gen)
            o4, _ = _layout(lengths, heads, head_dim, device, gen)
            ref_do = quantize(do4, lay, natural=False, transposed=True, out_for_delta=o4,
                              operand_order=common["operand_order"], t_starts=starts)
            counters.fill_(7)
            rows.fill_(float("nan"))
            both, do_q = prepare_backward(q4, k4, do4, o4, lay, lay, scale, k_smoothing, q_smoothing,
                                          row_shift=k_smoothing, operand_order=common["operand_order"],
                                          t_starts_q=starts, t_starts_k=starts, zero_ints=counters, zero_rows=rows)
            for field in ref._fields:
                if field not in ("v_scale", "v_parts"):
                    _equal(getattr(ref, field), getattr(both, field), field)
            for field in ("x8t", "scale", "delta"):
                _equal(getattr(ref_do, field), getattr(do_q, field), "dO's " + field)
            assert not counters.any() and not rows.isnan().any() and not rows.any()


@pytest.mark.parametrize("device", kernel_devices())
def test_dout_pass_zeroes_what_it_is_given(device):
    """dO's pass (with delta) is unchanged by zeroing: the same bytes with and without ``zero_ints``."""
    gen = torch.Generator().manual_seed(1)
    do4, lay = _layout((1, 300), 2, 64, device, gen)
    o4, _ = _layout((1, 300), 2, 64, device, gen)
    ref = quantize(do4, lay, natural=False, transposed=True, out_for_delta=o4)
    counters = torch.ones(16, dtype=torch.int32, device=device)
    new = quantize(do4, lay, natural=False, transposed=True, out_for_delta=o4, zero_ints=counters)
    for field in ("x8t", "scale", "delta"):
        _equal(getattr(ref, field), getattr(new, field), field)
    assert not counters.any()


# (path, options) -> (forward, backward) kernels of one call (Triton/Gluon launches plus torch kernels), at N=1K,
# causal, B=2, H=16 (more work items than an H100's SMs: every Gluon launch is persistent). Before the preparation
# was fused (2026-11): Hopper D=128 7 + 11, D=64 7 + 9, packed D=128 27 + 41; portable 6 + 7, packed 17 + 19.
LAUNCHES = {
    "hopper_d128": (True, dict(head_dim=128), (4, 6)),           # stats, K, Q+V, forward | stats, K, Q+dO, 3
    "hopper_d64": (True, dict(head_dim=64), (4, 5)),             # ... | stats, K, Q+dO, one launch, dQ's copy
    "hopper_d64_deterministic": (True, dict(head_dim=64, deterministic=True), (4, 6)),
    "hopper_d128_gqa": (True, dict(head_dim=128, kv_heads=4, batch=8), (4, 6)),
    # (packed: the token-major copies' padding columns zeroed, and the statistics chunks of an unknown count)
    "hopper_d128_packed": (True, dict(head_dim=128, packed=True), (7, 10)),
    "hopper_d64_packed": (True, dict(head_dim=64, packed=True), (7, 8)),
    "portable_d128": (False, dict(head_dim=128), (4, 5)),        # (CPU tiles: dK and dV in one launch)
    "portable_d128_packed": (False, dict(head_dim=128, packed=True), (7, 9)),
    "portable_d128_q_smoothing": (False, dict(head_dim=128, q_smoothing=True), (6, 8)),
}


@pytest.mark.parametrize("case", sorted(LAUNCHES))
def test_launches_per_call(case):
    hopper, options, (fwd, bwd) = LAUNCHES[case]
    counts, names = count_call(hopper, causal=True, **options)
    got = (counts["fwd"][0] + counts["fwd"][1], counts["bwd"][0] + counts["bwd"][1])
    assert got[0] <= fwd and got[1] <= bwd, f"{case}: {got} kernels (forward, backward), at most {(fwd, bwd)}: {names}"
    assert got == (fwd, bwd), f"{case}: fewer kernels than this test knows ({got}): lower its bounds"


def test_sinks_and_softcap_launch_no_more_preparation():
    """With a cap and sinks the preparation launches are the plain call's (the sinks' own math is torch ops)."""
    plain, _ = count_call(True, causal=True, head_dim=128)
    capped, names = count_call(True, causal=True, head_dim=128, softcap=30.0,
                               sinks=torch.zeros(16, requires_grad=True))
    assert capped["fwd"][0] == plain["fwd"][0] and capped["bwd"][0] == plain["bwd"][0], names


def test_descriptor_launch_key_is_its_fields_key():
    """A TMA descriptor from hopper_launch carries launch.py's key of its fields (so launches skip hashing its
    layout): the same key as one computed from the fields, and another for another block or dtype."""
    from sagebwd_hf.kernels import hopper_launch, launch

    def key(x, block, dtype=hopper_launch.gl.int8):
        desc = hopper_launch.tma_desc_2d(x, block, dtype)
        fields = dict(vars(desc), launch_key=None, round_f32_to_tf32=getattr(desc, "round_f32_to_tf32", None))
        computed = launch._arg_key(type("Fields", (), fields)())
        assert launch._arg_key(desc) == desc.launch_key == computed
        return desc.launch_key
    x8, x16 = torch.zeros(256, 64, dtype=torch.int8), torch.zeros(256, 64, dtype=torch.bfloat16)
    assert key(x8, [128, 64]) == key(x8[128:], [128, 64])
    assert len({key(x8, [128, 64]), key(x8, [64, 64]), key(x16, [128, 64], hopper_launch.gl.bfloat16)}) == 3
