"""QK-norm for models whose attention lacks it, and a check of a training setup against the paper.

SageBwd's pre-training results (arXiv 2603.02170, a 325M Llama): INT8 attention matches full precision at
260K tokens per optimizer step, but at 2.1M tokens per step it diverges unless the model has QK-norm
(per-head RMSNorm on q and k). ``add_qk_norm(model)`` adds it exactly where Qwen3 has it::

    q = q_norm(q_proj(h).view(*shape, -1, head_dim))     # then transpose, then RoPE
    k = k_norm(k_proj(h).view(*shape, -1, head_dim))

RMSNorm over ``head_dim`` with a learnable gain initialised to 1 (shared by the heads of a layer), eps from
``config.rms_norm_eps``. The norms are registered on each attention module as ``q_norm`` / ``k_norm`` (the
state-dict names Qwen3 uses: ``model.layers.0.self_attn.q_norm.weight``) and applied by a forward hook on the
projection's output: the model's own forward is untouched. The hook follows whatever module is
``attn.q_proj`` at call time, so a PEFT LoRA wrapper (``q_proj.base_layer`` = the original Linear) gets the
norm applied to its full output, base + LoRA delta, whichever of ``add_qk_norm`` / ``get_peft_model`` ran
first.

Saving and loading: ``save_pretrained`` writes the gains and records ``sagebwd_qk_norm = {"eps": ...}`` in
config.json; ``load_with_qk_norm(path, **from_pretrained_kwargs)`` rebuilds the norms before the weights are
loaded, so the gains come back exactly. (A plain ``from_pretrained`` drops them as unexpected keys;
``check_training_setup`` then reports it.)

PEFT: norms added before ``get_peft_model`` are frozen by PEFT like every base weight; to train them and save
them with the adapter, list them in ``LoraConfig(modules_to_save=["q_norm", "k_norm"])``. Norms added after
``get_peft_model`` keep ``trainable`` (then they are saved by a full ``save_pretrained`` of the merged model,
not in the adapter file).
"""
import dataclasses
import logging
import warnings
from typing import List, Optional

import torch
from torch import nn

from .config import options_for

logger = logging.getLogger(__name__)

RECORD_ATTR = "sagebwd_qk_norm"
# Tokens per optimizer step above which check_training_setup asks for QK-norm. The paper trains fine at
# 260K (2^18) tokens per step and diverges at 2.1M (2^21) without QK-norm; nothing in between was tested.
# 2^19 = 524,288 is the first power of two above the tested-safe setting: conservative, as QK-norm is cheap.
# Our own study (docs/fidelity.md: 60M Llama, 2^16 and 2^20) saw no departure at 2^20 within 84M tokens: too
# short to show a late divergence, so it neither confirms nor moves the threshold.
QK_NORM_TOKENS_THRESHOLD = 2 ** 19
# Attribute names under which models keep a QK-norm of their own (Qwen3, Gemma3, OLMo2, Cohere: q_norm/
# k_norm; Persimmon, StableLM: q_layernorm/k_layernorm; Llama4: qk_norm).
NATIVE_QK_NORM_ATTRS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "qk_norm", "query_norm", "key_norm")


class QKRMSNorm(nn.Module):
    """RMSNorm over the last dim (the head dim) with a learnable gain, the same arithmetic as Qwen3RMSNorm:
    normalise in float32, cast back to the input dtype, then multiply by the gain."""

    def __init__(self, head_dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class _ProjectionNorm:
    """Forward hook on ``attn.q_proj`` / ``attn.k_proj``: ``out -> attn.<norm>(out per head)``.

    Active only while the hooked module *is* ``attn.<proj>``: once PEFT wraps the projection, the original
    Linear becomes ``base_layer`` and its hook steps aside for the wrapper's (the full LoRA output)."""

    def __init__(self, attn: nn.Module, proj: str, norm: str):
        self.attn, self.proj, self.norm = attn, proj, norm

    def __call__(self, module, args, output):
        attn = self.attn
        if getattr(attn, self.proj) is not module:
            return output
        shape = output.shape
        return getattr(attn, self.norm)(output.view(*shape[:-1], -1, attn.head_dim)).view(shape)


class _FollowProjections:
    """Forward pre-hook on the attention module: makes sure the modules that are ``q_proj`` / ``k_proj`` now
    (after PEFT wrapped or unwrapped them) carry the norm hook, exactly once."""

    def __init__(self, attn: nn.Module):
        self.attn = attn
        self.hooked = {"q_proj": None, "k_proj": None}

    def sync(self):
        for proj, norm in (("q_proj", "q_norm"), ("k_proj", "k_norm")):
            current = getattr(self.attn, proj)
            if current is self.hooked[proj]:
                continue
            if not any(isinstance(h, _ProjectionNorm) and h.attn is self.attn and h.proj == proj
                       for h in current._forward_hooks.values()):
                current.register_forward_hook(_ProjectionNorm(self.attn, proj, norm))
            self.hooked[proj] = current

    def __call__(self, module, args):
        self.sync()


def _follower(attn: nn.Module) -> Optional[_FollowProjections]:
    for hook in attn._forward_pre_hooks.values():
        if isinstance(hook, _FollowProjections):
            return hook
    return None


def _attention_modules(model: nn.Module):
    """(name, module) of attention modules with separate q/k projections and a head dim."""
    found = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "q_proj", None), nn.Module) and isinstance(
                getattr(module, "k_proj", None), nn.Module) and hasattr(module, "head_dim"):
            found.append((name, module))
    return found


def _native_qk_norm(attn: nn.Module) -> Optional[str]:
    """The attribute of the model's own QK-norm on ``attn`` (None if none, or if it is ours)."""
    if _follower(attn) is not None:
        return None
    for attr in NATIVE_QK_NORM_ATTRS:
        if isinstance(getattr(attn, attr, None), nn.Module):
            return attr
    return None


def _configs(model: nn.Module):
    from .config import _is_config
    seen = []
    for cfg in [getattr(model, "config", None)] + [getattr(m, "config", None) for _, m in _attention_modules(model)]:
        if _is_config(cfg) and not any(cfg is c for c in seen):
            seen.append(cfg)
    return seen


def _default_eps(model: nn.Module, attn: nn.Module) -> float:
    for cfg in (getattr(attn, "config", None), getattr(model, "config", None)):
        eps = getattr(cfg, "rms_norm_eps", None) if cfg is not None else None
        if eps is None and cfg is not None and hasattr(cfg, "get_text_config"):
            eps = getattr(cfg.get_text_config(), "rms_norm_eps", None)
        if eps is not None:
            return float(eps)
    return 1e-6


def _float_param(module: nn.Module):
    for p in module.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    p = next(module.parameters(), None)
    return (p.device if p is not None else None), torch.get_default_dtype()


def has_qk_norm(model: nn.Module) -> bool:
    """True when every attention module of ``model`` has a QK-norm (its own, or one from ``add_qk_norm``)."""
    attns = _attention_modules(model)
    return bool(attns) and all(_follower(a) is not None or _native_qk_norm(a) for _, a in attns)


def qk_norm_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The gains added by ``add_qk_norm`` (e.g. to freeze them: ``p.requires_grad_(False)``)."""
    return [p for _, attn in _attention_modules(model) if _follower(attn) is not None
            for norm in ("q_norm", "k_norm") for p in getattr(attn, norm).parameters()]


def add_qk_norm(model: nn.Module, eps: Optional[float] = None, trainable: bool = True) -> nn.Module:
    """Add Qwen3-style QK-norm (per-head RMSNorm on q and k, learnable gain initialised to 1, after the q/k
    projections and before RoPE) to every attention module of ``model`` that has ``q_proj``, ``k_proj`` and
    ``head_dim`` (Llama, Mistral, Qwen2, ...). Returns ``model``.

    Args:
        eps: the RMSNorm epsilon; default ``config.rms_norm_eps`` (1e-6 if the config has none).
        trainable: ``requires_grad`` of the new gains.

    A model with a QK-norm of its own (Qwen3, Gemma3, OLMo2, ...) is left alone, with a log message.
    Idempotent: layers that already got the norm from an earlier call are not touched (no new weights, no
    second hook, ``eps`` and ``trainable`` unchanged). Records ``{"eps": eps}`` as ``config.sagebwd_qk_norm``
    so that ``load_with_qk_norm`` can rebuild the norms when the saved model is loaded.
    """
    return _add_qk_norm(model, eps, trainable, loading=False)


def _add_qk_norm(model: nn.Module, eps: Optional[float], trainable: bool, loading: bool) -> nn.Module:
    attns = _attention_modules(model)
    if not attns:
        raise ValueError(f"add_qk_norm: {type(model).__name__} has no attention module with q_proj, k_proj and "
                         "head_dim (fused qkv projections are not supported)")
    native = [(name, attr) for name, attn in attns if (attr := _native_qk_norm(attn))]
    if native:
        logger.warning("add_qk_norm: %s already has QK-norm (%s.%s): left unchanged.", type(model).__name__,
                       native[0][0], native[0][1])
        return model
    if eps is not None and not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"add_qk_norm: eps must be a positive number or None, got {eps!r}")
    configs = _configs(model)
    recorded = any(getattr(c, RECORD_ATTR, None) for c in configs)
    if not loading and recorded and all(_follower(a) is None for _, a in attns):
        logger.warning("add_qk_norm: the config records a QK-norm added by sagebwd_hf, but the model has none "
                       "(loaded with a plain from_pretrained, which drops the trained gains?). Adding fresh norms "
                       "(gain 1); use sagebwd_hf.load_with_qk_norm to load the saved ones.")
    added, used_eps = 0, None
    for _, attn in attns:
        if _follower(attn) is not None:
            continue
        layer_eps = float(eps) if eps is not None else _default_eps(model, attn)
        device, dtype = _float_param(attn.q_proj)
        for norm in ("q_norm", "k_norm"):
            module = QKRMSNorm(attn.head_dim, eps=layer_eps, device=device, dtype=dtype)
            module.weight.requires_grad_(trainable)
            attn.add_module(norm, module)
        follower = _FollowProjections(attn)
        attn.register_forward_pre_hook(follower)
        follower.sync()
        added, used_eps = added + 1, layer_eps
    if added:
        for cfg in configs:
            setattr(cfg, RECORD_ATTR, {"eps": used_eps})
        logger.info("add_qk_norm: added q_norm/k_norm (eps=%g) to %d attention modules", used_eps, added)
    else:
        logger.info("add_qk_norm: every attention module already has the QK-norm: nothing to do")
    return model


# ---------------------------------------------------------------------------------------------------
# Loading a model saved with add_qk_norm
# ---------------------------------------------------------------------------------------------------

_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
               "trust_remote_code", "proxies")


def _with_qk_norm(cls, eps):
    """A throw-away subclass of ``cls`` whose ``__init__`` adds the QK-norm: ``from_pretrained`` then finds
    the norms in the model it builds and loads their saved gains like any other weight."""

    def __init__(self, config, *args, **kwargs):
        cls.__init__(self, config, *args, **kwargs)
        _add_qk_norm(self, eps, trainable=True, loading=True)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def load_with_qk_norm(pretrained_model_name_or_path, model_class=None, **kwargs) -> nn.Module:
    """Load a model saved after ``add_qk_norm``, QK-norm gains included (bit-exact).

    ``model_class`` is a Transformers model class or Auto class (default ``AutoModelForCausalLM``); every other
    keyword goes to its ``from_pretrained`` (``dtype``, ``attn_implementation``, ``device_map``, ...). A
    checkpoint without the ``sagebwd_qk_norm`` record loads as a plain ``from_pretrained``. The returned model
    is an instance of the ordinary model class.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    model_class = model_class or AutoModelForCausalLM
    config = kwargs.get("config")
    if config is None or isinstance(config, str):
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
    record = getattr(config, RECORD_ATTR, None)
    if not record:
        logger.info("load_with_qk_norm: %s records no QK-norm added by sagebwd_hf: plain from_pretrained",
                    pretrained_model_name_or_path)
        return model_class.from_pretrained(pretrained_model_name_or_path, **kwargs)
    if not isinstance(record, dict) or not isinstance(record.get("eps"), (int, float)):
        raise ValueError(f"config.{RECORD_ATTR} must be a dict like {{'eps': 1e-06}}, got {record!r}")
    concrete = model_class
    mapping = getattr(model_class, "_model_mapping", None)     # an Auto class: the class for this config
    if mapping is not None:
        try:
            concrete = mapping[type(config)]
        except KeyError:
            raise ValueError(f"load_with_qk_norm: {model_class.__name__} has no model for {type(config).__name__}; "
                             "pass model_class= the model's class") from None
    model = _with_qk_norm(concrete, record["eps"]).from_pretrained(pretrained_model_name_or_path, **kwargs)
    model.__class__ = concrete
    return model


# ---------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Finding:
    """One result of ``check_training_setup``: ``code`` (stable, for tests and scripts) and ``message``."""

    code: str
    message: str


def check_training_setup(model: nn.Module, tokens_per_step: int, warn: bool = True,
                         threshold: int = QK_NORM_TOKENS_THRESHOLD) -> List[Finding]:
    """Check a SageBwd training setup against the paper's stability findings. Returns the findings (empty when
    all is well) and, with ``warn=True``, also issues each as a ``UserWarning``.

    ``tokens_per_step``: tokens per optimizer step, over all devices and gradient-accumulation steps. Codes:

    * ``qk_norm_missing``: more than ``threshold`` tokens per step (default 2^19 = 524,288, between the
      paper's 260K that trains fine and 2.1M that diverges) and attention layers without QK-norm.
    * ``k_smoothing_off``: K-smoothing is off for some layers (the paper finds it essential).
    * ``qk_norm_not_loaded``: config.json records a QK-norm added by ``add_qk_norm`` but the model has none
      (loaded with a plain ``from_pretrained``, which drops the gains: use ``load_with_qk_norm``).
    """
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step <= 0:
        raise ValueError(f"tokens_per_step must be a positive int, got {tokens_per_step!r}")
    findings = []
    attns = _attention_modules(model)
    without = [name for name, a in attns if _follower(a) is None and not _native_qk_norm(a)]
    recorded = any(getattr(c, RECORD_ATTR, None) for c in _configs(model))
    if recorded and without:
        findings.append(Finding("qk_norm_not_loaded", (
            f"config records a QK-norm added by sagebwd_hf (config.{RECORD_ATTR}) but {len(without)} attention "
            "modules have none: the saved gains were not loaded. Load with sagebwd_hf.load_with_qk_norm(path).")))
    if tokens_per_step > threshold and without:
        findings.append(Finding("qk_norm_missing", (
            f"{tokens_per_step:,} tokens per optimizer step with {len(without)} of {len(attns)} attention modules "
            f"without QK-norm: SageBwd pre-training diverged at 2.1M tokens per step without QK-norm (fine at "
            f"260K). Add it with sagebwd_hf.add_qk_norm(model), or use fewer tokens per step (<= {threshold:,}).")))
    off = [getattr(a, "layer_idx", name) for name, a in attns if not options_for(a).k_smoothing]
    if not attns and not options_for(model).k_smoothing:
        off = ["(model)"]
    if off:
        findings.append(Finding("k_smoothing_off", (
            f"K-smoothing is off for layers {off}: the paper finds it essential for stable INT8 attention "
            "training. Turn it back on: sagebwd_hf.configure(model, k_smoothing=True) (and per-layer settings).")))
    if warn:
        for finding in findings:
            warnings.warn(f"sagebwd: {finding.message}", UserWarning, stacklevel=2)
    return findings
