"""sagebwd-hf: SageBwd trainable INT8 attention for PyTorch and Hugging Face Transformers."""
import os as _os

# The Triton kernels live in the repository's top-level kernels/ folder and are installed as
# sagebwd_hf.kernels (setup.cfg). In a source checkout (editable install, or the repo on PYTHONPATH)
# that folder sits beside this package: let sagebwd_hf.kernels resolve there. kernels/ has no
# __init__.py, so it never shadows Hugging Face's own top-level `kernels` package.
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")):
    __path__.append(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))

from .interface import sagebwd_attn_func, sagebwd_attn_varlen_func  # noqa: E402
from .transformers_integration import attention_stats, reset_attention_stats  # noqa: E402,F401  (registers "sagebwd")

__all__ = ["sagebwd_attn_func", "sagebwd_attn_varlen_func"]
__version__ = "0.2.0"
from .config import (SageBwdOptions, clear_options, configure, get_global_options, get_options,  # noqa: E402,F401
                     options_for, reset_global_options, set_global_options)
__all__ += ["SageBwdOptions", "configure", "get_options", "options_for", "set_global_options",
            "get_global_options", "reset_global_options", "clear_options"]
from .qk_norm import (QK_NORM_TOKENS_THRESHOLD, Finding, add_qk_norm, check_training_setup,  # noqa: E402,F401
                      has_qk_norm, load_with_qk_norm, qk_norm_parameters)
__all__ += ["add_qk_norm", "has_qk_norm", "qk_norm_parameters", "load_with_qk_norm", "check_training_setup",
            "Finding", "QK_NORM_TOKENS_THRESHOLD"]
__all__ += ["attention_stats", "reset_attention_stats"]
from . import sdpa_flash  # noqa: E402
sdpa_flash.register()     # known to torch.nn.attention as "SageBwd"; active only once a user activates it
