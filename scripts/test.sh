#!/usr/bin/env bash
# Installs what the tests need, checks lint, format and types, and runs every test.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k agent`).
# Everything runs with the `python` on PATH (an activated virtualenv's, as .ci/run does):
# the packages go into it and ruff, mypy and pytest are its own.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e '.[test]'

# The status page is checked in a real headless browser: Chromium from Debian's packages.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
    >/dev/null 2>&1 || echo "note: cannot install chromium; the page's browser check is skipped" >&2
fi

# `srun relaunch ...` is checked on a real Slurm (controller, node daemons, munge) from
# Debian's packages, run by the tests in network namespaces; nothing is started here.
if ! command -v slurmctld >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      slurmctld slurmd munge slurm-client) >/dev/null 2>&1 \
      || echo "note: cannot install Slurm; the Slurm tests are skipped" >&2
  else
    echo "note: no apt-get as root to install Slurm; the Slurm tests are skipped" >&2
  fi
fi

python -m ruff check src tests bench examples
python -m ruff format --check src tests bench examples
python -m mypy src

# torch's TCPStore does a reverse DNS lookup per connection, which can stall for
# seconds: run the tests in a loopback-only network namespace where permitted.
if command -v unshare >/dev/null && command -v ip >/dev/null && unshare -n true 2>/dev/null; then
  exec unshare -n sh -c 'ip link set lo up && exec python -m pytest "$@"' sh "$@"
fi
echo "note: cannot create a network namespace; tests use the host's loopback" >&2
exec python -m pytest "$@"
