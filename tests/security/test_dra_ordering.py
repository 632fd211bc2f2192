"""Prepare and Unprepare of one claim are ordered, and the prepared claims follow the API
server, driven as the kubelet drives the DRA driver with a fake API server holding the claims:

- an Unprepare that arrives while a Prepare of the same claim waits on the API server wins:
  the Prepare gives up and leaves nothing behind;
- a prepared claim the API server no longer has (or has under another UID) is unprepared by
  the driver's reconcile, and the claims of a checkpoint that had to be moved aside are taken
  back from their CDI specs."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading

import grpc
import pytest

from deviceplugin._proto.dra.v1 import api_pb2 as dra_v1
from deviceplugin._proto.dra.v1 import api_pb2_grpc as dra_v1_grpc
from tests.blackbox.daemon_harness import Node, dra_frontend, eventually
from tests.blackbox.test_dra import (
    RPC_TIMEOUT_S,
    _claim,
    _dra,
    _prepare,
    _register,
    _spec,
    _unprepare,
    dra_daemon,
)
from tests.security.dra_support import ref
from tests.support.fake_apiserver import FakeApiServer

CLAIMS_PATH = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/"


async def test_an_unprepare_during_a_prepare_wins_and_nothing_stays(
    dra_node: Node, dra_api: FakeApiServer
) -> None:
    """The kubelet gives up on a Prepare whose GET the API server is slow to answer, and
    unprepares the claim: the Prepare, once its GET comes back, does not prepare it after all."""
    settings = _dra(dra_node, dra_api)
    dra_api.put_claim(_claim("u-late", "1Gi", "10"))
    held = threading.Event()
    dra_api.hold_claims[("default", "claim-u-late")] = held
    async with dra_daemon(dra_node, dra_api) as daemon:
        await _register(settings)
        async with grpc.aio.insecure_channel(f"unix://{settings.service_socket}") as channel:
            call = dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_v1.NodePrepareResourcesRequest(claims=[ref("u-late")]), timeout=RPC_TIMEOUT_S
            )
            await eventually(
                lambda: ("GET", CLAIMS_PATH + "claim-u-late") in dra_api.requests, what="the GET"
            )
            assert await _unprepare(settings.service_socket, "u-late") == ""
            held.set()
            answer = (await call).claims["u-late"]
        assert "unprepared while it was being prepared" in answer.error, answer
        assert not _spec(dra_node, "u-late").exists()
        assert dra_frontend(daemon).store.get("u-late") is None
        assert not [r for r in daemon.book if r.claim == "default/claim-u-late"]
        # The mark is for that Prepare only: the kubelet's next Prepare of the claim works.
        del dra_api.hold_claims[("default", "claim-u-late")]
        assert (await _prepare(settings.service_socket, "u-late")).error == ""
        assert _spec(dra_node, "u-late").exists()


async def test_a_prepared_claim_the_api_server_no_longer_has_is_unprepared(
    dra_node: Node, dra_api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The reconcile: a claim deleted from the API server, and one deleted and made again
    (another UID), are unprepared (spec and checkpoint entry gone, logged); a claim the API
    server cannot be asked about now (it does not answer) is kept, as is one still there."""
    caplog.set_level(logging.INFO, logger="deviceplugin.dra")
    settings = dataclasses.replace(
        _dra(dra_node, dra_api), api_timeout_s=1.0, reconcile_every_s=0.3
    )
    for uid, pod in [("u-gone", "pod-1"), ("u-again", "pod-2"), ("u-kept", "pod-3")]:
        dra_api.put_claim(_claim(uid, "1Gi", "10", pod=pod))
    dra_api.put_claim(_claim("u-quiet", "1Gi", "10", pod="pod-4"))
    async with dra_daemon(dra_node, dra_api, dra=settings) as daemon:
        await _register(settings)
        for uid in ("u-gone", "u-again", "u-kept", "u-quiet"):
            assert (await _prepare(settings.service_socket, uid)).error == ""
        with dra_api.locked():
            del dra_api.claims[("default", "claim-u-gone")]
            dra_api.claims[("default", "claim-u-again")]["metadata"]["uid"] = "u-again-2"
        dra_api.stall_claims.add(("default", "claim-u-quiet"))
        store = dra_frontend(daemon).store
        await eventually(
            lambda: store.get("u-gone") is None and store.get("u-again") is None,
            10,
            "the reconcile to unprepare the claims the API server no longer has",
        )
        assert not _spec(dra_node, "u-gone").exists()
        assert not _spec(dra_node, "u-again").exists()
        for kept in ("u-kept", "u-quiet"):
            assert store.get(kept) is not None
            assert _spec(dra_node, kept).exists()
        books = {r.claim for r in daemon.book}
        assert "default/claim-u-gone" not in books
        assert "default/claim-u-kept" in books
    logged = caplog.text
    assert "claim unprepared: the API server no longer has it claim=default/claim-u-gone" in logged
    assert "has uid 'u-again-2' claim=default/claim-u-again uid=u-again" in logged
    checkpoint = json.loads((dra_node.root / "state" / "dra-claims.json").read_text())
    assert sorted(c["uid"] for c in checkpoint["claims"]) == ["u-kept", "u-quiet"]


async def test_claims_of_a_lost_checkpoint_are_taken_back_from_their_specs(
    dra_node: Node, dra_api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint that must be moved aside at start forgets the prepared claims, not their
    CDI specs: the reconcile, at once, takes back a claim the API server still has (held to its
    amounts again) and removes the spec of one it no longer has."""
    caplog.set_level(logging.INFO, logger="deviceplugin.dra")
    # Never on its own period here: only the round that a moved-aside checkpoint starts at once.
    settings = dataclasses.replace(_dra(dra_node, dra_api), reconcile_every_s=3600.0)
    dra_api.put_claim(_claim("u-back", "3Gi", "30"))
    dra_api.put_claim(_claim("u-dead", "1Gi", "10", pod="pod-2"))
    async with dra_daemon(dra_node, dra_api, dra=settings):
        await _register(settings)
        for uid in ("u-back", "u-dead"):
            assert (await _prepare(settings.service_socket, uid)).error == ""
    (dra_node.root / "state" / "dra-claims.json").write_text('{"version": 1, "claims": 7}')
    with dra_api.locked():
        del dra_api.claims[("default", "claim-u-dead")]
    async with dra_daemon(dra_node, dra_api, dra=settings) as daemon:
        store = dra_frontend(daemon).store
        await eventually(
            lambda: store.get("u-back") is not None and not _spec(dra_node, "u-dead").exists(),
            10,
            "the claim taken back and the dead claim's spec removed",
        )
        assert _spec(dra_node, "u-back").exists()
        back = store.get("u-back")
        assert back is not None
        assert back.per_gpu()[0][1:] == (3 * 1024**3, 30.0)
        assert back.allocation_id in {r.allocation_id for r in daemon.book}
        assert store.get("u-dead") is None
    assert "claim taken back: its CDI spec was there but not its checkpoint entry" in caplog.text
    assert "CDI spec removed: its claim is not prepared here and the API server no longer" in (
        caplog.text
    )
