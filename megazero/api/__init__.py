"""megazero's DeepSpeed-shaped API for any nn.Module: `initialize` (initialize.py) returns DeepSpeed's
(engine, optimizer, dataloader, lr_scheduler) over megazero's ZeroEngine; `zero.Init` and the
parameter tools live in megazero.zero, re-exported under DeepSpeed's names by megazero/__init__.py,
megazero/zero/__init__.py and megazero/utils.py. docs/own_model.md says which DeepSpeed names are
answered and which are refused.
"""

from .initialize import initialize  # noqa: F401
