# Sourced by the checks here, inside the new network and PID namespaces the test made: a real
# etcd and kube-apiserver on loopback, stopped (by PID) when the sourcing script exits, and
# KUBECONFIG set to an admin's. Defines kubeconfig NAME USER-YAML, which writes $WORK/NAME.kubeconfig.
#   needs: WORK (a scratch directory), BIN (kube-multi and tinyetcd from the k8s bundle)
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

