"""SageBwd as a Hugging Face Transformers attention backend: ``attn_implementation="sagebwd"``.

``import sagebwd_hf`` registers two functions under the name ``"sagebwd"``:

* ``sagebwd_mask`` in ``AttentionMaskInterface``: what every layer gets as ``attention_mask``. As
  ``flash_attention_mask`` it returns ``None`` or the 2D padding mask, never a dense 4D mask per layer; unlike
  it, a mask pattern the kernel cannot express (or/and overlays, block-wise or chunked attention) is not
  dropped but handed on as the dense ``sdpa_mask``, so that those layers run SDPA; and a model that does not
  declare FlashAttention support (it may read the mask, or carry its pattern only there) gets the mask its own
  sdpa or eager path gets, whose plain patterns the attention reads back and runs on the kernel.
* ``sagebwd_attention_forward`` in ``AttentionInterface``: picks the kernel path the way
  ``_flash_attention_forward`` does (padding mask -> unpad + varlen; else ``cu_seq_lens_q/k`` -> varlen; else
  restarting ``position_ids`` -> varlen; else one dense call), and runs SDPA, with a one-time warning and a
  counter, for what the kernel cannot do; where such a call has a soft cap or sinks, which SDPA does not
  compute, PyTorch eager attention instead (``_eager_with_extras``).

Transformers' conventions kept here: causality from the ``is_causal`` kwarg, else ``module.is_causal``;
``sliding_window=W`` means a query sees W keys including itself, i.e. FlashAttention's
``window_size=(W-1, 0)`` (``(W-1, W-1)`` for bidirectional layers, as ``flash_attention_forward``);
causal masks align bottom-right when the query is shorter than the keys (decode with a KV cache).
"""
import collections
import sys
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers import masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from . import context_parallel, sdpa_flash
from .config import options_for
from .kernels import dispatch
from .interface import MAX_HEAD_DIM, _first_frame_outside_package, sagebwd_attn_func, sagebwd_attn_varlen_func
from .segments import per_tensor, segmented_attention
from .sinks import check_sinks, check_softcap

NAME = "sagebwd"
_HALF = (torch.float16, torch.bfloat16)

# ---------------------------------------------------------------------------------------------------
# What ran: counters and one-time warnings
# ---------------------------------------------------------------------------------------------------

# Plain Counters, updated only through _count (below), so that torch.compile neither traces nor guards them.
_kernel_calls = collections.Counter()    # path -> attention calls run by the SageBwd kernels
_fallback_calls = collections.Counter()  # reason -> attention calls run by SDPA instead
_warned = set()

FALLBACK_REASONS = {
    "dropout": "attention dropout > 0 in training (the kernel has no dropout)",
    "head_dim": f"a head dim the kernel does not take (q and k must share one; it and v's, a multiple of 8 up to "
                f"{MAX_HEAD_DIM})",
    "dtype": "q/k/v in a dtype other than float16, bfloat16 or float32",
    "mask_4d": "a 4D attention mask that is not a causal, bidirectional or sliding-window pattern over padded rows "
               "(a mask passed by the user, a pattern the kernel cannot express such as or_mask_function/"
               "and_mask_function overlays, block-wise attention, or chunked attention with padding, packing or a "
               "cache, or a mask the model edits itself), or any 4D mask under torch.compile",
    "position_bias": "an additive position_bias (T5-style relative attention)",
    "shape": "a causal query longer than its keys, or an empty tensor",
    "sparse_indices": "DeepSeek sparse attention's top-k keys (`indices`, DSA models such as deepseek_v32 and "
                      "glm_moe_dsa): the selected keys become a 4D mask",
}


def attention_stats() -> dict:
    """How many attention calls ran where since the last reset.

    Returns ``{"sagebwd": n, "paths": {path: n}, "fallback": {reason: n}}``: ``sagebwd`` counts calls run by
    the SageBwd kernels (``paths`` splits them: ``dense``, ``padding``, ``packed``, ``cu_seq_lens``; under
    torch.compile a batch with position_ids counts as ``dense_or_packed``, decided when it runs),
    ``fallback`` the calls that ran through SDPA, keyed by reason (see
    ``FALLBACK_REASONS``; under torch.compile both count each call site when dynamo traces it, not per run of the
    compiled model: once per compilation, again where a graph break makes dynamo trace a frame twice; the one-time
    warnings come then too, from dynamo's stack), and ``kernels`` which kernels ran each pass, counted per op call
    (under torch.compile too, but not in CUDA-graph replays), SageBwd's own API included (``fwd_gluon``/
    ``bwd_gluon``: the Hopper kernels, ``bwd_gluon_one_launch``: the Hopper backward in one launch, the default
    at head dim 64 unless ``SAGEBWD_BACKWARD=deterministic``; ``fwd_triton``/``bwd_triton``: the portable ones,
    ``*_naive``: the PyTorch path on CPU; ``kernels/dispatch.py`` says how the choice is made), and
    ``sdpa_flash`` the calls of torch's flash ops that SageBwd took or left while active behind SDPA
    (``sagebwd_hf.sdpa_flash.stats()``; ``paths["context_parallel"]`` counts this backend's calls sent there).
    """
    return {"sagebwd": sum(_kernel_calls.values()), "paths": dict(_kernel_calls),
            "fallback": dict(_fallback_calls), "kernels": dispatch.kernel_counts(), "sdpa_flash": sdpa_flash.stats()}


def reset_attention_stats() -> None:
    _kernel_calls.clear()
    _fallback_calls.clear()
    dispatch.reset_kernel_counts()
    sdpa_flash.reset_stats()


def _warn_once(key: str, message: str) -> None:
    if torch.compiler.is_compiling():
        if _comptime is not None:
            _comptime(_warn_traced)
    else:
        _warn_first(key, message)


def _count(counter: str, key: str) -> None:
    """One attention call: ``counter`` "kernel" (``key`` the path) or "fallback" (``key`` the reason). Under
    torch.compile the call is counted when dynamo traces it, once per compilation, not per run."""
    if torch.compiler.is_compiling():
        if _comptime is not None:
            _comptime(_count_traced)
    else:
        _bump(counter, key)


def _bump(counter: str, key: str) -> None:
    (_kernel_calls if counter == "kernel" else _fallback_calls)[key] += 1


def _warn_first(key: str, message: str, stacklevel: Optional[int] = None) -> None:
    """Warn once per key; the warning names the first frame outside this package (the model's attention call),
    or the caller ``stacklevel`` frames up."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=stacklevel or _first_frame_outside_package())


# What the two above do under torch.compile runs while dynamo traces them (torch._dynamo.comptime), not in the
# graph. A ``counter[key] += 1`` traced into the graph reads the count, so dynamo guarded the graph on its value:
# every call failed the guard and recompiled, and past dynamo's recompile limit (8) the model ran eager. (Dynamo's
# reorderable logging functions, called after each run of the graph, are dropped from inlined frames, which every
# attention call is.) Comptime functions take nothing from a closure: they read the caller's locals from ctx.
def _caller_constants(ctx, *names):
    """The caller's locals ``names`` as Python values, or None where one is computed from traced values (then
    nothing is counted or warned, rather than the compilation failing)."""
    try:
        return [ctx.get_local(name).as_python_constant() for name in names]
    except NotImplementedError:
        return None


def _count_traced(ctx) -> None:
    args = _caller_constants(ctx, "counter", "key")
    if args is not None:
        _bump(*args)


def _warn_traced(ctx) -> None:
    args = _caller_constants(ctx, "key", "message")
    if args is not None:
        _warn_first(*args, stacklevel=3)


try:
    from torch._dynamo.comptime import comptime as _comptime
except ImportError:     # (a torch without it: nothing is counted or warned under torch.compile)
    _comptime = None


# ---------------------------------------------------------------------------------------------------
# The mask function
# ---------------------------------------------------------------------------------------------------
# flash_attention_mask ignores ``mask_function``: whatever pattern a model asked for, the layers only see the
# padding. Here patterns beyond causal / bidirectional / sliding window / packed sequences are detected and
# handed on as the dense SDPA mask, so that those layers run SDPA instead of silently losing the pattern.

def _code_of(factory, *args):
    try:
        return factory(*args).__code__
    except Exception:   # a Transformers version without this building block
        return None


_AND_CODE = _code_of(masking_utils.and_masks, masking_utils.causal_mask_function)
_OR_CODE = _code_of(masking_utils.or_masks, masking_utils.causal_mask_function)
_REMAP_CODE = _code_of(getattr(masking_utils, "remap_positions_for_packed_sequence", None),
                       masking_utils.causal_mask_function, None)
# Building blocks the kernel expresses: the window and the sequence boundaries reach the attention function
# as the ``sliding_window`` kwarg and through position_ids / cu_seq_lens, as for FlashAttention.
_KNOWN_FUNCTIONS = (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)
_KNOWN_CODES = tuple(c for c in (
    _code_of(masking_utils.sliding_window_overlay, 1),
    _code_of(getattr(masking_utils, "sliding_window_bidirectional_overlay", None), 1),
    _code_of(masking_utils.packed_sequence_mask_function, None)) if c is not None)


_CHUNK_CODE = _code_of(getattr(masking_utils, "chunked_overlay", None), 1, None)
_PACKED_CODE = _code_of(masking_utils.packed_sequence_mask_function, None)
CHUNK_IDS_DTYPE = torch.int32   # sagebwd_mask's chunk ids [B, N]; padding masks are bool, user masks int64


def _mask_parts(mask_function):
    """Eager: walk the and_masks tree of ``mask_function`` (through the closures masking_utils builds) and
    accept only known building blocks. Returns None for anything else (a Transformers version whose blocks look
    different lands on the safe side: SDPA), else ``(chunk_size, left_padding)`` of a chunked-attention overlay,
    or ``(None, None)`` without one. This is the one place that reads masking_utils' internals."""
    stack, chunk, packed = [mask_function], (None, None), False
    try:
        while stack:
            fn = stack.pop()
            if fn in _KNOWN_FUNCTIONS:
                continue
            code = getattr(fn, "__code__", None)
            if code is _AND_CODE:
                stack.extend(fn.__closure__[code.co_freevars.index("mask_functions")].cell_contents)
            elif code is _REMAP_CODE:   # packed sequences (5.2x): positions counted per sequence
                stack.append(fn.__closure__[code.co_freevars.index("mask_function")].cell_contents)
                packed = True
            elif code is not None and code is _CHUNK_CODE and chunk[0] is None:   # Llama 4's chunked layers
                cells = {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__)}
                chunk = (int(cells["chunk_size"]), cells["left_padding"])
            elif code is None or code not in _KNOWN_CODES:
                return None
            packed = packed or code is _PACKED_CODE
        # chunks inside packed sequences: the chunk boundaries would need each sequence's start (dense mask)
        return None if packed and chunk[0] is not None else chunk
    except (AttributeError, ValueError, IndexError, TypeError, KeyError):
        return None


def _expressible(mask_function) -> bool:
    parts = _mask_parts(mask_function)
    return parts is not None and parts[0] is None


def _chunk_ids(chunk_size, left_padding, batch, q_len, kv_len, q_offset, kv_offset, attention_mask, device):
    """Chunked attention as the kernel runs it: each chunk of ``chunk_size`` tokens a sequence of its own (the
    packed path, causal inside), given as chunk ids ``[B, N]`` (``CHUNK_IDS_DTYPE``). Only self-attention
    without a cache and without padding; None otherwise (the dense 4D mask then)."""
    if isinstance(q_offset, torch.Tensor) or q_offset != 0 or kv_offset != 0 or q_len != kv_len:
        return None
    if left_padding is not None and bool((left_padding != 0).any()):
        return None
    if attention_mask is not None and not bool(attention_mask[:, -kv_len:].bool().all()):
        return None
    ids = (torch.arange(kv_len, device=device) // chunk_size).to(CHUNK_IDS_DTYPE)
    return ids[None].expand(batch, -1)


def _whole_chunks(ids) -> Optional[int]:
    """The chunk size when every row of chunk ids ``[B, N]`` is whole chunks of one size: the chunks are then the
    rows of a padded batch (``[B, N, H, D]`` viewed as ``[B * N / size, size, H, D]``), the plain causal call.
    None otherwise: a shorter last chunk (Llama 4 on rows that the chunk size does not divide) runs the packed
    path, which measured faster than whole chunks padded plus the last as one more call (H100, 20K-token rows in
    chunks of 8K, fwd+bwd per FLOP against the plain call: 0.93-0.96 packed, 0.77-0.86 split; 2026-11,
    docs/history.md). Reads the ids on the host (once per forward: per_tensor)."""
    row = ids[0].cpu()
    size = int((row == 0).sum())
    if size == 0 or row.numel() % size:
        return None
    chunked = torch.equal(row, torch.arange(row.numel(), dtype=row.dtype) // size) and bool((ids == ids[:1]).all())
    return size if chunked else None


def _chunked_dense(q, k, v, size, op):
    """Attention inside whole chunks of ``size`` tokens of ``[B, N, H, D]`` rows (``_whole_chunks``): one padded
    batch of chunks, a view of the rows."""
    rows = (x.reshape(-1, size, *x.shape[2:]) for x in (q, k, v))
    return _dense(*rows, op).reshape(*q.shape[:3], -1)


def _expressible_compiled(mask_function, kwargs) -> bool:
    """Under torch.compile, dynamo cannot read closures: decide from what the mask creators pass instead.
    ``use_vmap`` is set exactly when a model adds or_mask_function/and_mask_function; block-wise overlays make
    an or_masks at the top; chunked layers pass their chunk size as ``local_size``."""
    if kwargs.get("use_vmap", False) or getattr(mask_function, "__code__", None) is _OR_CODE:
        return False
    config, local_size = kwargs.get("config"), kwargs.get("local_size")
    chunk = getattr(config, "attention_chunk_size", None)
    return not (local_size is not None and chunk is not None and local_size == chunk
                and local_size != getattr(config, "sliding_window", None))


@torch.compiler.assume_constant_result
def _declared_support(config_class) -> tuple:
    """``(flash, sdpa)``: whether the models built on ``config``'s class declare FlashAttention / SDPA support
    (``_supports_flash_attn`` / ``_supports_sdpa`` of the ``PreTrainedModel`` classes in the modeling module
    beside the configuration module); it takes the config's class, which torch.compile treats as a constant.
    FlashAttention support is the promise that a layer's pattern reaches the attention through ``is_causal`` /
    ``sliding_window`` and that the model never reads the mask: what ``sagebwd_mask``'s None or 2D mask needs.
    ``(True, True)`` when no such class is found (a config without its modeling module loaded), as before this
    check."""
    key = config_class
    if key is type(None):
        return True, True
    if key not in _SUPPORT:
        module = sys.modules.get(key.__module__.replace(".configuration_", ".modeling_"))
        models = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
                  and getattr(c, "config_class", None) is key] if module is not None else []
        _SUPPORT[key] = ((all(getattr(c, "_supports_flash_attn", False) or getattr(c, "_supports_flash_attn_2", False)
                              for c in models), all(getattr(c, "_supports_sdpa", False) for c in models))
                         if models else (True, True))
    return _SUPPORT[key]


_SUPPORT = {}   # config class -> (flash, sdpa)


def sagebwd_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=masking_utils.causal_mask_function, attention_mask: Optional[torch.Tensor] = None,
                 **kwargs):
    """``AttentionMaskInterface`` entry for ``"sagebwd"``, as ``flash_attention_mask``. Returns ``None`` (no
    padding: causality, windows and packing come from the layer's kwargs), a 2D bool padding mask
    ``[batch, kv_len]`` (True = real token) that the attention turns into varlen, chunk ids ``[batch, kv_len]``
    (``CHUNK_IDS_DTYPE``) for chunked attention, which it runs as packed sequences, or, for a pattern the
    kernel cannot express (or a model that reads the mask itself), the dense 4D ``sdpa_mask`` (SDPA then)."""
    compiling = torch.compiler.is_compiling()
    if compiling:
        expressible = _expressible_compiled(mask_function, kwargs)
    else:   # one walk of the mask's building blocks: chunked attention, or a pattern the kernel expresses
        chunk_size, left_padding = _mask_parts(mask_function) or (False, None)
        if chunk_size:
            ids = _chunk_ids(chunk_size, left_padding, batch_size, q_length, kv_length, q_offset, kv_offset,
                             attention_mask, kwargs.get("device", "cpu"))
            if ids is not None:
                return ids
        expressible = chunk_size is None
    mask_args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask)
    # A model that does not declare FlashAttention support may read the mask, or carry its pattern only there
    # (a decoder layer built without is_causal, a window no kwarg names); DeepSeek sparse attention (a config
    # with index_topk) reads it (its indexer takes attention_mask[:, 0]). These get the mask their own sdpa or
    # eager implementation gets, as does a pattern the kernel cannot express (materialized, so that it is kept);
    # the attention function reads plain patterns back from it (_as_kernel_pattern).
    flash, sdpa = _declared_support(type(kwargs.get("config")))
    keep_pattern = getattr(kwargs.get("config"), "index_topk", None) is not None or not expressible
    if keep_pattern:
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    if keep_pattern or not flash:
        if sdpa or flash:
            return masking_utils.sdpa_mask(**mask_args, **kwargs)
        kwargs.pop("allow_is_causal_skip", None)     # eager_mask sets it
        return masking_utils.eager_mask(**mask_args, **kwargs)
    if attention_mask is None:
        # A static cache hands every layer all its slots, written or not (q_offset is then a tensor): mark the
        # unwritten ones, or the kernel's bottom-right causal alignment would put the queries at the end.
        if isinstance(q_offset, torch.Tensor) or q_offset + q_length < kv_offset + kv_length:
            slots = torch.arange(kv_length, device=kwargs.get("device", "cpu")) + kv_offset
            return (slots < q_offset + q_length)[None].expand(batch_size, -1)
        return None
    # The last kv_length entries (sliding caches); an all-ones mask is dropped. Under torch.compile reading
    # the mask would break the graph: the attention function checks it in-graph instead.
    attention_mask = attention_mask[:, -kv_length:].bool()
    if not compiling and attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


# ---------------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------------

def _window(sliding_window: Optional[int], causal: bool):
    if sliding_window is None:
        return (-1, -1)
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return (sliding_window - 1, 0) if causal else (sliding_window - 1, sliding_window - 1)


def _compute_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype:
    """As flash_attention's get_target_dtype: float32 q/k/v (PEFT upcasts, autocast) run in the model's
    compute dtype. A model that is float32 throughout runs the attention in bfloat16."""
    if query.dtype in _HALF:
        return query.dtype
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) in _HALF:
        return torch.get_autocast_dtype(device_type)
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            if layer.weight.dtype in _HALF:
                return layer.weight.dtype
            break
    _warn_once("fp32", "sagebwd: float32 attention inputs in a float32 model are computed in bfloat16 (INT8 "
                       "attention has no float32 path); outputs and gradients are returned in float32.")
    return torch.bfloat16


# Keyword arguments that reach attention functions and do not change what they compute, or that this adapter
# reads (Trainer's num_items_in_batch, the loss's token count, reaches every call); a tensor under any other name
# may be one that the model's own attention uses and SDPA, FlashAttention and sagebwd all ignore: a one-time
# warning names it.
KNOWN_KWARGS = frozenset({
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cache_position",
    "use_cache", "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "labels",
    "logits_to_keep", "token_type_ids", "indices", "position_bias", "past_key_values", "past_key_value",
    "position_embeddings", "layer_idx", "cache", "is_causal", "sliding_window", "softcap", "s_aux", "sinks",
    "dropout", "scaling", "target_dtype", "num_items_in_batch"})


def _warn_unknown(kwargs) -> None:
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name not in KNOWN_KWARGS:
            _warn_once("kwarg:" + name, f"sagebwd: the attention call got `{name}=` (a tensor), which sagebwd does "
                                        f"not read (nor do SDPA and FlashAttention); if the model's own attention "
                                        f"uses it, use attn_implementation='eager' for this model.")


def _fallback_reason(query, key, value, attention_mask, dropout, kwargs) -> Optional[str]:
    if dropout and dropout > 0:
        return "dropout"
    if key.shape[-1] != query.shape[-1] or not all(
            d % 8 == 0 and 8 <= d <= MAX_HEAD_DIM for d in (query.shape[-1], value.shape[-1])):
        return "head_dim"
    if any(x.dtype not in _HALF + (torch.float32,) for x in (query, key, value)):
        return "dtype"
    if attention_mask is not None and attention_mask.dim() == 4:
        return "mask_4d"
    if kwargs.get("position_bias") is not None:
        return "position_bias"
    if query.numel() == 0 or key.numel() == 0:
        return "shape"
    return None


def _check_score_extras(softcap, s_aux, query) -> None:
    """What this call adds to the softmax, checked before any path takes it (a clear error on bad values)."""
    if softcap is not None:
        check_softcap(softcap)
    if s_aux is not None:
        check_sinks(s_aux, query.shape[1], query.device)


def _query_positions(q_len, kv_len, padding, device):
    """Each query's position among the keys ``[B or 1, q]``, as the kernel paths align them: bottom-right,
    or with a cache and padding, ending at each row's last real key (see segments.query_rows)."""
    if padding is not None and q_len != kv_len:
        keys = torch.arange(kv_len, device=device)
        end = (padding * (keys + 1)).amax(1, keepdim=True)                    # [B, 1]
    else:
        end = torch.full((1, 1), kv_len, device=device)
    return end - q_len + torch.arange(q_len, device=device)


def _dense_mask(batch, q_len, kv_len, causal, window, padding, segments, device):
    """The bool ``[B, 1, q, kv]`` mask meaning what the kernel path computes (for SDPA fallbacks)."""
    keys = torch.arange(kv_len, device=device, dtype=torch.int32)
    if padding is not None and padding.shape[1] < kv_len:   # static cache: slots after the mask are unwritten
        padding = F.pad(padding, (0, kv_len - padding.shape[1]), value=False)
    q_pos = _query_positions(q_len, kv_len, padding, device).to(torch.int32)
    dist = q_pos[:, :, None] - keys                                            # [B or 1, q, kv]
    mask = torch.ones_like(dist, dtype=torch.bool)
    left, right = window
    if causal:
        mask = mask & (dist >= 0)
    if left >= 0:
        mask = mask & (dist <= left)
    if right >= 0:
        mask = mask & (dist >= -right)
    mask = mask[:, None].expand(batch, 1, q_len, kv_len)
    if padding is not None:
        mask = mask & padding[:, None, None, :]
    if segments is not None:
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    return mask


def _as_kernel_pattern(mask, batch, q_len, kv_len):
    """``(causal, window, padding)`` that the kernel runs exactly as the 4D ``mask`` (bool, or additive with
    nothing but 0 and "masked" values), or None. ``padding`` is a 2D bool mask, or None for none.

    What sagebwd_mask hands a model that does not declare FlashAttention support, and a 4D mask a user passes,
    may still be a plain causal, bidirectional or sliding-window pattern over padded rows: read it back (the
    extent each query sees decides causal and window) and keep it only where ``_dense_mask`` of the result
    equals the mask entry for entry. Eager only: under torch.compile this would break the graph."""
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        masked = mask <= torch.finfo(mask.dtype).min / 2                       # -inf, or min_dtype
        if not bool(((mask == 0) | masked).all()):
            return None                                                       # a bias: not a pattern
        keep = ~masked
    else:
        return None
    if keep.shape[0] not in (1, batch) or keep.shape[2] not in (1, q_len) or keep.shape[3] != kv_len:
        return None
    if keep.shape[1] > 1:
        if not bool((keep == keep[:, :1]).all()):
            return None                                                       # per-head patterns
        keep = keep[:, :1]
    keep = keep.expand(batch, 1, q_len, kv_len)
    padding = keep.any(2)[:, 0]                                               # a key no query sees: padding
    rows = keep[:, 0].any(-1)                                                 # queries that see a key
    if not bool(rows.any()):
        return None
    full = bool(padding.all())
    padding = None if full else padding
    # each query's first and last key, against its position: how far left and right any query sees
    as_int = keep[:, 0].to(torch.uint8)
    first = as_int.argmax(-1)
    last = kv_len - 1 - as_int.flip(-1).argmax(-1)
    q_pos = _query_positions(q_len, kv_len, padding, mask.device)
    left = int(torch.where(rows, q_pos - first, -kv_len).max())
    right = int(torch.where(rows, last - q_pos, -kv_len).max())
    causal = right <= 0
    left = -1 if left >= kv_len - 1 else left
    window = (-1, -1) if causal and left < 0 else (left, 0) if causal else (left, -1 if right >= kv_len - 1 else right)
    if padding is not None and window != (-1, -1):
        # the padded path counts distances among real tokens: a window needs each row's tokens in one run
        real = padding.sum(1)
        span = kv_len - padding.int().argmax(1) - padding.int().flip(1).argmax(1)
        if not bool((real == span).all()):
            return None
    if not torch.equal(_dense_mask(batch, q_len, kv_len, causal, window, padding, None, mask.device), keep):
        return None
    return causal, window, padding


def _sdpa(module, query, key, value, mask, dropout, scaling, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k != "is_causal"}
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                  is_causal=False, **kwargs)[0]


def _sequence_ids(batch, q_len, kv_len, kwargs, check, position_ids=True):
    """Per-token sequence ids ``[B, N]`` of a packed batch, from cu_seq_lens_q/k or (``position_ids``: the
    packed_position_ids option) restarting position_ids (a new sequence wherever they do not step by one, as
    masking_utils.find_packed_sequence_indices), or None. ``check`` reads the ids on the host and returns None
    when nothing restarts (eager only)."""
    if q_len != kv_len or q_len < 2:
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and kwargs.get("max_length_q") is not None:
        if batch * q_len != int(cu_q[-1]) or not torch.equal(cu_q, cu_k):
            raise ValueError("sagebwd: cu_seq_lens_q/k must be equal and cover the flattened batch in self-attention")
        index = torch.arange(batch * q_len, device=cu_q.device)
        return torch.searchsorted(cu_q[1:].to(index.dtype), index, right=True).view(batch, q_len)
    position_ids = kwargs.get("position_ids") if position_ids else None
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != q_len:
        return None

    def from_positions(position_ids):
        position_ids = position_ids.expand(batch, -1)
        diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
        ids = (diff != 1).cumsum(-1)
        return ids if not check or bool((ids[:, -1] != 0).any()) else None

    if not check:
        return from_positions(position_ids)
    return per_tensor(f"position_ids:{batch}", position_ids, from_positions)


def _with_selected_keys(mask, indices, batch, q_len, kv_len, causal, window, device):
    """A bool 4D mask ``[B, 1, q, kv]`` keeping only the keys ``indices`` ``[B, q, topk]`` selects, within
    ``mask`` (4D bool or additive; a 2D padding mask or None: the pattern the kernel path would compute)."""
    selected = torch.zeros(batch, q_len, kv_len, dtype=torch.bool, device=device)
    selected = selected.scatter(-1, indices.long(), True)[:, None]
    if mask is None or mask.dim() == 2:
        mask = _dense_mask(batch, q_len, kv_len, causal, window, mask, None, device)
    elif mask.dtype != torch.bool:
        mask = mask == 0                      # additive: 0 where a key is seen
    return mask & selected


def _eager_with_extras(module, query, key, value, mask, dropout, scaling, softcap, s_aux, position_bias=None):
    """Attention with what SDPA does not compute, a soft cap and sinks, in plain PyTorch as the models' own eager
    code computes them (Gemma 2: the cap on the scaled scores before the mask; gpt-oss: the sink a logit of the
    softmax, dropped after it; softmax in float32). ``mask``: bool (True: attend) or additive, [B or 1, 1 or H,
    q, >= kv]; ``position_bias`` added to the scores as SDPA's fallback adds it. Rows that see no key and no sink
    give zeros. Returns ``[B, q, H, Dv]``, as _sdpa."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)).float() * (scaling if scaling is not None
                                                                  else query.shape[-1] ** -0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias.float()
    if mask is not None:
        mask = mask[..., :key.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if s_aux is not None:
        sink = s_aux.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    top = scores.amax(dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(torch.isfinite(top), top, 0.0))    # a row of -inf only: zeros
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if s_aux is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs.to(query.dtype), p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def _sdpa_fallback(reason, module, query, key, value, attention_mask, dropout, scaling, causal, window,
                   kwargs, segments=None, softcap=None, s_aux=None):
    """The call through SDPA, or, where it has a soft cap or sinks that SDPA does not compute, through
    _eager_with_extras (either way counted under ``reason`` in attention_stats()["fallback"])."""
    _count("fallback", reason)
    eager = bool(softcap) or s_aux is not None
    _warn_once("fallback:" + reason + (":eager" if eager else ""),
               f"sagebwd: {FALLBACK_REASONS[reason]}: this attention call runs through "
               f"{'PyTorch eager attention (SDPA has no soft cap or sinks)' if eager else 'SDPA'} instead "
               f"(counted in sagebwd_hf.attention_stats()).")
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask
    else:   # the same pattern the kernel path would have computed, packed sequences (or chunks) included
        if segments is None and attention_mask is None:
            segments = _sequence_ids(batch, q_len, kv_len, kwargs, check=not torch.compiler.is_compiling(),
                                     position_ids=options_for(module).packed_position_ids)
        mask = _dense_mask(batch, q_len, kv_len, causal, window, attention_mask, segments, query.device)
    if eager:
        return _eager_with_extras(module, query, key, value, mask, dropout, scaling, softcap, s_aux,
                                  kwargs.get("position_bias"))
    return _sdpa(module, query, key, value, mask, dropout, scaling, kwargs)


# --- kernel paths: every one takes [B, N, H, D] views (any strides) and returns [B, N, H, D] -------------
# ``op``: the keyword arguments of every kernel call of one attention call (causal, softmax_scale,
# window_size and the layer's options).

def _dense(q, k, v, op):
    """No padding, no packing: one call on the padded layout."""
    out = sagebwd_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **op)
    return out.transpose(1, 2)     # the op writes [B, N, H, D]: this is contiguous


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, op):
    """The batch flattened into one packed run of tokens, cut by cu_seqlens (reshape copies a strided view)."""
    flat = lambda x: x.reshape(-1, x.shape[-2], x.shape[-1])  # noqa: E731
    return sagebwd_attn_varlen_func(flat(q), flat(k), flat(v), cu_q, cu_k, max_q, max_k, **op).view(
        *q.shape[:-1], v.shape[-1])


# Padding masks and packed sequence ids go to segmented_attention (sagebwd_hf/segments.py): the real tokens
# gathered into one varlen call and scattered back, inside one custom op whose shapes do not depend on the
# data, so that eager and torch.compile'd models run the same path without a graph break.

def sagebwd_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                              scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                              sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                              s_aux: Optional[torch.Tensor] = None, **kwargs):
    """``AttentionInterface`` entry for ``"sagebwd"``: query ``[B, Hq, S, D]``, key/value ``[B, Hkv, Skv, D]``
    (KV heads not repeated). Returns ``(out [B, S, Hq, D], None)``."""
    # What neither the kernel nor SDPA computes: a fallback would be silently wrong, so refuse.
    if kwargs.get("output_attentions", False):
        raise ValueError("output_attentions=True needs the attention weights, which sagebwd never forms: use "
                         "attn_implementation='eager' for that call.")
    if kwargs.get("cache") is not None:
        raise NotImplementedError("sagebwd does not support continuous batching (a paged KV cache).")
    sinks = kwargs.pop("sinks", None)
    if sinks is not None:
        # Some models name the sinks ``sinks``: one logit per head is s_aux under another name; anything else
        # (a sink per query, [B, H, S, 1]) neither the kernel nor SDPA computes.
        if s_aux is None and sinks.dim() == 1:
            s_aux = sinks
        else:
            raise ValueError(f"sagebwd: sinks of shape {tuple(sinks.shape)} (one logit per query) are not computed "
                             f"by the kernel or by SDPA; sagebwd takes one sink logit per head (s_aux or sinks of "
                             f"shape [{query.shape[1]}]): use attn_implementation='eager' for this model.")
    _warn_unknown(kwargs)
    if attention_mask is not None and attention_mask.dim() not in (2, 4):
        raise ValueError(f"sagebwd: attention_mask must be None, a 2D padding mask from the 'sagebwd' mask "
                         f"function or a 4D mask; got shape {tuple(attention_mask.shape)}")

    chunks = None
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype == CHUNK_IDS_DTYPE:
        chunks, attention_mask = attention_mask, None   # chunked attention: chunk ids from sagebwd_mask
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _window(sliding_window, causal)
    if context_parallel.active():      # the sequence is sharded over GPUs: only SDPA's ring attention sees all of it
        _count("kernel", "context_parallel")
        return context_parallel.ring_attention(query, key, value, attention_mask, dropout, scaling, causal, window,
                                               softcap, s_aux), None
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    mask = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2 else attention_mask
    if mask is not None and mask.dim() == 4 and not torch.compiler.is_compiling():
        pattern = per_tensor(f"pattern:{batch}:{q_len}:{kv_len}", mask,
                             lambda m: _as_kernel_pattern(m, batch, q_len, kv_len))   # once per forward
        if pattern is not None:          # the mask says which pattern: it, not the layer's kwargs, decides
            causal, window, mask = pattern
    _check_score_extras(softcap, s_aux, query)
    reason = "sparse_indices" if kwargs.get("indices") is not None else _fallback_reason(
        query, key, value, mask, dropout, kwargs)
    if reason is None and causal and q_len > kv_len:
        reason = "shape"
    # SDPA has neither a soft cap nor sinks: such a call's fallback is eager attention, which has both
    eager = dict(softcap=softcap, s_aux=s_aux)
    if reason == "sparse_indices":
        # DeepSeek sparse attention hands backends that are not eager/sdpa its top-k keys per query and leaves
        # them out of the mask (a sparse MLA kernel would consume them; flash_attention_2 ignores them): fold
        # them into the mask, as the model's eager path does, and let SDPA run it.
        mask = _with_selected_keys(mask, kwargs["indices"], batch, q_len, kv_len, causal, window, query.device)
        kwargs = {k: v for k, v in kwargs.items() if k != "indices"}
        return _sdpa_fallback("sparse_indices", module, query, key, value, mask, dropout, scaling, causal, window,
                              kwargs, **eager), None
    if reason is not None:
        out = _sdpa_fallback(reason, module, query, key, value, mask, dropout, scaling, causal, window, kwargs,
                             segments=chunks, **eager)
        return out, None

    out_dtype = query.dtype
    dtype = _compute_dtype(query, module)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    # plus this layer's k_smoothing / q_smoothing (sagebwd_hf.configure: global, per model, per layer)
    options = options_for(module)
    op = dict(causal=causal, softmax_scale=scale, window_size=window, **options.op_kwargs(),
              softcap=float(softcap or 0.0), sinks=s_aux)
    # [B, N, H, D]: the layout of Transformers' projections and of the output it expects. Views: the dense
    # kernels read any strides, and the varlen paths copy only the tokens they gather.
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (query, key, value))
    compiling = torch.compiler.is_compiling()

    if chunks is not None:                                      # 0. chunked attention: chunks as sequences
        _count("kernel", "chunked")
        size = None if compiling else per_tensor(f"chunks:{batch}:{kv_len}", chunks, _whole_chunks)
        if size:   # whole chunks of one size: a padded batch of chunks, the plain causal call
            out = _chunked_dense(q, k, v, size, op)
        else:      # another pattern, or under torch.compile: the sequences of a packed batch
            out = segmented_attention(q, k, v, None, chunks, **op)
    elif mask is not None:                                      # 1. padding (precedes packing, as flash)
        _count("kernel", "padding")
        out = segmented_attention(q, k, v, mask, None, **op)
    elif all(kwargs.get(n) is not None for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                 "max_length_k")):   # 2. packed, lengths given
        _count("kernel", "cu_seq_lens")
        out = _varlen(q, k, v, kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
                      int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), op)
    else:                                                       # 3. packed by position_ids, else dense
        # Eager reads the ids once per forward and runs a batch without restarts as one dense call; under
        # torch.compile that read would break the graph, so the op decides when it runs.
        ids = _sequence_ids(batch, q_len, kv_len, kwargs, check=not compiling,
                            position_ids=options.packed_position_ids)
        if ids is None:
            _count("kernel", "dense")
            out = _dense(q, k, v, op)
        else:
            _count("kernel", "dense_or_packed" if compiling else "packed")
            out = segmented_attention(q, k, v, None, ids, **op)
    return out.to(out_dtype), None


def register() -> None:
    """Register ``"sagebwd"`` with Transformers (done by ``import sagebwd_hf``)."""
    AttentionInterface.register(NAME, sagebwd_attention_forward)
    AttentionMaskInterface.register(NAME, sagebwd_mask)


register()
