"""`afd rebalance --apply`: the new placement written, each FFN node restarted in turn to load it.

Each FFN node is asked to restart through the coordinator (Coordinator.Restart): it exits, its supervisor
(afd launch, afd serve, Kubernetes) starts it again with the YAML as it now is, and it names its new experts
when its pairs form (PairReply.experts), which is what the attention nodes route by. One node at a time, the
next once the last is back and ready. While a node is away its experts' tokens go to their replicas, or the
attention nodes pause for it (cluster.rejoin_timeout); and while the placement is half changed, an expert
that neither an old nor a new holder has yet pauses them until the next restart brings it (attention_node
.node.AttentionNode._exchange). No request fails either way. The order keeps every expert held after each
restart where one exists.
"""

from __future__ import annotations

import time

from afd.config.placement import Placement

POLL_S = 0.5


def restart_order(current: Placement, new: Placement) -> list[str]:
    """FFN nodes in an order in which every expert stays held while each node is away restarting (by the
    others: current holdings of the nodes not yet restarted, new ones of those restarted) and after it is back.
    Each turn takes the first node that keeps that; else the first after whose restart every expert is held
    (the attention side waits for it meanwhile); else the first left. Nodes whose experts do not change are
    never restarted, so never away."""
    held = {n: set(h) for n, h in zip(current.nodes, current.held)}
    target = {n: set(h) for n, h in zip(new.nodes, new.held)}
    every = set(range(current.n_routed))
    todo, order = list(current.nodes), []

    def covered(n: str, while_away: bool) -> bool:
        after = {**held, n: target[n]}
        away = {k: v for k, v in held.items() if k != n or target[n] == held[n]}
        return set().union(*after.values()) >= every and (not while_away or set().union(*away.values()) >= every)

    while todo:
        # held while away and after; else (no replica covers a node's experts) held after, at least
        n = next((n for n in todo if covered(n, True)), None) or next((n for n in todo if covered(n, False)), todo[0])
        held[n] = target[n]
        order.append(n)
        todo.remove(n)
    return order


def apply(cfg, current: Placement, new: Placement, restart, status, out=print) -> None:
    """Restarts the FFN nodes of `cfg` (whose YAML already holds `new`) one at a time: restart(node) asks the
    coordinator, status() returns its ClusterStatus (afd.entrypoints.cli's coordinator calls). Raises RuntimeError
    naming a node that does not come back."""
    moved = [n for n, a, b in zip(current.nodes, current.held, new.held) if a != b]
    timeout = cfg.cluster.startup_timeout + cfg.cluster.heartbeat_timeout + 30
    for name in [n for n in restart_order(current, new) if n in moved]:
        out(f"restarting {name} to load its new experts ...")
        restart(name)
        end = time.monotonic() + timeout
        while True:
            st = status()
            if name not in st.restarting and name in st.ready:
                break
            if time.monotonic() > end:
                raise RuntimeError(
                    f"{name} did not come back within {timeout:.0f}s: is it supervised (afd launch, afd serve, "
                    "Kubernetes)? Start it again with its own command to finish applying the placement"
                )
            time.sleep(POLL_S)
        out(f"{name} is back with its new experts")
