"""ZeRO over mixture-of-experts weights: the expert family's shard domain (zero/shard_domain.py).

Expert weights (marked `expert_parallel` by parallel.moe) are reduced, and their states sharded,
over the expert-data-parallel group (the ranks holding the same experts), not the data-parallel
group of the dense weights: the engine keeps them in a domain of their own (`expert_domain`), its
storages built with `ZeroGroups` of that group. Their squared gradient norm is summed over that
group's shards, then over the expert-parallel group (which holds the other experts), before it joins
the dense one.

Stage 3: each module owning expert weights (a layer's GroupedExperts) is one unit, gathered before
its forward and its backward by the domain's own coordinator over the expert-data-parallel group.
Which rows reach a rank's experts depends on the routing, which differs between ranks; the
collectives must not. The dispatchers call every rank's experts every microbatch (with no rows if
none came), so every rank gathers every expert unit in the same order; and the units' gradients are
reduced only once the microbatch's backward is over (the domain's policy, `ReduceAtBackwardEnd`),
all units in unit order, with zeros for what did not come, so that every rank issues the same
reductions in the same order whatever the routing (the hang DeepSpeed users meet when ranks route
differently).
"""

from __future__ import annotations

from megazero.core.comm import Group
from megazero.models.param_info import param_info
from .shard_domain import ReduceAtBackwardEnd, ShardDomain
from .zero_groups import ZeroGroups


def is_expert(param) -> bool:
    return param_info(param).expert_parallel


def expert_domain(groups: ZeroGroups, expert_parallel: Group) -> ShardDomain:
    """The expert weights' domain: `groups` over the expert-data-parallel ranks; `expert_parallel`
    the group holding the other experts, over which their part of a norm is summed too."""
    return ShardDomain("expert", groups, ReduceAtBackwardEnd(), claims=is_expert, across=(expert_parallel,))
