"""A claim consuming an absurd amount, driven as the kubelet drives the DRA driver, against a
daemon of its own process: `10e999999` bytes of memory (what the API server stores for
`1e1000000`) or compute is refused at once, compared as a decimal and never turned into an
integer of a million digits on the event loop; an amount above its device is refused naming
it; the other claim of the call is prepared, and /healthz answers throughout."""

from __future__ import annotations

import threading

from tests.blackbox.daemon_harness import Node, eventually
from tests.blackbox.test_dra import _claim, _dra, _spec
from tests.security.dra_support import healthy, healthz, prepare_all, ref, register, serving_dra
from tests.support.fake_apiserver import FakeApiServer


def keeps_answering(port: int, done: threading.Event, statuses: list[int | str]) -> None:
    """Ask /healthz until `done`: each answer's status, or the error that came instead."""
    while not done.is_set():
        try:
            statuses.append(healthz(port))
        except OSError as e:
            statuses.append(f"no answer: {e!r}")
        done.wait(0.05)


async def test_a_claim_consuming_an_absurd_amount_fails_at_once_and_healthz_answers(
    dra_node: Node, dra_api: FakeApiServer
) -> None:
    """`10e999999` bytes of memory (what the API server stores for `1e1000000`), or compute:
    refused as out of range, compared as a decimal, never turned into an integer of a million
    digits; an amount larger than the device is refused naming it. The other claim of the call
    is prepared, and /healthz answers throughout."""
    settings = _dra(dra_node, dra_api)
    dra_api.put_claim(_claim("u-memory", "10e999999", "10"))
    dra_api.put_claim(_claim("u-compute", "1Gi", "1e1000000", pod="pod-2"))
    dra_api.put_claim(_claim("u-over", "41Gi", "10", pod="pod-3"))  # the device has 40 GiB
    dra_api.put_claim(_claim("u-ok", "1Gi", "10", pod="pod-4"))
    with serving_dra(dra_node, dra_api) as (proc, port):
        await register(settings)
        await eventually(lambda: healthy(port), 20, "/healthz")
        done = threading.Event()
        statuses: list[int | str] = []
        asker = threading.Thread(target=keeps_answering, args=(port, done, statuses))
        asker.start()
        try:
            # The whole call, a million-digit conversion included, is given a kubelet's patience:
            # the daemon that converts first answers only after a minute or more.
            response = await prepare_all(
                settings.service_socket,
                [ref("u-memory"), ref("u-compute"), ref("u-over"), ref("u-ok")],
                timeout_s=20,
            )
        finally:
            done.set()
            asker.join()
        assert proc.poll() is None
        assert statuses
        assert all(s == 200 for s in statuses), statuses
        assert healthz(port) == 200
    claims = response.claims
    assert "ResourceClaim default/claim-u-memory" in claims["u-memory"].error
    assert "'gpu-0'" in claims["u-memory"].error
    assert "memory '10e999999' is out of range" in claims["u-memory"].error
    assert "compute '1e1000000' is out of range" in claims["u-compute"].error
    over = claims["u-over"].error
    assert "ResourceClaim default/claim-u-over" in over
    assert "more memory than device 'gpu-0' has" in over, over
    assert claims["u-ok"].error == ""
    assert [_spec(dra_node, u).exists() for u in ("u-memory", "u-compute", "u-over", "u-ok")] == [
        False,
        False,
        False,
        True,
    ]
