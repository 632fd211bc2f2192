"""Where the kubelet puts a pod's containers, and whether a process's cgroup is one of them.

A process is a pod's only when its cgroup is the one the kubelet made for one of that pod's
containers (or lies below it: a container may make cgroups of its own inside its own), on the
path the kubelet's cgroup driver and root give, from the root of the hierarchy:

    cgroupfs  <root>/kubepods[/burstable|/besteffort]/pod<uid>/[<runtime>-]<container ID>
    systemd   <root>/<p>kubepods.slice[/<p>kubepods-<qos>.slice]/<p>kubepods[-<qos>]-pod<uid>.slice/
              <runtime>-<container ID>.scope

(`<p>` is the systemd root's own slice prefix: `kubelet-` under `/kubelet.slice`, as kind runs
it; the UID's dashes are underscores there; a container ID is 64 hex digits; the runtime is
`cri-containerd`, `crio` or `docker`). A `pod<uid>` segment anywhere else (a host unit, a cgroup
a user made under a delegated subtree, the inside of another container) names no pod.

cgroup namespaces. A daemon in a cgroup namespace of its own (on cgroup v2 a container gets one,
hostPID or not) reads other processes' cgroups relative to its namespace's root: `/../../x`.
Such a path is resolved to a path from the hierarchy's root only when the namespace's root is
known (`namespace_root`, found at start from the host hierarchy mounted in the daemon's mount
namespace, see `find_namespace_root`); otherwise it is refused: the process counts as in no pod.
That is sound: a path is never guessed.

A runtime hook's container (`KubeletTree.container_leaf`, docs/design.md §15) is held to more: the
cgroup file of its init process must have exactly one unified line (`0::`, the one read on
hybrid hosts too) naming, in plain printable ASCII with no empty, `.` or `..` component once
resolved, exactly a container's cgroup in the kubelet's layout (not a cgroup below it); anything
else is refused with the reason.

Pure but for `find_namespace_root`, which reads /proc and the mounted hierarchy once.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("deviceplugin.usage.procs")

_UID = r"(?P<uid>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32})"


def _uid_us(group: str) -> str:
    """A pod UID as a systemd slice name writes it (dashes as underscores), in group `group`."""
    hex8, hex4, hex12 = "[0-9a-f]{8}", "[0-9a-f]{4}", "[0-9a-f]{12}"
    return rf"(?P<{group}>{hex8}_{hex4}_{hex4}_{hex4}_{hex12}|[0-9a-f]{{32}})"


_ID = r"(?P<id>[0-9a-f]{64})"
_RUNTIME = r"(?:cri-containerd|crio|docker)"

CGROUPFS = "cgroupfs"
SYSTEMD = "systemd"
AUTO = "auto"
DRIVERS = (AUTO, CGROUPFS, SYSTEMD)
# With driver `auto`, the systemd roots accepted besides "/": kind's.
_AUTO_SYSTEMD_ROOTS = ("/", "/kubelet.slice")


@dataclass(frozen=True, slots=True)
class PodContainer:
    """A process's place in the kubelet's tree: its pod (UID, lowercase with dashes), its
    container's runtime ID and the container's cgroup (a path from the hierarchy's root)."""

    pod_uid: str
    container_id: str
    cgroup: str


def _root_prefix(root: str) -> str:
    root = "/" + root.strip("/")
    return "" if root == "/" else root


def _cgroupfs_pattern(root: str) -> re.Pattern[str]:
    prefix = re.escape(_root_prefix(root))
    return re.compile(
        rf"(?P<cgroup>{prefix}/kubepods(?:/(?P<qos>burstable|besteffort))?/pod{_UID}"
        rf"/(?:{_RUNTIME}-)?{_ID})(?:/.*)?"
    )


def _systemd_pattern(root: str) -> re.Pattern[str]:
    prefix = _root_prefix(root)
    # A slice's name carries its parents' names: under /kubelet.slice, kubelet-kubepods.slice.
    last = prefix.rsplit("/", 1)[-1]
    if prefix and not last.endswith(".slice"):
        raise ValueError(f"a systemd cgroup root is a slice (e.g. /kubelet.slice), got {root!r}")
    p = last[: -len(".slice")] + "-" if prefix else ""
    kp = re.escape(p + "kubepods")
    return re.compile(
        rf"(?P<cgroup>{re.escape(prefix)}/{kp}\.slice"
        rf"(?:/{kp}-(?P<qos>burstable|besteffort)\.slice"
        rf"/{kp}-(?P=qos)-pod{_uid_us('uid')}\.slice"
        rf"|/{kp}-pod{_uid_us('guid')}\.slice)"
        rf"/{_RUNTIME}-{_ID}\.scope)(?:/.*)?"
    )


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """The kubelet's cgroup driver and root, as set on the node (`--cgroup-driver`,
    `--cgroup-root`). `auto` accepts either driver's layout: cgroupfs at `root`, systemd at
    `root` when it is a slice or "/" (and then at kind's `/kubelet.slice` too)."""

    driver: str = AUTO
    root: str = "/"

    def __post_init__(self) -> None:
        if self.driver not in DRIVERS:
            raise ValueError(f"cgroup driver {self.driver!r} is none of {', '.join(DRIVERS)}")
        if not self.root.startswith("/") or "/.." in self.root + "/" or "//" in self.root:
            raise ValueError(f"cgroup root {self.root!r} is not an absolute, plain path")

    def patterns(self) -> tuple[re.Pattern[str], ...]:
        found: list[re.Pattern[str]] = []
        if self.driver in (AUTO, CGROUPFS):
            found.append(_cgroupfs_pattern(self.root))
        if self.driver == SYSTEMD:
            found.append(_systemd_pattern(self.root))
        elif self.driver == AUTO:
            prefix = _root_prefix(self.root)
            if not prefix:
                found.extend(_systemd_pattern(r) for r in _AUTO_SYSTEMD_ROOTS)
            elif prefix.endswith(".slice"):
                found.append(_systemd_pattern(self.root))
        return tuple(found)


class KubeletTree:
    """Reads `/proc/<pid>/cgroup` content against one CgroupLayout. `namespace_root` is the
    path, from the root of the unified (v2) hierarchy, of the daemon's own cgroup namespace's
    root; "" when the daemon shares the host's; None when unknown (paths relative to it are then
    refused)."""

    def __init__(self, layout: CgroupLayout | None = None, namespace_root: str | None = "") -> None:
        self.layout = layout or CgroupLayout()
        self.namespace_root = namespace_root
        self._patterns = self.layout.patterns()

    def container_of(self, content: bytes) -> PodContainer | None:
        """The pod container a process is in, from its cgroup file's content; None when it is
        in none. cgroup v2 gives one line `0::<path>`, v1 one line per hierarchy (hybrid hosts
        both); the unified line wins when it names a pod container, else the first v1 line that
        does. In a cgroup namespace of the daemon's own every path is relative to its root (one
        without `..` lies inside it): the unified one is resolved, a v1 one refused."""
        first: PodContainer | None = None
        in_own_namespace = self.namespace_root != ""
        for line in content.split(b"\n"):
            parts = line.split(b":", 2)
            if len(parts) != 3:
                continue
            unified = parts[0] == b"0" and not parts[1]
            path = parts[2].decode("utf-8", "replace")
            if in_own_namespace or path == "/.." or path.startswith("/../"):
                resolved = self.resolve(path) if unified else None
                if resolved is None:
                    continue
                path = resolved
            found = self.match(path)
            if found is None:
                continue
            if unified:
                return found
            if first is None:
                first = found
        return first

    def match(self, path: str) -> PodContainer | None:
        """The pod container of a path from the hierarchy's root; None when the path is not
        where the kubelet puts containers."""
        for pattern in self._patterns:
            m = pattern.fullmatch(path)
            if m is None:
                continue
            groups = m.groupdict()
            uid = groups.get("uid") or groups.get("guid") or ""
            return PodContainer(uid.replace("_", "-"), groups["id"], groups["cgroup"])
        return None

    def resolve(self, path: str) -> str | None:
        """A path relative to the daemon's cgroup namespace root, from the hierarchy's root;
        None when that root is unknown or the path climbs above the hierarchy's root."""
        if self.namespace_root is None:
            return None
        base = [p for p in self.namespace_root.split("/") if p]
        parts = path.split("/")[1:]
        while parts and parts[0] == "..":
            if not base:
                return None
            base.pop()
            parts.pop(0)
        if parts == [""]:
            parts = []  # the namespace's root itself
        if any(p in ("", ".", "..") for p in parts):
            return None
        return "/" + "/".join(base + parts)


class LeafRefusedError(ValueError):
    """A process's cgroup file names no container's own cgroup; the message says why."""


# What a cgroup path of the kubelet's may hold: systemd's escapes are letters and digits.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9_.:@+=-]+(?:/[A-Za-z0-9_.:@+=-]+)*")
_PODS_ROOT_SEGMENT = re.compile(r"(?:[a-z0-9]+-)?kubepods(?:\.slice)?")


def container_leaf(tree: KubeletTree, content: bytes) -> PodContainer:
    """The container a runtime hook's init process was placed in, from the content of its
    `/proc/<pid>/cgroup`: exactly one unified line, a plain path, exactly a container's cgroup
    in the kubelet's layout. Raises LeafRefusedError naming what is wrong."""
    try:
        text = content.decode("ascii")
    except UnicodeDecodeError:
        raise LeafRefusedError("the cgroup file is not ASCII") from None
    unified = [line[3:] for line in text.split("\n") if line.startswith("0::")]
    if len(unified) != 1:
        raise LeafRefusedError(
            f"expected one cgroup v2 line (0::<path>), found {len(unified)}: the process is not "
            "on the unified hierarchy"
            if not unified
            else f"expected one cgroup v2 line (0::<path>), found {len(unified)}"
        )
    raw = unified[0]
    path: str | None = raw
    if tree.namespace_root != "" or raw == "/.." or raw.startswith("/../"):
        path = tree.resolve(raw)
        if path is None:
            raise LeafRefusedError(
                f"{_short(raw)} lies outside the hierarchy this daemon can resolve"
            )
    assert path is not None
    if not _PLAIN_PATH.fullmatch(path) or any(p in (".", "..") for p in path.split("/")):
        raise LeafRefusedError(f"{_short(path)} is not a plain cgroup path")
    found = tree.match(path)
    if found is None or found.cgroup != path:
        raise LeafRefusedError(
            f"{_short(path)} is not a container's cgroup in the kubelet's layout "
            f"(driver {tree.layout.driver}, root {tree.layout.root})"
        )
    return found


def pods_root(cgroup: str) -> str | None:
    """The kubelet's top cgroup of pods above a container's cgroup (`<root>/kubepods` or
    `<root>/<p>kubepods.slice`); None when the path has none."""
    parts = cgroup.split("/")
    for n, part in enumerate(parts):
        if n and _PODS_ROOT_SEGMENT.fullmatch(part):
            return "/".join(parts[: n + 1])
    return None


def pod_top_cgroups(driver: str, root: str, mount: Path) -> tuple[str, ...]:
    """The kubelet's top cgroups of pods (paths from the hierarchy's root) under the layout of
    the command line; with the driver read at start (`auto`), each candidate that exists under
    `mount`, the unified hierarchy."""
    prefix = _root_prefix(root or "/")
    candidates = {CGROUPFS: f"{prefix}/kubepods", SYSTEMD: f"{prefix}/kubepods.slice"}
    if driver in candidates:
        return (candidates[driver],)
    return tuple(c for c in candidates.values() if (mount / c.lstrip("/")).is_dir())


def _short(text: str) -> str:
    return repr(text if len(text) <= 200 else text[:197] + "...")


def kubelet_layout(driver: str, root: str) -> CgroupLayout | None:
    """The layout set on the command line; None when neither is set (then read at start).
    Raises ValueError for a driver or root that is not one."""
    if driver == AUTO and not root:
        return None
    return CgroupLayout(driver, root or "/")


def detect_layout(own_cgroup: bytes, namespace_root: str | None) -> CgroupLayout | None:
    """The kubelet's driver and root, read from where it put this daemon's own container (the
    content of /proc/self/cgroup), and checked: the layout made of them must place that very
    container. None when the daemon runs in no pod container (the demo, tests): `auto` then
    accepts either driver at "/"."""
    for line in own_cgroup.decode("utf-8", "replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path: str | None = parts[2]
        if namespace_root != "" or parts[2].startswith("/.."):
            # In a cgroup namespace of its own, its own path is relative to that namespace (whose
            # root is known for the unified hierarchy only).
            unified = parts[0] == "0" and not parts[1]
            path = KubeletTree(namespace_root=namespace_root).resolve(parts[2]) if unified else None
        if path is None:
            continue
        for driver, marker in ((SYSTEMD, _SYSTEMD_MARKER), (CGROUPFS, _CGROUPFS_MARKER)):
            m = marker.search(path)
            if m is None:
                continue
            layout = CgroupLayout(driver, m["root"] or "/")
            if KubeletTree(layout).match(path) is not None:
                return layout
    return None


_CGROUPFS_MARKER = re.compile(r"(?P<root>(?:/[^/]+)*?)/kubepods(?:/[^/]+)?/pod[0-9a-f_-]+/[^/]+$")
_SYSTEMD_MARKER = re.compile(
    r"(?P<root>(?:/[^/]+\.slice)*?)/(?:[a-z0-9]+-)?kubepods\.slice(?:/[^/]+)+\.scope$"
)


def _unified_path(cgroup_file: Path) -> str | None:
    try:
        content = cgroup_file.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in content.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def find_namespace_root(proc_root: Path = Path("/proc"), *, max_dirs: int = 100_000) -> str | None:
    """The path, from the root of the unified hierarchy, of this process's cgroup namespace's
    root: "" in the host's namespace (PID 1, the host's init with hostPID, reads a path from
    the root); otherwise found in the host's hierarchy mounted in this mount namespace (a
    cgroup2 mount whose root reads as the climb to the hierarchy's root): the directory at the
    namespace's depth whose subtree holds this process where /proc/self/cgroup says. None when
    it cannot be told (no such mount): paths relative to the namespace are then refused."""
    init_path = _unified_path(proc_root / "1" / "cgroup")
    own_path = _unified_path(proc_root / "self" / "cgroup")
    if init_path is None or own_path is None:
        return ""  # no unified hierarchy: nothing to resolve (v1 paths never are)
    if not (init_path == "/.." or init_path.startswith("/../")):
        return ""
    depth = 0
    for part in init_path.split("/")[1:]:
        if part != "..":
            break
        depth += 1
    climb = "/" + "/".join([".."] * depth)
    mount_point: str | None = None
    try:
        mountinfo = (proc_root / "self" / "mountinfo").read_text(errors="replace")
    except OSError:
        return None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        if fstype == "cgroup2" and fields[3] == climb:
            mount_point = fields[4]
            break
    if mount_point is None:
        return None
    own = own_path.strip("/")
    pid = str(os.getpid())
    seen = 0
    level = [""]
    for _ in range(depth):
        below: list[str] = []
        for rel in level:
            try:
                with os.scandir(os.path.join(mount_point, rel)) as it:
                    for entry in it:
                        if entry.is_dir(follow_symlinks=False):
                            below.append(os.path.join(rel, entry.name))
            except OSError:
                continue
            seen += len(below)
            if seen > max_dirs:
                return None
        level = below
    for rel in level:
        procs = os.path.join(mount_point, rel, own, "cgroup.procs")
        try:
            with open(procs, encoding="ascii") as f:
                if pid in f.read().split():
                    return "/" + rel
        except OSError:
            continue
    return None


def kubelet_tree_of(proc_root: Path, layout: CgroupLayout | None = None) -> KubeletTree:
    """The kubelet's layout as read once from this daemon's own container, and its cgroup
    namespace's root; logged, with what it means for attribution."""
    namespace_root = find_namespace_root(proc_root)
    try:
        own = (proc_root / "self" / "cgroup").read_bytes()
    except OSError:
        own = b""
    if layout is not None:
        log.info("kubelet cgroup layout as set driver=%s root=%s", layout.driver, layout.root)
        return _warn_unresolvable(KubeletTree(layout, namespace_root))
    layout = detect_layout(own, namespace_root)
    tree = KubeletTree(layout, namespace_root)
    if layout is None:
        log.info(
            "this daemon runs in no pod container: pod containers are recognised in either "
            "cgroup driver's layout at the root driver=%s root=%s",
            tree.layout.driver,
            tree.layout.root,
        )
    else:
        log.info(
            "kubelet cgroup layout read from this daemon's own container driver=%s root=%s",
            layout.driver,
            layout.root,
        )
    return _warn_unresolvable(tree)


def _warn_unresolvable(tree: KubeletTree) -> KubeletTree:
    if tree.namespace_root is None:
        log.warning(
            "this daemon runs in a cgroup namespace of its own whose root cannot be found (mount "
            "the host's cgroup2 hierarchy into its container): processes whose cgroup it reads "
            "relative to that namespace count as in no pod, and their allocation tags are refused"
        )
    return tree
