# Shared by the serving benchmark scripts (sourced, not run).

# Waits until the server on $PORT answers /health (up to 3 minutes).
wait_up() {
  for _ in $(seq 1 900); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 0.2
  done
  return 1
}
