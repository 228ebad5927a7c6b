"""The host path's shortcuts give what the long way gives: kernels/launch.py's inlined key is ``_arg_key``'s of
every argument, and the Hopper launches' TMA descriptors (made without views, their kinds cached) are Gluon's own
over the same memory. Runs on CPU tensors with the launches stubbed (tests/launch_counting.py)."""
import pytest
import torch

from launch_counting import Launches, call, inputs, stubbed_launches
from sagebwd_hf.kernels import launch

gl = pytest.importorskip("triton.experimental.gluon.language")
hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")


def _hopper_launch():
    from sagebwd_hf.kernels import hopper_launch
    return hopper_launch


class _Recorded(Launches):
    """Launches, keeping each one's positional arguments."""

    def __init__(self):
        super().__init__()
        self.args = []

    def __call__(self, kernel, grid, *args, **kwargs):
        self.args.append(args)
        super().__call__(kernel, grid, *args, **kwargs)


def _fields(desc):
    return (desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding,
            getattr(desc, "round_f32_to_tf32", False))


def _mixed_args():
    base = torch.empty(256, dtype=torch.uint8)
    desc = _hopper_launch().tma_desc_2d(torch.zeros(128, 64, dtype=torch.int8), [64, 64])
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    theirs = hopper.TensorDescriptor(x, list(x.shape), list(x.stride()), [64, 64],
                                     gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16))
    return [0, 1, 16, 17, -3, 2 ** 40, base[0:16], base[1:17], base[16:32].view(torch.float32),
            base[2:34].view(torch.bfloat16), torch.nn.Parameter(torch.zeros(4)), 1.0, 0.0, -2.5, True, False, None,
            desc, theirs]


def test_inline_key_is_every_arguments_own_key():
    args = _mixed_args()
    assert launch._key(args) == tuple(launch._arg_key(a) for a in args)
    keys = [launch._arg_key(a) for a in args]
    # an aligned and an unaligned tensor of one dtype, the int 1, True and 1.0, 0 and 0.0 and False stay apart
    assert keys[6] != keys[7] and len({keys[1], keys[14], keys[11]}) == 3 and len({keys[0], keys[12], keys[15]}) == 3


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_descriptors_are_gluons_own_over_the_same_memory(head_dim, packed):
    """Every TMA descriptor of a Hopper forward and backward: Gluon's constructor (its own checks) over the same
    address, shape, strides, block and layout gives the same fields and launch key; one made from a tensor's rows
    without a view has the view's address, shape and strides."""
    (q, k, v), cu, do = inputs(2, 4, 2, 256, head_dim, packed=packed)
    recorded = _Recorded()
    with stubbed_launches(True, recorded):
        call(q, k, v, cu, 256, causal=True).backward(do)
    descriptors = [a for args in recorded.args for a in args if isinstance(a, hopper.TensorDescriptor)]
    assert len(descriptors) >= 12
    rows_made = 0
    for desc in descriptors:
        theirs = hopper.TensorDescriptor(desc.base, list(desc.shape), list(desc.strides), list(desc.block_shape),
                                         desc.layout, desc.padding)
        assert _fields(desc) == _fields(theirs)
        assert launch._arg_key(desc) == launch._arg_key(theirs)
        base = desc.base
        if base.is_contiguous() and desc.shape == [base.numel() // base.shape[-1], base.shape[-1]]:
            rows = base.reshape(-1, base.shape[-1])
            assert rows.data_ptr() == base.data_ptr() and list(rows.stride()) == desc.strides
            rows_made += 1
    assert rows_made >= 8


@pytest.mark.parametrize("contiguous", [True, False])
def test_rows_descriptor_is_the_2d_views(contiguous):
    hl = _hopper_launch()
    x = torch.zeros(2, 4, 64, 64, dtype=torch.int8)
    if not contiguous:
        x = x.transpose(1, 2)
    want = hl.tma_desc_2d(x.reshape(-1, 64), [64, 64])
    got = hl.tma_desc_rows(x, [64, 64])
    if contiguous:   # the same memory
        assert got.base.data_ptr() == want.base.data_ptr() and got.base.dtype == want.base.dtype
    else:            # a copy each, of the same values
        assert torch.equal(got.base.reshape(-1, 64), want.base)
    assert _fields(got)[1:] == _fields(want)[1:] and got.launch_key == want.launch_key
    assert _triton_specialization(got) == _triton_specialization(want)    # the kernel Triton compiles for it


def _triton_specialization(arg):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def test_descriptor_kinds_stay_apart():
    """The kind cache (block, Gluon dtype, base dtype -> layout, key): asked in turn for kinds that differ in one
    of them, each descriptor gets the layout and key its own fields give, not an earlier kind's."""
    hl = _hopper_launch()
    x8, x16 = torch.zeros(256, 128, dtype=torch.int8), torch.zeros(256, 128, dtype=torch.bfloat16)
    kinds = [(x8, [64, 64], gl.int8), (x8, [128, 64], gl.int8), (x8, [64, 128], gl.int8),
             (x8.view(torch.float8_e4m3fn), [64, 64], gl.float8e4nv), (x16, [64, 64], gl.bfloat16),
             (x16.view(torch.float16), [64, 64], gl.float16),
             (x8, [64, 64], gl.bfloat16)]   # (no descriptor the op makes: a kind apart in its Gluon dtype alone)
    keys = []
    for _ in range(2):
        for base, block, dtype in kinds + kinds[::-1]:
            desc = hl.tma_desc_2d(base, block, dtype)
            layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
            assert desc.layout == layout and desc.block_shape == block
            assert desc.launch_key == launch.descriptor_key(base.dtype, block, layout, "zero",
                                                            getattr(hopper.TensorDescriptor, "round_f32_to_tf32",
                                                                    None))
            keys.append(desc.launch_key)
    assert len(set(keys)) == len(kinds)


@pytest.mark.parametrize("addressable", [True, False])
def test_caller_descriptor_is_tma_addressables(addressable):
    """A descriptor over a caller's tensor: its memory where TMA addresses it, else a contiguous copy's."""
    from sagebwd_hf.kernels.layout import tma_addressable, token_rows
    hl = _hopper_launch()
    x4 = torch.zeros(2, 64, 4, 64, dtype=torch.bfloat16).transpose(1, 2)     # token-major [B, H, N, D]
    if not addressable:
        x4 = torch.zeros(2, 4, 64, 72, dtype=torch.bfloat16)[..., 4:68]      # rows not 16-byte aligned
    desc, coords = hl._caller_desc(x4, [64, 64], gl.bfloat16)
    want_base = tma_addressable(x4)
    shape, strides, want_coords = token_rows(want_base)
    assert desc.shape == list(shape) and desc.strides == list(strides) and coords == want_coords
    if addressable:
        assert desc.base is x4
    else:
        assert desc.base.is_contiguous() and torch.equal(desc.base, x4)



@pytest.mark.parametrize("path", ["dense", "padded", "packed"])
def test_eager_backward_makes_no_stand_in_for_absent_sinks(path, monkeypatch):
    """An eager backward without sinks returns None for their gradient without allocating the empty tensor a custom
    op returns in its place (the dense op's, and the segmented one's with rows cut, padded, or not, packed); with
    sinks it returns theirs; the ops' own backward functions still return the stand-in."""
    from sagebwd_hf import interface, segments

    stand_ins = []
    for module, name in ((interface, "_no_sinks_grad"), (segments, "_sinks_grad")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original: stand_ins.append(a) or _f(*a))
    gen = torch.Generator().manual_seed(0)
    if path == "dense":
        (q, k, v), cu, do = inputs(1, 2, 2, 64, 64)
        run = lambda sinks: call(q, k, v, cu, 64, causal=True, sinks=sinks)  # noqa: E731
    else:   # [B, N, H, D]
        q, k, v = (torch.randn(2, 48, 2, 64, generator=gen, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        do = torch.randn(2, 48, 2, 64, generator=gen, dtype=torch.bfloat16)
        cut = dict(mask=torch.arange(48)[None] < torch.tensor([[30], [48]])) if path == "padded" else \
            dict(ids=(torch.arange(48) >= 20).long()[None].expand(2, 48))
        run = lambda sinks: segments.segmented_attention(q, k, v, causal=True, softmax_scale=0.125,  # noqa: E731
                                                         sinks=sinks, **cut)
    with stubbed_launches(False):
        run(None).backward(do)
        assert not stand_ins and q.grad is not None
        sinks = torch.zeros(2, requires_grad=True)
        run(sinks).backward(do)
        assert sinks.grad is not None and sinks.grad.shape == (2,) and not stand_ins
        if path == "dense":
            out, lse, row_max = interface._attn_fwd(q.detach(), k.detach(), v.detach(), None, None, 64, 64, 0.125,
                                                    -1, 0, True, False, "triton", 0.0, None, "accurate", None)
            grads = interface._attn_bwd(do, q.detach(), k.detach(), v.detach(), out, lse, row_max, None, None, 64,
                                        64, 0.125, -1, 0, True, False, "triton", 0.0, None, "accurate", None)
        else:
            x = [t.detach() for t in (q, k, v)]
            args = (cut.get("mask"), cut.get("ids"), True, 0.125, -1, 0, True, False, "triton", 0.0, "accurate", None)
            out, lse = segments._segmented_fwd_impl(*x, *args)
            grads = segments._segmented_bwd_impl(do, *x, out, lse, *args)
    assert grads[3].shape == (0,) and len(stand_ins) == 1
