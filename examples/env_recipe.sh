#!/usr/bin/env bash
# The generic recipe for harnesses configured by environment variables: create a
# rollout, point OPENAI_BASE_URL / OPENAI_API_KEY at it, run the harness unchanged, then
# post the reward and finish the rollout.
#
#   TURNSTILE_URL=http://127.0.0.1:8100 examples/env_recipe.sh [harness command...]
#
# Without a command it runs examples/env_harness.py. Needs curl and jq.
set -euo pipefail
TURNSTILE_URL=${TURNSTILE_URL:-http://127.0.0.1:8100}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)

rollout=$(curl -fsS -X POST "$TURNSTILE_URL/rollouts" -H 'Content-Type: application/json' \
  -d '{"group_id": "env-demo", "metadata": {"harness": "env"}}')
rollout_id=$(jq -r .rollout_id <<<"$rollout")

# The rollout's own key when Turnstile requires keys; any non-empty value otherwise.
export OPENAI_BASE_URL=$(jq -r .base_url <<<"$rollout")
export OPENAI_API_KEY=$(jq -r '.api_key // "unused"' <<<"$rollout")

[ "$#" -gt 0 ] || set -- "$PYTHON" "$HERE/env_harness.py"
if "$@"; then status=0; else status=$?; fi

# A real verifier would grade the harness's output here.
curl -fsS -X POST "$TURNSTILE_URL/rollouts/$rollout_id/rewards" \
  -H 'Content-Type: application/json' -d "{\"rewards\": {\"exit_ok\": $([ $status = 0 ] && echo 1 || echo 0)}}" >/dev/null
curl -fsS -X POST "$TURNSTILE_URL/rollouts/$rollout_id/finish" >/dev/null
echo "rollout $rollout_id finished"
