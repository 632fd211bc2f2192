"""Claim references and the API server's answers, hostile or garbled, driven as the kubelet
drives the DRA driver (its gRPC socket) with a fake API server holding the claims:

- a claim reference that is not a Kubernetes namespace, name or UID (`/` or NUL in a UID), or
  an API answer that is not a claim, fails that claim with its reason and never the others of
  the call, in Prepare and Unprepare alike;
- a namespace or a name made to climb out of the claim's URL (`../`, `?`, `#`, `%2e`) is
  refused before any request is sent, by the driver and by its API client alike."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin.dra.kubeapi import ApiCallError, LightkubeApi, load_config
from tests.blackbox.daemon_harness import Node, dra_frontend, eventually
from tests.blackbox.test_dra import _claim, _dra, _register, _spec, dra_daemon
from tests.security.dra_support import prepare_all, ref, unprepare_all
from tests.support.fake_apiserver import SLICES, FakeApiServer

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/"


def claim_with_uid(uid: str, name: str, pod: str) -> dict[str, Any]:
    claim = _claim("x", "1Gi", "10", pod=pod)
    claim["metadata"] = {"namespace": "default", "name": name, "uid": uid}
    return claim


async def test_each_bad_claim_of_a_call_fails_alone_and_the_good_one_is_answered(
    dra_node: Node, dra_api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """UIDs with `/` or NUL (which the API server answers with, here), a namespace and a name
    that are not Kubernetes names, and an API answer that is not JSON: each fails its own claim
    with its reason; the good claim of the same call, asked first, is prepared and answered,
    and nothing is written for the others. Unprepare answers each the same way."""
    settings = _dra(dra_node, dra_api)
    dra_api.put_claim(_claim("u-ok", "1Gi", "10"))
    dra_api.put_claim(claim_with_uid("a/b", "claim-slash", "pod-2"))
    dra_api.put_claim(claim_with_uid("a\x00b", "claim-nul", "pod-3"))
    dra_api.raw_claims[("default", "claim-garbled")] = b"\xff\xfe{not json"
    refs = [
        ref("u-ok"),
        ref("a/b", "claim-slash"),
        ref("a\x00b", "claim-nul"),
        ref("u-garbled", "claim-garbled"),
        ref("u-ns", "claim-ns", namespace="Not_A_Namespace"),
        ref("u-name", "Claim..Name"),
    ]
    async with dra_daemon(dra_node, dra_api):
        await _register(settings)
        response = await prepare_all(settings.service_socket, refs)
        claims = response.claims
        assert set(claims) == {r.uid for r in refs}
        assert claims["u-ok"].error == ""
        assert _spec(dra_node, "u-ok").exists()
        assert "uid 'a/b' is not a claim UID" in claims["a/b"].error
        assert "uid 'a\\x00b' is not a claim UID" in claims["a\x00b"].error
        assert "get ResourceClaim default/claim-garbled" in claims["u-garbled"].error
        assert "not a ResourceClaim" in claims["u-garbled"].error
        assert "namespace 'Not_A_Namespace' is not a DNS-1123 label" in claims["u-ns"].error
        assert "name 'Claim..Name' is not a DNS-1123 subdomain" in claims["u-name"].error
        cdi = sorted(p.name for p in (dra_node.root / "cdi").iterdir())
        assert cdi == ["vgpu.dev-claim_u-ok.json"]

        unprepared = await unprepare_all(settings.service_socket, refs)
        errors = {uid: c.error for uid, c in unprepared.claims.items()}
        assert errors["u-ok"] == ""
        assert not _spec(dra_node, "u-ok").exists()
        assert "uid 'a/b' is not a claim UID" in errors["a/b"]
        assert "uid 'a\\x00b' is not a claim UID" in errors["a\x00b"]
        assert errors["u-garbled"] == ""  # a valid reference, never prepared
    assert "Traceback" not in caplog.text


async def test_a_name_climbing_out_of_the_claims_url_is_never_sent(
    dra_node: Node, dra_api: FakeApiServer
) -> None:
    settings = _dra(dra_node, dra_api)
    climbing = [
        ref("u-up1", "../../../../api/v1/nodes/n1"),
        ref("u-up2", "claim", namespace="../../../api/v1/nodes/n1#"),
        ref("u-query", "claim?watch=true"),
        ref("u-escaped", "%2e%2e%2fnodes"),
    ]
    async with dra_daemon(dra_node, dra_api):
        await _register(settings)
        await eventually(lambda: len(dra_api.slice_list()) == 1, what="the slice")
        with dra_api.locked():
            before = len(dra_api.requests)
        response = await prepare_all(settings.service_socket, climbing)
        with dra_api.locked():
            # The driver's own slice requests aside (its publish loop runs meanwhile).
            sent = [r for r in dra_api.requests[before:] if not r[1].startswith(SLICES)]
    assert sent == [], f"requests sent for names that are not Kubernetes names: {sent}"
    for r in climbing:
        assert "is not a DNS-1123" in response.claims[r.uid].error, response.claims[r.uid]


async def test_the_api_client_refuses_a_name_that_would_leave_its_url(
    dra_api: FakeApiServer, tmp_path: Path
) -> None:
    """Below the driver's own check: the client itself sends no request for such a name."""
    client = LightkubeApi(load_config(dra_api.kubeconfig(tmp_path / "kubeconfig")))
    try:
        for namespace, name in [
            ("default", "../../../../api/v1/nodes/n1"),
            ("../../api/v1/nodes/n1", "x"),
            ("default", "a/b"),
            ("default", ""),
        ]:
            with pytest.raises(ApiCallError, match="not sent"):
                await client.get_claim(namespace, name)
        with pytest.raises(ApiCallError, match="not sent"):
            await client.get_node("../nodes/n1")
    finally:
        await client.close()
    assert dra_api.requests == []


async def test_a_claim_written_for_a_call_the_kubelet_gave_up_on_is_undone(
    dra_node: Node, dra_api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A call that ends without an answer (its deadline passed while it waited on the API
    server for a later claim) leaves nothing of the claims it had already written: the kubelet
    never heard they were prepared, and prepares them again."""
    settings = _dra(dra_node, dra_api)
    dra_api.put_claim(_claim("u-first", "1Gi", "10"))
    dra_api.put_claim(_claim("u-second", "1Gi", "10", pod="pod-2"))
    async with dra_daemon(dra_node, dra_api) as daemon:
        await _register(settings)
        # u-second prepared before: the call reads only u-first first, and u-second again
        # only once it finds it unprepared meanwhile.
        assert (await prepare_all(settings.service_socket, [ref("u-second")])).claims[
            "u-second"
        ].error == ""
        first, second = threading.Event(), threading.Event()
        dra_api.hold_claims[("default", "claim-u-first")] = first
        dra_api.hold_claims[("default", "claim-u-second")] = second
        call = asyncio.ensure_future(
            prepare_all(settings.service_socket, [ref("u-first"), ref("u-second")], timeout_s=3)
        )
        await eventually(
            lambda: ("GET", CLAIMS + "claim-u-first") in dra_api.requests, what="the first GET"
        )
        assert (await unprepare_all(settings.service_socket, [ref("u-second")])).claims[
            "u-second"
        ].error == ""
        first.set()  # u-first is written; u-second is read again, and that GET waits
        with pytest.raises(grpc.aio.AioRpcError) as gave_up:
            await call
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        store = dra_frontend(daemon).store
        await eventually(lambda: store.get("u-first") is None, 10, "u-first undone")
        assert not _spec(dra_node, "u-first").exists()
        assert not _spec(dra_node, "u-second").exists()
        second.set()
    assert "prepare not answered (the call was cancelled); undone uid=u-first" in caplog.text
