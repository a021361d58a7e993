"""The random number generators a resumed run needs, as values ckptd stores without pickling.

Python's ``random`` state is a tuple of ints, numpy's a tuple holding a uint32
array, torch's a uint8 tensor per generator; each goes into a checkpoint as it is
and comes back the same (``ckptd.state`` keeps tuples and numpy arrays).
"""

from __future__ import annotations

import random
from typing import Any


def capture() -> dict[str, Any]:
    """This process's generator states: python, numpy, torch CPU and (if present) every CUDA device."""
    import numpy as np
    import torch

    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(states: dict[str, Any]) -> None:
    """Set the generators from ``capture()``'s result as loaded back from a checkpoint."""
    import numpy as np
    import torch

    random.setstate(_tuples(states["python"]))
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _tuples(value: Any) -> Any:
    """random.setstate wants tuples all the way down."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
