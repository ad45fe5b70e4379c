# Two "nodes" on this machine joined by a link of known rate, for the benchmarks that train across
# one (bench/slow_links.sh, bench/pipeline_links.sh); sourced, not run. Two network namespaces
# <tag><PID>-a / -b joined by a veth pair <tag><PID>a (10.X.Y.1, node A) and <tag><PID>b (10.X.Y.2,
# node B), X.Y from the PID, loopback up in each. A rate sets `tbf rate R burst B latency L` as the
# root qdisc of both veths (each direction is limited at its sender): B = max(32 KiB, 4 ms at R) (at
# least one timer tick of data, else tbf cannot reach R; BURST overrides), L = LATENCY (default
# 100 ms: the queue tbf keeps before dropping). "unlimited" removes the qdisc (veth at memory speed).
# check_link times a bulk TCP transfer A -> B of about 2 s of data (a small Python socket pair, no nc
# needed). Everything created here is removed on exit, on Ctrl-C, on SIGTERM and on failure (an EXIT
# trap; the processes registered with `started` are stopped first, by their PIDs); PID-based names
# keep two invocations apart.
# LINK=loopback instead runs both "nodes" in this machine's own network namespace on 127.0.0.1 (lo),
# for a machine where network namespaces cannot be made (a container without the capability): the
# link is then the loopback device at memory speed, so "unlimited" is the only rate, and root, ip and
# tc are not needed. The default, LINK=veth, is the namespaces and the veth pair above.
#
# The caller sets py (Debian's python3) and out (a directory for the link check's files). Defined
# here: log MSG (timestamped, to stderr), die MSG (names the script, exits 2), link_require (refuses clearly unless root with a working `ip netns` and tc's
# tbf), link_up TAG (the namespaces, after which ns_a ns_b dev_a dev_b addr_a addr_b are set),
# in_ns NS CMD... (runs CMD in namespace NS, or here where NS is empty, as LINK=loopback leaves both),
# set_rate RATE, check_link RATE, rate_ok RATE, tx_bytes NS DEV, started PID, reap PID. SYSCTLS
# ("k=v ...") are set in both namespaces (their TCP stacks are their own). `port` is the last TCP
# port used (link_up sets 29500 unless the caller set one); check_link takes the next.

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
die() { echo "$0: $*" >&2; exit 2; }
rate_ok() { [[ $1 == unlimited || $1 =~ ^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$ ]]; }
link_mode=${LINK:-veth}
in_ns() {  # NS CMD...: CMD in network namespace NS; where NS is empty (LINK=loopback), here
  local ns=$1
  shift
  if [ -n "$ns" ]; then ip netns exec "$ns" "$@"; else "$@"; fi
}

link_require() {
  case $link_mode in
    veth) ;;
    loopback)
      command -v "$py" > /dev/null || die "$py not found (Debian's python3 checks the link; set PYTHON)"
      return ;;
    *) die "LINK must be veth or loopback, not '$link_mode'" ;;
  esac
  [ "$(id -u)" = 0 ] || die "must run as root: it creates network namespaces, a veth pair and tc qdiscs (try: sudo -E $0)"
  command -v ip > /dev/null || die "'ip' not found: install Debian's iproute2"
  command -v tc > /dev/null || die "'tc' not found: install Debian's iproute2"
  ip netns list > /dev/null 2>&1 || die "'ip netns' does not work here (network namespaces unsupported?)"
  command -v "$py" > /dev/null || die "$py not found (Debian's python3 checks the link; set PYTHON)"
}

running=""  # PIDs of the processes the caller started and has not reaped yet

link_cleanup() {
  local rc=$? p i
  trap - EXIT INT TERM
  if [ -n "${running// /}" ]; then
    log "stopping the processes this script started: $running"
    for p in $running; do kill -TERM "$p" 2> /dev/null || true; done
    for ((i = 0; i < 20; i++)); do
      local alive=""
      for p in $running; do kill -0 "$p" 2> /dev/null && alive+=" $p"; done
      [ -z "$alive" ] && break
      sleep 0.5
    done
    for p in $running; do kill -KILL "$p" 2> /dev/null || true; done
    for p in $running; do wait "$p" 2> /dev/null || true; done
  fi
  if [ -n "${ns_a:-}" ]; then
    ip netns del "$ns_a" 2> /dev/null || true  # deleting a namespace destroys the veth end in it, and so the pair
    ip netns del "$ns_b" 2> /dev/null || true
    if ip netns list | grep -q -e "^$ns_a" -e "^$ns_b"; then
      echo "$0: could not remove namespaces: $(ip netns list | grep -e "^$ns_a" -e "^$ns_b" | tr '\n' ' ')" >&2
    else
      log "removed namespaces $ns_a and $ns_b"
    fi
  fi
  exit "$rc"
}

started() { running="$running $1"; }
reap() {  # PID: waits for it, removes it from the list; returns its exit status
  local rc=0
  wait "$1" || rc=$?
  running=$(echo "$running" | tr ' ' '\n' | grep -vx "$1" | tr '\n' ' ' || true)
  return "$rc"
}

link_up() {  # TAG: a few letters naming the caller's namespaces and interfaces
  local id=$$ ns kv
  trap link_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  port=${port:-29500}
  if [ "$link_mode" = loopback ]; then
    ns_a="" ns_b="" dev_a=lo dev_b=lo addr_a=127.0.0.1 addr_b=127.0.0.1
    log "both nodes on 127.0.0.1 (LINK=loopback: no namespaces, the link is lo at memory speed)"
    return
  fi
  ns_a=ddm-$1$id-a ns_b=ddm-$1$id-b
  dev_a=ddm$1${id}a dev_b=ddm$1${id}b  # interface names: at most 15 characters (PIDs have at most 7 digits)
  [ ${#dev_a} -le 15 ] || die "interface name $dev_a is longer than 15 characters: use a shorter tag than '$1'"
  local net=10.$(((id >> 8) & 255)).$((id & 255))
  addr_a=$net.1 addr_b=$net.2
  log "namespaces $ns_a ($dev_a $addr_a) and $ns_b ($dev_b $addr_b)"
  ip netns add "$ns_a"
  ip netns add "$ns_b"
  ip link add "$dev_a" netns "$ns_a" type veth peer name "$dev_b" netns "$ns_b"
  ip -n "$ns_a" addr add "$addr_a/24" dev "$dev_a"
  ip -n "$ns_b" addr add "$addr_b/24" dev "$dev_b"
  for ns in "$ns_a" "$ns_b"; do
    ip -n "$ns" link set lo up
    for kv in ${SYSCTLS:-}; do ip netns exec "$ns" sysctl -qw "$kv" || die "SYSCTLS: cannot set $kv in $ns"; done
  done
  ip -n "$ns_a" link set "$dev_a" up
  ip -n "$ns_b" link set "$dev_b" up
  tc -n "$ns_a" qdisc add dev "$dev_a" root tbf rate 10mbit burst 32kb latency 100ms 2> /dev/null ||
    die "tc cannot add a tbf qdisc here (is the kernel's sch_tbf available?); the link rate cannot be limited"
  tc -n "$ns_a" qdisc del dev "$dev_a" root
}

rate_bps() {  # 10mbit -> 10000000; unlimited -> 0
  case $1 in unlimited) echo 0 ;; *) awk -v r="$1" 'BEGIN { n = r + 0; u = substr(r, length(n "") + 1);
    m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : 1e9; printf "%.0f\n", n * m }' ;; esac
}
burst_for() {  # bytes: BURST, or 4 ms of data at the rate, at least 32 KiB
  if [ -n "${BURST:-}" ]; then echo "$BURST"; return; fi
  awk -v b="$(rate_bps "$1")" 'BEGIN { x = b / 8 * 0.004; if (x < 32768) x = 32768; printf "%.0f\n", x }'
}
set_rate() {
  local ns dev
  if [ "$link_mode" = loopback ]; then
    [ "$1" = unlimited ] || die "LINK=loopback has no rate but 'unlimited' (asked for $1): limiting lo would limit every connection of this machine"
    return
  fi
  for ns in a b; do
    if [ $ns = a ]; then ns=$ns_a dev=$dev_a; else ns=$ns_b dev=$dev_b; fi
    tc -n "$ns" qdisc del dev "$dev" root 2> /dev/null || true
    [ "$1" = unlimited ] || tc -n "$ns" qdisc add dev "$dev" root tbf rate "$1" burst "$(burst_for "$1")" latency "${LATENCY:-100ms}"
  done
}
tx_bytes() { in_ns "$1" cat "/sys/class/net/$2/statistics/tx_bytes"; }

check_link() {  # RATE: times a bulk TCP transfer from node A to node B; logs it and leaves "bytes seconds" in $out/link-RATE.txt
  local bps n
  bps=$(rate_bps "$1")
  n=$(awk -v b="$bps" 'BEGIN { n = (b == 0) ? 1073741824 : b / 8 * 2; if (n < 262144) n = 262144; printf "%.0f\n", n }')
  port=$((port + 1))
  in_ns "$ns_b" "$py" -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(60)
c, _ = s.accept(); n = 0; t0 = None
while True:
    d = c.recv(1 << 20)
    if not d: break
    if t0 is None: t0 = time.perf_counter()
    n += len(d)
t = time.perf_counter() - t0
print("%d %.6f" % (n, t))' "$addr_b" "$port" > "$out/link-$1.txt" &
  local server=$!
  started "$server"
  in_ns "$ns_a" "$py" -c '
import socket, sys, time
for _ in range(100):
    try: s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
s.sendall(bytes(int(sys.argv[3]))); s.close()' "$addr_b" "$port" "$n"
  reap "$server"
  read -r got secs < "$out/link-$1.txt"
  log "link check at $1: $(awk -v n="$got" -v t="$secs" 'BEGIN { printf "%.1f Mbit/s measured (%.1f MB A -> B in %.2f s)", n * 8 / t / 1e6, n / 1e6, t }')"
  [ "$link_mode" = loopback ] || log "  qdisc on $dev_a: $(tc -n "$ns_a" qdisc show dev "$dev_a" | head -1)"
}
