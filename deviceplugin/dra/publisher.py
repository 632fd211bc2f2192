"""The node's ResourceSlice on the API server (docs/dra.md, "What the node publishes"): written
whenever the devices the driver would publish change, checked first against the API server's
rules, and published again when someone deletes it.

Each attempt lists this driver's slices of the node, creates or updates the one (a new pool
generation) and deletes any other. What happens when it fails:

- the slice breaks a rule of the API server's (`validation`): it is not sent, since the API
  server would refuse it as a whole; one ERROR line per broken rule, naming the device, the
  field and the config key, once for each new set of problems;
- the API server answers no (400, 401, 403, 422: an invalid object, or a service account that
  may not write it): one ERROR line with its answer, once for each new answer;
- the API server does not answer, or answers 409, 429 or 5xx: a WARNING, and nothing else.

Every failure is retried with backoff (0.5 s doubling to 30 s); a new set of devices (a reload's
new policy, a GPU turning unhealthy, a new MIG layout), a registration with the kubelet, or a
deletion of the slice tries again at once, whatever the backoff. A refused slice fails /healthz
after `REFUSED_UNHEALTHY_S` and shows in `vgpu_dra_resourceslice_published` (0) and
`vgpu_dra_resourceslice_refused` (1), so that an alert fires.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from deviceplugin.dra.kubeapi import ApiCallError, KubeApi
from deviceplugin.dra.settings import DraSettings
from deviceplugin.dra.slices import build_slice, slice_name, slice_problems
from deviceplugin.state import until_set

if TYPE_CHECKING:
    from prometheus_client import Metric

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
RESYNC_S = 300.0
# /healthz fails once the slice has been refused this long.
REFUSED_UNHEALTHY_S = 60.0
# The answers that are a refusal of the slice itself (or of our right to write it), not a
# passing failure: retrying the same slice cannot help.
REFUSING_STATUSES = frozenset({400, 401, 403, 422})


class SliceRefusedError(Exception):
    """The slice breaks the API server's rules: `problems`, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class SlicePublisher:
    """Keeps the node's one ResourceSlice of the driver on the API server (see the module)."""

    def __init__(
        self,
        settings: DraSettings,
        api: KubeApi,
        devices: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self._settings = settings
        self._api = api
        self._devices = devices
        self._wanted = asyncio.Event()
        # The devices of the last attempt, and of the slice the API server last took.
        self.attempted: list[dict[str, Any]] | None = None
        self._published: list[dict[str, Any]] | None = None
        # Requests to publish (`request`), and how many the last finished attempt served.
        self._requests = 0
        self._served = 0
        self._attempt_done = asyncio.Event()
        # Why the API server refuses the slice ("" when it does not), since when (monotonic),
        # and the problems last logged.
        self.refusal = ""
        self.refused_since_s = 0.0
        self._reported: tuple[str, ...] = ()
        self.published = False
        self.writes = 0
        self.failures = 0

    @property
    def pool(self) -> str:
        return self._settings.node_name

    def request(self) -> int:
        """Publish now, whatever the backoff; returns the request's number for `verdict`."""
        self._requests += 1
        self._wanted.set()
        return self._requests

    def forget(self) -> None:
        """The slice is gone from the API server (deleted by someone else): publish it again."""
        self._published = None
        self.published = False
        self.request()

    async def verdict(self, request: int, timeout_s: float) -> str:
        """Why the API server refused the slice of the attempt that served `request`; "" once
        it took the slice, when it could not be asked (no answer: not a refusal), or when no
        attempt ended within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._served < request:
            left = deadline - time.monotonic()
            if left <= 0:
                return ""
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._attempt_done.wait(), left)
        return self.refusal

    def unhealthy(self, now_mono_s: float) -> str:
        """Why /healthz fails, "" when it does not on the slice's account."""
        if not self.refusal:
            return ""
        refused_s = now_mono_s - self.refused_since_s
        if refused_s <= REFUSED_UNHEALTHY_S:
            return ""
        return (
            f"the API server has refused the node's ResourceSlice for {refused_s:.1f}s "
            f"(limit {REFUSED_UNHEALTHY_S:g}s): {self.refusal}"
        )

    async def publish_once(self) -> None:
        """Make the API server hold exactly our one slice with the current devices. Raises
        SliceRefusedError (not sent: it breaks the API server's rules) or ApiCallError."""
        devices = self._devices()
        self.attempted = devices
        s = self._settings
        existing = await self._api.list_slices(s.node_name, s.driver_name)
        name = slice_name(s.node_name, s.driver_name)
        ours = next((e for e in existing if e["metadata"]["name"] == name), None)
        if ours is None:
            desired = build_slice(s.node_name, s.driver_name, devices, 1)
            _check(desired)
            desired = build_slice(s.node_name, s.driver_name, devices, 1, await self._owner())
            await self._api.create_slice(desired)
            log.info("ResourceSlice created name=%s devices=%d", name, len(devices))
            self.writes += 1
        elif (ours.get("spec") or {}).get("devices") != devices:
            generation = int(ours["spec"]["pool"].get("generation", 0)) + 1
            desired = build_slice(s.node_name, s.driver_name, devices, generation)
            desired["metadata"] = {**ours["metadata"], "labels": desired["metadata"]["labels"]}
            _check(desired)
            await self._api.replace_slice(desired)
            log.info(
                "ResourceSlice updated name=%s devices=%d generation=%d",
                name,
                len(devices),
                generation,
            )
            self.writes += 1
        for other in existing:
            if other["metadata"]["name"] != name:
                await self._api.delete_slice(other["metadata"]["name"])
                log.info("ResourceSlice deleted name=%s", other["metadata"]["name"])
        self._published = devices

    async def _owner(self) -> dict[str, str] | None:
        try:
            node = await self._api.get_node(self._settings.node_name)
        except ApiCallError as e:
            log.warning("ResourceSlice without an owner: cannot read the Node: %s", e)
            return None
        uid = (node.get("metadata") or {}).get("uid")
        return {"name": self._settings.node_name, "uid": str(uid)} if uid else None

    async def run(self, stop: asyncio.Event) -> None:
        """Publish until `stop`: at once, on every `request`, after a failure with backoff, and
        every RESYNC_S."""
        delay = RETRY_FIRST_S
        failed = False
        self._wanted.set()
        while not stop.is_set():
            await until_set(stop, self._wanted, delay if failed else RESYNC_S)
            if stop.is_set():
                return
            self._wanted.clear()
            served = self._requests
            failed = not await self._attempt(delay)
            delay = min(delay * 2, RETRY_MAX_S) if failed else RETRY_FIRST_S
            self._served = served
            self._attempt_done.set()
            self._attempt_done = asyncio.Event()

    async def _attempt(self, delay: float) -> bool:
        """One publication; whether the API server holds the slice now."""
        name = slice_name(self._settings.node_name, self._settings.driver_name)
        try:
            await self.publish_once()
        except SliceRefusedError as e:
            self.failures += 1
            self._refused(
                e.problems,
                f"ResourceSlice not written: the API server would refuse it name={name} "
                f"retry_in_s={delay:g} problem=%s",
            )
            return False
        except ApiCallError as e:
            self.failures += 1
            self.published = self._published is not None and self._published == self.attempted
            if e.status in REFUSING_STATUSES:
                self._refused(
                    [str(e)],
                    f"ResourceSlice refused by the API server name={name} status={e.status} "
                    f"retry_in_s={delay:g} error=%s",
                )
            else:
                self.refusal = ""
                log.warning("ResourceSlice not written; retrying in %.1fs: %s", delay, e)
            return False
        if self.refusal:
            log.info("ResourceSlice taken by the API server again name=%s", name)
        self.refusal, self._reported, self.published = "", (), True
        return True

    def _refused(self, problems: list[str], line: str) -> None:
        """A refusal: logged once for each new set of problems, remembered for /healthz."""
        self.published = False
        if not self.refusal:
            self.refused_since_s = time.monotonic()
        self.refusal = "; ".join(problems)
        if tuple(problems) != self._reported:
            self._reported = tuple(problems)
            for problem in problems:
                log.error(line, problem)
        else:
            log.debug(line, self.refusal)

    async def watch(self, stop: asyncio.Event) -> None:
        """Publish again when our slice is deleted behind our back (a kubelet that starts wipes
        its node's slices; an operator's kubectl delete)."""
        s = self._settings
        delay = RETRY_FIRST_S
        while not stop.is_set():
            try:
                async for kind, name in self._api.watch_slices(s.node_name, s.driver_name):
                    delay = RETRY_FIRST_S
                    if kind == "DELETED":
                        log.info(
                            "ResourceSlice deleted by someone else; publishing again name=%s", name
                        )
                        self.forget()
            except ApiCallError as e:
                log.info("ResourceSlice watch ended; watching again in %.1fs: %s", delay, e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, RETRY_MAX_S)

    def collector(self, node_name: str) -> PublicationCollector:
        return PublicationCollector(self, node_name)


class PublicationCollector:
    """`vgpu_dra_resourceslice_published{node,pool}` and `vgpu_dra_resourceslice_refused`, read
    from the publisher at each scrape (a prometheus_client collector)."""

    def __init__(self, publisher: SlicePublisher, node_name: str) -> None:
        self._publisher = publisher
        self._node = node_name

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415 (with the metrics)

        p = self._publisher
        families = []
        for name, value, text in (
            (
                "vgpu_dra_resourceslice_published",
                p.published,
                "1 when the API server holds the node's ResourceSlice with the devices the DRA "
                "driver has now; 0 while it refuses it, does not answer, or has not taken it yet.",
            ),
            (
                "vgpu_dra_resourceslice_refused",
                bool(p.refusal),
                "1 while the API server refuses the node's ResourceSlice (or would: it breaks "
                "the API server's validation rules, so it is not sent); the log names the field.",
            ),
        ):
            family = GaugeMetricFamily(name, text, labels=["node", "pool"])
            family.add_metric([self._node, p.pool], 1.0 if value else 0.0)
            families.append(family)
        return families


def _check(desired: dict[str, Any]) -> None:
    problems = slice_problems(desired)
    if problems:
        raise SliceRefusedError(problems)
