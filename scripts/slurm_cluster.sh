#!/usr/bin/env bash
# A one-node SLURM for the CI stage: Debian's packages, munged, slurmctld and slurmd started
# here under a private state directory, and stopped again by pid.
#
#   source scripts/slurm_cluster.sh && slurm_up DIR   # installs if needed, starts, exports SLURM_CONF
#   slurm_down DIR                                    # stops the daemons it started


slurm_install() {
  if command -v srun >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  echo "slurm: installing Debian's slurm-wlm and munge" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

slurm_up() {
  local dir=$1 node cpus mem
  slurm_install
  mkdir -p "$dir/state" "$dir/spool" /run/munge
  node=$(hostname -s)
  read -r cpus mem < <(slurmd -C | awk '/NodeName/ {for (i = 1; i <= NF; i++) {split($i, kv, "="); v[kv[1]] = kv[2]}; print v["CPUs"], v["RealMemory"]}')
  cat >"$dir/slurm.conf" <<CONF
ClusterName=meshtrain-ci
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=$node CPUs=$cpus RealMemory=$((mem * 9 / 10)) State=UNKNOWN
PartitionName=ci Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  export SLURM_CONF=$dir/slurm.conf
  if ! munge -n </dev/null >/dev/null 2>&1; then  # no munged running yet: start one
    chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged --pid-file /run/munge/munged.pid
    cp /run/munge/munged.pid "$dir/munged.pid"
  fi
  slurmctld -i
  slurmd
  local i
  for i in $(seq 1 60); do
    if sinfo -h -o %t 2>/dev/null | grep -qx idle; then
      echo "slurm: one node ($node, $cpus CPUs) up in $dir" >&2
      return 0
    fi
    sleep 0.5
  done
  echo "slurm: the node did not come up; see $dir/slurmctld.log and $dir/slurmd.log" >&2
  tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
  return 1
}

slurm_down() {
  local dir=$1 f pid
  for f in slurmd slurmctld munged; do
    pid=$(cat "$dir/$f.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    fi
  done
}
