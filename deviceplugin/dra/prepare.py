"""Prepare, unprepare and reconcile of the DRA driver's claims (docs/dra.md, "Prepare and
unprepare").

- Every claim reference is checked before it is used (`refs`): a UID, a namespace or a name that
  is not a Kubernetes one fails that claim, naming it, and is never sent to the API server nor
  made a file name.
- Each claim of a call is answered on its own: whatever goes wrong with one (the API server, its
  answer, its amounts, a file) fails that claim with its reason, never the others. A call the
  kubelet gives up on (cancelled) undoes what it wrote for claims it had not answered: their CDI
  specs and checkpoint entries.
- Prepare and Unprepare of one claim are ordered. The claims of a Prepare are read from the API
  server outside the lock (a slow API server holds up no other call); an Unprepare that arrives
  meanwhile marks the claim, and that Prepare then gives up on it, with an error, writing
  nothing. Writing a spec and the checkpoint, and removing them, happen under the lock.
- Every `reconcile_every_s` the prepared claims are read from the API server: one it no longer
  has, or has under another UID (deleted and made again), is unprepared (its spec removed, its
  checkpoint entry dropped, logged). A CDI spec of this driver whose claim is not in the
  checkpoint (a checkpoint moved aside, a daemon killed between the two writes) is taken back
  when the API server still has its claim with that UID, and removed otherwise. A claim the API
  server does not answer for is left as it is until the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from deviceplugin import statefiles
from deviceplugin.config import Config
from deviceplugin.dra import cdi
from deviceplugin.dra.claims import ClaimError, PreparedClaim, claim_edits, read_claim
from deviceplugin.dra.kubeapi import ApiCallError, KubeApi
from deviceplugin.dra.mpsclaims import claim_namespace, in_namespace
from deviceplugin.dra.params import with_memory_limits
from deviceplugin.dra.refs import escaped, ref_problem, shown, uid_problem
from deviceplugin.dra.settings import DraSettings, GpuCdi
from deviceplugin.dra.store import ClaimStore
from deviceplugin.kubelet.draplugin import ClaimRef, PreparedDevice, PrepareResult
from deviceplugin.memlimits.cdihook import LimitHooks
from deviceplugin.model import GpuPlan, MpsNamespace
from deviceplugin.mpsnamespaces import NO_NAMESPACES, ContainerNamespaces

log = logging.getLogger("deviceplugin.dra.driver")

# A CDI spec larger than this is not read back (vgpu's are about a kilobyte).
MAX_SPEC_BYTES = 1 << 20
NOT_FOUND = 404


@dataclass(slots=True)
class _Flight:
    """A Prepare of one claim between its start and its answer; `unprepared` once an
    Unprepare of that claim has run meanwhile."""

    unprepared: bool = False


class ClaimPreparer:
    """The driver's NodePrepareResources/NodeUnprepareResources, and the reconcile."""

    def __init__(
        self,
        settings: DraSettings,
        config: Callable[[], Config],
        store: ClaimStore,
        api: KubeApi,
        *,
        lock: asyncio.Lock,
        plans: Callable[[], Mapping[str, GpuPlan]],
        on_change: Callable[[], None],
        hooks: LimitHooks | None = None,
        mps_namespaces: ContainerNamespaces = NO_NAMESPACES,
    ) -> None:
        self.settings = settings
        # Which claims' specs carry the memory-limit hook (None: none do).
        self._hooks = hooks
        # Under MPS v3, each claim's namespace, made before its spec is written.
        self._mps_namespaces = mps_namespaces
        self._config = config
        self._store = store
        self._api = api
        self._lock = lock
        self._plans = plans
        self._on_change = on_change
        # The Prepares in flight, by claim UID.
        self._flights: dict[str, list[_Flight]] = {}
        # Specs without a checkpoint entry whose claim cannot be prepared again: kept (a pod
        # may still run with it), said once.
        self._kept: set[str] = set()

    # --- prepare ---------------------------------------------------------------------------

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        valid: list[ClaimRef] = []
        for ref in refs:
            problem = ref_problem(ref.namespace, ref.name, ref.uid)
            if problem:
                results[ref.uid] = PrepareResult(error=self._failed("prepare", ref, problem))
            else:
                valid.append(ref)
        flights = [self._board(ref.uid) for ref in valid]
        try:
            # The claims are read from the API server together and before the lock: a GET that
            # is slow to answer costs the call one API timeout, whatever the number of claims,
            # and holds up no other prepare or unprepare.
            fetched = await asyncio.gather(
                *(self._fetch(ref) for ref in valid), return_exceptions=True
            )
            async with self._lock:
                written: list[str] = []
                try:
                    for ref, flight, got in zip(valid, flights, fetched, strict=True):
                        results[ref.uid] = await self._answer(ref, flight, got, written)
                except BaseException:
                    # The call was cancelled (the kubelet gave up on it): the claims it wrote
                    # are not answered, so they are not prepared either.
                    self._undo(written)
                    raise
                finally:
                    self._on_change()
        finally:
            for ref, flight in zip(valid, flights, strict=True):
                self._land(ref.uid, flight)
        return results

    async def _answer(
        self, ref: ClaimRef, flight: _Flight, got: object, written: list[str]
    ) -> PrepareResult:
        """One claim's answer, under the lock; `written` gets its UID if it was written now."""
        try:
            if isinstance(got, Exception):
                raise got
            if isinstance(got, BaseException):  # its read was cancelled, not this call
                raise ClaimError(
                    f"ResourceClaim {ref.namespace}/{ref.name}: its read was cancelled"
                )
            prepared, new = await self._prepare_one(ref, got, flight)
        except (ClaimError, ApiCallError, OSError) as e:
            return PrepareResult(error=self._failed("prepare", ref, str(e)))
        except Exception as e:
            log.error("unexpected error preparing a claim", exc_info=True)
            reason = f"cannot prepare ResourceClaim {ref.namespace}/{ref.name}: {e!r}"
            return PrepareResult(error=self._failed("prepare", ref, reason))
        if new:
            written.append(ref.uid)
        return PrepareResult(
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

    def _failed(self, action: str, ref: ClaimRef, reason: str) -> str:
        # Each format whole, as the operator's troubleshooting table quotes it.
        log.error(
            "prepare failed claim=%s/%s uid=%s error=%s"
            if action == "prepare"
            else "unprepare failed claim=%s/%s uid=%s error=%s",
            escaped(ref.namespace),
            escaped(ref.name),
            escaped(ref.uid),
            reason,
        )
        return reason

    async def _fetch(self, ref: ClaimRef) -> dict[str, Any] | None:
        """The claim from the API server; None for one prepared before (nothing to read)."""
        if self._store.get(ref.uid) is not None:
            return None
        return await self._api.get_claim(ref.namespace, ref.name)

    async def _prepare_one(
        self, ref: ClaimRef, obj: Any, flight: _Flight
    ) -> tuple[PreparedClaim, bool]:
        """Under the lock. `obj`: the claim as `_fetch` read it. The claim, and whether it was
        written now (not prepared before)."""
        label = f"ResourceClaim {ref.namespace}/{ref.name}"
        known = self._store.get(ref.uid)
        if known is not None:
            # Prepared before (a retry, a kubelet restart): the same answer; the spec again in
            # case it was lost (and its MPS namespace, which a restart of MPS made again).
            self._write_spec(known, await self._namespace(known))
            return known, False
        if obj is None:  # unprepared since `_fetch` found it prepared
            obj = await self._api.get_claim(ref.namespace, ref.name)
        if not isinstance(obj, dict):
            raise ClaimError(f"{label}: the API server's answer is not an object")
        meta = _metadata(obj)
        uid = meta.get("uid")
        if uid != ref.uid:
            raise ClaimError(
                f"{label} has uid {shown(uid)}, not {ref.uid}: it was deleted and made again"
            )
        if (meta.get("namespace"), meta.get("name")) != (ref.namespace, ref.name):
            raise ClaimError(f"{label}: the API server answered with another claim")
        claim = await self._read(obj)
        if flight.unprepared:
            raise ClaimError(
                f"{label} (uid {ref.uid}) was unprepared while it was being prepared: not "
                "prepared; the kubelet prepares it again if a pod still needs it"
            )
        claim = self._write(claim, await self._namespace(claim))
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
            ",".join(escaped(p) for p, _ in claim.pods),
            per_gpu,
        )
        return claim, True

    async def _read(self, obj: dict[str, Any]) -> PreparedClaim:
        """The claim's allocation on this node's devices (ClaimError if it has none), read off
        the event loop: every amount is bounded before it is converted, but the claim is the
        API server's, and its reading is no business of the loop's."""
        return await asyncio.to_thread(
            _read_claim,
            obj,
            driver_name=self.settings.driver_name,
            node_name=self.settings.node_name,
            plans=self._plans(),
            now_s=time.time(),
        )

    async def _namespace(self, claim: PreparedClaim) -> MpsNamespace | None:
        return await claim_namespace(self._mps_namespaces, claim, self._config().mps)

    def _write(self, claim: PreparedClaim, ns: MpsNamespace | None) -> PreparedClaim:
        """The claim's spec, then its checkpoint entry; neither when the second fails. The
        claim as written (with its CDI device IDs)."""
        nvidia = self.settings.gpu_cdi == GpuCdi.NVIDIA
        claim = replace(claim, cdi_ids=cdi.cdi_ids(self.settings.driver_name, claim, nvidia=nvidia))
        self._write_spec(claim, ns)
        try:
            self._store.put(claim)
        except BaseException:
            with contextlib.suppress(OSError):
                cdi.remove_spec(self.settings.cdi_dir, self.settings.driver_name, claim.uid)
            raise
        return claim

    def _write_spec(self, claim: PreparedClaim, ns: MpsNamespace | None) -> None:
        config = self._config()
        edits = claim_edits(
            claim,
            config.allocation,
            config.mps,
            device_nodes=self.settings.gpu_cdi == GpuCdi.DEVICE_NODES,
        )
        if ns is not None:
            edits = in_namespace(edits, ns, config.mps)
        hooks = self._hooks.for_grant(claim.allocation_id, claim.gpu_uuids) if self._hooks else []
        cdi.write_spec(self.settings.cdi_dir, self.settings.driver_name, claim, edits, hooks)

    def _undo(self, uids: Sequence[str]) -> None:
        for uid in uids:
            try:
                self._drop(uid)
            except OSError as e:
                log.error("cannot undo an unanswered prepare uid=%s error=%s", uid, e)
            else:
                log.warning("prepare not answered (the call was cancelled); undone uid=%s", uid)

    def _drop(self, uid: str) -> bool:
        """Remove the claim's spec, then its checkpoint entry; whether it was prepared."""
        cdi.remove_spec(self.settings.cdi_dir, self.settings.driver_name, uid)
        return self._store.remove(uid)

    def _board(self, uid: str) -> _Flight:
        flight = _Flight()
        self._flights.setdefault(uid, []).append(flight)
        return flight

    def _land(self, uid: str, flight: _Flight) -> None:
        flights = self._flights.get(uid, [])
        if flight in flights:
            flights.remove(flight)
        if not flights:
            self._flights.pop(uid, None)

    # --- unprepare -------------------------------------------------------------------------

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        errors: dict[str, str] = {}
        async with self._lock:
            try:
                for ref in refs:
                    errors[ref.uid] = self._unprepare_one(ref)
            finally:
                self._on_change()
        return errors

    def _unprepare_one(self, ref: ClaimRef) -> str:
        """Under the lock: "" once the claim is unprepared, or why it is not."""
        problem = ref_problem(ref.namespace, ref.name, ref.uid)
        if problem:
            return self._failed("unprepare", ref, problem)
        for flight in self._flights.get(ref.uid, ()):
            flight.unprepared = True
        try:
            if self._drop(ref.uid):
                log.info("claim unprepared claim=%s/%s uid=%s", ref.namespace, ref.name, ref.uid)
        except OSError as e:
            reason = f"cannot remove the CDI spec of claim {ref.uid}: {e}"
            return self._failed("unprepare", ref, reason)
        return ""

    # --- reconcile -------------------------------------------------------------------------

    async def run_reconcile(self, stop: asyncio.Event) -> None:
        """Reconcile every `reconcile_every_s`, until `stop`; the first time at once when the
        checkpoint was moved aside at start (its claims' specs are still there)."""
        wait_s = 0.0 if self._store.moved_aside is not None else self.settings.reconcile_every_s
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait_s)
            if not stop.is_set():
                await self.reconcile()
            wait_s = self.settings.reconcile_every_s

    async def reconcile(self) -> None:
        """One round: the prepared claims, and the specs without one, against the API server."""
        async with self._lock:
            prepared = list(self._store)
            orphans = [
                uid
                for uid in cdi.spec_claim_uids(self.settings.cdi_dir, self.settings.driver_name)
                if self._store.get(uid) is None and uid not in self._flights
            ]
        orphan_refs = [self._spec_ref(uid) for uid in orphans]
        refs = [ClaimRef(c.namespace, c.uid, c.name) for c in prepared]
        refs += [ref for ref in orphan_refs if ref is not None]
        answers = await asyncio.gather(
            *(self._api.get_claim(ref.namespace, ref.name) for ref in refs),
            return_exceptions=True,
        )
        async with self._lock:
            try:
                for ref, answer in zip(refs, answers, strict=True):
                    await self._reconcile_one(ref, answer)
                for uid, orphan_ref in zip(orphans, orphan_refs, strict=True):
                    unknown = self._store.get(uid) is None and uid not in self._flights
                    if orphan_ref is None and unknown:
                        self._remove_orphan(uid, "its spec does not name a valid claim")
            finally:
                self._on_change()

    async def _reconcile_one(self, ref: ClaimRef, answer: object) -> None:
        """Under the lock: one claim, prepared or only a spec, against the API server's
        answer for it."""
        if isinstance(answer, ApiCallError) and answer.status == NOT_FOUND:
            gone = "the API server no longer has it"
        elif isinstance(answer, dict):
            uid = _metadata(answer).get("uid")
            if uid == ref.uid:
                if self._store.get(ref.uid) is None and ref.uid not in self._flights:
                    await self._adopt(ref, answer)
                return
            gone = f"the API server's claim of that name has uid {shown(uid)}"
        else:
            return  # no answer now: asked again next round
        if ref.uid in self._flights:
            return  # a Prepare of it is under way: its own answer decides
        if self._store.get(ref.uid) is None:
            self._remove_orphan(ref.uid, gone)
            return
        try:
            self._drop(ref.uid)
        except OSError as e:
            log.error("cannot unprepare a claim %s uid=%s error=%s", gone, ref.uid, e)
            return
        log.info("claim unprepared: %s claim=%s/%s uid=%s", gone, ref.namespace, ref.name, ref.uid)

    async def _adopt(self, ref: ClaimRef, obj: dict[str, Any]) -> None:
        """Take back a spec's claim that the checkpoint lost: prepared again from the API."""
        try:
            claim = await self._read(obj)
            if claim.uid != ref.uid or self._store.get(ref.uid) is not None:
                return
            claim = self._write(claim, await self._namespace(claim))
        except (ClaimError, OSError) as e:
            if ref.uid not in self._kept:
                self._kept.add(ref.uid)
                log.warning(
                    "a CDI spec whose claim is not in the checkpoint is kept: its claim cannot "
                    "be prepared again; the kubelet's Unprepare removes it uid=%s error=%s",
                    ref.uid,
                    e,
                )
            return
        self._kept.discard(ref.uid)
        log.info(
            "claim taken back: its CDI spec was there but not its checkpoint entry "
            "claim=%s/%s uid=%s allocation=%s",
            claim.namespace,
            claim.name,
            claim.uid,
            claim.allocation_id,
        )

    def _spec_ref(self, uid: str) -> ClaimRef | None:
        """The claim a spec file names (its annotation), None when it names none validly."""
        if uid_problem(uid):
            return None
        try:
            raw = statefiles.read_file(
                self.settings.cdi_dir,
                cdi.spec_file_name(self.settings.driver_name, uid),
                MAX_SPEC_BYTES,
            )
            spec = json.loads(raw) if raw is not None else None
        except (OSError, ValueError, RecursionError):
            return None
        annotations = spec.get("annotations") if isinstance(spec, dict) else None
        named = annotations.get(cdi.CLAIM_ANNOTATION) if isinstance(annotations, dict) else None
        if not isinstance(named, str) or named.count("/") != 1:
            return None
        namespace, name = named.split("/")
        return None if ref_problem(namespace, name, uid) else ClaimRef(namespace, uid, name)

    def _remove_orphan(self, uid: str, why: str) -> None:
        self._kept.discard(uid)
        try:
            removed = cdi.remove_spec(self.settings.cdi_dir, self.settings.driver_name, uid)
        except (OSError, ValueError) as e:
            log.error("cannot remove a CDI spec without a claim uid=%s error=%s", shown(uid), e)
            return
        if removed:
            log.info(
                "CDI spec removed: its claim is not prepared here and %s uid=%s", why, shown(uid)
            )


def _read_claim(
    obj: dict[str, Any],
    *,
    driver_name: str,
    node_name: str,
    plans: Mapping[str, GpuPlan],
    now_s: float,
) -> PreparedClaim:
    """The claim's allocation on this node's devices, with the memory limits of its parameters."""
    claim = read_claim(obj, driver_name=driver_name, node_name=node_name, plans=plans, now_s=now_s)
    return with_memory_limits(claim, obj, driver_name)


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}
