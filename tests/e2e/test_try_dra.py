"""docs/dra.md's "Try DRA on a node by hand", run as written on the real node (kubelet v1.36.2,
the real scheduler, containerd 2.x with CDI): the DeviceClasses, a fake GPU and the stand-in
NVIDIA spec, `serve --kubelet-api dra`, a claim template and a pod, what the claim got and what
is left on the device, the clean-up.

Only what the node needs changes: the directory (the cluster's own), the node's name (the
kubelet's `--hostname-override`), the image (the node's local busybox) and `hostNetwork: true`
(the node has no pod network). The commands run as root inside the node's namespaces, with the
project's kubectl and vgpu-device-plugin first on PATH and the cluster's admin kubeconfig as
~/.kube/config, from the repository's root."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import images
from tests.e2e.harness import NODE, REPO, Cluster, wait_until
from tools import fetch_k8s_tools

RUNTIME = "containerd"
SECTION = "## Try DRA on a node by hand"
DOC_DIR = "/tmp/vgpu-dra"
DOC_IMAGE = "busybox:1.36"
RESOURCE_API = "/apis/resource.k8s.io/v1"
GiB = 1024**3


def blocks() -> list[tuple[str, str]]:
    """The section's fenced blocks in order: (language, text)."""
    text = (REPO / "docs" / "dra.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(r"```(sh|yaml)\n(.*?)```", section, flags=re.DOTALL)


def commands(block: str) -> list[str]:
    """A sh block's commands, continuation lines joined."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_the_section_is_the_steps_a_user_takes() -> None:
    langs = [lang for lang, _ in blocks()]
    assert langs == ["sh", "sh", "sh", "yaml", "sh", "sh", "sh", "sh"]
    (_, classes), (_, gpu), (_, serve), _, (_, run), (_, look), (_, delete), (_, rest) = blocks()
    assert commands(classes) == ["kubectl apply -f daemonset/components/dra/deviceclasses.yaml"]
    assert "nvidia.com/gpu" in gpu
    assert "/var/run/cdi/" in gpu
    (serve_line,) = commands(serve)
    assert serve_line.startswith("vgpu-device-plugin serve --kubelet-api dra ")
    assert [c.split()[:2] for c in commands(run)] == [["kubectl", "apply"], ["kubectl", "wait"]]
    assert commands(look)[-1] == "vgpu-device-plugin status"
    assert commands(delete)[0].startswith("kubectl delete -f ")
    assert commands(rest)[-1].startswith("rm -r ")


class Shell:
    """The section's commands in the node's namespaces, as root on the node would run them."""

    def __init__(self, cluster: Cluster, kubectl: Path) -> None:
        self.cluster = cluster
        self.directory = cluster.paths.root / "try-dra"
        home = cluster.paths.root / "try-dra-home"
        (home / ".kube").mkdir(parents=True)
        (home / ".kube" / "config").write_text((cluster.paths.pki / "admin.kubeconfig").read_text())
        path = f"{Path(sys.executable).parent}:{kubectl.parent}:{os.environ.get('PATH', '')}"
        self.env = {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8"}
        self.started: list[subprocess.Popen[bytes]] = []

    def line(self, command: str) -> str:
        command = command.replace(DOC_DIR, str(self.directory))
        return command.replace('"$(hostname)"', NODE)

    def run(self, command: str) -> str:
        """Run `command` (a line or a whole block) with bash; its output."""
        return self.cluster.run_in_namespaces(
            ["bash", "-euo", "pipefail", "-c", self.line(command)], env=self.env, cwd=REPO
        )

    def start(self, command: str, log: Path) -> subprocess.Popen[bytes]:
        proc = self.cluster.in_namespaces(
            ["bash", "-c", "exec " + self.line(command)], log=log, env=self.env, cwd=REPO
        )
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def shell(cluster: Cluster) -> Iterator[Shell]:
    kubectl = fetch_k8s_tools.cached("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not fetched: python tools/fetch_k8s_tools.py")
    s = Shell(cluster, kubectl)
    try:
        yield s
    finally:
        s.close()


def the_pod(manifests: str, *, name: str | None = None, memory: str | None = None) -> str:
    """The section's claim template and pod as this node runs them (its image, hostNetwork),
    renamed and asking for other memory when told."""
    docs = list(yaml.safe_load_all(manifests))
    template, pod = docs
    pod["spec"]["hostNetwork"] = True
    (container,) = pod["spec"]["containers"]
    assert container["image"] == DOC_IMAGE
    container["image"] = images.BUSYBOX
    if name is not None:
        template["metadata"]["name"] = f"{name}-claim"
        pod["metadata"]["name"] = name
        pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = f"{name}-claim"
    if memory is not None:
        requests = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]
        requests["requests"]["memory"] = memory
    return yaml.safe_dump_all([template, pod])


def ours(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in items if i.get("spec", {}).get("driver") == "vgpu.dev"]


def claim_specs(cluster: Cluster) -> list[str]:
    return sorted(p.name for p in cluster.paths.cdi_dir.glob("vgpu.dev-claim_*.json"))


def test_try_dra_by_hand(cluster: Cluster, shell: Shell) -> None:
    (
        (_, classes),
        (_, gpu),
        (_, serve),
        (_, manifests),
        (_, run),
        (_, look),
        (_, delete),
        (
            _,
            rest,
        ),
    ) = blocks()
    uuid = re.search(r'"uuid": "(GPU-[^"]+)"', gpu)
    assert uuid is not None
    gpu_uuid = uuid.group(1)
    shell.run(classes)
    shell.run(gpu)
    assert (cluster.paths.cdi_dir / "try-vgpu-nvidia.json").is_file()
    driver = shell.start(commands(serve)[0], cluster.paths.log_dir / "try-dra-serve.log")

    def published() -> dict[str, Any] | None:
        assert driver.poll() is None, (cluster.paths.log_dir / "try-dra-serve.log").read_text()
        slices = ours(cluster.api.get(f"{RESOURCE_API}/resourceslices")["items"])
        return slices[0] if slices else None

    the_slice = wait_until(published, timeout_s=30, what="the node's ResourceSlice")
    (device,) = the_slice["spec"]["devices"]
    assert device["name"] == "gpu-0"
    assert device["capacity"]["memory"]["value"] == str(40 * GiB)
    assert device["capacity"]["compute"]["value"] == "100"

    (shell.directory / "trainer.yaml").write_text(the_pod(manifests))
    for command in commands(run):
        shell.run(command)
    env_line, claims_line, slices_line, status_line = commands(look)

    # The container's environment, from the claim's CDI devices alone.
    env = dict(line.split("=", 1) for line in shell.run(env_line).splitlines())
    claims = yaml.safe_load(shell.run(claims_line))["items"]
    (claim,) = claims
    documented = ("NVIDIA_VISIBLE_DEVICES", "VGPU_ALLOCATION_ID", "VGPU_MEMORY_LIMIT_MIB_0",
                  "VGPU_COMPUTE_SHARE_PERCENT_0")  # fmt: skip
    assert claim["metadata"]["name"].startswith("trainer-gpu-")
    uid = claim["metadata"]["uid"]
    assert claim_specs(cluster) == [f"vgpu.dev-claim_{uid}.json"]
    spec = json.loads((cluster.paths.cdi_dir / f"vgpu.dev-claim_{uid}.json").read_text())
    written = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    shown = re.compile(r"^(NVIDIA_VISIBLE_DEVICES|VGPU_|FAKE_GPU)")
    assert env == {k: v for k, v in written.items() if shown.match(k)} | {"FAKE_GPU": gpu_uuid}
    assert {k: env[k] for k in documented} == {
        "NVIDIA_VISIBLE_DEVICES": gpu_uuid,
        "VGPU_ALLOCATION_ID": hashlib.sha256(f"{gpu_uuid}::{uid}".encode()).hexdigest()[:16],
        "VGPU_MEMORY_LIMIT_MIB_0": "15360",
        "VGPU_COMPUTE_SHARE_PERCENT_0": "30",
    }
    assert "env" not in cluster.pod("trainer")["spec"]["containers"][0]
    # What the scheduler granted, and for whom.
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["device"], result["consumedCapacity"]) == (
        "gpu-0",
        {"compute": "30", "memory": "15Gi"},
    )
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["trainer"]
    (listed,) = ours(yaml.safe_load(shell.run(slices_line))["items"])
    assert listed["spec"]["devices"][0]["capacity"]["memory"]["value"] == str(40 * GiB)

    # pod-resources names the container within a second or so of its start (docs/dra.md).
    def named() -> str | None:
        out = shell.run(status_line)
        return out if "default/trainer/main" in out else None

    status = wait_until(
        named,
        timeout_s=15,
        interval_s=0.5,
        what="vgpu status naming the trainer's container",
    )
    assert f"claim default/{claim['metadata']['name']}" in status, status

    # What is left on gpu-0, as the section says: 25Gi; 26Gi more does not fit, 25Gi does.
    for name, memory in (("second-26", "26Gi"), ("second-25", "25Gi")):
        (shell.directory / f"{name}.yaml").write_text(the_pod(manifests, name=name, memory=memory))
        shell.run(f"kubectl apply -f {shell.directory}/{name}.yaml")
    cluster.assert_stays_pending("second-26", seconds=3)
    cluster.wait_running("second-25")
    for name in ("second-26", "second-25"):
        shell.run(f"kubectl delete -f {shell.directory}/{name}.yaml")

    # The clean-up: the pod's claim unprepared, its spec gone; the driver stops on Ctrl-C.
    for command in commands(delete):
        shell.run(command)
    wait_until(lambda: not claim_specs(cluster), timeout_s=30, what="the claim unprepared")
    driver.send_signal(signal.SIGINT)
    assert driver.wait(15) == 0
    shell.run(rest)
    assert not (cluster.paths.cdi_dir / "try-vgpu-nvidia.json").exists()
    assert not shell.directory.exists()
