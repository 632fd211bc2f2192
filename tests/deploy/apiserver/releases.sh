# Sourced by rbac_check.sh, with the API server up: the chart installed by `helm install` under
# three releases side by side, then, for each, what its DaemonSet's service account may do (RBAC,
# asked with `kubectl auth can-i --as`) and what the DRA admission policy lets it write (a
# ResourceSlice created as that service account, its token's node stood in for by impersonation).
#   - vgpu in vgpu-system: DRA (values-dra.yaml), under the name the chart's examples once used;
#   - gpu-pool-b in vgpu-system: DRA too, beside it in one namespace, with per-node configs;
#     first without dra.deviceClasses=false (refused: the DeviceClasses are vgpu's), then with;
#   - vgpu in gpu-team: the same release name in another namespace, device plugins with per-node
#     configs (get on nodes only).
# Prints `result release ...` lines; the test reads them.
CHART=$REPO/daemonset/chart
DRA_VALUES=$CHART/values-dra.yaml
printf 'config:\n  map:\n    default: {slicing: {replicas: 4}}\n' > "$WORK/per-node.yaml"
PER_NODE=(-f "$WORK/per-node.yaml")
kubectl create namespace gpu-team >/dev/null
printf 'apiVersion: v1\nkind: Node\nmetadata:\n  name: gpu-2\n' | kubectl apply -f - >/dev/null

install() {  # RELEASE NAMESPACE HELM-ARGS...: installed, or helm's error
    local release=$1 namespace=$2 log
    shift 2
    log=$WORK/helm-$release-$namespace.log
    if helm install "$release" "$CHART" -n "$namespace" "$@" > "$log" 2>&1; then
        echo "result release $release/$namespace installed"
    else
        echo "result release $release/$namespace refused: $(grep -o 'Error: .*' "$log" | head -1)"
    fi
}

install vgpu vgpu-system -f "$DRA_VALUES"
install gpu-pool-b vgpu-system -f "$DRA_VALUES" "${PER_NODE[@]}"
install gpu-pool-b vgpu-system -f "$DRA_VALUES" "${PER_NODE[@]}" --set dra.deviceClasses=false
install vgpu gpu-team "${PER_NODE[@]}"

service_account() {  # RELEASE NAMESPACE: the user its DaemonSet's pods run as
    local sa
    sa=$(kubectl get daemonset -n "$2" -l "app.kubernetes.io/instance=$1" \
        -o jsonpath='{.items[0].spec.template.spec.serviceAccountName}' 2>/dev/null || true)
    echo "system:serviceaccount:$2:$sa"
}

can_i() {  # RELEASE NAMESPACE VERB RESOURCE
    local answer
    answer=$(kubectl auth can-i "$3" "$4" --as="$(service_account "$1" "$2")" 2>/dev/null || true)
    echo "result release $1/$2 can-i $3 $4 ${answer:-error}"
}

slice() {  # RELEASE NAMESPACE TOKEN-NODE SLICE-NODE: create a slice as the service account
    local extra=()
    [ -n "$3" ] && extra=(--as-user-extra "authentication.kubernetes.io/node-name=$3")
    printf '%s\n' '{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",' \
        "\"metadata\": {\"generateName\": \"check-$4-\"}," \
        "\"spec\": {\"driver\": \"vgpu.dev\", \"nodeName\": \"$4\"," \
        "\"pool\": {\"name\": \"$4\", \"generation\": 1, \"resourceSliceCount\": 1}, \"devices\": []}}" \
        > "$WORK/slice.json"
    kubectl create -f "$WORK/slice.json" --as="$(service_account "$1" "$2")" "${extra[@]}" 2>&1 || true
}

check_slice() {  # RELEASE NAMESPACE TOKEN-NODE SLICE-NODE: what became of the slice
    local out verdict
    out=$(slice "$@")
    case $out in
        *created*) verdict=created ;;
        *"may not write ResourceSlices of node $4"*) verdict="denied: may not write" ;;
        *"names no node"*) verdict="denied: names no node" ;;
        *) verdict="other: $out" ;;
    esac
    echo "result release $1/$2 slice token-node=${3:--} slice-node=$4 $verdict"
}

for release in vgpu/vgpu-system gpu-pool-b/vgpu-system; do
    name=${release%/*} namespace=${release#*/}
    for verb in create update delete get list watch; do
        can_i "$name" "$namespace" "$verb" resourceslices.resource.k8s.io
    done
    can_i "$name" "$namespace" get resourceclaims.resource.k8s.io
    can_i "$name" "$namespace" get nodes
    can_i "$name" "$namespace" list resourceclaims.resource.k8s.io
    can_i "$name" "$namespace" deletecollection resourceslices.resource.k8s.io
    can_i "$name" "$namespace" create deviceclasses.resource.k8s.io
    can_i "$name" "$namespace" patch nodes
    can_i "$name" "$namespace" list pods
    can_i "$name" "$namespace" get secrets
    # The policy holds it to its own node's slices once the API server has loaded it.
    for _ in $(seq 60); do
        slice "$name" "$namespace" gpu-1 gpu-2 | grep -q 'may not write' && break
        sleep 0.5
    done
    check_slice "$name" "$namespace" gpu-1 gpu-1
    check_slice "$name" "$namespace" gpu-1 gpu-2
    check_slice "$name" "$namespace" "" gpu-1
done
can_i vgpu gpu-team get nodes
can_i vgpu gpu-team list nodes
can_i vgpu gpu-team create resourceslices.resource.k8s.io
echo "result release cluster roles $(kubectl get clusterroles -l app.kubernetes.io/part-of=vgpu \
    -o jsonpath='{range .items[*]}{.metadata.name}{" "}{end}')"
