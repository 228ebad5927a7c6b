"""sagebwd-hf: SageBwd trainable INT8 attention for PyTorch and Hugging Face Transformers."""

def _mount_kernels():
    """``sagebwd_hf.kernels`` is the repository's top-level ``kernels/`` folder: installs put it there (setup.cfg's
    ``package_dir``); in a source checkout (the repository on PYTHONPATH, or an editable install) this package is
    given that one folder as its ``kernels`` subpackage, and no other folder of the repository. (As a top-level
    ``kernels`` it would shadow Hugging Face's own package of that name, which Transformers imports.)"""
    import importlib.machinery
    import importlib.util
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(os.path.dirname(here), "kernels")
    if os.path.isdir(os.path.join(here, "kernels")) or not os.path.isfile(os.path.join(folder, "dispatch.py")):
        return
    spec = importlib.machinery.ModuleSpec(__name__ + ".kernels", None, is_package=True)
    spec.submodule_search_locations = [folder]
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
    sys.modules[__name__].kernels = module   # as the import system does for a subpackage it loads


_mount_kernels()

from .interface import sagebwd_attn_func, sagebwd_attn_varlen_func  # noqa: E402
from .transformers_integration import attention_stats, reset_attention_stats  # noqa: E402  (registers "sagebwd")

__all__ = ["sagebwd_attn_func", "sagebwd_attn_varlen_func"]
__version__ = "0.2.0"
from .config import (SageBwdOptions, clear_options, configure, get_global_options, get_options,  # noqa: E402
                     options_for, reset_global_options, set_global_options)
__all__ += ["SageBwdOptions", "configure", "get_options", "options_for", "set_global_options",
            "get_global_options", "reset_global_options", "clear_options"]
from .qk_norm import (QK_NORM_TOKENS_THRESHOLD, Finding, add_qk_norm, check_training_setup,  # noqa: E402
                      has_qk_norm, load_with_qk_norm, qk_norm_parameters)
__all__ += ["add_qk_norm", "has_qk_norm", "qk_norm_parameters", "load_with_qk_norm", "check_training_setup",
            "Finding", "QK_NORM_TOKENS_THRESHOLD"]
__all__ += ["attention_stats", "reset_attention_stats"]
from . import sdpa_flash  # noqa: E402
sdpa_flash.register()     # known to torch.nn.attention as "SageBwd"; active only once a user activates it
