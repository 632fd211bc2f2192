"""The DRA driver: prepared claims, their CDI specs, and what the kubelet asks of a driver
(prepare, unprepare, the devices' health). It owns no socket: the kubelet-plugin helper
(`kubelet.draplugin`) serves and registers it, and the DRA frontend (`dra.frontend`) puts the
two together with the ResourceSlice's publisher.

Prepare (per claim): a claim already prepared answers what it answered before; otherwise its
allocation is read from the API server (the claims of one call together, outside the lock),
then, under one lock, its CDI spec is written and it is checkpointed before the answer goes
back. Unprepare removes the spec, then the checkpoint entry; a claim it does not know is
already unprepared. Both, and the reconcile of the prepared claims against the API server, are
`prepare.ClaimPreparer`'s. Every prepared claim is an allocation in the daemon's book, granted per
GPU the memory and compute it consumed: the snapshot, /status, /metrics and the enforcer treat it
like any other. Who uses each claim is `users.ClaimUsers`'.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deviceplugin.config import Config
from deviceplugin.dra.claims import (
    PreparedClaim,
    claim_owners,
    claim_record,
    plans_by_device,
    reserved_pods,
)
from deviceplugin.dra.kubeapi import ApiCallError, KubeApi
from deviceplugin.dra.prepare import ClaimPreparer
from deviceplugin.dra.settings import DraSettings
from deviceplugin.dra.slices import build_devices, device_plans, inventory_health
from deviceplugin.dra.slices import device_name as plan_device_name
from deviceplugin.dra.store import ClaimStore
from deviceplugin.dra.users import ClaimUsers, Users
from deviceplugin.kubelet.draplugin import ClaimRef, HealthReport, PrepareResult
from deviceplugin.kubelet.podresources import PodResourcesClient
from deviceplugin.memlimits.cdihook import LimitHooks
from deviceplugin.model import AllocationRecord, Inventory, NodeSnapshot
from deviceplugin.mpsnamespaces import NO_NAMESPACES, ContainerNamespaces
from deviceplugin.owners import AllocationOwners
from deviceplugin.state import AllocationBook

log = logging.getLogger(__name__)


class DraDriver:
    """The prepared claims and the kubelet's calls on them (a `draplugin.Preparer`)."""

    def __init__(
        self,
        settings: DraSettings,
        config: Callable[[], Config],
        state_dir: Path,
        book: AllocationBook,
        api: KubeApi,
        *,
        snapshot: Callable[[], NodeSnapshot | None] = lambda: None,
        on_claims_changed: Callable[[], None] = lambda: None,
        pod_resources: PodResourcesClient | None = None,
        hooks: LimitHooks | None = None,
        mps_namespaces: ContainerNamespaces = NO_NAMESPACES,
    ) -> None:
        self.settings = settings
        # The daemon's current config (a reload replaces it): new claims get its env settings.
        self._config = config
        self._book = book
        self._api = api
        self._snapshot = snapshot
        self._on_claims_changed = on_claims_changed
        self.store = ClaimStore(state_dir)
        self._lock = asyncio.Lock()
        self._preparer = ClaimPreparer(
            settings,
            config,
            self.store,
            api,
            lock=self._lock,
            plans=lambda: plans_by_device(self._built),
            on_change=self._claims_changed,
            hooks=hooks,
            mps_namespaces=mps_namespaces,
        )
        # Read by the poll worker: replaced whole, never changed in place.
        self._claims: tuple[PreparedClaim, ...] = ()
        self._built = Inventory()
        self._health_changed = asyncio.Event()
        self.users = ClaimUsers(
            pod_resources,
            settings.driver_name,
            lambda: self._claims,
            on_change=self._sync_book,
            reread=self._reread_pods,
        )
        # The last evidence and the claims and users it was made of.
        self._evidence: tuple[tuple[PreparedClaim, ...], Users, AllocationOwners] | None = None

    # --- the poll's view -------------------------------------------------------------------

    def view(self, built: Inventory) -> Inventory:
        """Called by the poll worker with the inventory it built: remember its plans and health
        for the slice, and hand back its plans alone (nothing is advertised as slices; the
        prepared claims are allocations of the book, with their grants)."""
        self._built = built
        return Inventory.of(built.plans, ())

    def health_changed(self) -> None:
        """The devices changed (after a poll): the dra-health stream sends them again."""
        self._health_changed.set()

    def _reasons(self) -> dict[str, str]:
        snapshot = self._snapshot()
        if snapshot is None:
            return {}
        return {g.reading.info.uuid: g.reading.health_reason for g in snapshot.gpus}

    def devices(self) -> list[dict[str, Any]]:
        """The devices of the node's ResourceSlice, with the request policies of the current
        config (a reload republishes the slice)."""
        return build_devices(
            self._built, self._config().dra, self.settings.driver_name, self._reasons()
        )

    def evidence(self) -> AllocationOwners:
        """Attribution's evidence in DRA mode: each prepared claim held by the containers the
        kubelet's pod-resources DRA entries list for it, in the pods it is reserved for (a
        claim from a process outside them is refused). Read by the poll worker; the same object
        while the claims and their users are (both are replaced whole on a change), so that a
        poll of unchanged processes reuses the last attribution."""
        claims, users = self._claims, self.users.users
        last = self._evidence
        if last is not None and last[0] is claims and last[1] is users:
            return last[2]
        owners = claim_owners(claims, users)
        self._evidence = (claims, users, owners)
        return owners

    # --- prepare and unprepare ---------------------------------------------------------------

    def _claims_changed(self) -> None:
        self._claims = tuple(self.store)
        self._sync_book()
        self.users.wanted()
        self._on_claims_changed()

    def _sync_book(self) -> None:
        self._book.sync(self._records(), now_s=time.time(), grace_s=0.0)

    def _records(self) -> list[AllocationRecord]:
        users = self.users.users
        return [claim_record(c, _container_names(users.get(c.uid, ()))) for c in self._claims]

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        return await self._preparer.prepare(claims)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        return await self._preparer.unprepare(claims)

    @property
    def claims(self) -> tuple[PreparedClaim, ...]:
        """The prepared claims (replaced whole on a change)."""
        return self._claims

    async def reread_claim(self, claim: PreparedClaim, pod_uid: str) -> bool:
        """Read the claim's pods again (a container of pod `pod_uid`, which the claim was not
        reserved for when it was prepared, asks for its memory limits); whether they changed."""
        before = claim.pods
        await self._reread_pods(claim, frozenset({pod_uid}))
        current = self.store.get(claim.uid)
        return current is not None and current.pods != before

    async def _reread_pods(self, claim: PreparedClaim, unknown: frozenset[str]) -> bool:
        """Read the claim's pods (`reservedFor`) again: `unknown` pods use it on this node.
        Whether it could be read."""
        where = f"claim={claim.namespace}/{claim.name} uid={claim.uid}"
        try:
            obj = await self._api.get_claim(claim.namespace, claim.name)
        except ApiCallError as e:
            log.warning(
                "cannot read the pods of a claim that more pods use; their processes are "
                "refused until it can be read %s pods=%s error=%s",
                where,
                ",".join(sorted(unknown)),
                e,
            )
            return False
        if str((obj.get("metadata") or {}).get("uid") or "") != claim.uid:
            return True  # made again since: the kubelet unprepares this one
        pods = reserved_pods(obj)
        async with self._lock:
            current = self.store.get(claim.uid)
            if current is None or current.pods == pods:
                return True
            self.store.put(replace(current, pods=pods))
            log.info("claim's pods changed %s pods=%s", where, ",".join(name for name, _ in pods))
            self._claims_changed()
        return True

    # --- health stream ----------------------------------------------------------------------

    async def watch_health(self) -> AsyncIterator[list[HealthReport]]:
        while True:
            self._health_changed.clear()
            health = inventory_health(self._built, self._reasons())
            now = int(time.time())
            yield [
                HealthReport(
                    self.settings.node_name,
                    plan_device_name(plan),
                    health.get(plan.gpu.uuid) is None or health[plan.gpu.uuid].healthy,
                    "" if plan.gpu.uuid not in health else health[plan.gpu.uuid].reason,
                    now,
                )
                for plan in device_plans(self._built)
            ]
            await self._health_changed.wait()

    # --- running ----------------------------------------------------------------------------

    def recover(self) -> None:
        """Load the checkpoint, before the first poll: the enforcer knows the claims at once."""
        self.store.load()
        self._claims = tuple(self.store)
        if self._claims:
            self._sync_book()

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the claims' users current and the prepared claims reconciled until `stop`."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.users.run(stop), name="dra-names")
            tasks.create_task(self._preparer.run_reconcile(stop), name="dra-reconcile")


def _container_names(users: Sequence[tuple[str, str]]) -> str:
    """The container names of a claim's users, for /status: `main`, or `main,sidecar`."""
    return ",".join(dict.fromkeys(c for _, c in users))
