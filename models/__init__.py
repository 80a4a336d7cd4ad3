"""Pure single-device model code (installed as megazero.models).

The names below load on first use (PEP 562), so that `megazero.models.config` (a plain dataclass)
and `megazero.models.param_info` import without torch: the flags are checked before torch loads.
"""

import importlib

_WHERE = {"GPTConfig": ".config", "padded_vocab_size": ".config", "GPT": ".gpt", "initial_value": ".gpt"}

__all__ = ["GPT", "GPTConfig", "initial_value", "padded_vocab_size"]


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
