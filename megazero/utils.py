"""DeepSpeed's `deepspeed.utils` names for a user's model under megazero.initialize: reading and
editing partitioned state by parameter (megazero.zero.state_access) and stage 3's leaf modules
(megazero.api.modules). Re-exports only; see docs/own_model.md.
"""

from megazero.api.modules import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module  # noqa: F401
from megazero.zero.state_access import (  # noqa: F401
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
