"""LoraAdapterControl: one model's LoRA adapters loaded and unloaded at runtime (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter), across every replica of both pools.

Load: one replica reads and checks the adapter first (a bad one: 400 with its one-line
refusal, and no replica changed); then every other live replica loads it, the pools' engine
config gets it (a replica started later loads it at start), and the membership view lists it,
so every ingress's ModelCatalog serves it. The call returns once every live ingress applied
that view: the next request by the adapter's name is served wherever it lands.

Unload (the policy: wait, then give up): the adapter leaves the view first, and the call waits
until every live ingress applied it (new requests for it get 404 there). Then each replica
unloads it, prefill first; a replica refuses while requests still use it, and is asked again
until unload_timeout_s. At the timeout the replicas that did unload it load it again, it
returns to the view, and the answer is 409: nothing changed.

A replica that starts while a load or an unload runs may miss it (it read the pools' engine
config before), and a restarted controller serves the adapters of its start-up config: both
are known gaps. Each call answers (HTTP status, message).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from splitserve.cluster.routing.replica_pools import DECODE, PREFILL

if TYPE_CHECKING:
    from splitserve.cluster.control.controller import Controller
    from splitserve.cluster.control.worker_pool import Replica

logger = logging.getLogger(__name__)
REPLICA_CALL_TIMEOUT_S = 120.0  # reading an adapter's files from disk into a replica
VIEW_APPLIED_TIMEOUT_S = 10.0  # every ingress follows the view within its long poll
BUSY_RETRY_S = 0.1
UNLOAD_TIMEOUT_S = 60.0  # how long an unload waits for the adapter's requests to finish

Outcome = tuple[int, str]  # (HTTP status, message)


class LoraAdapterControl:
    def __init__(self, controller: Controller):
        self.controller = controller
        self._lock = asyncio.Lock()  # one load or unload at a time: each sees the last one's result

    def _replicas(self) -> list[Replica]:
        """Every live replica, prefill first (a request holds decode's copy after prefill's)."""
        pools = self.controller.pools
        return [r for pool in (PREFILL, DECODE) for r in pools[pool].live_replicas()]

    def _refused_name(self, name: str) -> str | None:
        cfg = self.controller.cfg
        if not cfg.enable_lora:
            return "this deployment serves no LoRA adapters: start it with --enable-lora"
        if not name or not name.strip():
            return "lora_name must not be empty"
        taken = {cfg.model_id, *cfg.aliases, *(route.name for route in cfg.model_routes)}
        if name in taken:
            return f"LoRA adapter {name!r}: the name is already a served model, alias or route's"
        if name in (self.controller.pools[DECODE].engine_config.get("lora_modules") or {}):
            return f"LoRA adapter {name!r} is already loaded"
        return None

    async def load(self, name: str, path: str) -> Outcome:
        async with self._lock:
            refused = self._refused_name(name)
            if refused is not None:
                return 400, refused
            replicas = self._replicas()
            if not replicas:
                return 503, "no replica is serving: load the adapter once the pools are up"
            # One replica checks it (shapes, rank, targets, files); a refusal changes nothing.
            refusal = await _load_on(replicas[0], name, path)
            if refusal is not None:
                return 400, refusal
            rest = await asyncio.gather(*(_load_on(r, name, path) for r in replicas[1:]), return_exceptions=True)
            failed = [(r, why) for r, why in zip(replicas[1:], rest) if why is not None]
            if failed:  # the same files passed on the first: a replica's own failure; undo
                loaded = [replicas[0], *(r for r, why in zip(replicas[1:], rest) if why is None)]
                await asyncio.gather(*(_unload_on(r, name) for r in loaded), return_exceptions=True)
                replica, why = failed[0]
                return 500, f"LoRA adapter {name!r} not loaded: {replica.replica_id} failed: {why}"
            for pool in self.controller.pools.values():
                pool.engine_config["lora_modules"] = {**(pool.engine_config.get("lora_modules") or {}), name: path}
            await self._publish([*self.controller.roster.lora_adapters, name])
            logger.info("LoRA adapter %s loaded from %s on %d replica(s)", name, path, len(replicas))
            return 200, f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str, timeout_s: float) -> Outcome:
        async with self._lock:
            roster = self.controller.roster
            if name not in roster.lora_adapters:
                return 404, f"the LoRA adapter {name!r} is not loaded"
            path = self.controller.pools[DECODE].engine_config["lora_modules"][name]
            await self._publish([a for a in roster.lora_adapters if a != name])  # new requests: 404
            clock = self.controller.clock
            deadline = clock() + timeout_s
            unloaded: list[Replica] = []
            for replica in self._replicas():
                while True:
                    answer = await _unload_on(replica, name)
                    if answer is None or not answer[0]:  # unloaded, or never had it
                        unloaded.append(replica)
                        break
                    if clock() >= deadline:
                        # Still in use: put everything back as it was.
                        await asyncio.gather(*(_load_on(r, name, path) for r in unloaded), return_exceptions=True)
                        await self._publish([*roster.lora_adapters, name])
                        return 409, (
                            f"the LoRA adapter {name!r} is still in use by requests after {timeout_s:g} s "
                            f"({replica.replica_id}: {answer[1]}); it stays loaded"
                        )
                    await asyncio.sleep(BUSY_RETRY_S)
            for pool in self.controller.pools.values():
                modules = dict(pool.engine_config.get("lora_modules") or {})
                modules.pop(name, None)
                pool.engine_config["lora_modules"] = modules
            logger.info("LoRA adapter %s unloaded from %d replica(s)", name, len(unloaded))
            return 200, f"Success: LoRA adapter '{name}' removed successfully."

    async def _publish(self, adapters: list[str]) -> None:
        """A view with these adapters, applied by every live ingress (or the timeout)."""
        roster = self.controller.roster
        roster.lora_adapters = adapters
        roster.bump()
        if not await self.controller.wait_applied(roster.version, VIEW_APPLIED_TIMEOUT_S):
            logger.warning(
                "not every ingress applied the LoRA adapters %s within %g s", adapters, VIEW_APPLIED_TIMEOUT_S
            )


async def _load_on(replica: Replica, name: str, path: str) -> str | None:
    return await asyncio.wait_for(replica.handle.load_lora_adapter.remote(name, path), REPLICA_CALL_TIMEOUT_S)


async def _unload_on(replica: Replica, name: str) -> tuple[bool, str] | None:
    return await asyncio.wait_for(replica.handle.unload_lora_adapter.remote(name), REPLICA_CALL_TIMEOUT_S)
