#!/usr/bin/env bash
# Install dsbd-chat with its test extras and run the whole default test suite (CPU, no GPU needed).
# Browser tests drive Debian's Chromium; as root this installs it when missing (never a downloaded build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null \
    || echo "test.sh: could not install chromium; browser tests will be skipped" >&2
fi
# llama-cpp-python builds from source here; GGML_RPC=on adds the RPC backend (dsbd-chat --rpc, rpc-worker).
# pip's wheel cache ignores CMAKE_ARGS, so a cached wheel built without it is rebuilt once, uncached.
export CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }-DGGML_RPC=on"
python -m pip install -q -e '.[test]'
if ! python -c 'import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)'; then
  echo "test.sh: llama-cpp-python lacks RPC support (a cached wheel?): rebuilding it once with GGML_RPC=on" >&2
  python -m pip install -q --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
fi
set +e
python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when a marker selection collected nothing: not a failure of the code.
if [ "$rc" = 5 ]; then echo "test.sh: no tests collected"; exit 0; fi
exit "$rc"
