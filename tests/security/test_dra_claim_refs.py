"""Claim references and the API server's answers, hostile or garbled, driven as the kubelet
drives the DRA driver (its gRPC socket) with a fake API server holding the claims: a namespace
or a name made to climb out of the claim's URL (`../`, `?`, `#`, `%2e`) is refused before any
request is sent, by the driver and by its API client alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin.dra.kubeapi import ApiCallError, LightkubeApi, load_config
from tests.blackbox.daemon_harness import Node, eventually
from tests.blackbox.test_dra import _dra, _register, dra_daemon
from tests.security.dra_support import prepare_all, ref
from tests.support.fake_apiserver import SLICES, FakeApiServer


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
