"""Shared by the tests and benchmarks: input generators and error metrics against exact attention.

The model-coverage harness (every Transformers architecture, tiny, on SageBwd) is ``sagebwd_hf.testing.model_coverage``,
imported on its own: it imports Transformers' model registry."""
from typing import Dict, Optional, Tuple

import torch

from ..naive import attention_exact


def error_stats(x: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    """(cosine similarity, relative L2 error) of ``x`` against ``ref``, computed in float64."""
    a, b = x.detach().double().flatten(), ref.detach().double().flatten()
    if not torch.isfinite(a).all():
        return float("nan"), float("nan")
    ref_norm = b.norm()
    if ref_norm == 0:
        return (1.0 if a.norm() == 0 else 0.0), a.norm().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    return cos, ((a - b).norm() / ref_norm).item()


def make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, device, k_outliers=0.0,
             seed: Optional[int] = None, head_dim_v: Optional[int] = None):
    """Random q, k, v ``[B, H, N, D]`` plus an upstream gradient (v and the gradient with ``head_dim_v``
    channels if given: MLA's value head dim).

    ``k_outliers > 0`` adds a per-channel offset to K of that many standard deviations on a few
    channels and a smaller one on all: the channel bias real models show and K-smoothing removes."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = rnd(batch, heads, seqlen_q, head_dim)
    k = rnd(batch, kv_heads, seqlen_k, head_dim)
    if k_outliers:
        offset = rnd(head_dim) * (k_outliers / 4)
        offset[torch.randperm(head_dim, generator=gen)[: max(1, head_dim // 16)]] = k_outliers
        k = k + offset
    v = rnd(batch, kv_heads, seqlen_k, head_dim_v or head_dim)
    do = rnd(batch, heads, seqlen_q, head_dim_v or head_dim)
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(do)


def run_with_grads(fn, q, k, v, do) -> Dict[str, torch.Tensor]:
    """out and dq/dk/dv of ``fn(q, k, v)`` for the upstream gradient ``do``; inputs are not touched."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return {"O": out.detach(), "dQ": leaves[0].grad, "dK": leaves[1].grad, "dV": leaves[2].grad}


def exact_reference(q, k, v, do, softmax_scale=None, window_size=(-1, -1), dtype=torch.float64):
    """Exact attention and its gradients (float64 by default)."""
    return run_with_grads(lambda a, b, c: attention_exact(a, b, c, softmax_scale, window_size, dtype)[0],
                          q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype))


def compare(result: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]):
    """{name: (cos, rel_l2)} for O, dQ, dK, dV."""
    return {name: error_stats(result[name], reference[name]) for name in ("O", "dQ", "dK", "dV")}


def assert_equal_but_summation_order(got: torch.Tensor, want: torch.Tensor, message: str = "") -> None:
    """``got`` and ``want`` are the same fp32 sums added up in different orders, then rounded to their dtype (the
    Hopper one launch's dQ, whose reduce-adds land in any order). The fp32 sums differ by a few fp32 units, so a
    stored element either matches or is the adjacent value of the stored dtype, where the order moved it across a
    rounding boundary (a 16-bit dtype's step is 2^-8 of the value, so a few such elements already give a relative
    L2 of 1e-5: a bound on that alone flakes). Asserted: everything finite; each element equal, the adjacent value
    (counted in the dtype's own encoding, so a power of two's edge is no exception), or within the fp32 sums' own
    error where values cancel to near zero; and, in a 16-bit dtype, at most a tenth of the elements not equal. (An
    fp32 result, the sums unrounded: within 1e-5 of each other.)"""
    assert got.shape == want.shape and got.dtype == want.dtype, message
    assert torch.isfinite(got).all(), f"{message}: non-finite values"
    g, w = got.detach(), want.detach()
    if g.element_size() == 2:    # fp16 / bf16: sign-magnitude codes -> integers in the values' order
        def order(x):
            bits = x.view(torch.int16).int()
            return torch.where(bits < 0, -(bits & 0x7FFF), bits)
        steps = (order(g) - order(w)).abs()
    else:       # fp32 (the sums themselves, unrounded): a few units of fp32 apart
        steps = 2 * ((g.double() - w.double()).abs() > 1e-5 * w.double().abs()).int()
    # the sums' own fp32 error, relative to their terms, not to a value they cancel down to
    atol = (1e-5 if g.element_size() == 4 else torch.finfo(got.dtype).eps * 1e-3) * w.double().abs().max()
    near_zero = (g.double() - w.double()).abs() <= atol
    bad = (steps > 1) & ~near_zero
    assert not bad.any(), (f"{message}: {int(bad.sum())} elements differ by more than one step, e.g. "
                           f"{g[bad][:3].tolist()} against {w[bad][:3].tolist()}")
    if g.element_size() == 2:   # (unrounded fp32 sums differ in their last bits almost everywhere)
        assert (g != w).float().mean() <= 0.1, f"{message}: {(g != w).float().mean():.1%} of the elements differ"
