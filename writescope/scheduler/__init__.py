"""Where new KV goes: placement policies (docs/DESIGN.md sections 5 and 7)."""

from writescope.scheduler.policies import COMPUTE, LOAD, PlacementPolicy, StaticPolicy, parse_policy, route_block

__all__ = ["COMPUTE", "LOAD", "PlacementPolicy", "StaticPolicy", "parse_policy", "route_block"]
