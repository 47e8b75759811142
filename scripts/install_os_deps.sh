#!/usr/bin/env bash
# Best effort: the OS packages some tests use, from the distribution's package registry (apt):
#   Slurm (slurmctld, slurmd, slurm-client, munge)  tests/test_launchers.py submits deploy/slurm.sbatch to a
#                                                    two-node cluster it starts on this machine.
#   chromium                                         tests/test_status.py renders the live status page in it,
#                                                    headless.
# Nothing is done when they are installed already. Without root (or apt), it says so and exits 0: the tests
# that need a package are then skipped, each with the reason. `make test` runs this.
set -uo pipefail

need=()
for pkg_bin in slurmctld:slurmctld slurmd:slurmd slurm-client:sbatch munge:munged; do
    pkg=${pkg_bin%%:*}
    bin=${pkg_bin##*:}
    command -v "$bin" >/dev/null 2>&1 || [[ -x /usr/sbin/$bin ]] || need+=("$pkg")
done
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && ! command -v google-chrome >/dev/null 2>&1; then
    need+=(chromium)
fi
if [[ ${#need[@]} -eq 0 ]]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_os_deps: no apt-get; not installing ${need[*]} (the tests that need them will be skipped)" >&2
    exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    if sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_os_deps: not root and no passwordless sudo; not installing ${need[*]}" >&2
        exit 0
    fi
fi
echo "install_os_deps: apt-get install ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"; } >/tmp/install_os_deps.log 2>&1; then
    echo "install_os_deps: apt-get failed (see /tmp/install_os_deps.log); the tests that need it will be skipped" >&2
fi
exit 0
