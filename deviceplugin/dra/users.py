"""Who uses a prepared claim: the (pod, container) pairs the kubelet's pod-resources DRA entries
list with it, kept current for attribution (a claim's processes stand only from its users) and
for /status (the containers a claim's allocation names).

Pod-resources is asked after every change of the claims, every `NAMES_EVERY_S` while a claim has
no user yet or pod-resources does not answer, and every `USERS_EVERY_S` while claims are
prepared: a pod that joins a claim already prepared on the node (a claim shared by pods) is not
prepared again, so nothing else tells the driver. A pod listed that the claim was not reserved
for when it was prepared has the claim read again from the API server (`reread`), for the pod's
UID.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeAlias

import grpc

from deviceplugin.dra.claims import PreparedClaim
from deviceplugin.kubelet.podresources import PodResourcesClient

log = logging.getLogger("deviceplugin.dra.driver")

# How often pod-resources is asked for the prepared claims' users: while a claim has none yet,
# and otherwise while claims are prepared (a pod joining a prepared claim).
NAMES_EVERY_S = 1.0
USERS_EVERY_S = 5.0

# (pod name, container name) pairs using each claim, by claim UID.
Users: TypeAlias = dict[str, tuple[tuple[str, str], ...]]


class ClaimUsers:
    """The users of the prepared claims (`users`, replaced whole: the poll worker reads it), and
    whether pod-resources answered the last ask (`ok`, for /healthz and /status)."""

    def __init__(
        self,
        client: PodResourcesClient | None,
        driver_name: str,
        claims: Callable[[], tuple[PreparedClaim, ...]],
        *,
        on_change: Callable[[], None],
        reread: Callable[[PreparedClaim, frozenset[str]], Awaitable[bool]],
    ) -> None:
        # One channel for every ask (a new one only after a failed call); None: not asked.
        self._client = client
        self._driver_name = driver_name
        self._claims = claims
        self._on_change = on_change
        self._reread = reread
        self.users: Users = {}
        # The pod names pod-resources listed with a claim when it was last read again for them.
        self._looked_up: dict[str, frozenset[str]] = {}
        self._wanted = asyncio.Event()
        self.ok = False

    def wanted(self) -> None:
        """Ask pod-resources now (the claims changed)."""
        self._wanted.set()

    async def run(self, stop: asyncio.Event) -> None:
        client = self._client
        if client is None:
            return
        try:
            await self._ask(client, stop)
        finally:
            await client.close()

    async def _ask(self, client: PodResourcesClient, stop: asyncio.Event) -> None:
        warned = False
        while not stop.is_set():
            self._wanted.clear()
            if self._claims() or not self.ok:
                try:
                    users = await client.claim_users(self._driver_name)
                    warned = False
                    self.ok = True
                except grpc.aio.AioRpcError as e:
                    users = None
                    self.ok = False
                    if not warned:
                        log.warning(
                            "pod-resources not answering; the claims' processes are refused "
                            "until it names their containers socket=%s error=%s",
                            client.socket,
                            e.code().name,
                        )
                        warned = True
                if users is not None:
                    await self._update(users)
            waiter = asyncio.ensure_future(self._wanted.wait())
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait(
                    {waiter, stopper}, timeout=self._next_s(), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                waiter.cancel()
                stopper.cancel()

    def _next_s(self) -> float | None:
        claims = self._claims()
        if not self.ok or any(c.uid not in self.users for c in claims):
            return NAMES_EVERY_S
        return USERS_EVERY_S if claims else None

    async def _update(self, listed: Mapping[tuple[str, str], list[tuple[str, str]]]) -> None:
        """Take pod-resources' answer: each claim's users (a claim it lists none for keeps
        those it had: a pod between two containers' lives); the claim read again for a pod
        listed with it that it was not reserved for."""
        claims = self._claims()
        found: Users = {}
        for claim in claims:
            users = tuple(listed.get((claim.namespace, claim.name), ()))
            if users:
                found[claim.uid] = users
            elif claim.uid in self.users:
                found[claim.uid] = self.users[claim.uid]
        changed = found != self.users
        self.users = found
        for claim in claims:
            pods = frozenset(p for p, _ in found.get(claim.uid, ()))
            unknown = pods - {name for name, _ in claim.pods}
            if unknown and self._looked_up.get(claim.uid) != pods:
                self._looked_up[claim.uid] = pods
                if not await self._reread(claim, unknown):
                    self._looked_up.pop(claim.uid, None)  # asked again next time
        known = {c.uid for c in self._claims()}
        self._looked_up = {u: p for u, p in self._looked_up.items() if u in known}
        if changed:
            self._on_change()
