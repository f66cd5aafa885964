#!/usr/bin/env bash
# Coding agents against a local edgemoe server, as a new user runs them: installs Codex
# and Claude Code from npm, starts `python -m edgemoe.server` (the bundled model unless
# server arguments are given), and runs one turn of each, printing what each agent shows
# and the server's warnings (every refused request is one, naming the client).
#
#   scripts/agents_live.sh [SERVER ARGS...]      e.g. scripts/agents_live.sh --model DIR
#
# AGENTS_DIR (default /tmp/edgemoe-agents) holds the CLIs, a HOME of their own (your own
# config is never read or written) and a scratch working folder. CODEX_VERSION and
# CLAUDE_VERSION pin the releases (default: the ones tests/data/agents was recorded from).
set -u
DIR=${AGENTS_DIR:-/tmp/edgemoe-agents}
PORT=${PORT:-8097}
PYTHON=${PYTHON:-python}
CODEX_VERSION=${CODEX_VERSION:-0.171.0}
CLAUDE_VERSION=${CLAUDE_VERSION:-2.1.332}
TURN_TIMEOUT=${TURN_TIMEOUT:-600}
mkdir -p "$DIR/home" "$DIR/work"
echo "== npm install @openai/codex@$CODEX_VERSION @anthropic-ai/claude-code@$CLAUDE_VERSION"
npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error \
    "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_VERSION" || exit 1
BIN=$DIR/node_modules/.bin
echo "codex: $("$BIN/codex" --version)   claude: $("$BIN/claude" --version)"

echo "== python -m edgemoe.server --port $PORT $*"
$PYTHON -m edgemoe.server --port "$PORT" --log-level WARNING "$@" > "$DIR/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$DIR/server.log"; exit 1; }
    sleep 0.5
done
MODEL=$(curl -s "http://127.0.0.1:$PORT/v1/models" | $PYTHON -c \
    "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
echo "serving $MODEL; HEAD / -> $(curl -s -o /dev/null -w '%{http_code}' -I "http://127.0.0.1:$PORT/")"

cd "$DIR/work" || exit 1
export HOME=$DIR/home
echo
echo "== claude -p 'Say hello.' --model $MODEL   (Messages API, streamed, with its tools)"
ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=local \
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 \
    timeout "$TURN_TIMEOUT" "$BIN/claude" -p "Say hello." --model "$MODEL" 2>&1
echo "[claude exit status $?]"

echo
echo "== codex exec 'Say hello.' -m $MODEL   (Responses API, streamed, with its tools)"
OPENAI_API_KEY=local timeout "$TURN_TIMEOUT" "$BIN/codex" exec --skip-git-repo-check \
    -c "model_providers.local={name=\"local\",base_url=\"http://127.0.0.1:$PORT/v1\",wire_api=\"responses\",env_key=\"OPENAI_API_KEY\",stream_max_retries=0,request_max_retries=0}" \
    -c model_provider=local -m "$MODEL" "Say hello." 2>&1 | grep -v "^warning: Codex could not find bubblewrap"
echo "[codex exit status ${PIPESTATUS[0]}]"

echo
echo "== the server's warnings"
grep -E "WARNING|ERROR" "$DIR/server.log" | sed -E 's/^[0-9-]+ [0-9:,]+ //'
