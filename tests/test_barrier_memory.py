"""No Gluon kernel reads or writes an mbarrier's shared memory with plain loads and stores.

PTX leaves that undefined while the barrier is valid (it is never invalidated in our kernels). Triton 3.6 laid the
scratch word through which it broadcasts a scalar atomic's result over the forward's unused turn barriers; under GPU
time-slicing a persistent program then read a wrong work-item count and dropped the item it had taken, leaving its
output rows unwritten. The check reads the compiled PTX: mbarrier.init addresses against every shared-memory
access whose address is a constant offset from the kernel's shared base (accesses through computed addresses,
such as the tiles', are not resolved, so it catches scratch words and mailboxes, not everything).
"""
import re

import pytest
import torch

from sagebwd_hf import sagebwd_attn_func
from sagebwd_hf.testing import make_qkv

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

_BASE = re.compile(r"mov\.[bu]32\s+(%r\d+),\s*global_smem;")
_OFFSET = re.compile(r"add\.s32\s+(%r\d+),\s*(%r\d+),\s*(-?\d+);")
_BARRIER = re.compile(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[(%r\d+)\]")
_ACCESS = re.compile(r"\b(?:st|ld|atom|red)\.shared[\w:.]*\s+(?:%r\d+,\s*)?"
                     r"\[\s*(global_smem|%r\d+)\s*(?:\+\s*(-?\d+))?\s*\]")


def plain_accesses_of_barriers(ptx: str):
    """(offset, PTX line) of each plain shared-memory access that lands on an mbarrier (8 bytes from its init's
    address), with addresses resolved where a register holds ``global_smem`` plus a constant."""
    offset_of = {}
    barriers = set()
    accesses = []
    for line in ptx.splitlines():
        text = line.strip()
        if m := _BASE.match(text):
            offset_of[m.group(1)] = 0
        elif (m := _OFFSET.match(text)) and m.group(2) in offset_of:
            offset_of[m.group(1)] = offset_of[m.group(2)] + int(m.group(3))
        elif "mbarrier" in text:
            if (m := _BARRIER.search(text)) and m.group(1) in offset_of:
                barriers.add(offset_of[m.group(1)])
        elif m := _ACCESS.search(text):
            base = 0 if m.group(1) == "global_smem" else offset_of.get(m.group(1))
            if base is not None:
                accesses.append((base + int(m.group(2) or 0), text))
    return [(at, text) for at, text in accesses if any(b <= at < b + 8 for b in barriers)]


def test_the_check_finds_a_scratch_word_on_a_barrier():
    """The pattern Triton 3.6 emitted for the forward's work counter (a scratch word on the first barrier), and the
    same code with the word beside the barriers."""
    ptx = """
	mov.b32 	%r140, global_smem;
	add.s32 	%r1906, %r140, 40960;
	@%p127 mbarrier.init.shared::cta.b64 [%r1906], 1;
	add.s32 	%r1907, %r140, 41312;
	@%p127 mbarrier.init.shared::cta.b64 [%r1907], 1;
	@%p12 atom.global.gpu.acq_rel.add.u32 %r192, [ %rd56 + 0 ], %r193;
	add.s32 	%r194, %r140, WORD;
	@%p12 st.shared.b32 [ %r194 + 0 ], %r192;
	ld.shared.b32 	%r195, [global_smem+WORD];
	st.shared.b32 	[global_smem+41328], %r3680;
	mbarrier.arrive.shared::cta.b64 _, [%r1907];
"""
    hits = plain_accesses_of_barriers(ptx.replace("WORD", "40964"))
    assert [at for at, _ in hits] == [40964, 40964] and hits[0][1].startswith("@%p12 st.shared")
    assert [at for at, _ in plain_accesses_of_barriers(ptx.replace("WORD", "41316"))] == [41316, 41316]
    assert plain_accesses_of_barriers(ptx.replace("WORD", "40000")) == []
    assert plain_accesses_of_barriers(ptx.replace("WORD", "41320")) == []


def _compiled_gluon_kernels():
    from sagebwd_hf.kernels import backward_hopper_dkdv, backward_hopper_dq, forward_hopper
    for fn in (forward_hopper._attn_fwd_hopper_kernel, backward_hopper_dkdv._attn_bwd_dkdv_hopper_kernel,
               backward_hopper_dq._attn_bwd_dq_hopper_kernel):
        for cache in fn.device_caches.values():
            for compiled in cache[0].values():
                yield fn.__name__, compiled


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernels need an sm_90 GPU")
def test_no_gluon_kernel_touches_a_barrier_with_plain_loads_or_stores(monkeypatch):
    from sagebwd_hf.kernels import plan
    monkeypatch.setattr(plan, "gluon_programs", lambda device: 5)    # persistent programs: the work counter's path
    for head_dim in (64, 128):
        for precision in ("accurate", "fastest"):
            for causal in (False, True):
                q, k, v, do = make_qkv(1, 4, 2, 1024, 1024, head_dim, torch.bfloat16, "cuda", seed=0)
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                sagebwd_attn_func(q, k, v, causal=causal, precision=precision).backward(do)
    kernels = list(_compiled_gluon_kernels())
    assert {name for name, _ in kernels} >= {"_attn_fwd_hopper_kernel", "_attn_bwd_dkdv_hopper_kernel"}
    hits = {(name, at, text) for name, compiled in kernels
            for at, text in plain_accesses_of_barriers(compiled.asm["ptx"])}
    assert not hits, sorted(hits)[:8]
