#!/usr/bin/env bash
# Installs what the tests need, checks lint, format and types, and runs every test.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k agent`).
# Everything runs with the `python` on PATH (an activated virtualenv's, as .ci/run does):
# the packages go into it and ruff, mypy and pytest are its own.
set -euo pipefail
cd "$(dirname "$0")/.."

# The status page is checked in a real headless browser (Chromium), and `srun relaunch
# ...` on a real Slurm (controller, node daemons, munge, run by the tests in network
# namespaces; nothing is started here): both from Debian's packages (one index update),
# installed in the background while pip installs the Python side (a few minutes each
# on a fresh machine, and independent).
apt_install() {  # $1: what the packages are for; the rest: the packages
  local what="$1"
  shift
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 \
    || echo "note: cannot install $*; the $what tests are skipped" >&2
}
debian_packages() {
  apt-get update -qq >/dev/null 2>&1 || echo "note: apt-get update failed" >&2
  command -v chromium >/dev/null || apt_install "status page's browser" chromium
  command -v slurmctld >/dev/null || apt_install Slurm slurmctld slurmd munge slurm-client
}
apt_job=""
if ! command -v chromium >/dev/null || ! command -v slurmctld >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    debian_packages &
    apt_job=$!
    # a failure below must not leave apt half done behind us: wait for it first
    trap 'wait "$apt_job" 2>/dev/null || true' EXIT
  else
    echo "note: no apt-get as root to install Chromium or Slurm; their tests are skipped" >&2
  fi
fi

# pip compiles every module it installs to bytecode (about a minute of the run for
# torch, transformers and lightning). Not skipped (--no-compile): where
# PYTHONDONTWRITEBYTECODE is set, as on these machines, no process would ever write the
# bytecode, and every worker of every test would compile torch again on import.
pip_install=(python -m pip install --quiet --disable-pip-version-check)
"${pip_install[@]}" torch==2.13.0
"${pip_install[@]}" -e '.[test]'
# pip does not compile an editable install's own modules, and where
# PYTHONDONTWRITEBYTECODE is set no process writes them either: every agent, fork
# server and worker the tests start would compile relaunch again (0.45 s each here).
python -m compileall -q src

python -m ruff check src tests bench examples
python -m ruff format --check src tests bench examples
# mypy (a minute or two of one core, most of it reading torch's types) runs beside the
# apt wait and the first tests, on the core they leave idle; its verdict counts as
# much as theirs, and its output comes after them.
mypy_log="$(mktemp "${TMPDIR:-/tmp}/relaunch-mypy.XXXXXX")"
python -m mypy src >"$mypy_log" 2>&1 &
mypy_job=$!
# (a trap's failing command would be the script's exit status under set -e: none fails)
trap 'kill "$mypy_job" 2>/dev/null || true; rm -f "$mypy_log"; wait 2>/dev/null || true' EXIT
if [ -n "$apt_job" ]; then
  wait "$apt_job"
fi

# torch's TCPStore does a reverse DNS lookup per connection, which can stall for
# seconds: run the tests in a loopback-only network namespace where permitted.
tests_rc=0
if command -v unshare >/dev/null && command -v ip >/dev/null && unshare -n true 2>/dev/null; then
  unshare -n sh -c 'ip link set lo up && exec python -m pytest "$@"' sh "$@" || tests_rc=$?
else
  echo "note: cannot create a network namespace; tests use the host's loopback" >&2
  python -m pytest "$@" || tests_rc=$?
fi
mypy_rc=0
wait "$mypy_job" || mypy_rc=$?
echo "mypy src:"
cat "$mypy_log"
if [ "$mypy_rc" -ne 0 ]; then
  echo "mypy failed (exit $mypy_rc)" >&2
fi
[ "$tests_rc" -eq 0 ] && [ "$mypy_rc" -eq 0 ]
