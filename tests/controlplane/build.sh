#!/usr/bin/env bash
# Builds the Go tools the end-to-end tests use, from the Go modules pinned
# in this repository, into a cache directory:
#
#   etcd, kube-apiserver, kubectl   tests/controlplane/go.mod (k8s.io/kubernetes
#                                   and each k8s.io/* staging module it replaces)
#   helm                            tests/helm/go.mod (helm.sh/helm/v4)
#   meshca-gospiffe                 tests/gospiffe (a go-spiffe Workload API
#                                   client, github.com/spiffe/go-spiffe/v2)
#
# Output: $MESHCA_GO_TOOLS (default: <repo>/target/go-tools)/bin. A stamp of
# the pins and the Go version sits beside the binaries: when it matches,
# nothing is built. The first build downloads about 400 MB of modules and
# takes about 10 minutes on 2 cores (docs/testing.md).
#
# Usage: tests/controlplane/build.sh [--print-dir]
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${MESHCA_GO_TOOLS:-$repo/target/go-tools}"

if [ "${1:-}" = "--print-dir" ]; then
    echo "$out/bin"
    exit 0
fi

command -v go >/dev/null 2>&1 || {
    echo "build.sh: the Go toolchain (go 1.26 or newer) is needed to build the control plane" >&2
    exit 1
}

# The version kube-apiserver and kubectl report (kube's own build sets these
# with -ldflags; without them they say v0.0.0-master).
kube_version="$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
helm_version="$(cd "$repo/tests/helm" && go list -m -f '{{.Version}}' helm.sh/helm/v4)"
[ -n "$kube_version" ] || { echo "build.sh: no k8s.io/kubernetes version in $here/go.mod" >&2; exit 1; }
minor="$(echo "$kube_version" | cut -d. -f2)"

stamp_of() {
    {
        go version
        echo "$kube_version $helm_version"
        cat "$here/build.sh" "$here/go.mod" "$here/go.sum" "$here/etcd/main.go" "$repo/tests/helm/go.mod" "$repo/tests/helm/go.sum"
        cat "$repo/tests/gospiffe/go.mod" "$repo/tests/gospiffe/go.sum" "$repo/tests/gospiffe/main.go"
    } | sha256sum | cut -d' ' -f1
}
stamp="$(stamp_of)"
tools=(etcd kube-apiserver kubectl helm meshca-gospiffe)

up_to_date() {
    [ -f "$out/stamp" ] && [ "$(cat "$out/stamp")" = "$stamp" ] || return 1
    for tool in "${tools[@]}"; do
        [ -x "$out/bin/$tool" ] || return 1
    done
}

if up_to_date; then
    echo "build.sh: the control plane in $out/bin is up to date"
    exit 0
fi

echo "build.sh: building ${tools[*]} ($kube_version) into $out/bin"
start=$(date +%s)
mkdir -p "$out"
staging="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$staging"' EXIT

# No symbol tables or DWARF (-s -w): smaller binaries, shorter links.
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags="$ldflags -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags="$ldflags -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

export GOFLAGS="${GOFLAGS:-} -mod=readonly"
(cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$staging/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubectl ./etcd)
(cd "$repo/tests/helm" && go build -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version" \
    -o "$staging/helm" helm.sh/helm/v4/cmd/helm)
(cd "$repo/tests/gospiffe" && go build -trimpath -ldflags "-s -w" -o "$staging/meshca-gospiffe" .)

mkdir -p "$out/bin"
for tool in "${tools[@]}"; do
    mv -f "$staging/$tool" "$out/bin/$tool"
done
echo "$stamp" >"$out/stamp.tmp" && mv -f "$out/stamp.tmp" "$out/stamp"
echo "build.sh: built in $(( $(date +%s) - start )) s"
