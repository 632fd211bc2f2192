"""Unit tables for deviceplugin.allocation: one container's Allocate response
(docs/design.md §3)."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace as dataclasses_replace

import pytest

from deviceplugin.allocation import (
    MpsDefaults,
    build_container_allocation,
    device_env_suffix,
    format_hundredths,
    framework_hints,
    memory_fraction_hundredths,
    mps_defaults,
)
from deviceplugin.config import (
    AllocationConfig,
    DeviceIdStrategy,
    DeviceListStrategy,
    GpuMatch,
    MigConfig,
    MigStrategy,
    MpsConfig,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.errors import AllocationError
from deviceplugin.model import (
    ContainerAllocation,
    DeviceNodeSpec,
    GpuInfo,
    GpuReading,
    Inventory,
    MountSpec,
    NodeReading,
)
from deviceplugin.slicing import build_inventory

GI = 1 << 30
MI = 1 << 20
S = DeviceListStrategy

U0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
U1 = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
U2 = "GPU-cccccccc-0000-0000-0000-000000000000"


def make_inventory(*, unhealthy: tuple[int, ...] = ()) -> Inventory:
    """Three GPUs. GPU 0 has U1 and GPU 1 has U0, so that ordering by UUID and ordering by index
    differ. GPU 0: 80Gi in 4 slices; GPU 1: 40Gi in 3 slices; GPU 2: 16Gi in 2 slices, minor 7."""
    gpus = [
        GpuInfo(uuid=U1, index=0, name="A100", memory_total_bytes=80 * GI, minor=0),
        GpuInfo(uuid=U0, index=1, name="A100-40", memory_total_bytes=40 * GI, minor=1),
        GpuInfo(uuid=U2, index=2, name="T4", memory_total_bytes=16 * GI, minor=7),
    ]
    cfg = SlicingConfig(
        default=SliceRule(replicas=4),
        overrides=(
            SliceOverride(GpuMatch(index=1), SliceRule(replicas=3)),
            SliceOverride(GpuMatch(index=2), SliceRule(replicas=2)),
        ),
    )
    reading = NodeReading(
        timestamp_s=0.0,
        gpus=tuple(GpuReading(info=g, healthy=g.index not in unhealthy) for g in gpus),
    )
    return build_inventory(reading, cfg)


INV = make_inventory()
ENVVAR = AllocationConfig()
NO_MPS = MpsConfig()


def alloc(
    ids: list[str],
    strategies: tuple[DeviceListStrategy, ...] = (S.ENVVAR,),
    *,
    mps: bool = False,
    inventory: Inventory = INV,
) -> ContainerAllocation:
    return build_container_allocation(
        ids, inventory, AllocationConfig(device_list_strategy=strategies), MpsConfig(enabled=mps)
    )


def expected_allocation_id(ids: list[str]) -> str:
    return hashlib.sha256(",".join(sorted(ids)).encode("utf-8")).hexdigest()[:16]


# --- envs ------------------------------------------------------------------------------------


def test_one_slice_on_one_gpu() -> None:
    ids = [f"{U1}::2"]
    a = alloc(ids)
    assert a.gpu_uuids == (U1,)
    assert a.slice_ids == (f"{U1}::2",)
    assert a.allocation_id == expected_allocation_id(ids)
    assert dict(a.envs) == {
        "NVIDIA_VISIBLE_DEVICES": U1,
        "VGPU_ALLOCATION_ID": expected_allocation_id(ids),
        "VGPU_MEMORY_LIMIT_MIB_0": str(20 * 1024),
        "VGPU_COMPUTE_SHARE_PERCENT_0": "25",
        # (20Gi - 512Mi) / 80Gi = 0.24375, rounded down.
        "VGPU_MEMORY_FRACTION_0": "0.24",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.24",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        # The same per device, under keys no other resource's answer can hold.
        "VGPU_ALLOCATION_ID_GPU_BBBBBBBB_0000_0000_0000_000000000000": expected_allocation_id(ids),
        "VGPU_MEMORY_LIMIT_MIB_GPU_BBBBBBBB_0000_0000_0000_000000000000": str(20 * 1024),
        "VGPU_COMPUTE_SHARE_PERCENT_GPU_BBBBBBBB_0000_0000_0000_000000000000": "25",
        "VGPU_MEMORY_FRACTION_GPU_BBBBBBBB_0000_0000_0000_000000000000": "0.24",
    }
    assert a.mounts == ()
    assert a.devices == ()
    assert dict(a.annotations) == {}
    assert a.cdi_devices == ()


@pytest.mark.parametrize(
    ("k", "mib", "percent"),
    [(1, 20 * 1024, "25"), (2, 40 * 1024, "50"), (3, 60 * 1024, "75"), (4, 80 * 1024, "100")],
)
def test_k_slices_on_one_gpu(k: int, mib: int, percent: str) -> None:
    a = alloc([f"{U1}::{n}" for n in range(k)])
    assert a.envs["VGPU_MEMORY_LIMIT_MIB_0"] == str(mib)
    assert a.envs["VGPU_COMPUTE_SHARE_PERCENT_0"] == percent
    assert "VGPU_MEMORY_LIMIT_MIB_1" not in a.envs


@pytest.mark.parametrize(("k", "percent"), [(1, "33"), (2, "66"), (3, "100")])
def test_share_percent_is_integer_floor(k: int, percent: str) -> None:
    a = alloc([f"{U0}::{n}" for n in range(k)])
    assert a.envs["VGPU_COMPUTE_SHARE_PERCENT_0"] == percent
    assert a.envs["VGPU_MEMORY_LIMIT_MIB_0"] == str(k * ((40 * GI) // 3) // MI)


def test_two_gpus_ordinals_follow_gpu_index_not_request_order() -> None:
    # GPU 1 (U0) is named first and GPU 0 (U1) last; ordinal 0 must still be GPU index 0.
    ids = [f"{U0}::2", f"{U0}::0", f"{U1}::3"]
    a = alloc(ids)
    assert a.gpu_uuids == (U1, U0)
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == f"{U1},{U0}"
    assert a.envs["VGPU_MEMORY_LIMIT_MIB_0"] == str(20 * 1024)
    assert a.envs["VGPU_COMPUTE_SHARE_PERCENT_0"] == "25"
    assert a.envs["VGPU_MEMORY_LIMIT_MIB_1"] == str(2 * ((40 * GI) // 3) // MI)
    assert a.envs["VGPU_COMPUTE_SHARE_PERCENT_1"] == "66"
    assert a.slice_ids == (f"{U1}::3", f"{U0}::0", f"{U0}::2")


def test_allocation_id_is_sha256_of_sorted_ids_and_order_independent() -> None:
    ids = [f"{U2}::1", f"{U1}::0", f"{U0}::2"]
    want = expected_allocation_id(ids)
    assert len(want) == 16
    for perm in itertools.permutations(ids):
        a = alloc(list(perm))
        assert a.allocation_id == want
        assert a.envs["VGPU_ALLOCATION_ID"] == want


# --- framework hints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "reserve", "total", "want"),
    [
        (20 * GI, 512 * MI, 80 * GI, 24),  # 0.24375: rounded down, never up
        (20 * GI, 0, 80 * GI, 25),  # exact
        (80 * GI, 0, 80 * GI, 100),  # the whole GPU
        (80 * GI - 1, 0, 80 * GI, 99),  # one byte short of 100 is 0.99
        (10 * GI, 512 * MI, 80 * GI, 11),  # 0.11875
        (512 * MI, 512 * MI, 80 * GI, 0),  # nothing left after the reserve
        (256 * MI, 512 * MI, 80 * GI, 0),  # less than the reserve: 0, not negative
        (5 * GI, 512 * MI, 0, 0),  # a GPU reporting no memory gets no fraction
    ],
)
def test_fraction_arithmetic_rounds_down(limit: int, reserve: int, total: int, want: int) -> None:
    assert memory_fraction_hundredths(limit, reserve, total) == want


@pytest.mark.parametrize(("h", "text"), [(1, "0.01"), (24, "0.24"), (75, "0.75"), (100, "1.00")])
def test_fraction_is_written_with_two_decimals(h: int, text: str) -> None:
    assert format_hundredths(h) == text


def test_jax_gets_the_tightest_gpu_and_each_gpu_its_own_fraction() -> None:
    # GPU 0: 1 of 4 slices of 80Gi (0.24); GPU 1: 2 of 3 of 40Gi (0.65); GPU 2: 1 of 2 of 16Gi
    # (0.46). JAX takes one fraction for every GPU: the smallest, so that no GPU goes over.
    a = alloc([f"{U1}::0", f"{U0}::0", f"{U0}::1", f"{U2}::0"])
    assert a.envs["VGPU_MEMORY_FRACTION_0"] == "0.24"
    assert a.envs["VGPU_MEMORY_FRACTION_1"] == "0.65"  # (2 * 40Gi/3 - 512Mi) / 40Gi = 0.6541
    assert a.envs["VGPU_MEMORY_FRACTION_2"] == "0.46"  # (8Gi - 512Mi) / 16Gi = 0.46875
    assert a.envs["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.24"
    assert a.envs["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_context_reserve_is_taken_from_the_limit() -> None:
    ids = [f"{U1}::0"]  # 20Gi of 80Gi
    for reserve, want in ((0, "0.25"), (512 * MI, "0.24"), (4 * GI, "0.20"), (GI + 1, "0.23")):
        cfg = AllocationConfig(context_reserve_bytes=reserve)
        a = build_container_allocation(ids, INV, cfg, NO_MPS)
        assert a.envs["XLA_PYTHON_CLIENT_MEM_FRACTION"] == want, reserve


def test_a_slice_no_bigger_than_the_reserve_gets_no_fraction() -> None:
    cfg = AllocationConfig(context_reserve_bytes=21 * GI)
    # GPU 0's 20Gi slice is all reserve; GPU 1's two slices (26.7Gi) are not: (26.7 - 21) / 40.
    a = build_container_allocation([f"{U1}::0", f"{U0}::0", f"{U0}::1"], INV, cfg, NO_MPS)
    assert "VGPU_MEMORY_FRACTION_0" not in a.envs
    assert a.envs["VGPU_MEMORY_FRACTION_1"] == "0.14"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in a.envs  # 0 would leave JAX nothing
    assert a.envs["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_with_mps_the_hints_are_what_one_process_may_hold() -> None:
    # Two slices of GPU 0 (40Gi) and one of GPU 2 (8Gi). Without MPS a process may use the
    # container's whole limit; with MPS the GPU holds every process to one slice.
    ids = [f"{U1}::0", f"{U1}::1", f"{U2}::0"]
    plain = alloc(ids)
    assert plain.envs["VGPU_MEMORY_FRACTION_0"] == "0.49"  # (40Gi - 512Mi) / 80Gi
    assert plain.envs["VGPU_MEMORY_FRACTION_1"] == "0.46"  # (8Gi - 512Mi) / 16Gi
    assert plain.envs["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.46"
    mps = alloc(ids, mps=True)
    assert mps.envs["VGPU_MEMORY_FRACTION_0"] == "0.24"  # (20Gi - 512Mi) / 80Gi
    assert mps.envs["VGPU_MEMORY_FRACTION_1"] == "0.46"
    assert mps.envs["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.24"
    # The container's own limits are unchanged: k slices' worth, across its processes.
    assert mps.envs["VGPU_MEMORY_LIMIT_MIB_0"] == str(40 * 1024)


def test_hints_can_be_turned_off() -> None:
    cfg = AllocationConfig(framework_hints=False)
    a = build_container_allocation([f"{U1}::0", f"{U0}::0"], INV, cfg, NO_MPS)
    hinted = [k for k in a.envs if k.startswith(("XLA_", "TF_", "VGPU_MEMORY_FRACTION_"))]
    assert hinted == []
    assert a.envs["VGPU_MEMORY_LIMIT_MIB_0"] == str(20 * 1024)  # the limits stay


def test_framework_hints_of_plain_figures() -> None:
    assert framework_hints([8 * GI], [16 * GI], 0) == {
        "VGPU_MEMORY_FRACTION_0": "0.50",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.50",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }


def test_mps_envs() -> None:
    ids = [f"{U1}::0", f"{U1}::1", f"{U0}::0"]
    a = alloc(ids, mps=True)
    mib0 = 2 * 20 * 1024
    mib1 = ((40 * GI) // 3) // MI
    assert a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={mib0}M,1={mib1}M"
    assert a.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "33"  # min(50, 33)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in alloc(ids).envs
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in alloc(ids).envs


def test_mps_mounts_the_pipe_directory_and_the_servers_shared_memory() -> None:
    mps = MpsConfig(enabled=True, root="/run/vgpu/mps")
    a = build_container_allocation([f"{U1}::0"], INV, ENVVAR, mps)
    assert a.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/vgpu/mps/pipe"
    assert a.mounts == (
        MountSpec("/run/vgpu/mps/pipe", "/run/vgpu/mps/pipe", read_only=True),
        MountSpec("/dev/shm", "/run/vgpu/mps/shm", read_only=False),
    )
    off = build_container_allocation([f"{U1}::0"], INV, ENVVAR, NO_MPS)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in off.envs
    assert off.mounts == ()


def test_mps_mounts_follow_the_root_and_come_after_volume_mounts() -> None:
    mps = MpsConfig(enabled=True, root="/var/lib/mps")
    cfg = AllocationConfig(device_list_strategy=(S.VOLUME_MOUNTS,))
    a = build_container_allocation([f"{U1}::0"], INV, cfg, mps)
    assert [m.container_path for m in a.mounts] == [
        f"/var/run/nvidia-container-devices/{U1}",
        "/var/lib/mps/pipe",
        "/dev/shm",
    ]
    assert a.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/var/lib/mps/pipe"


def test_mps_defaults_are_one_slice_per_gpu_and_the_smallest_share() -> None:
    # GPU 0: 80Gi / 4; GPU 1: 40Gi / 3; GPU 2: 16Gi / 2. One thread percentage for all: 25.
    d = mps_defaults(INV.plans)
    assert d == MpsDefaults(
        pinned_mem_limit_mib=((U1, 20 * 1024), (U0, (40 * GI // 3) // MI), (U2, 8 * 1024)),
        active_thread_percentage=25,
    )
    assert d.commands() == (
        f"set_default_device_pinned_mem_limit {U1} 20480M",
        f"set_default_device_pinned_mem_limit {U0} 13653M",
        f"set_default_device_pinned_mem_limit {U2} 8192M",
        "set_default_active_thread_percentage 25",
    )


def test_mps_defaults_leave_out_unsliced_gpus_and_need_a_sliced_one() -> None:
    mig = GpuInfo(uuid="GPU-mig", index=3, name="A100", memory_total_bytes=GI, minor=3)
    reading = NodeReading(0.0, (GpuReading(info=dataclasses_replace(mig, mig_enabled=True)),))
    inv = build_inventory(reading, SlicingConfig())
    assert mps_defaults(inv.plans) == MpsDefaults()
    assert mps_defaults(inv.plans).commands() == ()
    many = GpuInfo(uuid="GPU-many", index=0, name="X", memory_total_bytes=200 * GI, minor=0)
    inv = build_inventory(
        NodeReading(0.0, (GpuReading(info=many),)), SlicingConfig(default=SliceRule(replicas=200))
    )
    assert mps_defaults(inv.plans).active_thread_percentage == 1  # MPS rejects 0


def test_mps_single_gpu() -> None:
    a = alloc([f"{U2}::1"], mps=True)
    assert a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert a.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_mps_thread_percentage_is_at_least_one() -> None:
    g = GpuInfo(uuid="GPU-many", index=0, name="X", memory_total_bytes=200 * GI, minor=0)
    inv = build_inventory(
        NodeReading(0.0, (GpuReading(info=g),)), SlicingConfig(default=SliceRule(replicas=200))
    )
    a = alloc(["GPU-many::0"], mps=True, inventory=inv)
    assert a.envs["VGPU_COMPUTE_SHARE_PERCENT_0"] == "0"
    assert a.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"


# --- device-list strategies ------------------------------------------------------------------

IDS = [f"{U0}::1", f"{U2}::0", f"{U1}::1"]  # GPUs in index order: U1 (minor 0), U0 (1), U2 (7)
UUIDS = (U1, U0, U2)
CDI = tuple(f"nvidia.com/gpu={u}" for u in UUIDS)
AID = expected_allocation_id(IDS)
MOUNTS = tuple(
    MountSpec(f"/var/run/nvidia-container-devices/{u}", "/dev/null", True) for u in UUIDS
)
DEVICES = tuple(
    DeviceNodeSpec(p, p, "rw")
    for p in (
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia0",
        "/dev/nvidia1",
        "/dev/nvidia7",
    )
)


def test_strategy_envvar() -> None:
    a = alloc(IDS, (S.ENVVAR,))
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS)
    assert (a.mounts, a.devices, dict(a.annotations), a.cdi_devices) == ((), (), {}, ())


def test_strategy_volume_mounts() -> None:
    a = alloc(IDS, (S.VOLUME_MOUNTS,))
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert a.mounts == MOUNTS
    assert all(m.read_only and m.host_path == "/dev/null" for m in a.mounts)
    assert (a.devices, dict(a.annotations), a.cdi_devices) == ((), {}, ())


def test_strategy_cdi_annotations() -> None:
    a = alloc(IDS, (S.CDI_ANNOTATIONS,))
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert dict(a.annotations) == {f"cdi.k8s.io/vgpu-device-plugin_{AID}": ",".join(CDI)}
    assert (a.mounts, a.devices, a.cdi_devices) == ((), (), ())


def test_strategy_cdi_cri() -> None:
    a = alloc(IDS, (S.CDI_CRI,))
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert a.cdi_devices == CDI
    assert (a.mounts, a.devices, dict(a.annotations)) == ((), (), {})


def test_strategy_device_specs() -> None:
    a = alloc(IDS, (S.DEVICE_SPECS,))
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert a.devices == DEVICES
    assert (a.mounts, dict(a.annotations), a.cdi_devices) == ((), {}, ())


def test_empty_strategy_list_means_envvar() -> None:
    assert alloc(IDS, ()) == alloc(IDS, (S.ENVVAR,))


def test_strategy_order_and_repeats_do_not_matter() -> None:
    a = alloc(IDS, (S.CDI_CRI, S.ENVVAR, S.CDI_CRI))
    assert a == alloc(IDS, (S.ENVVAR, S.CDI_CRI))


ALL_STRATEGIES = tuple(S)


@pytest.mark.parametrize(
    "strategies",
    [
        pytest.param(combo, id="+".join(combo))
        for r in range(1, len(ALL_STRATEGIES) + 1)
        for combo in itertools.combinations(ALL_STRATEGIES, r)
    ],
)
def test_every_strategy_combination(strategies: tuple[DeviceListStrategy, ...]) -> None:
    a = alloc(IDS, strategies)
    chosen = set(strategies)
    if S.ENVVAR in chosen:
        want_visible = ",".join(UUIDS)
    elif S.VOLUME_MOUNTS in chosen:
        want_visible = "/var/run/nvidia-container-devices"
    else:
        want_visible = "void"
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == want_visible
    assert a.mounts == (MOUNTS if S.VOLUME_MOUNTS in chosen else ())
    assert a.devices == (DEVICES if S.DEVICE_SPECS in chosen else ())
    assert a.cdi_devices == (CDI if S.CDI_CRI in chosen else ())
    want_annotations = (
        {f"cdi.k8s.io/vgpu-device-plugin_{AID}": ",".join(CDI)}
        if S.CDI_ANNOTATIONS in chosen
        else {}
    )
    assert dict(a.annotations) == want_annotations
    # The per-GPU envs and identity do not depend on the strategy.
    assert a.allocation_id == AID
    assert a.gpu_uuids == UUIDS
    assert a.envs["VGPU_ALLOCATION_ID"] == AID
    assert [a.envs[f"VGPU_COMPUTE_SHARE_PERCENT_{i}"] for i in range(3)] == ["25", "33", "50"]


# --- refusals --------------------------------------------------------------------------------


def test_empty_request_is_refused() -> None:
    with pytest.raises(AllocationError, match="no device IDs"):
        alloc([])


def test_unknown_id_is_refused_by_name() -> None:
    with pytest.raises(AllocationError) as exc:
        alloc([f"{U1}::0", "GPU-nope::0"])
    assert str(exc.value) == 'unknown device ID "GPU-nope::0": not advertised by this node'


def test_slice_number_beyond_replicas_is_unknown() -> None:
    with pytest.raises(AllocationError, match=f'unknown device ID "{U2}::2"'):
        alloc([f"{U2}::2"])


def test_unhealthy_id_is_refused_by_name() -> None:
    inv = make_inventory(unhealthy=(1,))
    with pytest.raises(AllocationError) as exc:
        alloc([f"{U1}::0", f"{U0}::1"], inventory=inv)
    assert str(exc.value) == f'device ID "{U0}::1" is unhealthy'


def test_duplicate_id_is_refused_by_name() -> None:
    with pytest.raises(AllocationError) as exc:
        alloc([f"{U1}::0", f"{U1}::1", f"{U1}::0"])
    assert str(exc.value) == f'device ID "{U1}::0" is requested 2 times'


def test_every_bad_id_is_named_in_one_error() -> None:
    inv = make_inventory(unhealthy=(2,))
    ids = [f"{U1}::0", "bogus", f"{U2}::0", f"{U2}::1", "bogus", "GPU-gone::3"]
    with pytest.raises(AllocationError) as exc:
        alloc(ids, inventory=inv)
    message = str(exc.value)
    for part in (
        'device ID "bogus" is requested 2 times',
        'unknown device ID "bogus": not advertised by this node',
        'unknown device ID "GPU-gone::3": not advertised by this node',
        f'device ID "{U2}::0" is unhealthy',
        f'device ID "{U2}::1" is unhealthy',
    ):
        assert part in message
    assert f'"{U1}::0"' not in message


def test_refusal_of_slice_whose_gpu_is_not_planned() -> None:
    # An inventory whose plans do not cover a slice is inconsistent; refuse rather than guess.
    broken = Inventory.of((), INV.slices)
    with pytest.raises(AllocationError, match="does not slice"):
        alloc([f"{U1}::0"], inventory=broken)


def test_device_env_keys_are_named_after_the_device() -> None:
    assert device_env_suffix("MIG-4f1e2a3b-0000-4000-8000-00000000000a") == (
        "MIG_4F1E2A3B_0000_4000_8000_00000000000A"
    )
    assert device_env_suffix("MIG-GPU-aa/1/0") == "MIG_GPU_AA_1_0"


def test_with_several_resources_envvar_also_lists_the_devices_as_mounts() -> None:
    ids = [f"{U1}::0", f"{U0}::1"]
    plain = alloc(ids)
    several = build_container_allocation(
        ids,
        INV,
        AllocationConfig(device_list_strategy=(DeviceListStrategy.ENVVAR,)),
        MpsConfig(),
        several_resources=True,
    )
    assert several.envs == plain.envs  # NVIDIA_VISIBLE_DEVICES keeps the UUIDs
    assert plain.mounts == ()
    assert {(m.container_path, m.host_path, m.read_only) for m in several.mounts} == {
        (f"/var/run/nvidia-container-devices/{U0}", "/dev/null", True),
        (f"/var/run/nvidia-container-devices/{U1}", "/dev/null", True),
    }
    # Without envvar the strategies are as configured.
    cdi = build_container_allocation(
        ids,
        INV,
        AllocationConfig(device_list_strategy=(DeviceListStrategy.CDI_CRI,)),
        MpsConfig(),
        several_resources=True,
    )
    assert cdi.mounts == ()


# --- device ID strategy: index ---------------------------------------------------------------

BY_INDEX = AllocationConfig(device_id_strategy=DeviceIdStrategy.INDEX)
PARENT = "GPU-dddddddd-0000-0000-0000-000000000000"
MIG_A = "MIG-aaaaaaaa-0000-4000-8000-000000000000"
MIG_B = "MIG-bbbbbbbb-0000-4000-8000-000000000000"


def mig_device(uuid: str, gi: int, mig_index: int | None) -> GpuInfo:
    return GpuInfo(
        uuid=uuid,
        index=3,
        name="A100 MIG 1g.10gb",
        memory_total_bytes=10 * GI,
        minor=3,
        parent_uuid=PARENT,
        mig_profile="1g.10gb",
        gpu_instance_id=gi,
        compute_instance_id=0,
        mig_index=mig_index,
    )


def mixed_inventory(mig_indices: tuple[int | None, int | None] = (4, 1)) -> Inventory:
    """Under the mixed strategy: the three GPUs of make_inventory, and on GPU 3 two 1g.10gb MIG
    devices whose UUID order and MIG index order differ (MIG_A in slot 4, MIG_B in slot 1)."""
    parent = GpuInfo(PARENT, 3, "A100", 80 * GI, 3, mig_enabled=True)
    infos = [*(p.gpu for p in INV.plans), parent]
    infos += [mig_device(MIG_A, 5, mig_indices[0]), mig_device(MIG_B, 2, mig_indices[1])]
    reading = NodeReading(0.0, tuple(GpuReading(info=i) for i in infos))
    cfg = SlicingConfig(
        default=SliceRule(replicas=4),
        overrides=(SliceOverride(GpuMatch(profile="1g.10gb"), SliceRule(replicas=2)),),
    )
    return build_inventory(reading, cfg, mig=MigConfig(strategy=MigStrategy.MIXED))


def by_index(
    ids: list[str],
    strategies: tuple[DeviceListStrategy, ...] = (S.ENVVAR,),
    *,
    inventory: Inventory = INV,
    several_resources: bool = False,
) -> ContainerAllocation:
    cfg = dataclasses_replace(BY_INDEX, device_list_strategy=strategies)
    return build_container_allocation(
        ids, inventory, cfg, NO_MPS, several_resources=several_resources
    )


def test_by_index_a_gpu_is_named_by_its_nvml_index() -> None:
    a = by_index([f"{U0}::2"])  # U0 is GPU 1
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "1"


def test_by_index_several_gpus_in_index_order_each_once() -> None:
    # Two slices of GPU 0: NVIDIA's plugin would write its index twice; one is enough.
    a = by_index([f"{U2}::0", f"{U1}::3", f"{U1}::0", f"{U0}::1"])
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "0,1,2"


def test_by_index_a_mig_device_is_named_gpu_index_colon_mig_index() -> None:
    inv = mixed_inventory()
    a = by_index([f"{MIG_A}::1", f"{MIG_B}::0"], inventory=inv)
    # In the order of the ordinals (by UUID within the GPU), named by their slots under GPU 3.
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "3:4,3:1"
    assert [a.envs[f"VGPU_MEMORY_LIMIT_MIB_{i}"] for i in (0, 1)] == ["5120", "5120"]


def test_by_index_every_device_list_strategy_names_devices_by_index() -> None:
    ids = [f"{U1}::0", f"{U2}::1"]
    a = by_index(ids, (S.VOLUME_MOUNTS, S.CDI_ANNOTATIONS, S.CDI_CRI, S.DEVICE_SPECS))
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert a.mounts == (
        MountSpec("/var/run/nvidia-container-devices/0", "/dev/null", True),
        MountSpec("/var/run/nvidia-container-devices/2", "/dev/null", True),
    )
    assert a.cdi_devices == ("nvidia.com/gpu=0", "nvidia.com/gpu=2")
    assert dict(a.annotations) == {
        f"cdi.k8s.io/vgpu-device-plugin_{expected_allocation_id(ids)}": (
            "nvidia.com/gpu=0,nvidia.com/gpu=2"
        )
    }
    # Device nodes are paths, whatever the strategy.
    assert [d.host_path for d in a.devices][-2:] == ["/dev/nvidia0", "/dev/nvidia7"]


def test_by_index_mixed_mig_mounts_carry_the_indices_beside_the_env() -> None:
    inv = mixed_inventory()
    a = by_index(
        [f"{MIG_B}::1"],
        inventory=inv.for_resource("nvidia.com/mig-1g.10gb"),
        several_resources=True,
    )
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "3:1"
    assert [m.container_path for m in a.mounts] == ["/var/run/nvidia-container-devices/3:1"]


def test_by_index_the_daemons_own_keys_and_identity_keep_uuids() -> None:
    ids = [f"{U1}::0", f"{U0}::1"]
    uuid = build_container_allocation(ids, INV, AllocationConfig(), NO_MPS)
    index = by_index(ids)
    assert index.gpu_uuids == uuid.gpu_uuids == (U1, U0)
    assert index.allocation_id == uuid.allocation_id
    assert {k: v for k, v in index.envs.items() if k != "NVIDIA_VISIBLE_DEVICES"} == {
        k: v for k, v in uuid.envs.items() if k != "NVIDIA_VISIBLE_DEVICES"
    }
    assert f"VGPU_ALLOCATION_ID_{device_env_suffix(U1)}" in index.envs


def test_by_index_a_mig_device_without_a_known_index_is_refused_with_what_to_do() -> None:
    inv = mixed_inventory((None, 1))
    with pytest.raises(AllocationError, match=f"MIG device {MIG_A} has no known MIG index.*uuid"):
        by_index([f"{MIG_A}::0"], inventory=inv)
    # By UUID it needs none.
    assert alloc([f"{MIG_A}::0"], inventory=inv).envs["NVIDIA_VISIBLE_DEVICES"] == MIG_A
