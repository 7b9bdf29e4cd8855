#!/usr/bin/env bash
# containers.sh — hsbn's sidecar pattern under a real container runtime (Debian's podman): the
# images built from docker/, pods of a sidecar and trainers, the Kubernetes manifests played,
# and faults through the runtime. docs/DEPLOY.md ("Containers, run here") says what each part
# checks and how to repeat it by hand.
#
#   scripts/containers.sh [BUILD_DIR]      (default $HSBN_BUILD_DIR, else build/)
#
# It reuses BUILD_DIR's compiled aggregator and wheel (it never compiles: run scripts/setup.sh
# first) and, as root, installs what is missing: the Debian packages podman, runc, catatonit,
# netavark, aardvark-dns, iptables (netavark's firewall driver runs it; without it every
# container on a network fails with "netavark: No such file or directory") and debootstrap, and
# the three settings podman needs here in
# /etc/containers/containers.conf (runtime = "runc", cgroup_manager = "cgroupfs",
# default_ulimits), each written only where the file does not set it already. The Debian 12
# base image (debootstrap --variant=minbase) is made once and kept (localhost/hsbn/debian:12);
# HSBN_CONTAINERS_REBASE=1 makes it again. Images are kept too (podman's layer cache makes the
# next run's builds quick); pods, containers, volumes and networks it made are removed however
# it ends. The last line is "containers: PASS ..." or "containers: FAILED ...".
#
# Exit status: 0 passed, 1 a check failed, 2 usage or missing build outputs, 77 skipped: a
# container runtime cannot run here (not root, podman not installable, or containers do not
# start; the message says which).
#
#   HSBN_CONTAINERS_PARTS=LIST which parts run, of pods,kube (default both): pods are the pods
#                              and the faults, kube the played manifests
#   HSBN_CONTAINERS_LOGS=DIR   where the containers' logs go (default: a new folder in /tmp,
#                              kept and printed when a check failed)
set -uo pipefail  # (so no "producer | grep -q" here: grep's early exit would fail the pipe)
cd "$(dirname "$0")/.." || exit 2
REPO="$PWD"
BUILD="${1:-${HSBN_BUILD_DIR:-build}}"
case "$BUILD" in /*) ;; *) BUILD="$REPO/$BUILD" ;; esac

P=hsbn-ct                     # prefix of every pod, container, volume and network made here
BASE=localhost/hsbn/debian:12
AGG=localhost/hsbn/aggregator:0.1.0
TRAINER=localhost/hsbn/trainer-cpu:0.1.0
EXAMPLE=localhost/hsbn/trainer-example:0.1.0
NET="$P-net"
KUBE_NET="$P-kube"
KUBE_SUBNET=10.89.77         # the played manifests' pods get fixed addresses in it (/24)
START=$SECONDS
FAILED=()
SKIPPED=()
PASSED=0
LOGS="${HSBN_CONTAINERS_LOGS:-}"

PARTS=",${HSBN_CONTAINERS_PARTS:-pods,kube},"
want() { [[ "$PARTS" == *",$1,"* ]]; }
say() { printf '[containers +%3ds] %s\n' "$((SECONDS - START))" "$*"; }
pass() { PASSED=$((PASSED + 1)); say "ok: $*"; }
fail() { FAILED+=("$1"); say "FAIL: $*"; }
KEEP=0
skip() { KEEP=1; echo "containers: SKIPPED: $*"; exit 77; }

# ------------------------------------------------------------------------------------ set-up

[ -x "$BUILD/server/hsbn-aggregator" ] || { echo "containers: no $BUILD/server/hsbn-aggregator: build first (scripts/setup.sh)" >&2; exit 2; }
WHEELS=("$BUILD"/dist/hsbn-*-py3-none-linux_x86_64.whl)
[ -f "${WHEELS[0]}" ] || { echo "containers: no wheel in $BUILD/dist: build first (scripts/setup.sh; it needs patchelf)" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || skip "not root (rootful podman and apt-get need root; run it as root or with sudo)"

PKGS=(podman runc catatonit netavark aardvark-dns iptables debootstrap)
missing=()
for p in "${PKGS[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } \
    || skip "apt-get could not install ${missing[*]}"
fi

# Adds KEY = VALUE to TABLE of containers.conf unless the file sets KEY already (anywhere: a
# user's value is never replaced; the smoke test below tells when it does not work here).
CONF=/etc/containers/containers.conf
conf_set() {
  local table="$1" key="$2" value="$3"
  mkdir -p "$(dirname "$CONF")"
  touch "$CONF"
  if grep -Eq "^[[:space:]]*${key}[[:space:]]*=" "$CONF"; then
    grep -Eq "^[[:space:]]*${key}[[:space:]]*=[[:space:]]*$(printf '%s' "$value" | sed 's/[][\.*^$"]/\\&/g')[[:space:]]*$" "$CONF" \
      || say "note: $CONF sets $key already (not changed; hsbn's runs here used $key = $value)"
    return
  fi
  if grep -Eq "^[[:space:]]*\[$table\][[:space:]]*$" "$CONF"; then
    sed -i "/^[[:space:]]*\[$table\][[:space:]]*$/a $key = $value" "$CONF"
  else
    printf '\n[%s]\n%s = %s\n' "$table" "$key" "$value" >>"$CONF"
  fi
  say "$CONF: added $key = $value under [$table]"
}
conf_set engine runtime '"runc"'
conf_set engine cgroup_manager '"cgroupfs"'
conf_set containers default_ulimits '["nofile=4096:4096", "nproc=4096:4096"]'

WORK="$(mktemp -d "${TMPDIR:-/tmp}/hsbn-containers.XXXXXX")"
[ -n "$LOGS" ] || LOGS="$WORK/logs"
mkdir -p "$LOGS"

# Everything made here carries the label hsbn-ct=1 (the played manifests' pods too) or the
# prefix hsbn-ct-; nothing else is touched.
remove_made() {
  podman pod ls -q --filter label=hsbn-ct=1 2>/dev/null | xargs -r podman pod rm -f -t 2 >/dev/null 2>&1
  podman ps -a --format '{{.Names}}' 2>/dev/null | grep -E "^$P-" | xargs -r podman rm -f -t 2 >/dev/null 2>&1
  podman volume ls --format '{{.Name}}' 2>/dev/null | grep -E "^$P-" | xargs -r podman volume rm -f >/dev/null 2>&1
  podman network rm -f "$NET" "$KUBE_NET" >/dev/null 2>&1
}
cleanup() {
  remove_made
  rm -rf "$WORK/base" "$WORK/context" "$WORK/kube" "$WORK/example"
  if { [ ${#FAILED[@]} -eq 0 ] && [ "$KEEP" = 0 ]; } || [ -n "${HSBN_CONTAINERS_LOGS:-}" ]; then
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
remove_made  # what an interrupted earlier run may have left

# ---------------------------------------------------------------------------------- the base

if [ "${HSBN_CONTAINERS_REBASE:-0}" = 1 ] || ! podman image exists "$BASE"; then
  say "making the Debian 12 base $BASE (debootstrap --variant=minbase bookworm, once)"
  mkdir -p "$WORK/base"
  debootstrap --variant=minbase bookworm "$WORK/base" >"$LOGS/debootstrap.log" 2>&1 \
    || { tail -5 "$LOGS/debootstrap.log"; skip "debootstrap failed (no Debian mirror reachable?); log: $LOGS/debootstrap.log"; }
  b="$WORK/base"
  # As Debian's -slim images: no documentation, manual pages or translations, now or later.
  cat >"$b/etc/dpkg/dpkg.cfg.d/hsbn-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
EOF
  find "$b/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$b/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  rm -rf "$b"/usr/share/man/* "$b"/usr/share/info/* "$b"/var/cache/apt/*.bin \
         "$b"/var/cache/apt/archives/*.deb "$b"/var/lib/apt/lists/* "$b/etc/apt/sources.list"
  # The archive as the official debian:12 image lists it: the release, its updates, security.
  cat >"$b/etc/apt/sources.list.d/debian.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  tar -C "$b" -c . | podman import -q -c 'CMD ["/bin/bash"]' - "$BASE" >/dev/null \
    || skip "podman import of the base failed"
  rm -rf "$b"
fi
if ! out="$(podman run --rm --network none "$BASE" true 2>&1)"; then
  skip "podman cannot start a container here: $out"
fi
# The builds' RUN steps and the pods need podman's default bridge network (netavark, iptables):
# a container that starts without a network but not with one is this machine's set-up failing,
# named here rather than as a failed image build.
if ! out="$(podman run --rm "$BASE" true 2>&1)"; then
  echo "containers: a container starts without a network but not on podman's default one: $out" >&2
  echo "containers: FAILED (podman's network: netavark needs iptables and the kernel's netfilter; 'podman info' shows the network backend)"
  exit 1
fi
say "podman $(podman version --format '{{.Client.Version}}') runs containers here (runtime $(podman info --format '{{.Host.OCIRuntime.Name}}'), base $BASE)"

# -------------------------------------------------------------------------------- the images

# The Dockerfiles' build stage compiles the tree (scripts/setup.sh); here the tree is built
# already, so a folder laid out as that stage's result stands in for it:
# --build-context build=DIR answers every COPY --from=build, and the stage is not run.
ctx="$WORK/context"
mkdir -p "$ctx/src/build/server" "$ctx/src/build/dist"
# (-p: the files keep their times, so an unchanged build hits the layer cache)
cp -p "$BUILD/server/hsbn-aggregator" "$ctx/src/build/server/"
cp -p "${WHEELS[@]}" "$ctx/src/build/dist/"
docker/runtime-deps.sh packages "$ctx/src/build/server/hsbn-aggregator" >"$ctx/runtime-packages.txt" \
  || { echo "containers: docker/runtime-deps.sh failed" >&2; exit 1; }

build_image() {  # NAME DOCKERFILE TAG [ARGS...]
  local name="$1" file="$2" tag="$3"; shift 3
  local t0=$SECONDS old
  old="$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null)"
  if podman build --format docker -f "$file" --ignorefile "$file.dockerignore" \
       --build-context "build=$ctx" --build-arg "DEBIAN_IMAGE=$BASE" "$@" -t "$tag" . \
       >"$LOGS/build-$name.log" 2>&1; then
    # The image this one replaces, if it changed and nothing uses it any more.
    [ -z "$old" ] || [ "$old" = "$(podman image inspect --format '{{.Id}}' "$tag")" ] \
      || podman rmi "$old" >/dev/null 2>&1
    pass "image $tag built from $file in $((SECONDS - t0)) s: $(podman image inspect "$tag" --format '{{.Size}}' | awk '{ printf "%.0f MB", $1 / 1e6 }')"
  else
    tail -20 "$LOGS/build-$name.log"
    fail "image $tag: podman build failed (log: $LOGS/build-$name.log)"
    echo "containers: FAILED (the images did not build)"; exit 1
  fi
}
say "building the images (the tree's binaries: $BUILD)"
build_image aggregator docker/aggregator.Dockerfile "$AGG" --build-arg "DEBIAN_SLIM_IMAGE=$BASE"
build_image trainer-cpu docker/trainer-cpu.Dockerfile "$TRAINER"
# The example trainer of the manifests: the CPU image with examples/trainer/train.py on top,
# as docs/DEPLOY.md tells users to add their script.
mkdir -p "$WORK/example"
cp -p examples/trainer/train.py "$WORK/example/"
printf 'FROM %s\nCOPY train.py /workspace/train.py\n' "$TRAINER" >"$WORK/example/Containerfile"
old="$(podman image inspect --format '{{.Id}}' "$EXAMPLE" 2>/dev/null)"
podman build -q -t "$EXAMPLE" "$WORK/example" >"$LOGS/build-example.log" 2>&1 \
  || { cat "$LOGS/build-example.log"; echo "containers: FAILED (example image)"; exit 1; }
[ -z "$old" ] || [ "$old" = "$(podman image inspect --format '{{.Id}}' "$EXAMPLE")" ] \
  || podman rmi "$old" >/dev/null 2>&1
# What the images hold, checked: the aggregator runs as 10001 and finds all its libraries; the
# trainer's hsbn loads its library and Debian's torch.
if out="$(podman run --rm --network none "$AGG" --help 2>&1)" && grep -q -- "--role" <<<"$out"; then
  pass "aggregator image: hsbn-aggregator --help runs as $(podman image inspect "$AGG" --format '{{.Config.User}}')"
else
  fail "aggregator image: hsbn-aggregator --help: $out"
fi
if out="$(podman run --rm --network none --entrypoint python3 "$TRAINER" -c 'import torch, hsbn, hsbn.torch; print(torch.__version__, hsbn.__file__)' 2>>"$LOGS/podman.log")"; then
  pass "trainer image: torch ${out%% *} and hsbn from /opt/venv"
else
  fail "trainer image: import torch, hsbn: $out"
fi

# -------------------------------------------------------------------------- helpers for runs

# Waits until the aggregator in container CT has written its ready file (a new one: not the
# inode INODE a previous process left), at most 60 s.
wait_ready() {  # CT [INODE]
  local ct="$1" old="${2:-}" i ino
  for ((i = 0; i < 300; i++)); do
    ino="$(podman exec "$ct" stat -c %i /run/hsbn/ready 2>/dev/null)" && [ "$ino" != "$old" ] && return 0
    [ "$(podman inspect "$ct" --format '{{.State.Running}}' 2>/dev/null)" = true ] || break
    sleep 0.2
  done
  podman logs "$ct" 2>&1 | tail -5
  return 1
}

# Waits until every container named has exited, at most SECONDS; prints their exit codes.
wait_exit() {  # SECONDS CT...
  local limit="$1"; shift
  timeout "$limit" podman wait "$@" 2>/dev/null
}

# A trainer of the pods: rank R of a 2x2 job, in node N's pod, as user 10002 with the pod's
# group 10001 as a supplementary group (Kubernetes' fsGroup): another user than the sidecar.
trainer() {  # NAME NODE RANK JOB ARGS...
  local name="$1" node="$2" rank="$3" job="$4"; shift 4
  podman run -d --no-healthcheck --name "$name" --pod "$P-node$node" --user 10002:10002 --group-add 10001 \
    --read-only --cap-drop=ALL --security-opt no-new-privileges \
    -v "$P-run$node:/run/hsbn" -v "$REPO/scripts/containers_job.py:/opt/job.py:ro" \
    -e RANK="$rank" -e WORLD_SIZE=4 -e LOCAL_RANK=$((rank % 2)) -e LOCAL_WORLD_SIZE=2 \
    -e GROUP_RANK="$node" -e HSBN_JOB_ID="$job" -e HSBN_ADDRESS=unix:/run/hsbn/hsbn.sock \
    --entrypoint python3 "$TRAINER" /opt/job.py "$@" >/dev/null 2>>"$LOGS/podman.log"
}

sidecar() {  # NODE
  local n="$1"
  podman run -d --name "$P-node$n-sidecar" --pod "$P-node$n" \
    --read-only --cap-drop=ALL --security-opt no-new-privileges -v "$P-run$n:/run/hsbn" \
    "$AGG" --role=node --listen=unix:/run/hsbn/hsbn.sock --upstream=hsbn-root:7070 \
    --id="node-$n" --ready-file=/run/hsbn/ready --round-timeout-ms=30000 >/dev/null 2>>"$LOGS/podman.log"
}

log_of() { podman logs "$1" >"$LOGS/$1.log" 2>&1; cat "$LOGS/$1.log"; }

# Runs a job of the 4 trainers (2 per pod) to its end and checks every rank's line.
run_job() {  # JOB SCOPE
  local job="$1" scope="$2" r names=() out codes
  for r in 0 1 2 3; do
    names+=("$P-$job-r$r")
    trainer "$P-$job-r$r" $((r / 2)) "$r" "$job" --scope "$scope" --expect-transport shm
  done
  if ! codes="$(wait_exit 300 "${names[@]}")"; then
    fail "job $job ($scope): trainers still running after 300 s"; return
  fi
  local ok=0
  for r in 0 1 2 3; do
    out="$(log_of "${names[$r]}")"
    if grep -q "^HSBN-JOB PASS rank=$r scope=$scope steps=4 .*transport=shm" <<<"$out"; then
      ok=$((ok + 1))
    else
      fail "job $job ($scope) rank $r: $(grep -m1 HSBN-JOB <<<"$out" || tail -3 <<<"$out")"
    fi
  done
  [ "$ok" -eq 4 ] && pass "job $job: 4 trainers in 2 pods, $scope scope equal to BatchNorm over the $scope's batch (max rel. error $(cat "$LOGS/$P-$job"-r*.log | grep -o 'max_err=[^ ]*' | sort -t= -k2 -g | tail -1 | cut -d= -f2)), node rounds through shared memory (exit codes $(tr '\n' ' ' <<<"$codes"))"
}

# ------------------------------------------------------------------------------ the pods

if want pods; then
say "the sidecar pattern: a root pod, two node pods (a sidecar and two trainers each)"
podman network create "$NET" >/dev/null || { echo "containers: cannot create network $NET"; exit 1; }
podman pod create --label hsbn-ct=1 --name "$P-root" --network "$NET" --network-alias hsbn-root >/dev/null 2>>"$LOGS/podman.log"
podman run -d --name "$P-root-agg" --pod "$P-root" --read-only --cap-drop=ALL \
  --security-opt no-new-privileges "$AGG" --role=root --listen=0.0.0.0:7070 --id=root \
  --ready-file=/run/hsbn/ready --round-timeout-ms=30000 >/dev/null 2>>"$LOGS/podman.log"
for n in 0 1; do
  podman volume create "$P-run$n" >/dev/null
  podman pod create --label hsbn-ct=1 --name "$P-node$n" --network "$NET" >/dev/null 2>>"$LOGS/podman.log"
  sidecar "$n"
done
up=1
for c in "$P-root-agg" "$P-node0-sidecar" "$P-node1-sidecar"; do
  wait_ready "$c" || { fail "$c did not write its ready file within 60 s"; up=0; }
done
if [ "$up" = 1 ]; then
  pass "root and two sidecars ready (ready files written)"
  # The image's HEALTHCHECK (podman runs it on a timer only under systemd; here, by hand).
  if podman healthcheck run "$P-node0-sidecar" >>"$LOGS/podman.log" 2>&1; then
    pass "sidecar node-0: the image's HEALTHCHECK says healthy"
  else
    fail "sidecar node-0: the image's HEALTHCHECK did not pass"
  fi
  run_job node node
  run_job global global
  for n in 0 1; do
    if [ "$(podman logs "$P-node$n-sidecar" 2>&1 | grep -c "job 'node': node rounds use shared memory (2 local ranks")" -gt 0 ]; then
      pass "sidecar node-$n: job 'node' used shared memory (its log)"
    else
      fail "sidecar node-$n: no 'node rounds use shared memory' for job 'node' in its log"
    fi
  done

  # ---------------------------------------------------------------------------- faults
  # 1. The sidecar stopped by the runtime (SIGTERM, SIGKILL after 10 s) while its trainers
  # run rounds: docs/PYTORCH.md ("When a sidecar restarts") says every rank in a round fails
  # at once with "sidecar ID is shutting down (SIGTERM)", one between rounds at its next call
  # within connect_timeout_ms (10 s); nothing hangs. Bound checked: 15 s.
  say "fault: podman stop of sidecar node-0 while its trainers run rounds"
  for r in 0 1; do trainer "$P-stop-r$r" 0 "$r" stop --scope node --forever; done
  running=0
  for ((i = 0; i < 300 && running < 2; i++)); do
    running=$(cat <(podman logs "$P-stop-r0" 2>&1) <(podman logs "$P-stop-r1" 2>&1) | grep -c "^HSBN-JOB RUNNING")
    [ "$running" -ge 2 ] || sleep 0.2
  done
  if [ "$running" -lt 2 ]; then
    fail "fault stop: the trainers did not start their rounds within 60 s"
  else
    ino="$(podman exec "$P-node0-sidecar" stat -c %i /run/hsbn/ready)"
    t0=$(date +%s.%N)
    podman stop -t 10 "$P-node0-sidecar" >/dev/null 2>>"$LOGS/podman.log"
    agg_code="$(podman inspect "$P-node0-sidecar" --format '{{.State.ExitCode}}')"
    t_agg=$(date +%s.%N)
    codes="$(wait_exit 60 "$P-stop-r0" "$P-stop-r1")" || codes="hung"
    t1=$(date +%s.%N)
    took=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    podman logs "$P-node0-sidecar" >"$LOGS/$P-node0-sidecar.stop.log" 2>&1
    if [ "$agg_code" = 0 ]; then
      pass "fault stop: the sidecar exited 0 on SIGTERM in $(awk -v a="$t0" -v b="$t_agg" 'BEGIN { printf "%.1f", b - a }') s (not killed)"
    else
      fail "fault stop: the sidecar's exit status after podman stop is $agg_code (SIGTERM should end it with 0)"
    fi
    for r in 0 1; do
      out="$(log_of "$P-stop-r$r")"
      line="$(grep -m1 "^HSBN-JOB FAIL" <<<"$out" || true)"
      if [ "$codes" = hung ]; then
        fail "fault stop rank $r: still running 60 s after the stop (hangs)"
      elif [ -z "$line" ]; then
        fail "fault stop rank $r: no failure line: $(tail -3 <<<"$out")"
      elif ! awk -v t="$took" 'BEGIN { exit !(t <= 15) }'; then
        fail "fault stop rank $r: failed after $took s (bound 15 s): $line"
      elif grep -Eq "sidecar node-0 is shutting down \(SIGTERM\)|sidecar (node-0 )?is gone" <<<"$line"; then
        pass "fault stop rank $r: failed in $took s naming the sidecar: ${line#*error=}"
      elif grep -q "CANCELLED" <<<"$line"; then
        fail "fault stop rank $r: a bare CANCELLED, not naming the sidecar: ${line#*error=}"
      else
        fail "fault stop rank $r: the error does not name the sidecar: ${line#*error=}"
      fi
    done
    # 2. Restarted, the sidecar serves a new job.
    podman start "$P-node0-sidecar" >/dev/null 2>>"$LOGS/podman.log"
    if wait_ready "$P-node0-sidecar" "$ino"; then
      codes=""
      for r in 0 1; do trainer "$P-after-r$r" 0 "$r" after --scope node --expect-transport shm; done
      codes="$(wait_exit 300 "$P-after-r0" "$P-after-r1")" || codes=hung
      n_ok=0
      for r in 0 1; do
        [ "$(log_of "$P-after-r$r" | grep -c "^HSBN-JOB PASS rank=$r scope=node .*transport=shm")" -gt 0 ] && n_ok=$((n_ok + 1))
      done
      if [ "$n_ok" = 2 ]; then pass "restarted sidecar node-0: a new job passed (node scope, shared memory)"
      else fail "restarted sidecar node-0: the new job did not pass (exit codes $(tr '\n' ' ' <<<"$codes"); logs $LOGS/$P-after-r*.log)"; fi
    else
      fail "restarted sidecar node-0: not ready within 60 s"
    fi
  fi

  # 3. The sidecar stopped while its trainers are between rounds (they hold after step 1 until
  # SIGUSR1). docs/PYTORCH.md ("When a sidecar restarts"): a rank between rounds is told of the
  # stop at its next call, at once, with the sidecar's own words (reason SHUTTING_DOWN), whether
  # or not a new sidecar listens by then (the call after that would join the new one). Checked
  # by events, not by a clock: the error is the first round after the hold (step 2) and in the
  # sidecar's words, not a bare CANCELLED after a connect timeout; the time the rank waited
  # (after=, measured in the trainer from SIGUSR1 to the error) is reported, never a bound
  # (seen here: 0.003-0.03 s in the rank; 2.4-5.5 s until both containers exited, under load).
  between() {  # JOB RESTART(0|1)
    local job="$1" restart="$2" r held=0 i ino line out what after
    for r in 0 1; do trainer "$P-$job-r$r" 0 "$r" "$job" --scope node --hold-after 1; done
    for ((i = 0; i < 300 && held < 2; i++)); do
      held=0
      for r in 0 1; do [ "$(podman logs "$P-$job-r$r" 2>&1 | grep -c "^HSBN-JOB HOLD")" -gt 0 ] && held=$((held + 1)); done
      [ "$held" -ge 2 ] || sleep 0.2
    done
    [ "$held" -ge 2 ] || { fail "fault between rounds ($job): the trainers did not reach step 1 within 60 s"; return; }
    ino="$(podman exec "$P-node0-sidecar" stat -c %i /run/hsbn/ready)"
    podman stop -t 10 "$P-node0-sidecar" >/dev/null 2>>"$LOGS/podman.log"
    if [ "$restart" = 1 ]; then
      podman start "$P-node0-sidecar" >/dev/null 2>>"$LOGS/podman.log"
      wait_ready "$P-node0-sidecar" "$ino" || { fail "fault between rounds ($job): the restarted sidecar is not ready within 60 s"; return; }
    fi
    local t0; t0=$(date +%s.%N)
    podman kill -s USR1 "$P-$job-r0" "$P-$job-r1" >/dev/null
    local codes took; codes="$(wait_exit 60 "$P-$job-r0" "$P-$job-r1")" || codes=hung
    took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    for r in 0 1; do
      out="$(log_of "$P-$job-r$r")"
      line="$(grep "^HSBN-JOB \(PASS\|FAIL\|MISMATCH\)" <<<"$out" | head -n 1)"
      what="fault between rounds, sidecar stopped$([ "$restart" = 1 ] && echo " and restarted") rank $r"
      after="$(sed -n 's/.* after=\([0-9.]*\) .*/\1/p' <<<"$line")"
      if [ "$codes" = hung ]; then fail "$what: still running 60 s after it went on (hangs)"
      elif [[ "$line" == "HSBN-JOB FAIL"*" step=2 "* ]] && grep -q "sidecar node-0 is shutting down (SIGTERM)" <<<"$line"; then
        pass "$what: told at its next call (${after:-?} s in the rank, $took s to both exits), in the sidecar's words: ${line#*error=}"
      elif grep -q "CANCELLED" <<<"$line"; then
        fail "$what: a bare CANCELLED after $took s, not naming the sidecar: ${line#*error=}"
      else
        fail "$what: ${line:-no result line: $(tail -3 <<<"$out")} ($took s)"
      fi
    done
    if [ "$restart" = 0 ]; then
      podman start "$P-node0-sidecar" >/dev/null 2>>"$LOGS/podman.log"
      wait_ready "$P-node0-sidecar" "$ino" || fail "sidecar node-0: not ready within 60 s after its restart"
    fi
  }
  say "fault: podman stop of sidecar node-0 while its trainers are between rounds (no restart, then a restart)"
  between gone 0
  between back 1

  # 4. A trainer container killed (SIGKILL) in a global job: the other three fail at once
  # (docs/PROTOCOL.md: a broken stream is reported to the round's members, not at the
  # deadline), naming it. Bound checked: 10 s, a third of the round timeout.
  say "fault: podman kill of trainer rank 3 (node 1) in a global job"
  for r in 0 1 2 3; do trainer "$P-kill-r$r" $((r / 2)) "$r" kill --scope global --forever; done
  running=0
  for ((i = 0; i < 300 && running < 4; i++)); do
    running=0
    for r in 0 1 2 3; do [ "$(podman logs "$P-kill-r$r" 2>&1 | grep -c "^HSBN-JOB RUNNING")" -gt 0 ] && running=$((running + 1)); done
    [ "$running" -ge 4 ] || sleep 0.2
  done
  if [ "$running" -lt 4 ]; then
    fail "fault kill: the trainers did not start their rounds within 60 s"
  else
    t0=$(date +%s.%N)
    podman kill -s KILL "$P-kill-r3" >/dev/null
    codes="$(wait_exit 60 "$P-kill-r0" "$P-kill-r1" "$P-kill-r2")" || codes=hung
    took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    for r in 0 1 2; do
      out="$(log_of "$P-kill-r$r")"
      line="$(grep -m1 "^HSBN-JOB FAIL" <<<"$out" || true)"
      if [ "$codes" = hung ]; then fail "fault kill rank $r: still running 60 s after the kill"
      elif [ -z "$line" ]; then fail "fault kill rank $r: no failure line: $(tail -3 <<<"$out")"
      elif ! awk -v t="$took" 'BEGIN { exit !(t <= 10) }'; then fail "fault kill rank $r: failed after $took s (bound 10 s): $line"
      elif grep -Eq "rank 3\b|ranks? \[?3\]?" <<<"$line"; then pass "fault kill rank $r: failed in $took s naming rank 3: ${line#*error=}"
      else fail "fault kill rank $r: the error does not name rank 3: ${line#*error=}"; fi
    done
  fi
fi
for c in "$P-root-agg" "$P-node0-sidecar" "$P-node1-sidecar"; do podman logs "$c" >"$LOGS/$c.log" 2>&1; done
podman pod rm -f -t 2 "$P-root" "$P-node0" "$P-node1" >/dev/null 2>&1
fi

# ------------------------------------------------------------------- the manifests, played

# podman kube play runs Pods and Deployments. The overlays are rendered with kubectl's
# kustomize (as tests/deploy does) through a kustomization of our own that only points the
# images at the local ones and sets 2 CPU workers per node; each Job's pod template becomes the
# Pod the Job controller would make (its labels and completion index), with the native sidecar
# (an init container with restartPolicy: Always, which podman 4.3 does not know) as the first
# container. Services become hostAliases: the root and pod 0 get fixed addresses.
if ! want kube; then
  :
elif ! command -v kubectl >/dev/null 2>&1; then
  SKIPPED+=("the manifests: kubectl not found (its kustomize renders deploy/k8s, as in tests/deploy)")
  say "SKIPPED: ${SKIPPED[-1]}"
else
  say "the manifests played: deploy/k8s/root, overlays/single-node, overlays/multi-node"
  K="$WORK/kube"
  mkdir -p "$K"
  podman network create --subnet "$KUBE_SUBNET.0/24" "$KUBE_NET" >/dev/null
  render() {  # OVERLAY OUT
    mkdir -p "$K/$2"
    cat >"$K/$2/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(realpath --relative-to="$K/$2" "$REPO/deploy/k8s/$1")
images:
  - name: hsbn/aggregator
    newName: ${AGG%:*}
    newTag: "${AGG##*:}"
  - name: hsbn/trainer
    newName: ${EXAMPLE%:*}
    newTag: "${EXAMPLE##*:}"
EOF
    kubectl kustomize "$K/$2" >"$K/$2.yaml" 2>"$K/$2.err" || { cat "$K/$2.err"; return 1; }
  }
  # Job -> Pods (one per completion index), Deployment kept, the rest dropped.
  to_pods() {  # IN OUT
    /usr/bin/python3 - "$1" "$2" "$KUBE_SUBNET" <<'EOF'
import re, sys, yaml
src, dst, subnet = sys.argv[1:4]
hosts = {"hsbn-root": subnet + ".10", "hsbn-train-0.hsbn-train": subnet + ".20"}
out = []
def fix_pod(spec):
    for c in spec.get("initContainers", [])[:]:
        if c.get("restartPolicy") == "Always":       # a native sidecar: a container here
            spec["initContainers"].remove(c)
            del c["restartPolicy"]
            spec["containers"].insert(0, c)
    if not spec.get("initContainers"):
        spec.pop("initContainers", None)
    for c in spec["containers"]:
        lim = c.get("resources", {}).get("limits", {})
        lim.pop("nvidia.com/gpu", None)             # CPU trainers here
        for e in c.get("env", []):
            if e["name"] == "HSBN_GPUS_PER_NODE":
                e["value"] = "2"
    spec["hostAliases"] = [{"ip": ip, "hostnames": [h]} for h, ip in hosts.items()]
def own_volumes(spec, pod):
    # podman 4.3 makes an emptyDir a volume named as in the pod spec, shared by every pod on
    # the host that names it so; on Kubernetes each pod has its own: prefix the pod's name
    # (and hsbn-ct-, which the clean-up removes).
    names = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
    for v in spec.get("volumes", []):
        if v["name"] in names:
            v["name"] = "hsbn-ct-%s-%s" % (pod, v["name"])
    for c in spec.get("initContainers", []) + spec["containers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] in names:
                m["name"] = "hsbn-ct-%s-%s" % (pod, m["name"])
def expand(spec, meta):
    # $(VAR) in command and args, as the kubelet expands them (podman 4.3 does not), from the
    # container's env: values, and fieldRefs to the pod's name, labels and annotations.
    def field(path):
        if path == "metadata.name":
            return meta["name"]
        m = re.match(r"metadata\.(labels|annotations)\['(.+)'\]$", path)
        return meta.get(m.group(1), {}).get(m.group(2), "") if m else None
    for c in spec.get("initContainers", []) + spec["containers"]:
        env = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
            elif field(e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")) is not None:
                env[e["name"]] = e["value"] = field(e.pop("valueFrom")["fieldRef"]["fieldPath"])
        for key in ("command", "args"):
            if key in c:
                # $$ is a literal $, as for the kubelet
                c[key] = [re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$"
                                 else env.get(m.group(1), m.group(0)), a) for a in c[key]]
for doc in yaml.safe_load_all(open(src)):
    if doc is None:
        continue
    if doc["kind"] == "Deployment":
        tpl = doc["spec"]["template"]
        fix_pod(tpl["spec"])
        own_volumes(tpl["spec"], doc["metadata"]["name"])
        tpl["metadata"]["labels"]["hsbn-ct"] = "1"
        expand(tpl["spec"], dict(tpl["metadata"], name=doc["metadata"]["name"]))
        out.append(doc)
    elif doc["kind"] == "Job":
        job, tpl = doc["metadata"]["name"], doc["spec"]["template"]
        indexed = doc["spec"].get("completionMode") == "Indexed"
        for i in range(doc["spec"].get("completions", 1)):
            meta = {"name": "%s-%d" % (job, i) if indexed else job,
                    "labels": dict(tpl["metadata"].get("labels", {}),
                                   **{"hsbn-ct": "1",
                                      "batch.kubernetes.io/controller-uid": "uid-" + job,
                                      "batch.kubernetes.io/job-name": job}),
                    "annotations": {"batch.kubernetes.io/job-completion-index": str(i)}}
            spec = yaml.safe_load(yaml.safe_dump(tpl["spec"]))
            fix_pod(spec)
            own_volumes(spec, meta["name"])
            expand(spec, meta)
            out.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
yaml.safe_dump_all(out, open(dst, "w"), sort_keys=False)
EOF
  }
  # A played pod's trainer ran to its end: exit 0, every worker's "done" line with rounds and
  # none failed; the sidecar put the job's node rounds in shared memory.
  check_played() {  # POD WORKERS WHAT
    local pod="$1" workers="$2" what="$3" code out done_lines
    code="$(wait_exit 300 "$pod-trainer")" || { fail "$what: the trainer still runs after 300 s"; return; }
    out="$(log_of "$pod-trainer")"
    podman logs "$pod-hsbn-sidecar" >"$LOGS/$pod-hsbn-sidecar.log" 2>&1
    done_lines="$(grep -cE "rank [0-9]+ done: [1-9][0-9]* rounds, [0-9.]+ s blocked in them, 0 failed" <<<"$out")"
    if [ "$code" = 0 ] && [ "$done_lines" = "$workers" ] && grep -q "node rounds use shared memory" "$LOGS/$pod-hsbn-sidecar.log"; then
      pass "$what: trainer exited 0, $workers workers done with 0 failed rounds, node rounds in shared memory"
    else
      fail "$what: trainer exit $code, $done_lines/$workers workers done (logs: $LOGS/$pod-trainer.log, $LOGS/$pod-hsbn-sidecar.log): $(grep -m3 -iE "error|refused|Traceback" <<<"$out" | tr '\n' ' ')"
    fi
  }
  play() {  # FILE IP
    podman kube play --network "$KUBE_NET" --ip "$2" "$1" >"$1.play.log" 2>&1 \
      || { cat "$1.play.log"; return 1; }
  }
  if render overlays/single-node single && to_pods "$K/single.yaml" "$K/single-pods.yaml" \
     && play "$K/single-pods.yaml" "$KUBE_SUBNET.30"; then
    check_played hsbn-train 2 "overlays/single-node under podman kube play"
  else
    fail "overlays/single-node: rendering or kube play failed"
  fi
  podman kube down "$K/single-pods.yaml" >/dev/null 2>&1
  if render root root && to_pods "$K/root.yaml" "$K/root-pods.yaml" \
     && play "$K/root-pods.yaml" "$KUBE_SUBNET.10" \
     && render overlays/multi-node multi && to_pods "$K/multi.yaml" "$K/multi-pods.yaml"; then
    /usr/bin/python3 - "$K/multi-pods.yaml" "$K" <<'EOF'
import sys, yaml
docs = list(yaml.safe_load_all(open(sys.argv[1])))
for i, d in enumerate(docs):
    yaml.safe_dump(d, open("%s/multi-pod%d.yaml" % (sys.argv[2], i), "w"), sort_keys=False)
EOF
    root_ct="$(podman ps --format '{{.Names}}' | grep '^hsbn-root' | head -n 1)"
    if [ -n "$root_ct" ] && wait_ready "$root_ct" && play "$K/multi-pod0.yaml" "$KUBE_SUBNET.20" \
       && play "$K/multi-pod1.yaml" "$KUBE_SUBNET.21"; then
      check_played hsbn-train-0 2 "overlays/multi-node pod 0 (with deploy/k8s/root) under podman kube play"
      check_played hsbn-train-1 2 "overlays/multi-node pod 1 under podman kube play"
      podman logs "$root_ct" >"$LOGS/$root_ct.log" 2>&1
      if grep -q "job 'uid-hsbn-train'.*2 node" "$LOGS/$root_ct.log"; then
        pass "deploy/k8s/root under podman kube play: the root served the job's 2 nodes"
      else
        fail "deploy/k8s/root: its log does not show the job's 2 nodes ($LOGS/$root_ct.log)"
      fi
    else
      fail "overlays/multi-node: the root did not come up or kube play failed"
    fi
  else
    fail "deploy/k8s/root or overlays/multi-node: rendering or kube play failed"
  fi
  for f in "$K"/multi-pod*.yaml "$K/root-pods.yaml"; do
    [ -f "$f" ] && podman kube down "$f" >/dev/null 2>&1
  done
fi

# ------------------------------------------------------------------------------- the verdict

took=$((SECONDS - START))
if [ ${#FAILED[@]} -eq 0 ]; then
  skipped=""
  [ ${#SKIPPED[@]} -eq 0 ] || skipped="; SKIPPED: ${SKIPPED[*]}"
  echo "containers: PASS ($PASSED checks in ${took} s; images $AGG, $TRAINER$skipped)"
  exit 0
fi
echo "containers: logs in $LOGS"
echo "containers: FAILED (${#FAILED[@]} of $((PASSED + ${#FAILED[@]})) checks failed in ${took} s)"
exit 1
