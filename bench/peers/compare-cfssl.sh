#!/bin/sh
# Side by side, in one run, on this machine: meshca and cfssl signing the
# same kind of CSRs (ECDSA P-256, 1000 identities) with an ECDSA P-256 CA,
# driven by meshca-bench at the same concurrency. meshca: gRPC over TLS
# with offline-JWT authentication; cfssl: `cfssl serve` sign endpoint over
# plain HTTP, no authentication (its default). Usage:
#   bench/peers/compare-cfssl.sh [CONCURRENCY] [DURATION]
set -eu
conc=${1:-16}
dur=${2:-10s}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
root=$(cd "$(dirname "$0")/../.." && pwd)
cfssl=$("$root/bench/peers/install-cfssl.sh")
cargo build --release --quiet --manifest-path "$root/Cargo.toml" --bin meshca --bin meshca-certs --bin meshca-bench
bin="$root/target/release"
work=$(mktemp -d)
meshca_pid=
cfssl_pid=
trap 'kill $meshca_pid $cfssl_pid 2>/dev/null; rm -rf "$work"' EXIT

# meshca, embedded mode (self-signed P-256 root, local token issuer), checking
# every token's signature (no reuse of verified tokens: cfssl has no auth at all).
MESHCA_LOG=warn MESHCA_JWT_CACHE_TTL=0 "$bin/meshca" serve --data-dir "$work/meshca" --listen 127.0.0.1:15912 --monitoring-listen 127.0.0.1:15914 \
    >/dev/null 2>"$work/meshca.log" &
meshca_pid=$!
# cfssl with a P-256 CA made by meshca-certs.
"$bin/meshca-certs" root-ca --out "$work/ca" >/dev/null
cat > "$work/cfssl.json" <<JSON
{"signing": {"default": {"expiry": "24h", "usages": ["digital signature", "key encipherment", "server auth", "client auth"]}}}
JSON
"$cfssl" serve -address 127.0.0.1 -port 18888 -ca "$work/ca/root-cert.pem" -ca-key "$work/ca/root-key.pem" -config "$work/cfssl.json" -loglevel 5 >/dev/null 2>"$work/cfssl.log" &
cfssl_pid=$!
sleep 2

echo "== meshca (concurrency $conc, $dur)"
"$bin/meshca-bench" --addr https://127.0.0.1:15912 --data-dir "$work/meshca" --server-pid $meshca_pid \
    --concurrency "$conc" --connections 4 --duration "$dur" --crypto-baseline "$@"
echo "== cfssl serve (concurrency $conc, $dur; one HTTP/1.1 connection per request in flight)"
"$bin/meshca-bench" --target cfssl --addr http://127.0.0.1:18888 --identities 1000 --server-pid $cfssl_pid \
    --concurrency "$conc" --connections "$conc" --duration "$dur"
