#!/usr/bin/env bash
# A local RabbitMQ cluster of N nodes on this host, beside the default node (5672), for
# quorum queues and broker failover (issue #30, item 1):
#
#   scripts/rabbit_cluster.sh start 3     # megha-b1..3@localhost on AMQP 5701..5703
#   scripts/rabbit_cluster.sh status
#   scripts/rabbit_cluster.sh urls        # rabbitmq_url for the federation file
#   scripts/rabbit_cluster.sh kill 1      # kill -9 node 1 (a fault, for tests)
#   scripts/rabbit_cluster.sh stop        # stops only the nodes this script started
#
# Each node has its own name (MEGHA_CLUSTER_NAME + i), AMQP port (MEGHA_CLUSTER_PORT + i), Erlang distribution port
# (MEGHA_CLUSTER_DIST_PORT + i), mnesia, log and config under MEGHA_CLUSTER_DIR (default
# /tmp/megha-rabbit-cluster), no plugins, and guest may log in over 127.0.0.1. Nodes 2..N
# join node 1 (rabbitmqctl join_cluster). All nodes share the Erlang cookie of the user
# the Debian scripts run them as (rabbitmq: /var/lib/rabbitmq/.erlang.cookie), the default
# node's. `stop` stops each node by its name and then, if it still runs, kills the pid it
# wrote, and removes the data: the next `start` makes a fresh cluster. The default node is
# never touched.
set -euo pipefail

DIR=${MEGHA_CLUSTER_DIR:-/tmp/megha-rabbit-cluster}
NAME=${MEGHA_CLUSTER_NAME:-megha-b}
PORT=${MEGHA_CLUSTER_PORT:-5700}
DIST_PORT=${MEGHA_CLUSTER_DIST_PORT:-25700}
HOST=localhost
START_TIMEOUT_S=${MEGHA_CLUSTER_START_TIMEOUT_S:-120}

node_name() { echo "$NAME$1@$HOST"; }
registered() { # whether a node of that name runs here (epmd knows it)
  local epmd
  epmd=$(command -v epmd || ls /usr/lib/erlang/erts-*/bin/epmd 2>/dev/null | head -n 1)
  [ -n "$epmd" ] && "$epmd" -names 2>/dev/null | grep -q "^name $NAME$1 at port "
}
node_dir() { echo "$DIR/b$1"; }
node_pid() { cat "$(node_dir "$1")/pid" 2>/dev/null || true; }
started() { # the node numbers this script started (that have a directory)
  local d
  for d in "$DIR"/b*; do
    [ -d "$d" ] && echo "${d##*/b}"
  done | sort -n
}
alive() { local pid; pid=$(node_pid "$1"); [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }
ctl() { # rabbitmqctl on node $1
  local i=$1
  shift
  timeout 120 rabbitmqctl -n "$(node_name "$i")" "$@"
}

start_node() {
  local i=$1 dir
  dir=$(node_dir "$i")
  mkdir -p "$dir/mnesia" "$dir/log"
  echo "[]." >"$dir/enabled_plugins"
  cat >"$dir/rabbitmq.conf" <<EOF
listeners.tcp.local = 127.0.0.1:$((PORT + i))
loopback_users = none
EOF
  # Our own env file, so /etc/rabbitmq/rabbitmq-env.conf (the default node's NODENAME) is
  # not read; the Debian wrapper runs the node through su, which keeps these variables.
  cat >"$dir/rabbitmq-env.conf" <<EOF
NODENAME=$(node_name "$i")
ERL_EPMD_ADDRESS=127.0.0.1
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
  if [ "$(id -u)" = 0 ] && id rabbitmq >/dev/null 2>&1; then
    chown -R rabbitmq:rabbitmq "$dir"
  fi
  env RABBITMQ_NODENAME="$(node_name "$i")" \
    RABBITMQ_NODE_PORT=$((PORT + i)) \
    RABBITMQ_DIST_PORT=$((DIST_PORT + i)) \
    RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf" \
    RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config" \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" \
    RABBITMQ_LOG_BASE="$dir/log" \
    RABBITMQ_PID_FILE="$dir/pid" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
    rabbitmq-server -detached >"$dir/start.out" 2>&1
}

await_node() { # await_startup fails at once while the node is not registered yet: poll
  local i=$1 deadline=$((SECONDS + START_TIMEOUT_S))
  until ctl "$i" await_startup --timeout 10 >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      echo "node $(node_name "$i") did not start within ${START_TIMEOUT_S} s; see $(node_dir "$i")/log" >&2
      return 1
    fi
    sleep 1
  done
}

cmd_start() {
  local n=${1:-3} i
  if [ -n "$(started)" ]; then
    echo "a cluster is already there ($DIR); stop it first" >&2
    exit 1
  fi
  for i in $(seq 1 "$n"); do
    if registered "$i"; then
      echo "a node named $(node_name "$i") already runs (another cluster?): set MEGHA_CLUSTER_NAME" >&2
      exit 1
    fi
  done
  for i in $(seq 1 "$n"); do
    start_node "$i"
  done
  for i in $(seq 1 "$n"); do
    await_node "$i"
  done
  for i in $(seq 2 "$n"); do
    ctl "$i" stop_app >/dev/null
    ctl "$i" join_cluster "$(node_name 1)" >/dev/null
    ctl "$i" start_app >/dev/null
  done
  echo "started $n nodes: $(for i in $(seq 1 "$n"); do printf '%s ' "$(node_name "$i")"; done)"
  echo "rabbitmq_url: $(cmd_urls)"
}

cmd_urls() {
  local i urls=()
  for i in $(started); do
    urls+=("amqp://guest:guest@127.0.0.1:$((PORT + i))/")
  done
  (IFS=,; echo "${urls[*]}")
}

cmd_status() {
  local i any=
  for i in $(started); do
    any=1
    if alive "$i"; then
      echo "$(node_name "$i") pid $(node_pid "$i") amqp 127.0.0.1:$((PORT + i)) up"
    else
      echo "$(node_name "$i") amqp 127.0.0.1:$((PORT + i)) down"
    fi
  done
  [ -n "$any" ] || { echo "no cluster nodes started from $DIR"; return 0; }
  for i in $(started); do
    if alive "$i"; then
      ctl "$i" cluster_status --formatter json 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
print("running:", " ".join(s.get("running_nodes", [])))
print("members:", " ".join(s.get("disk_nodes", [])))' || true
      return 0
    fi
  done
}

cmd_kill() {
  local i=$1 pid
  pid=$(node_pid "$i")
  [ -n "$pid" ] || { echo "node $i has no pid file" >&2; exit 1; }
  kill -9 "$pid"
  echo "killed $(node_name "$i") (pid $pid)"
}

cmd_stop() {
  local i pid
  for i in $(started); do
    pid=$(node_pid "$i")
    if alive "$i"; then
      ctl "$i" stop >/dev/null 2>&1 || true
    fi
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill -9 "$pid" 2>/dev/null || true
    fi
    echo "stopped $(node_name "$i")"
    rm -rf "$(node_dir "$i")"
  done
  rmdir "$DIR" 2>/dev/null || true
}

case ${1:-} in
start) cmd_start "${2:-3}" ;;
stop) cmd_stop ;;
status) cmd_status ;;
urls) cmd_urls ;;
kill) cmd_kill "${2:?which node: 1..N}" ;;
*)
  echo "usage: $0 start [N] | stop | status | urls | kill I" >&2
  exit 2
  ;;
esac
