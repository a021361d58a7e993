"""ckptd inside the training frameworks people already use.

    from ckptd.integrations.lightning import CkptdCheckpointIO      # PyTorch Lightning / Fabric
    from ckptd.integrations.transformers import CkptdCallback       # Hugging Face Trainer
    from ckptd.integrations import accelerate                       # save_state / load_state

Each module imports its framework only when used, and says how to install it
when it is missing (``pip install "ckptd[lightning]"`` and so on).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ImportError saying which ckptd extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"ckptd.integrations.{extra} needs the {module!r} package, which is not installed: "
            f"pip install \"ckptd[{extra}]\""
        ) from exc
