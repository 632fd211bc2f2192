"""The container a runtime hook's init process is in (usage/cgroups.py `container_leaf`): one
plain path under the kubelet's layout, from `/proc/<pid>/cgroup` alone, and every hostile or odd
cgroup file refused with its reason."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplugin.usage.cgroups import (
    CgroupLayout,
    KubeletTree,
    LeafRefusedError,
    container_leaf,
    pods_root,
)

UID = "0123abcd-0000-4000-8000-00000000000a"
UID_US = UID.replace("-", "_")
CID = "c" * 64
CGROUPFS = f"/kubepods/burstable/pod{UID}/{CID}"
SYSTEMD = (
    "/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{UID_US}.slice/cri-containerd-{CID}.scope"
)


def leaf(content: str, tree: KubeletTree | None = None) -> str:
    return container_leaf(tree or KubeletTree(), content.encode()).cgroup


def refused(content: str | bytes, tree: KubeletTree | None = None) -> str:
    raw = content.encode() if isinstance(content, str) else content
    with pytest.raises(LeafRefusedError) as raised:
        container_leaf(tree or KubeletTree(), raw)
    return str(raised.value)


def test_a_containers_own_cgroup_in_either_layout() -> None:
    assert leaf(f"0::{CGROUPFS}\n") == CGROUPFS
    assert leaf(f"0::{SYSTEMD}\n") == SYSTEMD
    found = container_leaf(KubeletTree(), f"0::{SYSTEMD}\n".encode())
    assert (found.pod_uid, found.container_id) == (UID, CID)


def test_on_a_hybrid_host_the_unified_line_is_the_one_read() -> None:
    content = f"12:memory:/somewhere/else\n1:name=systemd:/user.slice\n0::{CGROUPFS}\n"
    assert leaf(content) == CGROUPFS


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("", "found 0: the process is not on the unified hierarchy"),
        (f"12:memory:{CGROUPFS}\n", "found 0"),  # cgroup v1 only
        (f"0::{CGROUPFS}\n0::{CGROUPFS}\n", "found 2"),  # two unified lines
        (f"0::{CGROUPFS}/inner\n", "is not a container's cgroup"),  # below the container
        (f"0::/kubepods/burstable/pod{UID}\n", "is not a container's cgroup"),  # the pod
        (f"0::/system.slice/{CID}\n", "is not a container's cgroup"),  # outside the layout
        (f"0::/kubepods/burstable/pod{UID}/../pod{UID}/{CID}\n", "not a plain cgroup path"),
        (f"0::/kubepods/./burstable/pod{UID}/{CID}\n", "not a plain cgroup path"),
        (f"0::/kubepods//burstable/pod{UID}/{CID}\n", "not a plain cgroup path"),
        (f"0::{CGROUPFS} (deleted)\n", "not a plain cgroup path"),  # the cgroup is gone
        (f"0::{CGROUPFS}\x1b[2J\n", "not a plain cgroup path"),
        ("0::relative/path\n", "not a plain cgroup path"),
        (f"0::/../../{CGROUPFS}\n", "outside the hierarchy"),
    ],
)
def test_hostile_and_odd_cgroup_files_are_refused(content: str, why: str) -> None:
    assert why in refused(content)


def test_non_ascii_is_refused() -> None:
    assert "not ASCII" in refused(f"0::/kubepods/pod\xe9/{CID}\n".encode())


def test_the_kubelets_root_and_driver_bound_what_is_accepted() -> None:
    rooted = KubeletTree(CgroupLayout("cgroupfs", "/vgpu-test"))
    assert leaf(f"0::/vgpu-test{CGROUPFS}\n", rooted) == f"/vgpu-test{CGROUPFS}"
    assert "is not a container's cgroup" in refused(f"0::{CGROUPFS}\n", rooted)
    systemd_only = KubeletTree(CgroupLayout("systemd", "/"))
    assert "is not a container's cgroup" in refused(f"0::{CGROUPFS}\n", systemd_only)


def test_in_a_cgroup_namespace_of_its_own_paths_resolve_only_when_its_root_is_known() -> None:
    known = KubeletTree(namespace_root="/kubepods/burstable/podx/daemon")
    assert leaf(f"0::/../../../..{CGROUPFS}\n", known) == CGROUPFS
    unknown = KubeletTree(namespace_root=None)
    assert "outside the hierarchy" in refused(f"0::{CGROUPFS}\n", unknown)


def test_the_top_cgroup_of_pods() -> None:
    assert pods_root(CGROUPFS) == "/kubepods"
    assert pods_root(SYSTEMD) == "/kubepods.slice"
    assert pods_root(f"/kubelet.slice/kubelet-kubepods.slice/x/{CID}") == (
        "/kubelet.slice/kubelet-kubepods.slice"
    )
    assert pods_root("/system.slice/x") is None


@given(st.text(max_size=300))
def test_whatever_the_file_holds_an_accepted_leaf_is_its_one_unified_path(text: str) -> None:
    content = text.encode("utf-8", "surrogatepass")
    try:
        found = container_leaf(KubeletTree(), content)
    except LeafRefusedError:
        return
    lines = [line for line in text.split("\n") if line.startswith("0::")]
    assert lines == [f"0::{found.cgroup}"]
    assert KubeletTree().match(found.cgroup) == found


@given(
    st.sampled_from([CGROUPFS, SYSTEMD]),
    st.text(min_size=1, max_size=20).filter(lambda t: not t.startswith("\n")),
)
def test_anything_appended_to_a_containers_path_is_refused(path: str, tail: str) -> None:
    with pytest.raises(LeafRefusedError):
        container_leaf(KubeletTree(), f"0::{path}{tail}\n".encode("utf-8", "surrogatepass"))
