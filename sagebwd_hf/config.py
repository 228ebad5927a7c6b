"""SageBwd's options: one small object, settable globally, per model and per layer, saved with the model.

The options are what the op (``sagebwd_attn_func``) exposes that a user should choose; the rest of its
arguments (causality, scale, window) come from the model itself:

============== ======= ===================================================================================
key            default meaning
============== ======= ===================================================================================
``k_smoothing`` True   subtract the mean key (per sequence and KV head) before quantizing. Exact for
                       softmax; the paper finds it essential for stable training. Keep it on.
``q_smoothing`` False  subtract per-128-token query means, adding their scores back in fp32. Limited
                       benefit in pre-training (paper); costs an extra pass.
``packed_position_ids`` True: position_ids that restart inside a row mark packed sequences (as Transformers
                       reads them), which no token attends across. Finding them reads the ids on the host
                       (under torch.compile inside the op, every call), so nothing can capture the call in a
                       CUDA graph. False: position_ids are positions only (``cu_seq_lens_q/k`` still split a
                       batch), and a compiled model without a padding mask (which the segmented op also reads
                       on the host) can run with ``mode="reduce-overhead"``. It governs only what the backend
                       reads from position_ids: a mask Transformers builds with the packing in it still splits.
``precision``  "accurate" the numerics preset (``sagebwd_attn_func``'s ``precision``): "accurate", "fast",
                       "fastest", or rule names joined by "+" (sagebwd_hf.numerics). The Hopper kernels and the
                       PyTorch path compute "fast" and "fastest"; a kernel that does not compute a rule raises
                       NotImplementedError.
============== ======= ===================================================================================

Three levels, the most specific wins: **per layer > per model > global default**.

>>> import sagebwd_hf
>>> sagebwd_hf.set_global_options(q_smoothing=True)            # every model in this process
>>> sagebwd_hf.configure(model, k_smoothing=True)              # this model (saved in config.json)
>>> sagebwd_hf.configure(model, layers=[0, 1], q_smoothing=False)  # layers 0 and 1 of this model
>>> sagebwd_hf.get_options(model, layer=0)
SageBwdOptions(k_smoothing=True, q_smoothing=False, packed_position_ids=True, precision='accurate')

Model and layer settings live in ``model.config.sagebwd``, a plain JSON dict such as
``{"k_smoothing": true, "layers": {"0": {"q_smoothing": false}}}`` (layer indices as strings, JSON's only
key type), so ``save_pretrained`` / ``from_pretrained`` round-trip them through config.json. Only what was
set is stored: a key missing there falls through to the next level. Passing ``None`` for a key removes that
setting. Global defaults are per process and not saved.

The attention backend asks ``options_for(attention_module)`` on every call: it reads the module's
``config.sagebwd`` and ``layer_idx`` (Transformers' attention modules carry both).
"""
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, Iterable, Optional, Union

import torch

from . import numerics

CONFIG_ATTR = "sagebwd"
LAYERS_KEY = "layers"


@dataclass(frozen=True)
class SageBwdOptions:
    """SageBwd's per-call options (see the module docstring). Immutable; validated on construction."""

    k_smoothing: bool = True
    q_smoothing: bool = False
    packed_position_ids: bool = True
    precision: str = "accurate"

    def __post_init__(self):
        for f in fields(self):
            _check_value(f.name, getattr(self, f.name))

    def op_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for ``sagebwd_attn_func`` / ``sagebwd_attn_varlen_func`` (the op's own options;
        ``packed_position_ids`` is the attention backend's)."""
        return {key: getattr(self, key) for key in OP_KEYS}   # (asdict's deep copy: ~40 us a call)


OPTION_KEYS = tuple(f.name for f in fields(SageBwdOptions))
OP_KEYS = ("k_smoothing", "q_smoothing", "precision")
_ALLOWED = {name: (True, False) for name in OPTION_KEYS if name != "precision"}   # switches
_ALLOWED["precision"] = numerics.ALLOWED


def _check_value(key: str, value: Any) -> None:
    if key not in _ALLOWED:
        raise ValueError(f"unknown SageBwd option {key!r}; allowed options: {', '.join(OPTION_KEYS)}")
    if key == "precision":   # a preset name or rules joined by "+", as sagebwd_attn_func takes it
        numerics.parse_precision(value, f"SageBwd option {key!r}")
        return
    # bool only: 0/1 or "true" in a hand-edited config.json are more likely mistakes than intent
    if not isinstance(value, bool) or value not in _ALLOWED[key]:
        allowed = " or ".join(repr(v) for v in _ALLOWED[key])
        raise ValueError(f"SageBwd option {key!r} must be {allowed}, got {value!r}")


def _check_options(options: Dict[str, Any], where: str) -> Dict[str, Any]:
    if not isinstance(options, dict):
        raise ValueError(f"{where} must be a dict of SageBwd options, got {type(options).__name__}")
    for key, value in options.items():
        try:
            _check_value(key, value)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    return options


# ---------------------------------------------------------------------------------------------------
# Global defaults
# ---------------------------------------------------------------------------------------------------

_global = SageBwdOptions()


def set_global_options(**options) -> SageBwdOptions:
    """Set process-wide defaults (not saved with any model), e.g. ``set_global_options(q_smoothing=True)``.
    ``None`` restores a key's built-in default. Returns the new defaults."""
    global _global
    current = asdict(_global)
    for key, value in options.items():
        if key not in _ALLOWED:
            _check_value(key, value)          # raises: unknown key
        current[key] = getattr(SageBwdOptions, key) if value is None else value
    _global = SageBwdOptions(**current)
    return _global


def get_global_options() -> SageBwdOptions:
    return _global


def reset_global_options() -> SageBwdOptions:
    """Back to the built-in defaults (k_smoothing=True, q_smoothing=False, packed_position_ids=True,
    precision="accurate")."""
    global _global
    _global = SageBwdOptions()
    return _global


# ---------------------------------------------------------------------------------------------------
# Per model and per layer (stored in the model's config)
# ---------------------------------------------------------------------------------------------------

def _is_config(obj) -> bool:
    from transformers import PretrainedConfig
    return isinstance(obj, PretrainedConfig)


def _model_configs(model: torch.nn.Module):
    """Every distinct config object of ``model`` that its attention modules read: ``model.config`` and, for
    composite models (a text config inside a multimodal one), the attention modules' own ``config``."""
    configs = []
    top = getattr(model, "config", None)
    if _is_config(top):
        configs.append(top)
    for module in model.modules():
        cfg = getattr(module, "config", None) if hasattr(module, "layer_idx") else None
        if _is_config(cfg) and not any(cfg is c for c in configs):
            configs.append(cfg)
    if not configs:
        raise ValueError(f"{type(model).__name__} has no Transformers config to store SageBwd options in "
                         "(expected model.config)")
    return configs


def _num_layers(config) -> Optional[int]:
    try:
        return config.get_text_config().num_hidden_layers
    except AttributeError:
        return getattr(config, "num_hidden_layers", None)


def _layer_key(layer, num_layers: Optional[int]) -> str:
    if isinstance(layer, str) and layer.isdigit():
        layer = int(layer)
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"SageBwd layer index must be an int >= 0, got {layer!r}")
    if num_layers is not None and layer >= num_layers:
        raise ValueError(f"SageBwd layer index {layer} is out of range: the model has {num_layers} layers "
                         f"(0 to {num_layers - 1})")
    return str(layer)


def validate(settings: Any, num_layers: Optional[int] = None) -> Dict[str, Any]:
    """Check a ``config.sagebwd`` dict (raises ``ValueError`` naming the bad key and the allowed values)."""
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise ValueError(f"config.{CONFIG_ATTR} must be a dict, got {type(settings).__name__}")
    model_level = {k: v for k, v in settings.items() if k != LAYERS_KEY}
    _check_options(model_level, f"config.{CONFIG_ATTR}")
    layers = settings.get(LAYERS_KEY, {})
    if not isinstance(layers, dict):
        raise ValueError(f"config.{CONFIG_ATTR}[{LAYERS_KEY!r}] must be a dict {{layer index: options}}, "
                         f"got {type(layers).__name__}")
    for layer, options in layers.items():
        key = _layer_key(layer, num_layers)
        _check_options(options, f"config.{CONFIG_ATTR}[{LAYERS_KEY!r}][{key!r}]")
    return settings


def configure(model: torch.nn.Module, layers: Union[None, int, Iterable[int]] = None, **options) -> None:
    """Set SageBwd options for ``model`` (``layers=None``) or for some of its layers (an index or a list).

    Stored in ``model.config.sagebwd`` (saved by ``save_pretrained``). ``key=None`` removes that setting at
    that level, so it falls back to the next one (layer -> model -> global). Validated before anything is
    written: a bad key, value or layer index raises ``ValueError`` and leaves the model as it was.
    Example: ``configure(model, k_smoothing=True, q_smoothing=False)``;
    ``configure(model, layers=[0, 23], q_smoothing=True)``.
    """
    updates = {k: v for k, v in options.items() if v is not None}
    for key in options:
        if key not in _ALLOWED:
            _check_value(key, None)            # raises: unknown key
    _check_options(updates, "configure()")
    configs = _model_configs(model)
    num_layers = _num_layers(configs[0])
    if layers is None:
        targets = None
    else:
        indices = [layers] if isinstance(layers, (int, str)) else list(layers)
        targets = [_layer_key(i, num_layers) for i in indices]
    for config in configs:
        settings = validate(getattr(config, CONFIG_ATTR, None), num_layers)
        settings = {k: (dict(v) if k == LAYERS_KEY else v) for k, v in settings.items()}
        scopes = [settings] if targets is None else [settings.setdefault(LAYERS_KEY, {}).setdefault(t, {})
                                                     for t in targets]
        for scope in scopes:
            for key, value in options.items():
                if value is None:
                    scope.pop(key, None)
                else:
                    scope[key] = value
        if LAYERS_KEY in settings:
            settings[LAYERS_KEY] = {k: v for k, v in sorted(settings[LAYERS_KEY].items(), key=lambda kv: int(kv[0]))
                                    if v}
            if not settings[LAYERS_KEY]:
                del settings[LAYERS_KEY]
        setattr(config, CONFIG_ATTR, settings)


def clear_options(model: torch.nn.Module) -> None:
    """Remove every model and layer setting of ``model`` (global defaults then apply)."""
    for config in _model_configs(model):
        if hasattr(config, CONFIG_ATTR):
            delattr(config, CONFIG_ATTR)


def _resolve(settings: Optional[dict], layer_idx: Optional[int]) -> SageBwdOptions:
    if not settings:
        return _global
    validate(settings)
    merged = {k: v for k, v in settings.items() if k != LAYERS_KEY}
    if layer_idx is not None:
        merged.update(settings.get(LAYERS_KEY, {}).get(str(layer_idx), {}))
    return replace(_global, **merged) if merged else _global


def get_options(model: torch.nn.Module, layer: Optional[int] = None) -> SageBwdOptions:
    """The options that apply to ``layer`` of ``model`` (``None``: the model-wide ones), all levels merged."""
    config = _model_configs(model)[0]
    if layer is not None:
        layer = int(_layer_key(layer, _num_layers(config)))
    return _resolve(getattr(config, CONFIG_ATTR, None), layer)


def options_for(module: torch.nn.Module) -> SageBwdOptions:
    """The options for one attention call: what the ``"sagebwd"`` attention backend should pass to the op.

    Reads ``module.config.sagebwd`` and ``module.layer_idx`` (both set by Transformers' attention modules);
    a module without a config gets the global defaults, one without ``layer_idx`` the model-wide options."""
    config = getattr(module, "config", None)
    settings = getattr(config, CONFIG_ATTR, None) if config is not None else None
    return _resolve(settings, getattr(module, "layer_idx", None))
