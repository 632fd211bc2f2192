"""The API server, as the DRA driver needs it: its node's ResourceSlice, claims, its Node.

`KubeApi` is what the driver calls; `LightkubeApi` speaks it through lightkube's async client
(docs/kubernetes-api.md says why lightkube). Objects cross this boundary as plain dicts in the
API's own JSON shape, so that the pure modules (`slices`, `claims`) know no client library.
Every call raises `ApiCallError` naming the object and the server's answer. Every request but
the slice watch times out (`DraSettings.api_timeout_s`): an API server that does not
answer fails the call, naming the server and the timeout, and never holds up the caller, the
kubelet's NodePrepareResources included, for longer.

lightkube joins a name into the request's path as it is, unescaped: `../` would climb out of the
object's URL (and take the token with it), `?` or `#` would cut it. So every namespace and name
is checked to be a Kubernetes name (`refs`: a DNS-1123 label or subdomain, which needs no
escaping) before a request is built; any other is refused, naming it, and nothing is sent. An
answer that is not the object asked for (not JSON, not its shape) fails the call the same way as
an error status.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import httpx2
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.core.exceptions import ConfigError as KubeConfigError
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from deviceplugin.dra.refs import escaped, name_problem, namespace_problem, shown
from deviceplugin.dra.settings import DEFAULT_API_TIMEOUT_S

FIELD_MANAGER = "vgpu"

# httpx logs every request at INFO: the driver logs what it did itself.
logging.getLogger("httpx2").setLevel(logging.WARNING)


class ApiCallError(Exception):
    """An API call that failed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class KubeApi(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]: ...
    async def get_node(self, name: str) -> dict[str, Any]: ...
    async def list_slices(self, node_name: str, driver_name: str) -> list[dict[str, Any]]: ...
    async def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]: ...
    async def replace_slice(self, obj: dict[str, Any]) -> dict[str, Any]: ...
    async def delete_slice(self, name: str) -> None: ...
    def watch_slices(self, node_name: str, driver_name: str) -> AsyncIterator[tuple[str, str]]: ...
    async def close(self) -> None: ...


def load_config(kubeconfig: Path | None) -> KubeConfig:
    """A kubeconfig file, or the pod's service account; StartupError-worthy ValueError if
    neither can be read."""
    try:
        if kubeconfig is not None:
            return KubeConfig.from_file(kubeconfig)
        return KubeConfig.from_service_account()
    except (OSError, KubeConfigError, ValueError, KeyError) as e:
        where = str(kubeconfig) if kubeconfig else "the pod's service account"
        raise ValueError(
            f"cannot read the API server's address and credentials from {where}: {e}; "
            "set --kubeconfig or run in a pod with a service account"
        ) from None


def _server(config: KubeConfig) -> str:
    single = config.get()
    return single.cluster.server if single is not None else "(no current context)"


class LightkubeApi:
    def __init__(self, config: KubeConfig, timeout_s: float = DEFAULT_API_TIMEOUT_S) -> None:
        self.server = _server(config)
        self.timeout_s = timeout_s
        # trust_env=False: no proxy from the environment; the API server is reached directly.
        # The watch lifts the read timeout itself; every other request has it.
        self._client = AsyncClient(
            config,
            field_manager=FIELD_MANAGER,
            trust_env=False,
            timeout=httpx2.Timeout(timeout_s),
        )

    def _unanswered(self, what: str, e: httpx2.HTTPError) -> ApiCallError:
        if isinstance(e, httpx2.TimeoutException):
            why = f"did not answer within {self.timeout_s:g}s ({type(e).__name__})"
        else:
            why = f"cannot be reached: {type(e).__name__}" + (f": {e}" if str(e) else "")
        return ApiCallError(f"{what}: the API server at {self.server} {why}")

    async def _call(self, what: str, call: Any, kind: str = "object") -> Any:
        try:
            return await call
        except ApiError as e:
            code = int(e.status.code or 0)
            raise ApiCallError(
                f"{what}: {e.status.reason or ''} {e.status.message}", code
            ) from None
        except httpx2.HTTPError as e:
            raise self._unanswered(what, e) from None
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            # Not JSON (UnicodeDecodeError and JSONDecodeError are ValueErrors), or not the
            # object's shape.
            raise ApiCallError(
                f"{what}: the answer of the API server at {self.server} is not a {kind} "
                f"({type(e).__name__}: {shown(str(e))})"
            ) from None

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        what = f"get ResourceClaim {namespace}/{name}"
        _check_names(what, namespace_problem(namespace), name_problem(name))

        async def get() -> dict[str, Any]:
            claim = await self._client.get(ResourceClaim, name, namespace=namespace)
            return dict(claim.to_dict())

        result: dict[str, Any] = await self._call(what, get(), "ResourceClaim")
        return result

    async def get_node(self, name: str) -> dict[str, Any]:
        what = f"get Node {name}"
        _check_names(what, name_problem(name))

        async def get() -> dict[str, Any]:
            return dict((await self._client.get(Node, name)).to_dict())

        result: dict[str, Any] = await self._call(what, get(), "Node")
        return result

    async def list_slices(self, node_name: str, driver_name: str) -> list[dict[str, Any]]:
        async def collect() -> list[dict[str, Any]]:
            return [
                dict(s.to_dict())
                async for s in self._client.list(
                    ResourceSlice, fields={"spec.nodeName": node_name, "spec.driver": driver_name}
                )
            ]

        result: list[dict[str, Any]] = await self._call("list ResourceSlices", collect())
        return result

    async def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        _check_names(f"create ResourceSlice {name}", name_problem(name))
        created = await self._call(
            f"create ResourceSlice {name}", self._client.create(ResourceSlice.from_dict(obj))
        )
        return dict(created.to_dict())

    async def replace_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        _check_names(f"update ResourceSlice {name}", name_problem(name))
        replaced = await self._call(
            f"update ResourceSlice {name}", self._client.replace(ResourceSlice.from_dict(obj))
        )
        return dict(replaced.to_dict())

    async def delete_slice(self, name: str) -> None:
        _check_names(f"delete ResourceSlice {name}", name_problem(name))
        await self._call(f"delete ResourceSlice {name}", self._client.delete(ResourceSlice, name))

    async def watch_slices(
        self, node_name: str, driver_name: str
    ) -> AsyncIterator[tuple[str, str]]:
        """(event type, slice name) for every change of this node's slices of the driver; ends
        (ApiCallError) when the watch breaks."""
        fields: dict[str, Any] = {"spec.nodeName": node_name, "spec.driver": driver_name}
        try:
            async for kind, obj in self._client.watch(ResourceSlice, fields=fields):
                name = obj.metadata.name if obj.metadata is not None else None
                yield kind, str(name or "")
        except ApiError as e:
            raise ApiCallError(
                f"watch ResourceSlices: {e.status.message}", int(e.status.code or 0)
            ) from None
        except httpx2.HTTPError as e:
            raise self._unanswered("watch ResourceSlices", e) from None

    async def close(self) -> None:
        await self._client.close()


def _check_names(what: str, *problems: str) -> None:
    """Refuse, before any request is built, a call naming something that is not a Kubernetes
    name: lightkube would put it into the URL unescaped."""
    found = [p for p in problems if p]
    if found:
        raise ApiCallError(f"{escaped(what)}: not sent: {'; '.join(found)}")
