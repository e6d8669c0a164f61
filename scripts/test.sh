#!/usr/bin/env bash
# Install dsbd-chat with its test extras and run the whole default test suite (CPU, no GPU needed).
# Browser tests drive Debian's Chromium; as root this installs it when missing (never a downloaded build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null \
    || echo "test.sh: could not install chromium; browser tests will be skipped" >&2
fi
python -m pip install -q -e '.[test]'
set +e
python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when a marker selection collected nothing: not a failure of the code.
if [ "$rc" = 5 ]; then echo "test.sh: no tests collected"; exit 0; fi
exit "$rc"
