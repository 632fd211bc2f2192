"""The status view on a small terminal: at most its height in lines, in the compact layout, with
what the enforcer is doing shown first."""

from __future__ import annotations

import copy
from typing import Any

from deviceplugin.usage.statusview import render_status
from tests.unit.test_metrics import sample_snapshot
from tests.unit.test_statusview import doc_of


def busy_node(gpus: int = 6) -> dict[str, Any]:
    """A node of `gpus` GPUs, each with the sample's containers; only the last GPU's throttled
    container is throttled, and only the last GPU is unhealthy."""
    base = doc_of(sample_snapshot())
    healthy = base["gpus"][0]
    doc: dict[str, Any] = {**base, "gpus": [], "containers": []}
    for i in range(gpus):
        gpu = copy.deepcopy(healthy)
        gpu.update(uuid=f"GPU-{i}", index=i, healthy=i != gpus - 1)
        doc["gpus"].append(gpu)
        for original in base["containers"]:
            if original["gpu_uuid"] != healthy["uuid"]:
                continue
            c = copy.deepcopy(original)
            c.update(gpu_uuid=f"GPU-{i}", gpu_index=i)
            if i != gpus - 1:
                c.update(throttled=False, duty_cycle_ratio=None, memory_used_bytes=0)
            doc["containers"].append(c)
    return doc


def test_the_view_fits_80_by_24_with_the_gpu_where_the_enforcer_acts_first() -> None:
    doc = busy_node()
    assert len(render_status(doc, width=80)) > 24  # the full view would scroll away
    lines = render_status(doc, width=80, height=24)
    assert len(lines) <= 24
    assert all(len(line) <= 80 for line in lines)
    # The header, then the GPU where something happens (index 5: unhealthy, a container
    # throttled and over its memory limit), before GPU 0.
    assert lines[0].startswith("node node-a")
    assert lines[2].startswith("UNHEALTHY GPU 5 ")
    assert lines[3].startswith("  THROTTLED 60% OVER LIMIT team-b/")
    assert "25Gi/20Gi" in lines[3]
    assert lines[-1].startswith("enforcement actions:")
    assert lines[-2].startswith("... ")
    assert "more lines" in lines[-2]


def test_what_fits_in_full_is_drawn_in_full() -> None:
    doc = busy_node(1)
    assert render_status(doc, width=80, height=40) == render_status(doc, width=80)
    assert any(line.startswith("    mem [") for line in render_status(doc, width=80, height=40))


def test_a_very_small_terminal_still_gets_at_most_its_height() -> None:
    for height in range(1, 8):
        assert len(render_status(busy_node(), width=80, height=height)) <= height
