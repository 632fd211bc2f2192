#!/usr/bin/env bash
# Run inside new network and PID namespaces, as tests/deploy/test_apiserver_rbac.py does
# (unshare --net --pid --fork --kill-child: every process started here ends with it): a real
# etcd and kube-apiserver on loopback, the chart's per-node-values objects applied, then the
# daemon's per-node config reader (deviceplugin.nodeconfig) run with the ServiceAccount's own
# token. Prints one `result ...` line per finding; the test reads them.
#   rbac_check.sh WORK_DIR BIN_DIR      (BIN_DIR: kube-multi and tinyetcd from the k8s bundle)
set -euo pipefail
WORK=$1 BIN=$2
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
PKI=$WORK/pki
mkdir -p "$PKI" "$WORK/etcd" "$WORK/cfg"
ip link set lo up

# Certificates: a CA, the apiserver's serving certificate, an admin client, the SA signing key.
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 1 \
    -subj "/CN=test-ca" 2>/dev/null
printf '[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n' \
    > "$PKI/san.cnf"
openssl req -newkey rsa:2048 -nodes -keyout "$PKI/api.key" -out "$PKI/api.csr" \
    -subj "/CN=kube-apiserver" 2>/dev/null
openssl x509 -req -in "$PKI/api.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -out "$PKI/api.crt" -days 1 -extfile "$PKI/san.cnf" -extensions ext 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout "$PKI/admin.key" -out "$PKI/admin.csr" \
    -subj "/CN=admin/O=system:masters" 2>/dev/null
openssl x509 -req -in "$PKI/admin.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -out "$PKI/admin.crt" -days 1 2>/dev/null
openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null

"$BIN/tinyetcd" --data-dir "$WORK/etcd" --listen-client http://127.0.0.1:2379 \
    --listen-peer http://127.0.0.1:2380 > "$WORK/etcd.log" 2>&1 &
ETCD=$!
"$BIN/kube-multi" kube-apiserver --etcd-servers=http://127.0.0.1:2379 --bind-address=127.0.0.1 \
    --advertise-address=127.0.0.1 --secure-port=6443 --tls-cert-file="$PKI/api.crt" \
    --tls-private-key-file="$PKI/api.key" --client-ca-file="$PKI/ca.crt" \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc --service-cluster-ip-range=10.0.0.0/24 \
    --authorization-mode=Node,RBAC --enable-priority-and-fairness=false > "$WORK/api.log" 2>&1 &
API=$!
stop() {
    kill "$API" "$ETCD" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "$API" 2>/dev/null || kill -0 "$ETCD" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$API" "$ETCD" 2>/dev/null || true
    wait "$API" "$ETCD" 2>/dev/null || true
}
trap stop EXIT

kubeconfig() {  # NAME USER-YAML
    cat > "$WORK/$1.kubeconfig" <<EOC
apiVersion: v1
kind: Config
clusters: [{name: t, cluster: {server: "https://127.0.0.1:6443", certificate-authority: $PKI/ca.crt}}]
users: [{name: u, user: $2}]
contexts: [{name: t, context: {cluster: t, user: u}}]
current-context: t
EOC
}
kubeconfig admin "{client-certificate: $PKI/admin.crt, client-key: $PKI/admin.key}"
export KUBECONFIG=$WORK/admin.kubeconfig
for _ in $(seq 120); do
    kubectl get --raw /readyz >/dev/null 2>&1 && break
    sleep 1
done
kubectl get --raw /readyz >/dev/null

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
