#!/bin/sh
# The model tier's router, first choice: vLLM Router (the `vllm-router` package, pinned in
# requirements.txt; a Rust router made for vLLM) in front of several `vllm serve`, each
# chat's requests kept on one server by consistent hashing of its session key, so that the
# server's prefix cache holds the chat's history from turn to turn. The app sends the key
# (profiles.yaml, a remote preset's `session_header`: X-Session-Id, the chat's id), which is
# the first header vLLM Router hashes. deploy/haproxy-models.cfg is the plain alternative.
#
#   MODELS="http://10.0.1.21:8000 http://10.0.1.22:8000" ROUTER_PORT=9000 \
#     deploy/model-router.sh
#
# and in profiles.yaml:   remote: {base_url: http://models-lb:9000/v1, model: NAME}
#
# A server that stops answering: its requests are retried on it, and after two failures
# its circuit opens and its chats move to the others (the request under way is retried
# there, within `--retry-max-retries` attempts); a stream already flowing ends where it
# broke (the app says so and the chat goes on). Health checks every 2 s; back after two
# good ones, and its chats return to it. The router answers /health and /readiness itself
# and serves its own Prometheus series on ROUTER_METRICS_PORT (29000).
set -eu
: "${MODELS:?MODELS: the vllm serve addresses, space-separated (http://host:port ...)}"
# shellcheck disable=SC2086  # MODELS is a list
exec "${VLLM_ROUTER:-vllm-router}" \
  --host "${ROUTER_HOST:-0.0.0.0}" --port "${ROUTER_PORT:-9000}" \
  --worker-urls $MODELS \
  --policy consistent_hash \
  --health-check-interval-secs 2 --health-check-timeout-secs 2 \
  --cb-failure-threshold 2 --cb-success-threshold 2 --cb-timeout-duration-secs 10 \
  --worker-startup-check-interval 2 \
  --prometheus-host "${ROUTER_METRICS_HOST:-127.0.0.1}" \
  --prometheus-port "${ROUTER_METRICS_PORT:-29000}" \
  --log-level warning \
  "$@"
