#!/usr/bin/env bash
# Start whichever of the benchmark's peers is not listening yet: PostgreSQL, Redis, RabbitMQ
# and NATS (with JetStream), or only those named (`start_services.sh postgresql redis`). Ones
# that already run are left alone; one that cannot be started is reported and its runs fail or
# are skipped by compare.py.
set -u
WANTED=" $* "
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_for() { for _ in $(seq 1 60); do listening "$1" && return 0; sleep 1; done; return 1; }

start() {  # name port command...
    local name=$1 port=$2; shift 2
    if [ "$WANTED" != "  " ] && [[ "$WANTED" != *" $name "* ]]; then return 0; fi
    if listening "$port"; then return 0; fi
    echo "bench: starting $name"
    "$@" >/dev/null 2>&1 || true
    wait_for "$port" || echo "bench: $name did not start on port $port" >&2
}

start postgresql 5432 service postgresql start
start redis 6379 redis-server --bind 127.0.0.1 --port 6379 --daemonize yes --save '' --appendonly no
start rabbitmq 5672 service rabbitmq-server start
start nats 4222 bash -c 'mkdir -p /var/lib/nats-server && (nohup nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server >/tmp/nats-server.log 2>&1 &)'
exit 0
