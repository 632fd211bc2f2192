"""Node labels without Kubernetes API credentials: a node feature discovery (NFD) feature file.

NFD's worker reads every file in `/etc/kubernetes/node-feature-discovery/features.d/` on the node
(its `local` source) and turns each `name=value` line into a node label; GPU feature discovery
publishes NVIDIA's `nvidia.com/gpu.*` labels the same way. The daemon keeps one such file
(`nodeLabels.file`, a name) in step with its slice inventory, so that autoscalers and schedulers
can select nodes by their slices while the daemon itself holds no API token.

The file lives only in the features directory the daemon was started with
(`--node-features-dir`), never anywhere a config names. It is rewritten only when its content
changes, and atomically: the new content goes to a hidden file of a random name beside it (NFD
skips names that start with a dot, since v0.15), created exclusively without following a
symlink, which then replaces the old one by a rename. A reader sees the old file or the new
one, never half of either. Only the file the daemon wrote is ever removed.

The features directory is shared with other tools (GPU feature discovery, NFD's own hooks), and
`nodeLabels.file` may name one of their files. vgpu writes only a file that is its own: none
there yet, or one that starts with vgpu's header line (`HEADER`, a comment NFD ignores), or one
from a version before the header, holding only vgpu's own `nvidia.com/vgpu.*` labels. Anything
else at the name (another tool's file, a symbolic link, a FIFO) is left as it is, and the log
says which file, that it is not vgpu's, and what to do; vgpu tries again at the next change.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
from pathlib import Path

from deviceplugin.model import Inventory
from deviceplugin.safefs import RefusedFileError, open_directory, read_bounded
from deviceplugin.state import Published
from deviceplugin.statefiles import replace_file

log = logging.getLogger(__name__)

PREFIX = "nvidia.com/vgpu."
# A label value: at most 63 characters of [A-Za-z0-9-_.], starting and ending alphanumeric.
_NOT_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
_MAX_LABEL_VALUE = 63
MIB = 1024 * 1024
# A write that failed (a full disk, a directory not mounted yet) is tried again this often.
RETRY_S = 60.0
# The first line of every feature file vgpu writes: how it knows its own file from another
# tool's. NFD's local source skips lines that start with `#` (and reads `# +` as a directive).
HEADER = "# written by vgpu-device-plugin (nodeLabels.file): vgpu rewrites and removes this file\n"
# NFD ignores a feature file larger than this: vgpu reads no more of one to know whose it is.
MAX_FEATURE_FILE_BYTES = 64 * 1024


def label_value(text: str) -> str:
    """`text` as a valid label value: other characters become "-", cut to 63 characters
    ("NVIDIA A100-SXM4-80GB" -> "NVIDIA-A100-SXM4-80GB", as GPU feature discovery writes it)."""
    value = _NOT_LABEL_CHARS.sub("-", text)[:_MAX_LABEL_VALUE]
    return value.strip("-_.")


def node_labels(
    inventory: Inventory,
    *,
    mig_strategy: str = "none",
    resource_name: str | None = None,
    memory_enforcement: str | None = None,
) -> dict[str, str]:
    """The labels for this inventory, in the order they are written. With `resource_name`, they
    describe that resource's slices only (the daemon passes `resourceName`: full GPUs, and MIG
    devices under the single strategy; the mixed strategy's per-profile resources are not
    counted).

    - `count`: the slices the node advertises as healthy;
    - `replicas`: slices per GPU, when every sliced GPU has the same number (else absent);
    - `memory-per-slice-mib`: the smallest slice's memory, in MiB;
    - `product`: the model of the first sliced GPU;
    - `mig-strategy`: how MIG devices are offered;
    - `memory-enforcement` (when given): `driver` where every GPU's driver holds containers to
      their memory limits (docs/design.md §15), `poll` where none does, `mixed` between.
    Without a sliced GPU, only `count=0` and `mig-strategy`."""
    if resource_name is not None:
        inventory = inventory.for_resource(resource_name)
    plans = [p for p in inventory.plans if p.sliced]
    labels = {f"{PREFIX}count": str(sum(1 for s in inventory.slices if s.healthy))}
    replicas = {p.replicas for p in plans}
    if len(replicas) == 1:
        labels[f"{PREFIX}replicas"] = str(replicas.pop())
    if plans:
        smallest = min(p.memory_per_slice_bytes for p in plans)
        labels[f"{PREFIX}memory-per-slice-mib"] = str(smallest // MIB)
        product = label_value(plans[0].gpu.name)
        if product:
            labels[f"{PREFIX}product"] = product
    labels[f"{PREFIX}mig-strategy"] = mig_strategy
    if memory_enforcement is not None:
        labels[f"{PREFIX}memory-enforcement"] = memory_enforcement
    return labels


def feature_file(labels: dict[str, str]) -> str:
    """The feature file's content: vgpu's header, then one `name=value` line per label."""
    return HEADER + "".join(f"{name}={value}\n" for name, value in labels.items())


def is_vgpus(content: bytes) -> bool:
    """Whether a feature file's content is vgpu's: its header first, or (a version before the
    header) nothing but vgpu's own labels."""
    text = content.decode("utf-8", "replace")
    if text.startswith(HEADER.rstrip("\n")):
        return True
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return bool(lines) and all(line.startswith(PREFIX) and "=" in line for line in lines)


class NotVgpusFileError(OSError):
    """The feature file's name holds something vgpu did not write."""


def whose(dir_fd: int, name: str) -> str:
    """Why the entry `name` in the open directory is not vgpu's to write; "" when it is (or
    when there is none)."""
    try:
        content = read_bounded(name, MAX_FEATURE_FILE_BYTES, dir_fd=dir_fd)
    except FileNotFoundError:
        return ""
    except RefusedFileError as e:
        return str(e.strerror)
    return "" if is_vgpus(content) else "it does not start with vgpu's header"


def write_own(directory: Path, name: str, content: str) -> tuple[int, int]:
    """Replace the file `name` in `directory` with `content`, if whatever is at `name` is
    nothing or vgpu's own file (`whose`), and NotVgpusFileError saying why it is not otherwise;
    the (device, inode) written.

    The directory is opened without following a symlink (and made when missing); the content
    goes to a new hidden file of a random name, created with O_EXCL | O_NOFOLLOW in that open
    directory, which is then renamed over `name`: a file of vgpu's at `name` is replaced,
    never written through. Mode 0644: NFD's worker may run as another user, and node labels
    are public anyway."""
    handle = open_directory(str(directory), create=True)
    try:
        problem = whose(handle.fd, name)
        if problem:
            raise NotVgpusFileError(errno.EEXIST, problem)
        written = replace_file(handle.fd, name, content.encode(), 0o644)
    finally:
        os.close(handle.fd)
    return written.st_dev, written.st_ino


class NodeLabelFile:
    """Keeps the feature file `name` in `directory` (the node features directory the daemon
    was started with) in step with the published inventory."""

    def __init__(
        self,
        directory: Path,
        name: str,
        *,
        mig_strategy: str = "none",
        resource_name: str | None = None,
        memory: Published[str] | None = None,
    ) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a feature file name")
        self.directory = directory
        self.name = name
        self.path = directory / name
        self._mig_strategy = mig_strategy
        self._resource_name = resource_name
        # How the node's GPU memory is enforced (the memory-limits part's summary), if known.
        self._memory = memory
        self._written: str | None = None
        # The file this daemon wrote last, by (device, inode): the only one remove() deletes.
        self._identity: tuple[int, int] | None = None
        self._failing = False

    def update(self, inventory: Inventory) -> bool:
        """Write the file when its content would change; whether it was written. A failure is
        logged (once until it succeeds again) and retried at the next change."""
        content = feature_file(
            node_labels(
                inventory,
                mig_strategy=self._mig_strategy,
                resource_name=self._resource_name,
                memory_enforcement=self._memory.value if self._memory is not None else None,
            )
        )
        if content == self._written:
            return False
        try:
            self._identity = write_own(self.directory, self.name, content)
        except NotVgpusFileError as e:
            if not self._failing:
                log.error(
                    "node labels are not written: the node feature file %s was not written by "
                    "vgpu (%s): another tool's file is neither overwritten nor removed; set "
                    "nodeLabels.file to another name, or remove the file if nothing needs it",
                    self.path,
                    e.strerror,
                )
            self._failing = True
            return False
        except OSError as e:
            if not self._failing:
                log.warning(
                    "cannot write the node feature file; node labels are not updated "
                    "path=%s error=%s",
                    self.path,
                    e.strerror or e,
                )
            self._failing = True
            return False
        if self._failing:
            log.info("node feature file written again path=%s", self.path)
        self._failing = False
        self._written = content
        log.info(
            "node labels updated path=%s labels=%s",
            self.path,
            ",".join(content.splitlines()),
        )
        return True

    def remove(self) -> None:
        """Remove the file (a reload renamed it or turned node labels off): NFD then drops its
        labels. Only the file this daemon wrote is removed: a file that has been replaced since
        (another inode, a symlink) is left alone. Never raises; a failure is logged."""
        if self._identity is None:
            return
        try:
            handle = open_directory(str(self.directory), create=False)
            try:
                st = os.stat(self.name, dir_fd=handle.fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) != self._identity:
                    log.warning(
                        "the node feature file is not the one this daemon wrote; left in place "
                        "path=%s",
                        self.path,
                    )
                    return
                os.unlink(self.name, dir_fd=handle.fd)
            finally:
                os.close(handle.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning(
                "cannot remove the old node feature file path=%s error=%s",
                self.path,
                e.strerror or e,
            )
            return
        self._written = None
        self._identity = None
        log.info("node feature file removed path=%s", self.path)

    async def run(self, inventory: Published[Inventory], stop: asyncio.Event) -> None:
        """Write for the current inventory, then after each change of it or of the memory
        enforcement (and every RETRY_S while writing fails), until `stop`."""
        while not stop.is_set():
            version = inventory.version
            memory_version = self._memory.version if self._memory is not None else 0
            await asyncio.to_thread(self.update, inventory.value)
            waits = {
                asyncio.ensure_future(inventory.wait_change(version)),
                asyncio.ensure_future(stop.wait()),
            }
            if self._memory is not None:
                waits.add(asyncio.ensure_future(self._memory.wait_change(memory_version)))
            try:
                await asyncio.wait(
                    waits,
                    timeout=RETRY_S if self._failing else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                for wait in waits:
                    wait.cancel()
