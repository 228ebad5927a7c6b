"""Moved to ``sagebwd_hf.testing.model_coverage``. This name keeps working for one release, with a
DeprecationWarning naming the new one: its attributes, and ``python -m sagebwd_hf.model_coverage``."""
import importlib
import sys
import warnings

_NEW = "sagebwd_hf.testing.model_coverage"


def __getattr__(name):
    value = getattr(importlib.import_module(_NEW), name)     # an unknown name raises the new module's AttributeError
    warnings.warn(f"sagebwd_hf.model_coverage.{name} moved to {_NEW}.{name}; the old name goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return value


if __name__ == "__main__":
    warnings.warn(f"python -m sagebwd_hf.model_coverage moved to python -m {_NEW}; the old name goes in the next "
                  "release", DeprecationWarning, stacklevel=1)
    sys.exit(importlib.import_module(_NEW).main())
