#!/usr/bin/env bash
# Run inside new network and PID namespaces, as tests/deploy/test_apiserver_rbac.py does
# (unshare --net --pid --fork --kill-child: every process started here ends with it): a real
# etcd and kube-apiserver on loopback (apiserver.sh), the chart's per-node-values objects applied,
# then the daemon's per-node config reader (deviceplugin.nodeconfig) run with the ServiceAccount's
# own token; then the chart installed under several release names side by side (releases.sh).
# Prints one `result ...` line per finding; the test reads them.
#   rbac_check.sh WORK_DIR BIN_DIR      (BIN_DIR: kube-multi and tinyetcd from the k8s bundle)
set -euo pipefail
WORK=$1 BIN=$2
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
source "$(dirname "$0")/apiserver.sh"

kubectl create namespace vgpu-system >/dev/null
helm template vgpu-device-plugin "$REPO/daemonset/chart" -n vgpu-system \
    -f "$REPO/daemonset/chart/ci/per-node-values.yaml" > "$WORK/rendered.yaml"
kubectl apply -f "$WORK/rendered.yaml" >/dev/null
printf 'apiVersion: v1\nkind: Node\nmetadata:\n  name: gpu-1\n  labels: {nvidia.com/device-plugin.config: a100-eight}\n' \
    | kubectl apply -f - >/dev/null
SA=$(kubectl get -f "$WORK/rendered.yaml" -o jsonpath='{range .items[?(@.kind=="ServiceAccount")]}{.metadata.name}{end}')
for verb in get list watch patch; do
    echo "result can-i $verb nodes $(kubectl auth can-i "$verb" nodes --as="system:serviceaccount:vgpu-system:$SA" 2>/dev/null)"
done
echo "result can-i get pods $(kubectl auth can-i get pods -A --as="system:serviceaccount:vgpu-system:$SA")"
kubeconfig sa "{token: \"$(kubectl create token "$SA" -n vgpu-system)\"}"

WORK=$WORK "$PY" - <<'EOP'
import asyncio, os, subprocess
from pathlib import Path

import yaml

from deviceplugin.nodeconfig import NodeConfig, NodeConfigRules

work = Path(os.environ["WORK"])
for doc in yaml.safe_load_all((work / "rendered.yaml").read_text()):
    if doc and doc["kind"] == "ConfigMap":
        for name, content in doc["data"].items():
            (work / "cfg" / name).write_text(content)


def label(value: str) -> None:
    arg = "nvidia.com/device-plugin.config" + (f"={value}" if value else "-")
    subprocess.run(["kubectl", "label", "node", "gpu-1", arg, "--overwrite"], check=True,
                   capture_output=True)


async def main() -> None:
    reader = NodeConfig(NodeConfigRules(work / "cfg", default="default"), "gpu-1",
                        kubeconfig=str(work / "sa.kubeconfig"), interval_s=0.3)
    print("result initial", (await reader.initial()).name)
    events: list[str] = []

    async def switch(path, trigger):
        events.append(f"switch {path.name if path else '-'}")
        return "applied"

    def refuse(source, problems, trigger):
        events.append("refuse " + problems[0].split(" names")[0])
        return "refused"

    stop = asyncio.Event()
    task = asyncio.create_task(reader.run(stop, switch, refuse))
    for value, count in (("", 1), ("nope", 2), ("a100-eight", 3)):
        await asyncio.to_thread(label, value)
        for _ in range(100):
            if len(events) >= count:
                break
            await asyncio.sleep(0.1)
    stop.set()
    await task
    for event in events:
        print("result", event)


asyncio.run(main())
EOP

source "$(dirname "$0")/releases.sh"
