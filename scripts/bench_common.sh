# Shared by the serving benchmark scripts (sourced, not run).

# Waits until the server on $PORT answers /health (up to 3 minutes).
wait_up() {
  for _ in $(seq 1 900); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 0.2
  done
  return 1
}

# Puts a known model in the cache (fetching it on first use; progress on stderr) and prints its path:
# model_path [NAME] (the default model when NAME is left out). Needs $BIN.
model_path() {
  "$BIN" fetch-model "$@" >&2 && "$BIN" fetch-model "$@" --print-path
}
