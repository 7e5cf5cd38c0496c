"""How a serving engine stays in the data plane as nodes come and go (afd.node.runtime implements it).

The engine only ever calls these at a step boundary or after a failed step, on its own thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from afd.dataplane.exchange import MoEExchange


@dataclass
class PlaneMembership:
    rejoin: Callable[[str], MoEExchange] | None
    """Leaves the current generation of the data plane, waits up to `cluster.rejoin_timeout` for the
    next one to form and returns the exchange over it; raises when none forms in time. None (with
    `rejoin_timeout: 0`): the first data-plane error fails every request."""
    superseded: Callable[[], bool]
    """True once the cluster forms a newer generation (a node was replaced): the engine moves to it at
    its next step boundary, telling its FFN peers so on the old one."""
    release: Callable[[], None]
    """Closes this node's end of the data plane when the engine stops for good, so that its FFN peers
    drop it at once rather than after `comm_timeout`."""
