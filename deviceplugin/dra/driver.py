"""The DRA driver: prepared claims, their CDI specs, the node's ResourceSlice, and the kubelet
plugin sockets, run by the daemon in `--kubelet-api dra` mode (docs/dra.md).

Prepare (per claim): a claim already prepared answers what it answered before; otherwise its
allocation is read from the API server (the claims of one call together, outside the lock),
then, under one lock, its CDI spec is written and it is checkpointed before the answer goes
back. Unprepare removes the spec, then the checkpoint entry; a claim it does not know is
already unprepared. Both, and the reconcile of the prepared claims against the API server, are
`prepare.ClaimPreparer`'s. Every prepared claim is an allocation in the daemon's book, granted per
GPU the memory and compute it consumed: the snapshot, /status, /metrics and the enforcer treat it
like any other.

The ResourceSlice follows the poll's inventory (GPUs, their health, the MIG layout, a reload's
new plan): whenever the devices it would publish change, the publisher (`publisher`) writes it.
The kubelet's registration is watched: a driver the kubelet has not registered within
`REGISTRATION_WARN_S` (a wrong --kubelet-root-dir: the kubelet never finds its socket) says so
in a WARNING, again every `REGISTRATION_WARN_S`, and fails /healthz after
`UNREGISTERED_UNHEALTHY_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from deviceplugin.config import Config
from deviceplugin.dra.claims import (
    PreparedClaim,
    claim_owners,
    claim_record,
    plans_by_device,
    reserved_pods,
)
from deviceplugin.dra.grpcserver import (
    ClaimRef,
    HealthReport,
    PluginServers,
    PrepareResult,
)
from deviceplugin.dra.kubeapi import ApiCallError, KubeApi
from deviceplugin.dra.prepare import ClaimPreparer
from deviceplugin.dra.publisher import SlicePublisher, until_set
from deviceplugin.dra.settings import DraSettings
from deviceplugin.dra.slices import build_devices, device_plans, inventory_health
from deviceplugin.dra.slices import device_name as plan_device_name
from deviceplugin.dra.store import ClaimStore
from deviceplugin.kubelet.podresources import PodResourcesClient
from deviceplugin.model import AllocationRecord, Inventory, NodeSnapshot
from deviceplugin.owners import AllocationOwners
from deviceplugin.state import AllocationBook

log = logging.getLogger(__name__)

# A driver the kubelet has not registered this long is warned about (and every as long again);
# /healthz fails after UNREGISTERED_UNHEALTHY_S.
REGISTRATION_WARN_S = 30.0
UNREGISTERED_UNHEALTHY_S = 60.0
# How often pod-resources is asked for the prepared claims' users: while a claim has none yet,
# and otherwise while claims are prepared (a pod joining a prepared claim).
NAMES_EVERY_S = 1.0
USERS_EVERY_S = 5.0


class DraDriver:
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
        pod_resources_socket: Path | None = None,
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
        )
        # Read by the poll worker: replaced whole, never changed in place.
        self._claims: tuple[PreparedClaim, ...] = ()
        self._built = Inventory()
        self._health_changed = asyncio.Event()
        self.publisher = SlicePublisher(settings, api, self._devices)
        self.servers = PluginServers(
            self,
            settings.driver_name,
            settings.service_socket,
            settings.registration_socket,
            # A kubelet that starts removes its node's ResourceSlices: publish again.
            on_registered=self._on_registered,
        )
        # Since when (monotonic) the kubelet has not registered the driver; 0 while it has.
        self.unregistered_since_s = 0.0
        # (pod, container) names using each prepared claim, by claim UID, from pod-resources:
        # replaced whole (the poll worker reads it).
        # One channel for every ask (a new one only after a failed call).
        self._pod_resources = (
            None if pod_resources_socket is None else PodResourcesClient(pod_resources_socket)
        )
        self._users: dict[str, tuple[tuple[str, str], ...]] = {}
        # The pod names pod-resources listed with a claim when it was last read again for them.
        self._looked_up: dict[str, frozenset[str]] = {}
        self._names_wanted = asyncio.Event()
        # Whether pod-resources answered the last query (for /healthz and /status).
        self.pod_resources_ok = False
        # The last evidence and the claims and users it was made of.
        self._evidence: (
            tuple[
                tuple[PreparedClaim, ...], dict[str, tuple[tuple[str, str], ...]], AllocationOwners
            ]
            | None
        ) = None

    # --- the poll's view -------------------------------------------------------------------

    def inventory_view(self, built: Inventory) -> Inventory:
        """Called by the poll worker with the inventory it built: remember its plans and health
        for the slice, and hand back its plans alone (nothing is advertised as slices; the
        prepared claims are allocations of the book, with their grants)."""
        self._built = built
        return Inventory.of(built.plans, ())

    def inventory_changed(self, _: Inventory) -> None:
        """After each poll, on the event loop: publish when the devices changed."""
        if self._devices() != self.publisher.attempted:
            self.publisher.request()
            self._health_changed.set()

    def _reasons(self) -> dict[str, str]:
        snapshot = self._snapshot()
        if snapshot is None:
            return {}
        return {g.reading.info.uuid: g.reading.health_reason for g in snapshot.gpus}

    def _devices(self) -> list[dict[str, Any]]:
        # The request policies of the current config: a reload republishes the slice.
        return build_devices(
            self._built, self._config().dra, self.settings.driver_name, self._reasons()
        )

    def evidence(self) -> AllocationOwners:
        """Attribution's evidence in DRA mode: each prepared claim held by the containers the
        kubelet's pod-resources DRA entries list for it, in the pods it is reserved for (a
        claim from a process outside them is refused). Read by the poll worker; the same object
        while the claims and their users are (both are replaced whole on a change), so that a
        poll of unchanged processes reuses the last attribution."""
        claims, users = self._claims, self._users
        last = self._evidence
        if last is not None and last[0] is claims and last[1] is users:
            return last[2]
        owners = claim_owners(claims, users)
        self._evidence = (claims, users, owners)
        return owners

    def _on_registered(self) -> None:
        self.publisher.request()

    @property
    def registered(self) -> bool:
        return self.servers.registration.registered

    def unhealthy(self, now_mono_s: float) -> str:
        """Why /healthz fails on the driver's account ("" when it does not): the kubelet has not
        registered it for UNREGISTERED_UNHEALTHY_S, or the API server refuses its slice."""
        since = self.unregistered_since_s
        if not self.registered and since > 0 and now_mono_s - since > UNREGISTERED_UNHEALTHY_S:
            return (
                f"the kubelet has not registered the DRA driver for {now_mono_s - since:.1f}s "
                f"(limit {UNREGISTERED_UNHEALTHY_S:g}s): {self._unregistered_hint()}"
            )
        return self.publisher.unhealthy(now_mono_s)

    def _unregistered_hint(self) -> str:
        registration = self.servers.registration
        socket = self.settings.registration_socket
        if registration.error:
            return f"it refused the registration: {registration.error}"
        if registration.info_requests == 0:
            return (
                f"it never asked for the driver's info at {socket}; is --kubelet-root-dir "
                f"({self.settings.kubelet_root_dir}) the kubelet's --root-dir?"
            )
        return f"it asked for the driver's info at {socket} but never confirmed the registration"

    async def _watch_registration(self, stop: asyncio.Event) -> None:
        """A WARNING every REGISTRATION_WARN_S while the kubelet has not registered the driver,
        and `unregistered_since_s` kept for /healthz and /status."""
        self.unregistered_since_s = time.monotonic()
        state = self.servers.registration
        while not stop.is_set():
            await until_set(stop, state.changed, REGISTRATION_WARN_S)
            if stop.is_set():
                return
            if state.registered:
                self.unregistered_since_s = 0.0
                continue
            now = time.monotonic()
            if self.unregistered_since_s == 0.0:
                self.unregistered_since_s = now
            if now - self.unregistered_since_s >= REGISTRATION_WARN_S:
                log.warning(
                    "the kubelet has not registered the DRA driver for %.0fs; claims cannot be "
                    "prepared on this node driver=%s registration_socket=%s reason=%s",
                    now - self.unregistered_since_s,
                    self.settings.driver_name,
                    self.settings.registration_socket,
                    self._unregistered_hint(),
                )

    # --- prepare and unprepare ---------------------------------------------------------------

    def _claims_changed(self) -> None:
        self._claims = tuple(self.store)
        self._book.sync(self._records(), now_s=time.time(), grace_s=0.0)
        self._names_wanted.set()
        self._on_claims_changed()

    def _records(self) -> list[AllocationRecord]:
        return [claim_record(c, _container_names(self._users.get(c.uid, ()))) for c in self._claims]

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        return await self._preparer.prepare(claims)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        return await self._preparer.unprepare(claims)

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
            self._book.sync(self._records(), now_s=time.time(), grace_s=0.0)

    async def _name_containers(self, stop: asyncio.Event) -> None:
        """Keep each prepared claim's users current: the (pod, container) pairs the kubelet's
        pod-resources DRA entries list with it. Asked after every change of the claims, every
        second while a claim has none or pod-resources does not answer, and every
        `USERS_EVERY_S` while claims are prepared: a pod that joins a claim already prepared
        on the node (a claim shared by pods) is not prepared again, so nothing else tells the
        driver. A pod listed that the claim was not reserved for when it was prepared has the
        claim read again from the API server, for the pod's UID."""
        client = self._pod_resources
        if client is None:
            return
        try:
            await self._ask_for_names(client, stop)
        finally:
            await client.close()

    async def _ask_for_names(self, client: PodResourcesClient, stop: asyncio.Event) -> None:
        warned = False
        while not stop.is_set():
            self._names_wanted.clear()
            if self._claims or not self.pod_resources_ok:
                try:
                    users = await client.claim_users(self.settings.driver_name)
                    warned = False
                    self.pod_resources_ok = True
                except grpc.aio.AioRpcError as e:
                    users = None
                    self.pod_resources_ok = False
                    if not warned:
                        log.warning(
                            "pod-resources not answering; the claims' processes are refused "
                            "until it names their containers socket=%s error=%s",
                            client.socket,
                            e.code().name,
                        )
                        warned = True
                if users is not None:
                    await self._update_users(users)
            waiter = asyncio.ensure_future(self._names_wanted.wait())
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait(
                    {waiter, stopper},
                    timeout=self._next_names_s(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                waiter.cancel()
                stopper.cancel()

    def _next_names_s(self) -> float | None:
        if not self.pod_resources_ok or any(c.uid not in self._users for c in self._claims):
            return NAMES_EVERY_S
        return USERS_EVERY_S if self._claims else None

    async def _update_users(self, users: Mapping[tuple[str, str], list[tuple[str, str]]]) -> None:
        """Take pod-resources' answer: each claim's users (a claim it lists none for keeps
        those it had: a pod between two containers' lives); the claim read again for a pod
        listed with it that it was not reserved for."""
        found: dict[str, tuple[tuple[str, str], ...]] = {}
        for claim in self._claims:
            listed = tuple(users.get((claim.namespace, claim.name), ()))
            if listed:
                found[claim.uid] = listed
            elif claim.uid in self._users:
                found[claim.uid] = self._users[claim.uid]
        changed = found != self._users
        self._users = found
        for claim in self._claims:
            pods = frozenset(p for p, _ in found.get(claim.uid, ()))
            unknown = pods - {name for name, _ in claim.pods}
            if unknown and self._looked_up.get(claim.uid) != pods:
                self._looked_up[claim.uid] = pods
                await self._refresh_pods(claim, unknown)
        known = {c.uid for c in self._claims}
        self._looked_up = {u: p for u, p in self._looked_up.items() if u in known}
        if changed:
            self._book.sync(self._records(), now_s=time.time(), grace_s=0.0)

    async def _refresh_pods(self, claim: PreparedClaim, unknown: frozenset[str]) -> None:
        """Read the claim's pods (`reservedFor`) again: `unknown` pods use it on this node."""
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
            self._looked_up.pop(claim.uid, None)  # asked again next time
            return
        if str((obj.get("metadata") or {}).get("uid") or "") != claim.uid:
            return  # made again since: the kubelet unprepares this one
        pods = reserved_pods(obj)
        async with self._lock:
            current = self.store.get(claim.uid)
            if current is None or current.pods == pods:
                return
            self.store.put(replace(current, pods=pods))
            log.info("claim's pods changed %s pods=%s", where, ",".join(name for name, _ in pods))
            self._claims_changed()

    async def run(self, stop: asyncio.Event) -> None:
        await self.servers.start()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._name_containers(stop), name="dra-names")
                tasks.create_task(self._watch_registration(stop), name="dra-registration")
                tasks.create_task(self._preparer.run_reconcile(stop), name="dra-reconcile")
                watch = tasks.create_task(self.publisher.watch(stop), name="dra-watch")
                try:
                    await self.publisher.run(stop)
                finally:
                    watch.cancel()
        finally:
            await self.servers.stop()
            await self._api.close()


def _container_names(users: Sequence[tuple[str, str]]) -> str:
    """The container names of a claim's users, for /status: `main`, or `main,sidecar`."""
    return ",".join(dict.fromkeys(c for _, c in users))
