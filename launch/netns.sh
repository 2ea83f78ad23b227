#!/usr/bin/env bash
# Emulated Ethernet on one machine: N network namespaces joined by a bridge, one veth pair per rank,
# a tc token bucket (tbf) on each rank's egress, and gloo ranks running inside the namespaces.
#
#   launch/netns.sh check                                    # can this machine do it? (root, ip netns, veth, tbf)
#   launch/netns.sh run --ranks 2 --rate 1gbit -- .venv/bin/python -m pretrain batch=demo optim=onebit_lamb
#   launch/netns.sh up --id ID --ranks N [--rate RATE]       # create (the Python wrapper launch/netns.py uses these)
#   launch/netns.sh rate --id ID RATE [--rank R]             # change the limit of all ranks (or one)
#   launch/netns.sh stats --id ID                            # tc -s qdisc and interface byte counters per rank
#   launch/netns.sh down --id ID                             # remove one emulated network
#   launch/netns.sh cleanup [--all]                          # remove leftovers whose owner process is gone
#
# Layout, for run id ID (namespace names carry the owner's PID so parallel runs never collide):
#   bln-ID-hub   holds bridge br0 and the hub ends r0..r{N-1} of the veth pairs (no address, no route)
#   bln-ID-r<i>  rank i: interface nx0 = 10.77.0.(i+1)/24 and lo; tbf on nx0's egress at RATE
# Nothing is created in the host's namespace: its interfaces, addresses and routes are never touched.
# RATE: a tc rate (100mbit, 1gbit, 10gbit, ...) or "none" (no qdisc: veth speed, CPU-bound).
# Only egress is shaped: every collective used here (ring allreduce, all_to_all, all_gather) is
# symmetric, so each rank also receives at most its peers' shaped send rate. Latency is not emulated
# (netem is not available on these kernels); it is modelled analytically (bench/scaling.py).
#
# `run` starts the command once per rank inside its namespace with RANK, WORLD_SIZE, LOCAL_RANK=0,
# MASTER_ADDR (rank 0's address), MASTER_PORT, GLOO_SOCKET_IFNAME=nx0 and OMP_NUM_THREADS (--threads,
# default 1), waits for all ranks, prints per-rank byte counts, and always removes the network (trap on
# EXIT, INT and TERM). A rank that fails stops the others.
set -euo pipefail
LAUNCHER_NAME=netns.sh
# shellcheck source=launch/common.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/common.sh"

PREFIX=${NETNS_PREFIX:-bln}
SUBNET=10.77.0
IFACE=nx0
MAX_RANKS=250
# tbf queue: packets wait at most this long before being dropped (TCP then backs off, as on a switch).
TBF_LATENCY=${NETNS_TBF_LATENCY:-20ms}

usage() {
    sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

hub_ns() { printf '%s-%s-hub\n' "$PREFIX" "$1"; }
rank_ns() { printf '%s-%s-r%s\n' "$PREFIX" "$1" "$2"; }

# The reason this machine cannot build the network, or nothing. One line, for tests to print.
unavailable_reason() {
    [[ $(id -u) -eq 0 ]] || { echo "needs root (network namespaces, veth and tc); running as uid $(id -u)"; return; }
    command -v ip >/dev/null || { echo "the 'ip' command (iproute2) is not installed"; return; }
    command -v tc >/dev/null || { echo "the 'tc' command (iproute2) is not installed"; return; }
    local probe="$PREFIX-probe$$" error
    if ! error=$(ip netns add "$probe" 2>&1); then
        echo "'ip netns add' refused: ${error//$'\n'/ }"
        return
    fi
    if ! error=$(ip -n "$probe" link add pa type veth peer name pb 2>&1); then
        echo "veth pairs refused in a namespace: ${error//$'\n'/ }"
    elif ! error=$(tc -n "$probe" qdisc add dev pa root tbf rate 1gbit burst 64kb latency 20ms 2>&1); then
        echo "tc tbf refused: ${error//$'\n'/ }"
    fi
    ip netns del "$probe" 2>/dev/null || true
}

check() {
    local reason
    reason=$(unavailable_reason)
    if [[ -n $reason ]]; then
        printf 'netns: unavailable: %s\n' "$reason"
        return 1
    fi
    echo "netns: ok"
}

# tc rate -> bits per second (k/m/g prefixes are decimal in tc; "bit" or "bps" (bytes) suffixes).
rate_bits() {
    local rate=${1,,}
    [[ $rate =~ ^([0-9]+)([kmgt]?)(bit|bps)$ ]] || die "rate '$1': expected e.g. 100mbit, 1gbit, 10gbit or none"
    local value=${BASH_REMATCH[1]} scale=1
    case ${BASH_REMATCH[2]} in k) scale=1000 ;; m) scale=1000000 ;; g) scale=1000000000 ;; t) scale=1000000000000 ;; esac
    [[ ${BASH_REMATCH[3]} == bps ]] && scale=$((scale * 8))
    echo $((value * scale))
}

# Limit rank i's egress. The bucket holds 2 ms of traffic (at least 64 KiB, one GSO super-packet),
# so a steady stream runs at RATE while a short burst is not cut into tiny packets.
apply_rate() {  # id rank rate
    local ns
    ns=$(rank_ns "$1" "$2")
    case ${3,,} in
        none | unlimited | 0)
            tc -n "$ns" qdisc del dev "$IFACE" root 2>/dev/null || true
            ;;
        *)
            local bits burst
            bits=$(rate_bits "$3")
            burst=$((bits / 8 / 500))
            ((burst >= 65536)) || burst=65536
            tc -n "$ns" qdisc replace dev "$IFACE" root tbf rate "$3" burst "$burst" latency "$TBF_LATENCY"
            ;;
    esac
}

up() {  # id ranks rate
    local id=$1 ranks=$2 rate=$3 hub i ns
    [[ $id =~ ^[0-9]+(-[a-z0-9]+)?$ ]] || die "--id '$id': expected <owner pid>[-<suffix>] (digits, then letters/digits)"
    if ! is_positive_int "$ranks" || ((ranks > MAX_RANKS)); then
        die "--ranks '$ranks': expected 1..$MAX_RANKS"
    fi
    case ${rate,,} in none | unlimited | 0) ;; *) rate_bits "$rate" >/dev/null ;; esac
    hub=$(hub_ns "$id")
    ip netns add "$hub"
    ip -n "$hub" link add br0 type bridge
    ip -n "$hub" link set br0 up
    for ((i = 0; i < ranks; i++)); do
        ns=$(rank_ns "$id" "$i")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # Created inside the hub namespace, the rank end moved straight into the rank's namespace.
        ip -n "$hub" link add "r$i" type veth peer name "$IFACE" netns "$ns"
        ip -n "$hub" link set "r$i" master br0 up
        ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev "$IFACE"
        ip -n "$ns" link set "$IFACE" up
        apply_rate "$id" "$i" "$rate"
    done
}

ids_of_prefix() {  # the run ids of every namespace with our prefix
    ip netns list | awk '{print $1}' | sed -n "s/^$PREFIX-\([0-9][0-9a-z-]*\)-\(hub\|r[0-9]*\)\$/\1/p" | sort -u
}

down() {  # id: end what runs inside (our own ranks), then delete; the veth pairs go with them
    local id=$1 ns pids
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-$id-(hub|r[0-9]+)\$" || true); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            # shellcheck disable=SC2086
            kill -TERM $pids 2>/dev/null || true
            sleep 0.5
            # shellcheck disable=SC2086
            kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || true
    done
}

cleanup() {  # [--all]: by default only networks whose owner process (the PID in the id) is gone
    local all=${1:-} id owner removed=0
    for id in $(ids_of_prefix); do
        owner=${id%%-*}
        if [[ $all != --all ]] && kill -0 "$owner" 2>/dev/null; then
            echo "netns: keeping $PREFIX-$id-* (owner process $owner is running; --all removes it too)"
            continue
        fi
        down "$id"
        echo "netns: removed $PREFIX-$id-*"
        removed=$((removed + 1))
    done
    echo "netns: cleanup done ($removed network(s) removed)"
}

set_rates() {  # id rate [rank]: one rank, or every rank of the network
    local id=$1 rate=$2 rank=${3:-} r
    if [[ -n $rank ]]; then
        apply_rate "$id" "$rank" "$rate"
        return
    fi
    for r in $(ip netns list | awk '{print $1}' | sed -n "s/^$PREFIX-$id-r\([0-9]*\)\$/\1/p"); do
        apply_rate "$id" "$r" "$rate"
    done
}

stats() {  # id
    local id=$1 ns
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-$id-r[0-9]+\$" | sort -V); do
        printf '%s %s: tx_bytes=%s rx_bytes=%s\n' "$ns" "$IFACE" \
            "$(ip netns exec "$ns" cat "/sys/class/net/$IFACE/statistics/tx_bytes")" \
            "$(ip netns exec "$ns" cat "/sys/class/net/$IFACE/statistics/rx_bytes")"
        tc -n "$ns" -s qdisc show dev "$IFACE" | sed 's/^/    /'
    done
}

run() {  # ranks rate port threads -- command...
    local ranks=$1 rate=$2 port=$3 threads=$4
    shift 4
    [[ $# -gt 0 ]] || usage_error "run: nothing to run after --"
    local id="$$-run" python i status=0
    local -a pids=()
    down "$id"
    # shellcheck disable=SC2154  # p is the loop variable inside the handler's own text
    trap 'trap - EXIT INT TERM; for p in ${pids[@]+"${pids[@]}"}; do kill -TERM "$p" 2>/dev/null || true; done; down "'"$id"'"' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    up "$id" "$ranks" "$rate"
    python=$(launch_python)
    for ((i = 0; i < ranks; i++)); do
        ip netns exec "$(rank_ns "$id" "$i")" env RANK="$i" WORLD_SIZE="$ranks" LOCAL_RANK=0 \
            MASTER_ADDR="$SUBNET.1" MASTER_PORT="$port" GLOO_SOCKET_IFNAME="$IFACE" \
            OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}" PYTHON="$python" NETNS_ID="$id" "$@" &
        pids+=($!)
    done
    # The first rank to fail stops the others (they would wait for it until the gloo timeout).
    local remaining=$ranks
    while ((remaining > 0)); do
        if wait -n; then
            remaining=$((remaining - 1))
        else
            status=$?
            echo "netns: a rank exited with status $status; stopping the others" >&2
            break
        fi
    done
    echo "netns: rate $rate, $ranks ranks; bytes per rank interface:"
    stats "$id"
    return "$status"
}

main() {
    [[ $# -gt 0 ]] || usage_error "expected a command: check, run, up, rate, stats, down, cleanup"
    case $1 in -h | --help | help) usage; exit 0 ;; esac
    local command=$1 id="" ranks=2 rate=1gbit port=29500 threads=1 rank="" all=""
    shift
    local -a positional=()
    while [[ $# -gt 0 ]]; do
        case $1 in
            --id) need_value "$1" $#; id=$2; shift 2 ;;
            --ranks) need_value "$1" $#; ranks=$2; shift 2 ;;
            --rate) need_value "$1" $#; rate=$2; shift 2 ;;
            --rank) need_value "$1" $#; rank=$2; shift 2 ;;
            --port) need_value "$1" $#; port=$2; shift 2 ;;
            --threads) need_value "$1" $#; threads=$2; shift 2 ;;
            --all) all=--all; shift ;;
            -h | --help) usage; exit 0 ;;
            --) shift; break ;;
            -*) usage_error "unknown option $1" ;;
            *) positional+=("$1"); shift ;;
        esac
    done
    case $command in
        check) check ;;
        cleanup) cleanup "$all" ;;
        up | down | stats | rate)
            [[ -n $id ]] || usage_error "$command needs --id"
            case $command in
                up) up "$id" "$ranks" "$rate" ;;
                down) down "$id" ;;
                stats) stats "$id" ;;
                rate)
                    [[ ${#positional[@]} -eq 1 ]] || usage_error "rate needs exactly one RATE"
                    set_rates "$id" "${positional[0]}" "$rank"
                    ;;
            esac
            ;;
        run)
            is_positive_int "$ranks" || usage_error "--ranks '$ranks': expected a positive integer"
            is_positive_int "$threads" || usage_error "--threads '$threads': expected a positive integer"
            local reason
            reason=$(unavailable_reason)
            [[ -z $reason ]] || die "netns unavailable: $reason"
            run "$ranks" "$rate" "$port" "$threads" "$@"
            ;;
        *) usage_error "unknown command '$command'" ;;
    esac
}

main "$@"
