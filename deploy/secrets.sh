#!/usr/bin/env bash
# Make the Secrets the manifests expect (docs/deploy.md, "Security"), with fresh random
# values and certificates:
#   prefixgate-redis         password (Redis administrator), gateway-password, worker-password
#   prefixgate-tls           tls.crt, tls.key, ca.crt: the Chat API's certificate
#   prefixgate-internal-tls  ca.crt, gateway.crt/.key (the gateways' client certificate)
#   prefixgate-auth          tokens (hashed), internal-token (gateways) and its hash
#                            internal-token.sha256 (workers), peer-token (workers' block
#                            pulls), worker-keyring (gateways': each worker's Ed25519
#                            public key, and the gateways' own key)
#   prefixgate-worker-keys   per worker pod, named by the pod (prefixgate-worker-0, ...):
#                            <pod>.keyring (its Ed25519 private key, and the gateways'
#                            public pull-ticket key) and <pod>.crt/.key (its certificate,
#                            server and client, naming its worker id and its own DNS name
#                            only); each worker pod sees only its own (subPathExpr mounts)
# A Secret that already exists is left alone (bring your own certificate by creating
# prefixgate-tls first, e.g. with cert-manager). Prints the first client token, bound to
# the namespace TENANT (default: "default"), once: it is stored nowhere else.
#
#   bash deploy/secrets.sh [-n NAMESPACE] [--workers N]  # kubectl create secret ... in NAMESPACE
#   bash deploy/secrets.sh --dir DIR                     # write the files to DIR instead
# (one folder per Secret; it prints the `kubectl create secret` lines that load them, with
# their types: prefixgate-tls is kubernetes.io/tls)
# --workers N (default 16): keys for worker pods 0 .. N-1, the most the StatefulSet may be
# scaled to without adding keys (`prefixgate token --worker-key prefixgate-worker-N`).
# Needs openssl 1.1.1 or newer (and kubectl without --dir).
set -euo pipefail

namespace=prefixgate
out_dir=""
workers=16
while [ $# -gt 0 ]; do
    case "$1" in
        -n|--namespace) namespace="$2"; shift 2 ;;
        --dir) out_dir="$2"; shift 2 ;;
        --workers) workers="$2"; shift 2 ;;
        *) echo "usage: $0 [-n NAMESPACE] [--dir DIR] [--workers N]" >&2; exit 2 ;;
    esac
done
if [ -n "$out_dir" ]; then
    # Absolute before the `cd` below: a relative DIR is the caller's, not the scratch one's.
    (umask 077 && mkdir -p "$out_dir")
    out_dir="$(cd "$out_dir" && pwd)"
fi
tenant="${TENANT:-default}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
umask 077
cd "$work"

hex() { openssl rand -hex "$1"; }

# A CA, and certificates it signs: cert NAME CN SAN EXTENDED_KEY_USAGE
ca() {
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 \
        -subj "/CN=$2" -keyout "$1.key" -out "$1.crt" \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
        2>/dev/null
}
cert() {
    local name="$1" ca="$2" cn="$3" san="$4" usage="$5"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$cn" \
        -keyout "$name.key" -out "$name.csr" 2>/dev/null
    printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=%s\n%s' \
        "$usage" "${san:+subjectAltName=$san}" > "$name.ext"
    openssl x509 -req -in "$name.csr" -CA "$ca.crt" -CAkey "$ca.key" -CAcreateserial \
        -days 825 -extfile "$name.ext" -out "$name.crt" 2>/dev/null
}

svc="svc.cluster.local"
ca public-ca "prefixgate public CA"
cert gateway-public public-ca prefixgate-gateway \
    "DNS:prefixgate-gateway,DNS:prefixgate-gateway.$namespace,DNS:prefixgate-gateway.$namespace.svc,DNS:prefixgate-gateway.$namespace.$svc,DNS:localhost,IP:127.0.0.1" \
    serverAuth
ca internal-ca "prefixgate internal CA"
cert gateway internal-ca prefixgate-gateway "" clientAuth

token="pg_$(openssl rand -base64 32 | tr '+/' '-_' | tr -d '=\n')"
digest="$(printf '%s' "$token" | openssl dgst -sha256 -r | cut -d' ' -f1)"
printf '# sha256:<hash of the token> <namespace> [<label>]; `prefixgate token` adds more\nsha256:%s %s\n' \
    "$digest" "$tenant" > tokens
printf 'pg_%s\n' "$(hex 32)" > internal-token
printf 'sha256:%s\n' "$(tr -d '\n' < internal-token | openssl dgst -sha256 -r | cut -d' ' -f1)" \
    > internal-token.sha256
printf 'pg_%s\n' "$(hex 32)" > peer-token
# One Ed25519 key per worker pod (prefixgate/security/identity.py): the pod gets its private
# line, gateways every public line and the gateways' key. Raw keys are the last 32 bytes of
# the DER forms (PKCS#8 private key, SubjectPublicKeyInfo).
raw32() { tail -c 32 | od -An -v -tx1 | tr -d ' \n'; }
printf '# gateways only: workers'"'"' public keys, and the gateways'"'"' key (predictions, reaps)\n' \
    > worker-keyring
gateways_key="$(hex 32)"
printf '@gateways hmac:%s\n' "$gateways_key" >> worker-keyring
# The gateways sign pull tickets with an Ed25519 key derived from their key (seed: HMAC-SHA256
# of "pg-pull-ticket"; prefixgate/security/tickets.py); workers get its public half.
seed="$(printf 'pg-pull-ticket' | openssl dgst -sha256 -mac HMAC -macopt "hexkey:$gateways_key" -r \
    | cut -d' ' -f1)"
printf "$(printf '302e020100300506032b657004220420%s' "$seed" | sed 's/../\\x&/g')" > ticket.der
tickets_line="@tickets ed25519:$(openssl pkey -inform DER -in ticket.der -pubout -outform DER | raw32)"
rm -f ticket.der
mkdir worker-keys
for i in $(seq 0 $((workers - 1))); do
    id="prefixgate-worker-$i"
    openssl genpkey -algorithm ed25519 -out key.pem 2>/dev/null
    printf '%s ed25519-private:%s\n%s\n' "$id" "$(openssl pkey -in key.pem -outform DER | raw32)" \
        "$tickets_line" > "worker-keys/$id.keyring"
    printf '%s ed25519:%s\n' "$id" "$(openssl pkey -in key.pem -pubout -outform DER | raw32)" \
        >> worker-keyring
    # Its own certificate: another pod's files cannot serve TLS under this pod's name. It
    # names the worker id too (peers check it) and is its client certificate towards peers.
    cert "worker-keys/$id" internal-ca "$id" "DNS:$id,DNS:$id.prefixgate-worker.$namespace.$svc" \
        serverAuth,clientAuth
    rm -f "worker-keys/$id.csr" "worker-keys/$id.ext"
done
rm -f key.pem
hex 24 > redis-password
hex 24 > redis-gateway-password
hex 24 > redis-worker-password

# secret NAME TYPE key=file ...
secret() {
    local name="$1" type="$2"
    shift 2
    if [ -n "$out_dir" ]; then
        mkdir -p "$out_dir/$name"
        for pair in "$@"; do cp "${pair#*=}" "$out_dir/$name/${pair%%=*}"; done
        load_line "$name" "$type"
        return
    fi
    if kubectl -n "$namespace" get secret "$name" >/dev/null 2>&1; then
        echo "secret/$name exists: left as it is" >&2
        return
    fi
    local args=()
    for pair in "$@"; do args+=("--from-file=$pair"); done
    kubectl -n "$namespace" create secret generic "$name" --type="$type" "${args[@]}" >&2
}
# With --dir: the line that loads folder NAME as Secret NAME (its type kept: prefixgate-tls
# is kubernetes.io/tls, the rest Opaque).
loads=()
load_line() {
    loads+=("kubectl -n $namespace create secret generic $1 --type=$2 --from-file=$out_dir/$1")
}

if [ -z "$out_dir" ]; then
    kubectl get namespace "$namespace" >/dev/null 2>&1 || kubectl create namespace "$namespace" >&2
fi
secret prefixgate-redis Opaque password=redis-password gateway-password=redis-gateway-password \
    worker-password=redis-worker-password
secret prefixgate-tls kubernetes.io/tls tls.crt=gateway-public.crt tls.key=gateway-public.key \
    ca.crt=public-ca.crt
secret prefixgate-internal-tls Opaque ca.crt=internal-ca.crt gateway.crt=gateway.crt \
    gateway.key=gateway.key
secret prefixgate-auth Opaque tokens=tokens internal-token=internal-token \
    internal-token.sha256=internal-token.sha256 peer-token=peer-token worker-keyring=worker-keyring
worker_keys=()
for f in worker-keys/*; do worker_keys+=("$(basename "$f")=$f"); done
secret prefixgate-worker-keys Opaque "${worker_keys[@]}"
if [ -z "$out_dir" ]; then
    kubectl -n "$namespace" get secret prefixgate-tls -o jsonpath='{.data.ca\.crt}' \
        | base64 -d > prefixgate-ca.crt 2>/dev/null && cp prefixgate-ca.crt "$OLDPWD/" || true
    echo "the gateway's CA certificate: ./prefixgate-ca.crt (clients: --tls-ca)" >&2
else
    echo "wrote the Secrets' files to $out_dir (one folder per Secret); load them with:" >&2
    [ -n "$namespace" ] && echo "kubectl create namespace $namespace" >&2
    printf '%s\n' "${loads[@]}" >&2
    echo "the gateway's CA certificate: $out_dir/prefixgate-tls/ca.crt (clients: --tls-ca)" >&2
fi
echo "client token for namespace '$tenant' (keep it; it is stored nowhere else):" >&2
echo "$token"
