"""An attention node's TP ranks in a torch.distributed world of their own: the default group of these
processes, formed through rank 0's rendezvous store. The data plane's pairs live outside it
(afd.dataplane.pairs), so no other node ever takes part in it, and the node's TP groups (afd.model.tp.comm)
are made inside it. The node's ranks are started (and restarted) together.

Rank 0 leads every formation: it publishes a fresh key under `afd/tp/world`, and the other ranks form
the world under that key's prefix. After a failure each rank leaves the world and forms its pairs again;
rank 0 then publishes the next key and the others, waiting for a key they have not formed under yet,
follow. A fresh prefix per world keeps a re-made group from ever meeting the old one's store keys
(c10d names a group by its ranks, so the old and the new would share them)."""

from __future__ import annotations

import gc
import logging
import secrets
import time
from datetime import timedelta

import torch.distributed as dist

from afd.backend import Backend
from afd.backend.base import PeerError
from afd.config.schema import ClusterConfig
from afd.dataplane.rendezvous import ControlStore, apply_comm_env, bind_gloo

log = logging.getLogger("afd.node")
_KEY = "afd/tp/world"


class TPWorld:
    def __init__(self, cfg: ClusterConfig, name: str, tp_rank: int, backend: Backend, bind_host: str | None):
        self.cfg, self.name, self.rank, self.backend = cfg, name, tp_rank, backend
        node = cfg.node(name)
        # kept referenced while a world lives: c10d holds only the store's C++ half
        self.store = ControlStore(f"{node.host}:{node.ports.control}", cfg.cluster.startup_timeout, cfg.cluster.tls)
        self.key = ""
        self._errors_before = PeerError.made
        apply_comm_env(backend)
        if backend.dist_backend == "gloo":
            bind_gloo(bind_host)

    @classmethod
    def join(cls, cfg: ClusterConfig, name: str, tp_rank: int, backend: Backend, bind_host: str | None) -> TPWorld:
        world = cls(cfg, name, tp_rank, backend, bind_host)
        world.form(cfg.cluster.startup_timeout)
        return world

    def form(self, deadline_s: float) -> None:
        """Rank 0 publishes the next key; the others wait (up to deadline_s) for one they have not used."""
        t0 = time.monotonic()
        if self.rank == 0:
            key = secrets.token_hex(8)
            self.store.set(_KEY, key)
        else:
            key = self._next_key(t0 + deadline_s)
        timeout = self.cfg.cluster.comm_timeout
        group_s = timeout * 2 + 10 if self.backend.stream_ordered_waits else timeout
        dist.init_process_group(
            self.backend.dist_backend,
            store=dist.PrefixStore(f"afd/tp/{key}/", self.store),
            rank=self.rank,
            world_size=self.cfg.layout.attention_tp,
            timeout=timedelta(seconds=group_s),
        )
        self.key, self._errors_before = key, PeerError.made
        log.info(
            "TP world of %s up: rank %d of %d over %s, in %.2fs",
            self.name,
            self.rank,
            self.cfg.layout.attention_tp,
            self.backend.dist_backend,
            time.monotonic() - t0,
        )

    def _next_key(self, deadline: float) -> str:
        while True:
            if self.store.check([_KEY]):
                key = self.store.get(_KEY).decode()
                if key != self.key:
                    return key
            if time.monotonic() > deadline:
                raise PeerError(f"TP rank {self.rank} of {self.name}: rank 0 formed no new TP world in time")
            time.sleep(0.05)

    def leave(self) -> None:
        """After a failure: every group of the world aborted and forgotten, never shut down (NCCL's and
        HCCL's shutdown would wait for the work a failure left queued); a gloo group's sockets close once
        nothing holds it, so a sibling rank blocked in one of its collectives fails at once."""
        if dist.is_initialized():
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as e:  # noqa: BLE001 (a dead rank can make teardown fail; re-forming matters more)
                log.debug("TP world abort: %s", e)
        gc.collect()

    def close(self) -> None:
        """At exit: torn down, or, where that waits for queued work (NCCL, HCCL) and a failure may have left
        some (any PeerError in this process since the world formed), aborted."""
        if dist.is_initialized():
            abort = self.backend.shutdown_waits_for_queued_work and PeerError.made > self._errors_before
            try:
                if abort:
                    dist.distributed_c10d._abort_process_group()  # no shutdown(), no wait
                else:
                    dist.destroy_process_group()
            except Exception as e:  # a dead rank can make teardown fail; exiting matters more
                log.debug("TP world teardown: %s", e)
        self.store.close()
