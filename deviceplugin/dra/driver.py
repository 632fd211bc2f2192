"""The DRA driver: prepared claims, their CDI specs, the node's ResourceSlice, and the kubelet
plugin sockets, run by the daemon in `--kubelet-api dra` mode (docs/dra.md).

Prepare (per claim): a claim already prepared answers what it answered before; otherwise its
allocation is read from the API server (the claims of one call together, outside the lock),
then, under one lock, its CDI spec is written and it is checkpointed before the answer goes
back. Unprepare removes the spec, then the checkpoint entry; a claim it does not know is
already unprepared. Every prepared claim is an allocation in the daemon's book, granted per GPU
the memory and compute it consumed: the snapshot, /status, /metrics and the enforcer treat it
like any other.

The ResourceSlice follows the poll's inventory (GPUs, their health, the MIG layout, a reload's
new plan): whenever the devices it would publish change, it is created or updated (a new pool
generation) and any other slice of this driver on this node is deleted. An API server that
does not answer is retried with backoff; the daemon keeps serving what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from deviceplugin.config import Config
from deviceplugin.dra import cdi
from deviceplugin.dra.claims import (
    ClaimError,
    ClaimOwner,
    PreparedClaim,
    claim_edits,
    claim_owners,
    claim_record,
    plans_by_device,
    read_claim,
    reserved_pods,
)
from deviceplugin.dra.grpcserver import (
    ClaimRef,
    HealthReport,
    PluginServers,
    PreparedDevice,
    PrepareResult,
)
from deviceplugin.dra.kubeapi import ApiCallError, KubeApi
from deviceplugin.dra.podresources import claim_containers
from deviceplugin.dra.settings import DraSettings, GpuCdi
from deviceplugin.dra.slices import build_devices, build_slice, device_plans, inventory_health
from deviceplugin.dra.slices import device_name as plan_device_name
from deviceplugin.dra.store import ClaimStore
from deviceplugin.model import AllocationRecord, Inventory, NodeSnapshot
from deviceplugin.state import AllocationBook

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
RESYNC_S = 300.0
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
        # Read by the poll worker: replaced whole, never changed in place.
        self._claims: tuple[PreparedClaim, ...] = ()
        self._built = Inventory()
        self._published: list[dict[str, Any]] | None = None
        self._publish = asyncio.Event()
        self._health_changed = asyncio.Event()
        self.servers = PluginServers(
            self,
            settings.driver_name,
            settings.service_socket,
            settings.registration_socket,
            on_registered=self._publish.set,
        )
        self.slice_writes = 0
        self.slice_failures = 0
        # (pod, container) names using each prepared claim, by claim UID, from pod-resources:
        # replaced whole (the poll worker reads it).
        self._pod_resources = pod_resources_socket
        self._users: dict[str, tuple[tuple[str, str], ...]] = {}
        # The pod names pod-resources listed with a claim when it was last read again for them.
        self._looked_up: dict[str, frozenset[str]] = {}
        self._names_wanted = asyncio.Event()
        # Whether pod-resources answered the last query (for /healthz and /status).
        self.pod_resources_ok = False

    # --- the poll's view -------------------------------------------------------------------

    def inventory_view(self, built: Inventory) -> Inventory:
        """Called by the poll worker with the inventory it built: remember its plans and health
        for the slice, and hand back its plans alone (nothing is advertised as slices; the
        prepared claims are allocations of the book, with their grants)."""
        self._built = built
        return Inventory.of(built.plans, ())

    def inventory_changed(self, _: Inventory) -> None:
        """After each poll, on the event loop: publish when the devices changed."""
        if self._devices() != self._published:
            self._publish.set()
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

    def claim_owners(self) -> list[ClaimOwner]:
        """Attribution's evidence in DRA mode: each prepared claim held by the containers the
        kubelet's pod-resources DRA entries list for it, in the pods it is reserved for (a
        claim from a process outside them is refused). Read by the poll worker."""
        return claim_owners(self._claims, self._users)

    @property
    def registered(self) -> bool:
        return self.servers.registration.registered

    # --- prepare and unprepare ---------------------------------------------------------------

    def _claims_changed(self) -> None:
        self._claims = tuple(self.store)
        self._book.sync(self._records(), now_s=time.time(), grace_s=0.0)
        self._names_wanted.set()
        self._on_claims_changed()

    def _records(self) -> list[AllocationRecord]:
        return [claim_record(c, _container_names(self._users.get(c.uid, ()))) for c in self._claims]

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        # The claims are read from the API server together and before the lock: a GET that is
        # slow to answer costs the call one API timeout, whatever the number of claims, and
        # holds up no other prepare or unprepare.
        fetched = await asyncio.gather(
            *(self._fetch(ref) for ref in claims), return_exceptions=True
        )
        async with self._lock:
            for ref, got in zip(claims, fetched, strict=True):
                try:
                    if isinstance(got, BaseException):
                        raise got
                    prepared = await self._prepare_one(ref, got)
                except (ClaimError, ApiCallError, OSError) as e:
                    log.error(
                        "prepare failed claim=%s/%s uid=%s error=%s",
                        ref.namespace,
                        ref.name,
                        ref.uid,
                        e,
                    )
                    results[ref.uid] = PrepareResult(error=str(e))
                    continue
                results[ref.uid] = PrepareResult(
                    tuple(
                        PreparedDevice(
                            request_names=(d.request,),
                            pool_name=self.settings.node_name,
                            device_name=d.device,
                            cdi_device_ids=prepared.cdi_ids,
                            share_id=d.share_id,
                        )
                        for d in prepared.devices
                    )
                )
            self._claims_changed()
        return results

    async def _fetch(self, ref: ClaimRef) -> dict[str, Any] | None:
        """The claim from the API server; None for one prepared before (nothing to read)."""
        if self.store.get(ref.uid) is not None:
            return None
        return await self._api.get_claim(ref.namespace, ref.name)

    async def _prepare_one(self, ref: ClaimRef, obj: dict[str, Any] | None) -> PreparedClaim:
        """Under the lock. `obj`: the claim as `_fetch` read it."""
        known = self.store.get(ref.uid)
        if known is not None:
            # Prepared before (a retry, a kubelet restart): the same answer; the spec again in
            # case it was lost.
            self._write_spec(known)
            return known
        if obj is None:  # unprepared since `_fetch` found it prepared
            obj = await self._api.get_claim(ref.namespace, ref.name)
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if uid != ref.uid:
            raise ClaimError(
                f"ResourceClaim {ref.namespace}/{ref.name} has uid {uid}, not {ref.uid}: "
                "it was deleted and made again"
            )
        claim = read_claim(
            obj,
            driver_name=self.settings.driver_name,
            node_name=self.settings.node_name,
            plans=plans_by_device(self._built),
            now_s=time.time(),
        )
        nvidia = self.settings.gpu_cdi == GpuCdi.NVIDIA
        claim = _with_cdi_ids(claim, cdi.cdi_ids(self.settings.driver_name, claim, nvidia=nvidia))
        self._write_spec(claim)
        self.store.put(claim)
        per_gpu = ", ".join(
            f"{d.device}: memory={memory} compute={compute:g}"
            for d, memory, compute in claim.per_gpu()
        )
        log.info(
            "claim prepared claim=%s/%s uid=%s allocation=%s pods=%s %s",
            claim.namespace,
            claim.name,
            claim.uid,
            claim.allocation_id,
            ",".join(p for p, _ in claim.pods),
            per_gpu,
        )
        return claim

    def _write_spec(self, claim: PreparedClaim) -> None:
        config = self._config()
        edits = claim_edits(
            claim,
            config.allocation,
            config.mps,
            device_nodes=self.settings.gpu_cdi == GpuCdi.DEVICE_NODES,
        )
        cdi.write_spec(self.settings.cdi_dir, self.settings.driver_name, claim, edits)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        errors: dict[str, str] = {}
        async with self._lock:
            for ref in claims:
                try:
                    cdi.remove_spec(self.settings.cdi_dir, self.settings.driver_name, ref.uid)
                    if self.store.remove(ref.uid):
                        log.info(
                            "claim unprepared claim=%s/%s uid=%s", ref.namespace, ref.name, ref.uid
                        )
                    errors[ref.uid] = ""
                except OSError as e:
                    log.error("unprepare failed uid=%s error=%s", ref.uid, e)
                    errors[ref.uid] = f"cannot remove the CDI spec of claim {ref.uid}: {e}"
            self._claims_changed()
        return errors

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

    # --- the ResourceSlice ------------------------------------------------------------------

    async def publish_once(self) -> None:
        """Make the API server hold exactly our one slice with the current devices."""
        devices = self._devices()
        s = self.settings
        existing = await self._api.list_slices(s.node_name, s.driver_name)
        desired = build_slice(s.node_name, s.driver_name, devices, 1)
        name = desired["metadata"]["name"]
        ours = next((e for e in existing if e["metadata"]["name"] == name), None)
        if ours is None:
            owner = await self._owner()
            desired = build_slice(s.node_name, s.driver_name, devices, 1, owner)
            await self._api.create_slice(desired)
            log.info("ResourceSlice created name=%s devices=%d", name, len(devices))
            self.slice_writes += 1
        elif (ours.get("spec") or {}).get("devices") != devices:
            generation = int(ours["spec"]["pool"].get("generation", 0)) + 1
            desired = build_slice(s.node_name, s.driver_name, devices, generation)
            desired["metadata"] = {
                **ours["metadata"],
                "labels": desired["metadata"]["labels"],
            }
            await self._api.replace_slice(desired)
            log.info(
                "ResourceSlice updated name=%s devices=%d generation=%d",
                name,
                len(devices),
                generation,
            )
            self.slice_writes += 1
        for other in existing:
            if other["metadata"]["name"] != name:
                await self._api.delete_slice(other["metadata"]["name"])
                log.info("ResourceSlice deleted name=%s", other["metadata"]["name"])
        self._published = devices

    async def _owner(self) -> dict[str, str] | None:
        try:
            node = await self._api.get_node(self.settings.node_name)
        except ApiCallError as e:
            log.warning("ResourceSlice without an owner: cannot read the Node: %s", e)
            return None
        uid = (node.get("metadata") or {}).get("uid")
        return {"name": self.settings.node_name, "uid": str(uid)} if uid else None

    async def _publish_loop(self, stop: asyncio.Event) -> None:
        delay = RETRY_FIRST_S
        self._publish.set()
        while not stop.is_set():
            waiter = asyncio.ensure_future(self._publish.wait())
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait(
                    {waiter, stopper}, timeout=RESYNC_S, return_when="FIRST_COMPLETED"
                )
            finally:
                waiter.cancel()
                stopper.cancel()
            if stop.is_set():
                return
            self._publish.clear()
            try:
                await self.publish_once()
                delay = RETRY_FIRST_S
            except ApiCallError as e:
                self.slice_failures += 1
                log.warning("ResourceSlice not written; retrying in %.1fs: %s", delay, e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(delay * 2, RETRY_MAX_S)
                self._publish.set()

    # --- running ----------------------------------------------------------------------------

    def recover(self) -> None:
        """Load the checkpoint, before the first poll: the enforcer knows the claims at once."""
        self.store.load()
        self._claims = tuple(self.store)
        if self._claims:
            self._book.sync(self._records(), now_s=time.time(), grace_s=0.0)

    async def _watch_slice(self, stop: asyncio.Event) -> None:
        """Publish again when our slice is deleted behind our back (a kubelet that starts wipes
        its node's slices; an operator's kubectl delete)."""
        s = self.settings
        delay = RETRY_FIRST_S
        while not stop.is_set():
            try:
                async for kind, name in self._api.watch_slices(s.node_name, s.driver_name):
                    delay = RETRY_FIRST_S
                    if kind == "DELETED":
                        log.info(
                            "ResourceSlice deleted by someone else; publishing again name=%s", name
                        )
                        self._published = None
                        self._publish.set()
            except ApiCallError as e:
                log.info("ResourceSlice watch ended; watching again in %.1fs: %s", delay, e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _name_containers(self, stop: asyncio.Event) -> None:
        """Keep each prepared claim's users current: the (pod, container) pairs the kubelet's
        pod-resources DRA entries list with it. Asked after every change of the claims, every
        second while a claim has none or pod-resources does not answer, and every
        `USERS_EVERY_S` while claims are prepared: a pod that joins a claim already prepared
        on the node (a claim shared by pods) is not prepared again, so nothing else tells the
        driver. A pod listed that the claim was not reserved for when it was prepared has the
        claim read again from the API server, for the pod's UID."""
        if self._pod_resources is None:
            return
        warned = False
        while not stop.is_set():
            self._names_wanted.clear()
            if self._claims or not self.pod_resources_ok:
                try:
                    users = await claim_containers(self._pod_resources, self.settings.driver_name)
                    warned = False
                    self.pod_resources_ok = True
                except grpc.aio.AioRpcError as e:
                    users = None
                    self.pod_resources_ok = False
                    if not warned:
                        log.warning(
                            "pod-resources not answering; the claims' processes are refused "
                            "until it names their containers socket=%s error=%s",
                            self._pod_resources,
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
                watch = tasks.create_task(self._watch_slice(stop), name="dra-watch")
                try:
                    await self._publish_loop(stop)
                finally:
                    watch.cancel()
        finally:
            await self.servers.stop()
            await self._api.close()


def _container_names(users: Sequence[tuple[str, str]]) -> str:
    """The container names of a claim's users, for /status: `main`, or `main,sidecar`."""
    return ",".join(dict.fromkeys(c for _, c in users))


def _with_cdi_ids(claim: PreparedClaim, ids: tuple[str, ...]) -> PreparedClaim:
    return replace(claim, cdi_ids=ids)
