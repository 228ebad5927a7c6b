"""The launch cache (kernels/launch.py): its key never merges arguments Triton would compile apart, and on a
GPU its launches give the bytes Triton's own launches give."""
import pytest
import torch

from sagebwd_hf import sagebwd_attn_func
from sagebwd_hf.kernels import launch as launch_mod
from sagebwd_hf.testing import assert_equal_but_summation_order


def _triton_specialization(arg):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def _sample_args():
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 1000, 1024, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, 2 ** 32,
            -1, -16, -17, -2 ** 31, -2 ** 31 - 16, 2 ** 63 - 16, 2 ** 63, 2 ** 63 + 16]
    base = torch.empty(256, dtype=torch.uint8)     # CPU storage: only the addresses matter
    tensors = [base[i:i + 64].view(dtype) for i in (0, 1, 2, 4, 8, 16, 32)
               for dtype in (torch.uint8, torch.int8) if i % dtype.itemsize == 0]
    tensors += [base[i:i + 64].view(torch.bfloat16) for i in (0, 2, 16, 18)]
    tensors += [base[i:i + 64].view(torch.float32) for i in (0, 4, 16, 32)]
    return ints + tensors + [True, False, 0.0, 1.0, 16.0, -2.5, 1e30, None]


def test_key_is_at_least_as_fine_as_tritons_specialization():
    """Two arguments with one key must get one specialization from the installed Triton: else a launch could
    reuse a kernel compiled for, say, a 16-byte aligned pointer on an unaligned one."""
    args = _sample_args()
    seen = {}
    for a in args:
        key = launch_mod._arg_key(a)     # raw: 1, True and 1.0 compare equal in Python, their keys must not
        spec = _triton_specialization(a)
        if key in seen:
            assert seen[key][1] == spec, f"{seen[key][0]!r} and {a!r} share key {key} but Triton gives " \
                                         f"{seen[key][1]} and {spec}"
        else:
            seen[key] = (a, spec)
    assert len(seen) >= 12      # the sample does tell arguments apart


def test_key_of_tensor_descriptors_covers_tritons():
    gl = pytest.importorskip("triton.experimental.gluon.language")
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    base = torch.empty(64 * 256, dtype=torch.int8)
    seen = {}
    for rows in (64, 128):
        for block in ([64, 64], [128, 64], [64, 32]):
            for dtype in (torch.int8, torch.bfloat16):
                x = base.view(dtype)[:rows * 64].view(rows, 64)
                layout = gl.NVMMASharedLayout.get_default_for(block, gl.int8 if dtype == torch.int8 else gl.bfloat16)
                desc = hopper.TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)
                key, spec = launch_mod._arg_key(desc), _triton_specialization(desc)
                assert seen.setdefault(key, spec) == spec
    assert len(seen) == 6


def test_other_arguments_take_tritons_own_path():
    with pytest.raises(launch_mod._Uncached):
        launch_mod._arg_key([1, 2])
    with pytest.raises(launch_mod._Uncached):
        launch_mod._arg_key("a string")


def test_launches_ask_for_fp_fusion_unless_the_user_chose(monkeypatch):
    """Every launch compiles with FP fusion on (Triton 3.10's default is off: the kernels' timings and test bounds
    were measured with it on); a user's TRITON_DEFAULT_FP_FUSION, read when the module loads, leaves Triton's
    default alone, and an explicit option is never overridden."""
    seen = []

    class Recorder:      # not a JITFunction: launch takes Triton's own path, kernel[grid](...)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs)

    monkeypatch.setattr(launch_mod, "FP_FUSION", True)
    launch_mod.launch(Recorder(), (1,), 3, BLOCK=16)
    launch_mod.launch(Recorder(), (1,), 3, enable_fp_fusion=False)
    monkeypatch.setattr(launch_mod, "FP_FUSION", None)
    launch_mod.launch(Recorder(), (1,), 3, BLOCK=16)
    assert seen == [dict(BLOCK=16, enable_fp_fusion=True), dict(enable_fp_fusion=False), dict(BLOCK=16)]
    assert launch_mod._fp_fusion({}) is True
    assert launch_mod._fp_fusion({"TRITON_DEFAULT_FP_FUSION": "0"}) is None


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, None], ids=["deterministic", "default"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cached_launches_give_tritons_bytes(monkeypatch, causal, head_dim, deterministic):
    """Forward and backward with the cache (second and third calls: cache hits, each checked against Triton's
    lookup by SAGEBWD_CHECK_LAUNCH) are bit-identical to the same calls through kernel[grid]. The default backward
    at head dim 64 on Hopper adds dQ up by fp32 reduce-adds in whatever order they land, so there dQ is equal but
    for the summation order (testing.assert_equal_but_summation_order); the rest stays bits."""
    if not launch_mod.ENABLED:
        pytest.skip("the launch cache is off for this Triton release")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 700, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 2, 900, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    do = torch.randn(2, 4, 700, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run():
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out = sagebwd_attn_func(*leaves, causal=causal, deterministic=deterministic)
        out.backward(do)
        return [out.detach()] + [x.grad for x in leaves]

    monkeypatch.setattr(launch_mod, "CHECK", True)
    run()
    size = launch_mod.cache_size()
    cached = [run(), run()]
    assert launch_mod.cache_size() == size, "a repeated call missed the cache"
    monkeypatch.setattr(launch_mod, "ENABLED", False)
    plain = run()
    for got in cached:
        for name, a, b in zip(("O", "dQ", "dK", "dV"), got, plain):
            if name == "dQ" and not deterministic:
                assert_equal_but_summation_order(a, b, name)
            else:
                assert torch.equal(a, b), name


@pytest.mark.gpu
def test_unaligned_inputs_get_their_own_kernel(monkeypatch):
    """A view 2 bytes off a 16-byte boundary specializes differently: the cache must not reuse the aligned
    kernel (SAGEBWD_CHECK_LAUNCH raises if it would)."""
    if not launch_mod.ENABLED:
        pytest.skip("the launch cache is off for this Triton release")
    monkeypatch.setattr(launch_mod, "CHECK", True)
    flat = torch.randn(2 * 4 * 300 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    aligned = flat[:-1].view(2, 4, 300, 64)
    shifted = flat[1:].view(2, 4, 300, 64)
    for x in (aligned, shifted, aligned, shifted):
        out = sagebwd_attn_func(x, x, x, causal=True, backend="triton")
        assert torch.isfinite(out).all()


def test_tma_descriptor_is_the_checked_constructors():
    """hopper_launch.tma_descriptor skips Gluon's TensorDescriptor constructor (host time) but builds the
    same descriptor, and refuses memory TMA cannot address as the constructor does."""
    try:
        from sagebwd_hf.kernels import hopper_launch
    except Exception as exc:   # noqa: BLE001  (a Triton whose Gluon API these kernels do not build on)
        pytest.skip(f"no Gluon kernels here: {exc}")
    from triton.experimental.gluon import language as gl
    base = torch.empty(256 * 128 + 64, dtype=torch.int8)
    for rows, cols, block in ((64, 64, [64, 64]), (256, 128, [128, 128]), (128, 64, [64, 128][::-1])):
        x = base[:rows * cols].view(rows, cols)
        got = hopper_launch.tma_descriptor(x, x.shape, x.stride(), block)
        want = hopper_launch.TensorDescriptor(x, list(x.shape), list(x.stride()), block,
                                               hopper_launch.shared_layout(tuple(block), gl.int8))
        assert got == want and type(got) is type(want)
        assert launch_mod._arg_key(got) == launch_mod._arg_key(want)
    for bad in (base[1:65 * 64 + 1].view(65, 64),          # base not 16-byte aligned
                base[:63 * 65].view(63, 65)):               # row stride of 65 bytes
        with pytest.raises(ValueError, match="TMA cannot address"):
            hopper_launch.tma_descriptor(bad, bad.shape, bad.stride(), [64, 64])


def test_status_says_whether_and_why_not(monkeypatch):
    assert ("direct re-launch" in launch_mod.status()) == launch_mod.ENABLED
    monkeypatch.setenv("SAGEBWD_FAST_LAUNCH", "0")
    reason = launch_mod._off_reason()
    assert reason is not None and ("SAGEBWD_FAST_LAUNCH=0" in reason or "not a release" in reason)
    monkeypatch.setattr(launch_mod, "ENABLED", False)
    assert "kernel[grid]" in launch_mod.status() and reason in launch_mod.status()


def test_summation_order_check_passes_reorderings_only():
    """The check the GPU tests apply to the one launch's dQ: the same fp32 sums in another order, rounded to a
    16-bit dtype, pass (however many elements a reordering flips); a change of two units, or a NaN, fails."""
    gen = torch.Generator().manual_seed(0)
    terms = torch.randn(64, 4096, generator=gen) * torch.rand(1, 4096, generator=gen)
    for dtype in (torch.bfloat16, torch.float16):
        forward, reverse = terms.sum(0).to(dtype), terms.flip(0).sum(0).to(dtype)
        assert not torch.equal(forward, reverse)      # the reordering flipped some roundings
        assert_equal_but_summation_order(forward, reverse, "reordered")
        nudged = reverse.clone()
        nudged.view(torch.int16)[reverse.float().abs().argmax()] -= 2     # its magnitude two units smaller
        with pytest.raises(AssertionError):
            assert_equal_but_summation_order(nudged, reverse, "two units")
        poisoned = reverse.clone()
        poisoned[0] = float("nan")
        with pytest.raises(AssertionError):
            assert_equal_but_summation_order(poisoned, reverse, "nan")
    edge = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)    # two steps down from a power of two
    below = edge.clone()
    below.view(torch.int16)[:] -= 2
    with pytest.raises(AssertionError):
        assert_equal_but_summation_order(below, edge, "two steps at an edge")
    forward32, reverse32 = terms.sum(0), terms.flip(0).sum(0)
    assert_equal_but_summation_order(forward32, reverse32, "fp32 reordered")
    with pytest.raises(AssertionError):
        assert_equal_but_summation_order(forward32 * (1 + 1e-3), reverse32, "fp32 off by 1e-3")
