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
    """Ends this node's failed pairs of the data plane, forms new ones, waiting up to
    `cluster.rejoin_timeout` for a dead FFN node's replacement, and returns the exchange over them;
    raises when they do not form in time. None (with `rejoin_timeout: 0`): the first data-plane error
    fails every request."""
    release: Callable[[], None]
    """Closes this node's end of the data plane when the engine stops for good, so that its FFN peers
    drop it at once rather than after `comm_timeout`."""
    adopt: Callable[[], MoEExchange | None] | None = None
    """At each step boundary: takes pairs formed in the background with FFN nodes that are back (a left-out
    node's replacement, afd.node.adoption) into the exchange, returned when any was."""
