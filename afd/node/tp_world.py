"""An attention node's TP ranks in a torch.distributed world of their own: the default group of these
processes, formed once at start-up through rank 0's rendezvous store. The data plane's pairs live outside
it (afd.dataplane.pairs), so no other node ever takes part in it, and the node's TP groups
(afd.model.tp.comm) are made inside it. The node's ranks are started (and restarted) together."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

from afd.backend import Backend
from afd.backend.base import PeerError
from afd.cluster.config import ClusterConfig
from afd.dataplane.rendezvous import ControlStore, apply_comm_env, bind_gloo

log = logging.getLogger("afd.node")


class TPWorld:
    def __init__(self, backend: Backend, store: ControlStore):
        self.backend, self.store = backend, store
        self._errors_before = PeerError.made

    @classmethod
    def join(cls, cfg: ClusterConfig, name: str, tp_rank: int, backend: Backend, bind_host: str | None) -> TPWorld:
        node, t0 = cfg.node(name), time.monotonic()
        timeout = cfg.cluster.comm_timeout
        # kept referenced while the world lives: c10d holds only the store's C++ half
        store = ControlStore(f"{node.host}:{node.ports.control}", cfg.cluster.startup_timeout, cfg.cluster.tls)
        apply_comm_env(backend)
        if backend.dist_backend == "gloo":
            bind_gloo(bind_host)
        group_s = timeout * 2 + 10 if backend.stream_ordered_waits else timeout
        dist.init_process_group(
            backend.dist_backend,
            store=dist.PrefixStore("afd/tp/", store),
            rank=tp_rank,
            world_size=cfg.layout.attention_tp,
            timeout=timedelta(seconds=group_s),
        )
        log.info(
            "TP world of %s up: rank %d of %d over %s, in %.2fs",
            name,
            tp_rank,
            cfg.layout.attention_tp,
            backend.dist_backend,
            time.monotonic() - t0,
        )
        return cls(backend, store)

    def close(self) -> None:
        """Tears the world down; where that waits for queued work (NCCL, HCCL) and a failure may have left
        some (any PeerError in this process since the world formed), its groups are forgotten unshut."""
        if not dist.is_initialized():
            return
        abort = self.backend.shutdown_waits_for_queued_work and PeerError.made > self._errors_before
        try:
            if abort:
                dist.distributed_c10d._abort_process_group()  # no shutdown(), no wait
            else:
                dist.destroy_process_group()
        except Exception as e:  # a dead rank can make teardown fail; exiting matters more
            log.debug("TP world teardown: %s", e)
        self.store.close()
