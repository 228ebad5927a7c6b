"""Which kernels run (kernels/dispatch.py), and the Gluon (Hopper) kernels against the reference.

CPU: the choice, the environment switch and its errors. GPU (``-m gpu``): the Gluon forward and backward over
the op's padded feature grid against the PyTorch reference of the same quantized algorithm and against the
portable kernels, with poisoned outputs (conftest sets SAGEBWD_POISON=1); the Gluon forward on packed
batches; the dispatch choosing each path."""
import math
import warnings

import pytest
import torch

from sagebwd_hf import (attention_stats, numerics, reset_attention_stats, sagebwd_attn_func,
                        sagebwd_attn_varlen_func)
from sagebwd_hf.interface import backward_rule
from sagebwd_hf.kernels import dispatch, plan
from sagebwd_hf.naive import LOG2E
from sagebwd_hf.testing import error_stats, make_qkv, run_with_grads
from test_kernels import ORACLE_REL_TINY

HAS_CUDA = torch.cuda.is_available()
IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def test_env_choice_is_validated(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cudnn")
    with pytest.raises(ValueError, match="SAGEBWD_KERNELS must be one of .*'auto', 'gluon', 'triton'.*'cudnn'"):
        dispatch.requested()
    monkeypatch.setenv(dispatch.ENV_VAR, " Gluon ")
    assert dispatch.requested() == "gluon"
    monkeypatch.delenv(dispatch.ENV_VAR)
    assert dispatch.requested() == "auto"


def test_cpu_never_takes_gluon(monkeypatch):
    cpu = torch.device("cpu")
    for choice in ("auto", "triton"):
        monkeypatch.setenv(dispatch.ENV_VAR, choice)
        assert not dispatch.use_gluon(cpu, 128, False)
    monkeypatch.setenv(dispatch.ENV_VAR, "gluon")
    with pytest.raises(ValueError, match="SAGEBWD_KERNELS=gluon, but the Gluon kernels cannot run here: cpu"):
        dispatch.use_gluon(cpu, 128, False)


def test_auto_and_forced_choices_on_hopper(monkeypatch):
    """auto takes Gluon only when all of it holds (sm_90, a tested Triton, a call it takes); gluon forces it,
    also on an untested release, and sends calls it does not take elsewhere."""
    monkeypatch.setattr(dispatch, "gluon_unavailable", lambda device: None)   # as on an H100
    monkeypatch.setattr(dispatch, "_triton_minor", lambda: dispatch.TESTED_TRITON[0])
    dev = torch.device("cuda")
    assert dispatch.use_gluon(dev, 128, False) and dispatch.use_gluon(dev, 64, False)
    assert not dispatch.use_gluon(dev, 96, False) and not dispatch.use_gluon(dev, 128, True)
    # MLA: Q/K head dim 192 with V's 128 (DeepSeek V2/V3), both passes; not 192 for V too, nor 128 with V 64
    assert dispatch.use_gluon(dev, 192, False, head_dim_v=128) and dispatch.use_gluon(dev, 192, False,
                                                                                      head_dim_v=128)
    assert not dispatch.use_gluon(dev, 192, False) and not dispatch.use_gluon(dev, 128, False, head_dim_v=64)
    assert dispatch.use_gluon(dev, 128, False, varlen=True)        # the forward takes packed batches
    # every length, mask and pass alike (the family asks nothing of them), padded or packed, capped or not
    assert dispatch.use_gluon(dev, 128, False) and dispatch.use_gluon(dev, 64, False)
    assert dispatch.use_gluon(dev, 64, False, varlen=True)
    assert not dispatch.use_gluon(dev, 64, True)
    assert dispatch.use_gluon(dev, 64, False, softcap=True)
    assert dispatch.use_gluon(dev, 128, False, softcap=True)
    # an untested Triton: auto stays portable, and says so once per process on an H100/H200 (not elsewhere)
    monkeypatch.setattr(dispatch, "_triton_minor", lambda: "99.0")
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_is_hopper", lambda device: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not dispatch.use_gluon(dev, 128, False)
    monkeypatch.setattr(dispatch, "_is_hopper", lambda device: True)
    with pytest.warns(UserWarning, match=r"Triton .* not a release the Hopper \(Gluon\) kernels are tested on"):
        assert not dispatch.use_gluon(dev, 128, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not dispatch.use_gluon(dev, 64, False)
        assert not dispatch.use_gluon(dev, 96, False)            # a call Gluon does not take: no warning
    monkeypatch.setenv(dispatch.ENV_VAR, "gluon")
    assert dispatch.use_gluon(dev, 128, False)
    with pytest.warns(UserWarning, match="head dim 96"):
        assert not dispatch.use_gluon(dev, 96, False)
    assert dispatch.use_gluon(dev, 64, False, varlen=True)          # forced: the Gluon forward takes them
    with pytest.warns(UserWarning, match="q_smoothing=True"):
        assert not dispatch.use_gluon(dev, 64, True, varlen=True)
    assert dispatch.use_gluon(dev, 64, False, softcap=True)          # forced: the Gluon forward takes them
    assert dispatch.use_gluon(dev, 64, False)
    assert dispatch.use_gluon(dev, 64, False, varlen=True)


def test_three_consumer_warpgroups_only_where_measured_faster():
    """The Gluon forward runs three consumer warpgroups at head dims 64, 128 and 192 without a mask (and without
    a cap but at 64) from GLUON_THREE_CONSUMERS_MIN_QUERIES query rows; everything else keeps two."""
    consumers = plan.gluon_forward_consumers
    long_enough = plan.GLUON_THREE_CONSUMERS_MIN_QUERIES
    assert consumers(64, False, False, long_enough) == 3
    assert consumers(64, False, False, long_enough - 1) == 2
    assert consumers(64, True, False, 8 * long_enough) == 2       # causal or windowed
    assert consumers(64, False, True, long_enough) == 3           # soft-capped: faster at 64 only
    assert consumers(64, False, True, long_enough - 1) == 2
    assert consumers(128, False, True, 8 * long_enough) == 2
    assert consumers(192, False, True, 8 * long_enough) == 2
    assert consumers(128, False, False, long_enough) == 3
    assert consumers(128, False, False, long_enough - 1) == 2
    assert consumers(128, True, False, 8 * long_enough) == 2
    assert consumers(192, False, False, long_enough) == 3           # MLA (V's head dim 128)
    assert consumers(192, True, False, 8 * long_enough) == 2
    assert consumers(96, False, False, 8 * long_enough) == 2        # not a Gluon head dim: as the default
    # P·V in e4m3: masked calls too at 64 and 128 (a cap as without it)
    assert consumers(128, True, False, long_enough, pv_e4m3=True) == 3
    assert consumers(64, True, False, long_enough, pv_e4m3=True) == 3
    assert consumers(128, True, False, long_enough - 1, pv_e4m3=True) == 2
    assert consumers(128, False, True, 8 * long_enough, pv_e4m3=True) == 2
    assert consumers(192, True, False, 8 * long_enough, pv_e4m3=True) == 2    # MLA: not measured


@pytest.mark.parametrize("lengths, expected", [([100] * 20 + [3000], 2), ([2500, 3000], 3), ([3000], 3)],
                         ids=["short-documents-one-long", "long-documents", "one-sequence"])
def test_packed_batch_consumers_follow_the_mean_length(lengths, expected, forward_plans):
    """A packed batch's forward picks its consumer warpgroups by its sequences' mean query rows, not its longest:
    documents of a few hundred tokens with one past the threshold keep two (on lognormal documents three ran
    0.79-0.98x as fast). Through the op's own host code, launches stubbed, dispatch as on Hopper."""
    from launch_counting import stubbed_launches

    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(int(cu[-1]), 2, 64, dtype=torch.bfloat16) for _ in range(3))
    with stubbed_launches(hopper=True), torch.no_grad():
        sagebwd_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), backend="triton")
    assert [p.gluon for p in forward_plans] == [True]
    assert forward_plans[0].consumers == expected


def test_ping_pong_only_where_measured_faster():
    """Two-consumer Gluon forwards take turns at V's head dim 128 for causal or windowed square-head calls from
    GLUON_PINGPONG_MIN_QUERIES query rows, and for soft-capped ones; not without a mask, not for MLA's 192/128
    uncapped, never at 64."""
    pingpong = plan.gluon_forward_pingpong
    long_enough = plan.GLUON_PINGPONG_MIN_QUERIES
    assert pingpong(128, 128, True, False, long_enough)
    assert not pingpong(128, 128, True, False, long_enough - 1)
    assert not pingpong(128, 128, False, False, long_enough - 1)      # unmasked (longer: three consumers)
    assert not pingpong(192, 128, True, False, 8 * long_enough)       # MLA
    assert not pingpong(192, 128, False, False, 1024)
    assert pingpong(128, 128, False, True, 1024) and pingpong(192, 128, True, True, 1024)   # capped
    assert not pingpong(64, 64, True, False, 8 * long_enough) and not pingpong(64, 64, False, True, 1024)


def test_persistent_launches_take_one_program_per_sm(monkeypatch):
    """The Gluon forward and backward launch one program per SM (each taking work items from a counter)."""
    monkeypatch.setattr(dispatch, "sm_count", lambda device: 132)
    dev = torch.device("cuda", 0)
    assert plan.gluon_programs(dev) == 132


def test_persistent_grid_hands_out_every_item_once():
    """A persistent launch gets as many programs as asked and a zeroed counter (a stale count would skip work
    items, leaving outputs unwritten); as many programs as items or more, or none asked, is one program an item."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")   # hopper_launch imports Gluon
    from sagebwd_hf.kernels.hopper_launch import persistent_grid

    stand_in = torch.ones(3)
    grid, counter, dynamic = persistent_grid(1000, 132, stand_in)
    assert grid == (132, ) and dynamic and counter.dtype == torch.int32 and counter.tolist() == [0]
    assert persistent_grid(1000, 132, stand_in)[1] is not counter       # a fresh counter each launch
    for programs in (None, 0, 1000, 5000):
        grid, counter, dynamic = persistent_grid(1000, programs, stand_in)
        assert grid == (1000, ) and not dynamic and counter is stand_in


def test_gluon_kernels_ask_ptxas_for_its_default_register_allocation(monkeypatch):
    """Under CUDA 13's ptxas (Triton 3.9's for sm_90) the Gluon launches undo Triton's --regAllocOptLevel=2
    (which spills in the three-consumer forward and in dQ), keeping a user's PTXAS_OPTIONS after theirs; CUDA 12's
    ptxas, or the level set to None, leaves Triton's options as they are."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")   # hopper_launch imports Gluon
    pytest.importorskip("triton.backends.nvidia.compiler")
    import types

    import triton.backends.nvidia.compiler as nv_compiler
    from triton import knobs

    from sagebwd_hf.kernels import hopper_launch

    def options(ptxas_version, user=None, level=4):
        monkeypatch.setattr(nv_compiler, "get_ptxas", lambda arch: types.SimpleNamespace(version=ptxas_version))
        monkeypatch.setattr(knobs.nvidia, "ptxas_options", user)
        monkeypatch.setattr(hopper_launch, "PTXAS_REGALLOC_LEVEL", level)
        hopper_launch._ptx_options.cache_clear()
        return hopper_launch.ptx_options()

    try:
        assert options("13.4") == "--regAllocOptLevel=4"
        assert options("13.0", user="--maxrregcount=200") == "--regAllocOptLevel=4 --maxrregcount=200"
        assert options("12.8") is None and options("12.9", user="-O2") is None
        assert options("13.4", level=None) is None
    finally:
        hopper_launch._ptx_options.cache_clear()


def test_stats_say_which_kernels_ran():
    reset_attention_stats()
    q, k, v, do = (x.requires_grad_() for x in make_qkv(1, 2, 2, 9, 9, 16, torch.bfloat16, "cpu"))
    sagebwd_attn_func(q, k, v, causal=True, backend="naive").backward(do)
    kernels = attention_stats()["kernels"]
    assert kernels == {"fwd_naive": 1, "bwd_naive": 1}
    reset_attention_stats()
    assert attention_stats()["kernels"] == {}


# ---------------------------------------------------------------------------------------------------------
# GPU: the Gluon forward
# ---------------------------------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not IS_SM90, reason="the Gluon kernels need an sm_90 GPU")
# Same algorithm, same tiles: the kernels differ from the reference only by fp32 rounding order and the
# hardware exp2, which flip a rare INT8 rounding of P (see test_kernels.ORACLE_REL_GPU).
ORACLE_REL = 6e-3
# A tensor of a few hundred elements (the one-token decode's 4 rows x 128) moves by 2-3e-3 for each flipped INT8
# rounding, with no other rows to average it out. Over 100 fresh draws of that case on an H100 (Triton 3.6 and 3.9
# gave the same numbers) dQ against the reference had median 2.3e-3, 95th percentile 5.5e-3, max 6.26e-3, 2 draws
# over 6e-3, and the portable kernels the same: test_kernels' bound for such tensors holds them.


def _oracle_rel(t):
    return ORACLE_REL_TINY if t.numel() <= 1024 else ORACLE_REL


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, window[, V's head dim])
GLUON_CASES = [
    (2, 4, 4, 300, 300, 128, False, (-1, -1)),      # N not a multiple of the 128-row / 128-key tiles
    (1, 8, 2, 1000, 1000, 128, True, (-1, -1)),     # GQA 4, causal
    (1, 4, 1, 517, 517, 64, True, (-1, -1)),        # MQA
    (1, 4, 4, 1, 700, 128, True, (-1, -1)),         # one-token decode: bottom-right causal
    (2, 2, 1, 100, 900, 64, True, (-1, -1)),        # q shorter than k
    (1, 2, 2, 700, 200, 128, True, (-1, -1)),       # q longer than k: the first rows see no key
    (1, 4, 2, 1100, 1100, 64, True, (200, 0)),      # sliding window
    (1, 2, 2, 600, 800, 128, False, (130, 77)),     # two-sided window
    (3, 2, 2, 2048, 2048, 128, False, (-1, -1)),    # three consumer warpgroups at D=128
    (2, 4, 2, 2100, 2100, 64, False, (-1, -1)),     # three consumer warpgroups (192-row programs), GQA
    # MLA (DeepSeek V2/V3): Q/K head dim 192 as two channel blocks (128 + 64), V's 128
    (1, 4, 4, 700, 700, 192, True, (-1, -1), 128),
    (2, 4, 2, 1000, 1200, 192, False, (-1, -1), 128),   # GQA, q shorter than k
    (1, 2, 2, 600, 800, 192, False, (130, 77), 128),    # two-sided window
]


def _unpack(case):
    """(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, window, V's head dim)."""
    return tuple(case[:8]) + ((case[8] if len(case) > 8 else case[5]),)


def _case_id(case):
    b, h, hk, nq, nk, d, causal, window, dv = _unpack(case)
    mla = f"v{dv}" if dv != d else ""
    return f"b{b}h{h}kv{hk}-q{nq}k{nk}-d{d}{mla}-{'causal' if causal else 'full'}-w{window[0]}_{window[1]}"


def _forward(monkeypatch, choice, fn, *args, **kwargs):
    monkeypatch.setenv(dispatch.ENV_VAR, choice)
    reset_attention_stats()
    with torch.no_grad():
        out = fn(*args, **kwargs)
    ran = attention_stats()["kernels"]
    assert ran.get(f"fwd_{'gluon' if choice == 'gluon' else 'triton'}") == 1, ran
    return out


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GLUON_CASES, ids=_case_id)
def test_gluon_forward_matches_reference(case, dtype, monkeypatch):
    b, h, hk, nq, nk, d, causal, window, dv = _unpack(case)
    q, k, v, _ = make_qkv(b, h, hk, nq, nk, d, dtype, "cuda", head_dim_v=dv)
    kw = dict(causal=causal, window_size=window, return_lse=True)
    out, lse = _forward(monkeypatch, "gluon", sagebwd_attn_func, q, k, v, **kw)
    assert torch.isfinite(out).all(), "NaN/inf in O: an element the Gluon kernel never wrote, or a bad row"
    portable, lse_portable = _forward(monkeypatch, "triton", sagebwd_attn_func, q, k, v, **kw)
    with torch.no_grad():
        ref, lse_ref = sagebwd_attn_func(q, k, v, backend="naive", **kw)
    cos, rel = error_stats(out, ref)
    print(f"{_case_id(case)} {dtype}: gluon vs reference cos {cos:.6f} rel {rel:.2e}; "
          f"vs portable rel {error_stats(out, portable)[1]:.2e}")
    assert rel <= _oracle_rel(out) and cos >= 0.9999
    assert error_stats(out, portable)[1] <= _oracle_rel(out)
    seen = torch.isfinite(lse_ref)              # rows that see no key have lse -inf in all three
    assert torch.equal(seen, torch.isfinite(lse)) and torch.equal(seen, torch.isfinite(lse_portable))
    # The portable kernel shares the quantization kernels: the same INT8 bytes, so only fp32 rounding and exp2
    # differ, the score offset's rounding above all (1.2e-4 seen at D=64). The reference quantizes in PyTorch
    # (its K mean rounds differently and can flip an INT8 code, ~3e-3 on a row that sees one key): checked
    # looser, and through O above.
    torch.testing.assert_close(lse[seen], lse_portable[seen], rtol=0, atol=1e-4 + 2 * _offset_rounding_lse(q, k))
    torch.testing.assert_close(lse[seen], lse_ref[seen], rtol=0, atol=1e-2)
    if causal and nq > nk:                      # rows that see nothing are zeros, not NaN
        assert (out[:, :, : nq - nk] == 0).all()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "cap5"])
@pytest.mark.parametrize("case", [GLUON_CASES[i] for i in (0, 5, 6, 9, 10)], ids=_case_id)
def test_gluon_forward_schedules_agree(case, softcap):
    """The synchronization schedules (mbarrier or named-barrier turns and releases, two or three consumers, one
    program a work item or 3 programs taking every item from the atomic counter, their ring and Q buffer running on
    across items) and P V's keys in P's register order run the same arithmetic on the same INT8 inputs:
    bit-identical outputs and lse, over padded tiles, rows that see no key, a window, GQA and MLA, with and without
    a soft cap."""
    from sagebwd_hf.kernels.hopper_launch import launch_forward_hopper
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import quantize_qk, quantize_v
    b, h, hk, nq, nk, d, causal, window, dv = _unpack(case)
    q, k, v, _ = make_qkv(b, h, hk, nq, nk, d, torch.bfloat16, "cuda", head_dim_v=dv)
    q, k, v = (x.detach() for x in (q, k, v))
    lay_q, lay_k = SeqLayout(b, nq, None), SeqLayout(b, nk, None)
    quant = quantize_qk(q, k, lay_q, lay_k, d ** -0.5, True, False, row_shift=bool(softcap), v4=v)
    v8t, v_scale = quantize_v(v, lay_k, v_scale=quant.v_scale)
    window = (window[0], 0) if causal and window[1] < 0 else window
    cap = dict(softcap=softcap, shift=quant.q_shift * LOG2E) if softcap else {}
    runs = {}
    for consumers in (2, 3):
        for named in (False, True):
            for programs in (None, 3):    # one program a work item, or 3 persistent programs
                out = torch.full((b, h, nq, dv), float("nan"), device="cuda", dtype=q.dtype)
                lse = torch.full(q.shape[:3], float("nan"), device="cuda")
                launch_forward_hopper(quant, v8t, v_scale, out, lse, lay_q, lay_k, h, h // hk, d, window,
                                      consumers=consumers, named_barriers=named, programs=programs, **cap)
                runs[consumers, named, programs] = (out, lse)
    # P fed to P V in the order its registers hold it, V^T's keys permuted to match: the same int32 sums
    v8t_ordered, _ = quantize_v(v, lay_k, v_scale=quant.v_scale, operand_order=True)
    for consumers in (2, 3):
        out = torch.full((b, h, nq, dv), float("nan"), device="cuda", dtype=q.dtype)
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        launch_forward_hopper(quant, v8t_ordered, v_scale, out, lse, lay_q, lay_k, h, h // hk, d, window,
                              consumers=consumers, programs=3, v_operand_order=True, **cap)
        runs[consumers, "operand order"] = (out, lse)
    out0, lse0 = runs[2, False, None]
    assert not out0.isnan().any() and not lse0.isnan().any()
    for key, (out, lse) in runs.items():
        assert torch.equal(out, out0) and torch.equal(lse, lse0), key


def _grads(monkeypatch, choice, q, k, v, do, backward="deterministic", one_launch=False, **kw):
    """The op's gradients on the kernels of ``choice`` with ``SAGEBWD_BACKWARD=backward`` (left set, so that a
    reference computed next follows the same rule), asserting which backward ran."""
    monkeypatch.setenv(dispatch.ENV_VAR, choice)
    monkeypatch.setenv(dispatch.BACKWARD_ENV, backward)
    reset_attention_stats()
    grads = run_with_grads(lambda x, y, z: sagebwd_attn_func(x, y, z, **kw), q, k, v, do)
    ran = attention_stats()["kernels"]
    name = "bwd_gluon_one_launch" if one_launch else f"bwd_{'gluon' if choice == 'gluon' else 'triton'}"
    assert ran.get(name) == 1, ran
    return grads


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", GLUON_CASES, ids=_case_id)
def test_gluon_backward_matches_reference(case, monkeypatch):
    """dQ, dK, dV of the Gluon backward (kernels/backward_hopper.py) against the reference and the portable
    kernels, over the padded grid (GQA summed over the group, Nq != Nk, rows that see no key, windows, MLA's
    head dims); where the default (``SAGEBWD_BACKWARD=fast``) takes the one launch (head dim 64), that too,
    against the reference of its rule (plan.backward_rule)."""
    b, h, hk, nq, nk, d, causal, window, dv = _unpack(case)
    q, k, v, do = make_qkv(b, h, hk, nq, nk, d, torch.bfloat16, "cuda", head_dim_v=dv)
    kw = dict(causal=causal, window_size=window)
    runs = {"three launches": _grads(monkeypatch, "gluon", q, k, v, do, **kw)}
    portable = _grads(monkeypatch, "triton", q, k, v, do, **kw)
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    refs = {"three launches": run_with_grads(lambda x, y, z: sagebwd_attn_func(x, y, z, backend="naive", **kw),
                                             q, k, v, do)}
    monkeypatch.delenv(dispatch.BACKWARD_ENV)
    rule = backward_rule(q.device, d, dv)
    if rule.one_launch:
        runs["one launch"] = _grads(monkeypatch, "gluon", q, k, v, do, backward=dispatch.BACKWARD_DEFAULT,
                                    one_launch=True, **kw)
        monkeypatch.setenv(dispatch.ENV_VAR, "auto")
        refs["one launch"] = run_with_grads(lambda x, y, z: sagebwd_attn_func(x, y, z, backend="naive", **kw),
                                            q, k, v, do)
    for path, got in runs.items():
        for name in ("dQ", "dK", "dV"):
            assert torch.isfinite(got[name]).all(), f"{path} {name}: an element the Gluon kernels never wrote"
            cos, rel = error_stats(got[name], refs[path][name])
            rel_port = error_stats(got[name], portable[name])[1]
            print(f"{_case_id(case)} {path} {name}: gluon vs reference cos {cos:.6f} rel {rel:.2e}; "
                  f"vs portable {rel_port:.2e}")
            assert cos >= 0.9999 and rel <= _oracle_rel(got[name]), (path, name, cos, rel)
            if path == "three launches":     # (the portable kernels compute the three launches' rule)
                assert rel_port <= _oracle_rel(got[name]), (name, rel_port)
        if causal and nq > nk:                      # rows that see no key have zero dQ
            assert (got["dQ"][:, :, : nq - nk] == 0).all(), path


SOFTCAP_REF_REL = 2e-2
# (batch, heads, kv heads, queries, keys, head dim, causal, window, cap[, V's head dim]): caps that bend the scores
# hard (5) and gently (30), GQA, Nq != Nk with rows that see no key, a window, MLA
SOFTCAP_CASES = [
    (2, 4, 2, 700, 700, 128, True, (-1, -1), 5.0),
    (1, 4, 1, 300, 520, 128, False, (130, 77), 30.0),
    (2, 4, 2, 900, 600, 64, True, (-1, -1), 30.0),
    (1, 2, 2, 1100, 1100, 64, True, (200, 0), 5.0),
    (1, 4, 2, 600, 600, 192, True, (-1, -1), 30.0, 128),
]


def _score_unit(q, k):
    """A score's step per unit of the INT8 product ``q8 . k8``, at most: the largest q scale times the largest
    (K-smoothed) k scale, in softmax-scaled natural-log units."""
    from sagebwd_hf.naive import k_scale_block, quantize_per_block, quantize_per_token
    kf = k.float()
    q_scale = quantize_per_token(q.float())[1]
    k_scale = quantize_per_block(kf - kf.mean(2, keepdim=True), k_scale_block(k.shape[-1]))[1]
    return float(q_scale.max() * k_scale.max() * q.shape[-1] ** -0.5)


def _one_code_lse(q, k):
    """How far one INT8 code of Q or K moves a natural-log LSE at most: 127 score units (a soft cap only
    shrinks it)."""
    return _score_unit(q, k) * 127


def _offset_rounding_lse(q, k):
    """One rounding of the add trick's offset (quantize.int32_times: 1.5 * 2^23 score units, in fp32), in
    natural-log LSE units: the portable and Gluon forwards round it at different points (per key tile and K
    scale, or per row with the tile's one K scale folded in), so their LSEs may differ by about that."""
    base2 = 12582912.0 * _score_unit(q, k) * LOG2E
    return 2.0 ** (math.floor(math.log2(base2)) - 23) / LOG2E


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: _case_id(c[:8] + c[9:]) + f"-cap{c[8]:g}")
def test_gluon_softcap_matches_reference(case, monkeypatch):
    """Soft-capped scores (Gemma 2) on the Gluon forward and backward against the reference and the portable
    kernels: K with channel outliers, so K-smoothing's row shift, which the cap must undo, is large; dQ checks
    the op's K-smoothing term, which needs the dQ kernel's rowsum(dS) once capped."""
    b, h, hk, nq, nk, d, causal, window, cap = case[:9]
    dv = case[9] if len(case) > 9 else d
    q, k, v, do = make_qkv(b, h, hk, nq, nk, d, torch.bfloat16, "cuda", k_outliers=6.0, head_dim_v=dv)
    q = (q * 2.0).detach()   # scores large enough for a cap of 5 to bend them
    kw = dict(causal=causal, window_size=window, softcap=cap)
    out, lse = _forward(monkeypatch, "gluon", sagebwd_attn_func, q, k, v, return_lse=True, **kw)
    _, lse_portable = _forward(monkeypatch, "triton", sagebwd_attn_func, q, k, v, return_lse=True, **kw)
    got = _grads(monkeypatch, "gluon", q, k, v, do, **kw)
    portable = _grads(monkeypatch, "triton", q, k, v, do, **kw)
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    ref = run_with_grads(lambda x, y, z: sagebwd_attn_func(x, y, z, backend="naive", **kw), q, k, v, do)
    with torch.no_grad():
        _, lse_ref = sagebwd_attn_func(q, k, v, backend="naive", return_lse=True, **kw)
    assert torch.equal(out, got["O"]), "the forward alone and inside the training call differ"
    seen = torch.isfinite(lse_ref)
    assert torch.equal(seen, torch.isfinite(lse)) and torch.equal(seen, torch.isfinite(lse_portable))
    # The portable kernels read the same INT8 bytes: only fp32 rounding differs. The reference quantizes in
    # PyTorch, and one INT8 code it rounds the other way (its K mean differs in the last bit) moves a row that
    # sees one key by up to max(q scale) * max(k scale) * 127 * softmax scale: 0.03-0.04 on these doubled q and
    # outlier K, so a bound of 1e-2 alone could fail on a correct kernel (it did once, on an H100).
    torch.testing.assert_close(lse[seen], lse_portable[seen], rtol=0, atol=1e-3)
    one_code = _one_code_lse(q, k)
    err = (lse - lse_ref)[seen].abs()
    print(f"{_case_id(case[:8] + case[9:])} cap {cap:g} LSE: gluon vs reference max {err.max():.3e}, "
          f"one INT8 code {one_code:.3e}")
    assert err.max() <= 1e-2 + one_code, (f"LSE against the reference: max {err.max():.3e} at flat row "
                                          f"{int(err.argmax())}, 99.9th percentile {err.quantile(0.999):.3e}, "
                                          f"one INT8 code {one_code:.3e}")
    for name in ("O", "dQ", "dK", "dV"):
        assert torch.isfinite(got[name]).all(), f"{name}: an element the Gluon kernels never wrote"
        cos, rel = error_stats(got[name], ref[name])
        rel_port = error_stats(got[name], portable[name])[1]
        print(f"{_case_id(case[:8] + case[9:])} cap {cap:g} {name}: gluon vs reference cos {cos:.6f} rel {rel:.2e}; "
              f"vs portable {rel_port:.2e}")
        # the reference quantizes in PyTorch (its K mean can flip an INT8 code), and a cap of 5 on doubled
        # scores amplifies that: test_sinks_softcap.py's bound against it; the portable kernels read the same
        # INT8 bytes as the Gluon ones: this file's
        assert cos >= 0.9998 and rel <= SOFTCAP_REF_REL, (name, cos, rel)
        assert rel_port <= ORACLE_REL, (name, rel_port)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dims", [(128, 128), (64, 64), (192, 128)], ids=["d128", "d64", "d192v128"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 0)], ids=["full", "causal", "window"])
def test_gluon_forward_on_packed_batches(head_dims, window, monkeypatch):
    """Uneven and empty sequences in one packed batch on the Gluon forward. Two faults lived here: TMA needs each
    tile's innermost coordinate 16-byte aligned (V^T is laid out with aligned sequence starts,
    quantize.aligned_starts), and a
    program past a short sequence's end must still enter the warp-specialized region, with no tiles (with a
    window its bounds crossed and the loader and consumers disagreed: a hang)."""
    # at D=64 without a mask: three consumer warpgroups (from any length here); 5 programs walk the work items
    # (past a sequence's end too), more than one each
    monkeypatch.setattr(plan, "GLUON_THREE_CONSUMERS_MIN_QUERIES", 1)
    monkeypatch.setattr(plan, "gluon_programs", lambda device: 5)
    lengths = [300, 0, 1, 129, 128, 517]
    h, hk = 4, 2
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    total, longest = int(cu[-1]), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(total, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for n, d in ((h, head_dims[0]), (hk, head_dims[0]), (hk, head_dims[1])))
    kw = dict(causal=window[1] == 0, window_size=window, return_lse=True)
    args = (q, k, v, cu, cu, longest, longest)
    out, lse = _forward(monkeypatch, "gluon", sagebwd_attn_varlen_func, *args, **kw)
    assert torch.isfinite(out).all()
    portable, lse_portable = _forward(monkeypatch, "triton", sagebwd_attn_varlen_func, *args, **kw)
    with torch.no_grad():
        ref, _ = sagebwd_attn_varlen_func(*args, backend="naive", **kw)
    cos, rel = error_stats(out, ref)
    assert rel <= ORACLE_REL and cos >= 0.9999, (cos, rel)
    assert error_stats(out, portable)[1] <= ORACLE_REL
    bound = 1e-4 + 2 * _offset_rounding_lse(q.transpose(0, 1)[None], k.transpose(0, 1)[None])
    torch.testing.assert_close(lse, lse_portable, rtol=0, atol=bound)


@pytest.mark.gpu
@needs_sm90
def test_dispatch_picks_each_path_on_hopper(monkeypatch):
    # head dim 64: auto takes the Gluon forward at any length there
    q, k, v, do = (x.requires_grad_() for x in make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16, "cuda"))
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv(dispatch.BACKWARD_ENV, raising=False)
    reset_attention_stats()
    sagebwd_attn_func(q, k, v, causal=True).backward(do)
    default = dispatch._triton_minor() in dispatch.TESTED_TRITON
    one_launch = default and dispatch.BACKWARD_DEFAULT == "fast"     # head dim 64, no cap
    assert attention_stats()["kernels"] == {"fwd_gluon" if default else "fwd_triton": 1,
                                            ("bwd_gluon_one_launch" if one_launch else "bwd_gluon") if default
                                            else "bwd_triton": 1}
    for choice in ("gluon", "triton"):
        monkeypatch.setenv(dispatch.ENV_VAR, choice)
        reset_attention_stats()
        sagebwd_attn_func(q, k, v, causal=True)
        assert attention_stats()["kernels"] == {f"fwd_{choice}": 1}


def test_one_launch_backward_rule(monkeypatch):
    """SAGEBWD_BACKWARD: fast by default, taking the one launch where it fits and measured faster,
    never under torch.use_deterministic_algorithms(True); the op's argument wins over the variable; a bad value
    names the variable and its choices."""
    rule = plan.gluon_one_launch_backward
    plain = dict(deterministic=None, head_dim=64, head_dim_v=64, softcap=False)
    monkeypatch.delenv(dispatch.BACKWARD_ENV, raising=False)
    assert rule(**plain)
    assert not rule(**dict(plain, deterministic=True))
    monkeypatch.setenv(dispatch.BACKWARD_ENV, " Deterministic ")
    assert not rule(**plain)
    assert rule(**dict(plain, deterministic=False))
    monkeypatch.setenv(dispatch.BACKWARD_ENV, " Fast ")
    assert rule(**plain)
    assert not rule(**dict(plain, deterministic=True))
    assert not rule(**dict(plain, head_dim=128, head_dim_v=128))
    assert not rule(**dict(plain, softcap=True))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not rule(**plain) and not rule(**dict(plain, deterministic=False))
    finally:
        torch.use_deterministic_algorithms(before)
    monkeypatch.setenv(dispatch.BACKWARD_ENV, "atomic")
    with pytest.raises(ValueError, match="SAGEBWD_BACKWARD must be one of .*'deterministic', 'fast'.*'atomic'"):
        rule(**plain)


def test_backward_rule_and_the_pytorch_path_follow_the_one_launch(monkeypatch):
    """plan.backward_rule (interface.backward_rule too) says what a backward computes: the one launch's rule
    (64-query tiles, dQ from dS in the inputs' dtype) where the Gluon kernels run at head dim 64 and determinism is
    not asked for, the three launches' elsewhere; the PyTorch path computes the rule of its device (here a CPU made
    to look like a Hopper GPU), so that a GPU's ``backend="naive"`` is the reference of its default."""
    from sagebwd_hf.naive import sagebwd_backward_naive, sagebwd_forward_naive
    monkeypatch.delenv(dispatch.BACKWARD_ENV, raising=False)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert backward_rule(cpu, 64) == (64, 64, True, False)              # no Gluon on a CPU
    monkeypatch.setattr(dispatch, "gluon_unavailable", lambda device: None)
    monkeypatch.setattr(dispatch, "use_gluon", lambda *args, **kw: True)
    assert backward_rule(gpu, 64) == (plan.ONE_LAUNCH_QUERY_TILE, 128, False, True)
    assert backward_rule(gpu, 64, deterministic=True) == (128, 128, True, False)
    assert not backward_rule(gpu, 64, softcap=5.0).one_launch
    assert not backward_rule(gpu, 128).one_launch and not backward_rule(gpu, 192, 128).one_launch
    q, k, v, do = make_qkv(1, 4, 2, 150, 150, 64, torch.bfloat16, "cpu", k_outliers=4.0)
    scale, window = 0.125, (-1, 0)
    out, lse = sagebwd_forward_naive(q, k, v, scale, window, True, False, block_n=64)
    grads = {}
    for deterministic in (None, True):
        got = run_with_grads(lambda x, y, z: sagebwd_attn_func(x, y, z, causal=True, softmax_scale=scale,
                                                               backend="naive", deterministic=deterministic),
                             q, k, v, do)
        grads[deterministic] = [got[name] for name in ("dQ", "dK", "dV")]
    # the one launch's rule (a CPU's tiles are 64 either way: dQ's product is what differs)
    want = sagebwd_backward_naive(q, k, v, out, lse, do, scale, window, block_m_dkdv=64, dq_int8=False)
    for got, ref in zip(grads[None], want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    want = sagebwd_backward_naive(q, k, v, out, lse, do, scale, window, block_m_dkdv=64, block_n_dq=64)
    for got, ref in zip(grads[True], want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(grads[None][0], grads[True][0])


def test_backward_rule_of_the_in_place_rules(monkeypatch):
    """Precisions whose dV and dK sum in place (numerics' ``in_place``): on the Gluon kernels dV and dK run over
    64-query tiles (one key-tile launch for both, or the one launch), the one launch also at head dim 128 with P's
    fixed scale ("fastest"; with per-tile P scales a per-query row of dO's scales more overflows its shared memory);
    elsewhere the three launches' rule, and the plan says so."""
    monkeypatch.delenv(dispatch.BACKWARD_ENV, raising=False)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert backward_rule(cpu, 128, in_place=True, p_static=True) == backward_rule(cpu, 128)
    monkeypatch.setattr(dispatch, "gluon_unavailable", lambda device: None)
    monkeypatch.setattr(dispatch, "use_gluon", lambda *args, **kw: True)
    tile = plan.ONE_LAUNCH_QUERY_TILE
    assert backward_rule(gpu, 128, in_place=True, p_static=True) == (tile, 128, False, True)
    assert backward_rule(gpu, 128, in_place=True) == (tile, 128, True, False)      # dV and dK fused, dQ's launch
    assert backward_rule(gpu, 128, in_place=True, p_static=True, deterministic=True) == (tile, 128, True, False)
    assert backward_rule(gpu, 128, in_place=True, p_static=True, softcap=5.0) == (tile, 128, True, False)
    assert backward_rule(gpu, 128) == (128, 128, True, False)
    assert backward_rule(gpu, 64, in_place=True) == (tile, 128, False, True)
    rules = numerics.parse_precision("fastest")
    assert rules.in_place and not numerics.FAST.in_place and not numerics.parse_precision("pv_e4m3").in_place
    monkeypatch.setattr(plan, "gluon_programs", lambda device: 132)
    made = plan.backward_plan(gpu, 128, 128, q_smoothing=False, varlen=False, softcap=0.0, deterministic=True,
                              pv_e4m3=True, p_static=True, dk_e4m3=True, do_sequence=True, in_place=rules.in_place)
    assert made.in_place and made.gluon and not made.one_launch and made.rule.block_m_dkdv == tile
    per_tile = numerics.parse_precision("pv_e4m3+p_static+dk_e4m3")     # per-tile dO scales: not in place
    assert not per_tile.in_place
    made = plan.backward_plan(gpu, 128, 128, q_smoothing=False, varlen=False, softcap=0.0, deterministic=None,
                              pv_e4m3=True, p_static=True, dk_e4m3=True, in_place=per_tile.in_place)
    assert not made.in_place and not made.one_launch and made.rule.block_m_dkdv == 128


def test_in_place_rules_refuse_head_dims_not_built(monkeypatch):
    """A backward whose dV and dK would sum in place on the Gluon kernels at head dims where that is not built (MLA's
    192/128) raises before any launch, naming the head dims it runs at and the PyTorch path."""
    from sagebwd_hf import interface
    monkeypatch.setattr(dispatch, "gluon_unavailable", lambda device: None)
    monkeypatch.setattr(dispatch, "use_gluon", lambda *args, **kw: True)
    monkeypatch.setattr(plan, "gluon_programs", lambda device: 132)
    q, k, v, do = (torch.randn(1, 70, 4, d, dtype=torch.bfloat16) for d in (192, 192, 128, 128))   # [B, N, H, D]
    out, lse = torch.zeros_like(v), torch.zeros(1, 4, 70)
    for precision in ("fastest", "pv_e4m3+dk_e4m3"):
        with pytest.raises(NotImplementedError, match=r"sums dV and dK in place at \(Q/K, V\) head dims 64/64, "
                                                      r"128/128, not 192/128; the PyTorch path"):
            interface._backward(do, q, k, v, out, lse, None, None, 70, 70, 192 ** -0.5, (-1, 0), True, False,
                                "triton", precision=precision)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_one_launch_backward_through_the_op(causal, packed, sinks, monkeypatch):
    """SAGEBWD_BACKWARD=fast at head dim 64 on Hopper: the op's gradients through the one launch (it ran, and the
    three launches did not) within the accuracy bar against float64, close to the deterministic backward's (with
    sinks too: their K-smoothing term added after the launch); ``deterministic=True`` and
    torch.use_deterministic_algorithms(True) give the deterministic bits again."""
    from sagebwd_hf.naive import attention_exact
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    n, scale = 1000, 64 ** -0.5
    q, k, v, do = make_qkv(2, 8, 2, n, n, 64, torch.bfloat16, "cuda", k_outliers=8.0)
    sink = torch.randn(8, device="cuda") + 1.0 if sinks else None
    window = (-1, 0) if causal else (-1, -1)
    lens = [n, n - 300]
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")

    def op(**kw):
        if packed:
            return lambda a, b, c: sagebwd_attn_varlen_func(a, b, c, cu, cu, n, n, causal=causal, sinks=sink, **kw)
        return lambda a, b, c: sagebwd_attn_func(a, b, c, causal=causal, sinks=sink, **kw)
    if packed:   # two sequences of n and n - 300 tokens as one [T, H, D] batch
        args = [torch.cat([x[i, :, :lens[i]].transpose(0, 1) for i in range(2)]) for x in (q, k, v, do)]
    else:
        args = [q, k, v, do]
    runs = {}
    for mode in ("deterministic", "fast"):
        monkeypatch.setenv(dispatch.BACKWARD_ENV, mode)
        reset_attention_stats()
        runs[mode] = run_with_grads(op(), *args)
        kernels = attention_stats()["kernels"]
        assert kernels.get("bwd_gluon_one_launch", 0) == (mode == "fast"), kernels
        assert kernels.get("bwd_gluon", 0) == (mode == "deterministic"), kernels
    reset_attention_stats()   # the op's argument over the variable (still "fast")
    by_argument = run_with_grads(op(deterministic=True), *args)
    assert attention_stats()["kernels"].get("bwd_gluon_one_launch", 0) == 0
    torch.use_deterministic_algorithms(True)
    try:
        reset_attention_stats()
        again = run_with_grads(op(), *args)
        assert attention_stats()["kernels"].get("bwd_gluon_one_launch", 0) == 0
    finally:
        torch.use_deterministic_algorithms(False)
    for name in ("dQ", "dK", "dV"):
        assert torch.equal(by_argument[name], runs["deterministic"][name]), name
        assert torch.equal(again[name], runs["deterministic"][name]), name
    if not packed and not sinks:   # the reference of the one launch's rules (naive's dq_int8=False, 64-query tiles)
        from sagebwd_hf.naive import sagebwd_backward_naive, sagebwd_forward_naive
        from sagebwd_hf.interface import tile_configs
        out_ref, lse_ref = sagebwd_forward_naive(q, k, v, scale, window, True, False,
                                                 block_n=tile_configs(64, q.device)["fwd"][1])
        rule = sagebwd_backward_naive(q, k, v, out_ref, lse_ref, do, scale, window, block_m_dkdv=64, dq_int8=False)
        for name, want in zip(("dQ", "dK", "dV"), rule):
            cos, rel = error_stats(runs["fast"][name], want)
            print(f"{name}: one launch vs its reference cos {cos:.6f} rel {rel:.2e}")
            assert rel <= ORACLE_REL, name
    exact = lambda a, b, c: attention_exact(a, b, c, scale, window, sinks=sink)[0]  # noqa: E731
    if packed:
        refs = [run_with_grads(exact, *(x[None, :, :lens[i]].double() for x in (q[i], k[i], v[i], do[i])))
                for i in range(2)]
        ref = {name: torch.cat([r[name][0].transpose(0, 1) for r in refs]) for name in ("dQ", "dK", "dV")}
    else:
        ref = run_with_grads(exact, *(x.double() for x in (q, k, v, do)))
    for name, bound in (("dQ", 0.99), ("dK", 0.99), ("dV", 0.999)):
        got = runs["fast"][name]
        assert torch.isfinite(got).all(), name
        cos, rel = error_stats(got, ref[name])
        cos_d, rel_d = error_stats(runs["deterministic"][name], ref[name])
        print(f"{name}: fast cos {cos:.6f} rel {rel:.2e}; deterministic cos {cos_d:.6f} rel {rel_d:.2e}")
        assert cos >= bound and rel <= 1.25 * rel_d + 2e-3, name
