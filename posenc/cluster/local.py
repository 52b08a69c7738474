"""``python -m posenc.cluster.local up|down [--dir DIR]``: a one-node SLURM cluster on this machine.

The SLURM path (``launcher=submitit_slurm``: sbatch, job arrays, srun tasks joined into one DDP world, the signal
before a time limit, requeue) can only be trusted once it has run against the scheduler itself. Debian's
``slurm-wlm`` and ``munge`` packages run a cluster of one node on any machine: ``up`` writes a ``slurm.conf`` for
this host into DIR, starts munged, slurmctld and slurmd, and returns once the node is idle; ``down`` cancels the
cluster's jobs and stops the three daemons. The tests start one per session (``tests/conftest.py``); a user can
start one to try a sweep before taking it to a real cluster (``export SLURM_CONF=DIR/slurm.conf``).

The configuration differs from a production cluster only where a single machine needs it:

- ``proctrack/linuxproc`` and ``task/none``: jobs are tracked by process tree, without cgroups (which containers
  and CI machines often do not delegate);
- one node with this machine's CPUs and memory (as ``slurmd -C`` reports them), no GPUs, one partition ``local``;
- ``JobRequeue=1``; ``EnforcePartLimits=ALL``, as many sites set it: sbatch refuses a job no node could run;
  ``cred_expire`` of 10 s, which is also how long a requeued job waits before it may start again
  (SLURM's default is 120 s); the scheduler passes every 2 s instead of every 30-60 s;
- no accounting database: ``sacct`` has nothing to say here, ``squeue`` and ``scontrol show job`` do.

Every daemon runs in the foreground as a child started here, in a session of its own; their process ids are kept
in ``DIR/pids.json``, and ``down`` signals exactly those (after checking each still is that daemon of DIR), never
processes found by name. The daemons run as root, as slurmd must to start jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from posenc.jsonio import write_text

INSTALL = "apt-get install -y slurm-wlm munge"
DAEMONS = ("munged", "slurmctld", "slurmd")  # started in this order, stopped in the reverse one
CLIENTS = ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
PARTITION = "local"
REQUEUE_DELAY_S = 10  # cred_expire: a requeued job may start again this long after it was requeued
DEFAULT_DIR = Path(tempfile.gettempdir()) / "posenc-slurm"
PIDS_FILE = "pids.json"
_SBIN = ("/usr/sbin", "/sbin")  # where Debian puts the daemons; not on every user's PATH
_SOCKET_PATH_MAX = 100  # a unix socket's path holds at most 107 bytes


class ClusterError(SystemExit):
    """The local cluster cannot start or answer: the message says why and what to do (no traceback)."""


def which(name: str) -> str | None:
    """Where the SLURM or munge program ``name`` is (the daemons live in /usr/sbin)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))


def unavailable() -> str | None:
    """Why a local cluster cannot run on this machine, in one line; ``None`` when it can."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if which(name) is None]
    if missing:
        return f"no SLURM here ({', '.join(missing)} not found): install it as root with `{INSTALL}`"
    if os.geteuid() != 0:
        return "a local SLURM cluster runs slurmd, which starts every job, as root: run it as root"
    return None


@dataclass(frozen=True)
class LocalCluster:
    """A cluster's directory: its ``slurm.conf``, daemon logs, state and the pids of its daemons."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a SLURM command (and every job submitted from it) needs in its environment to use this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *command: str, timeout_s: float = 30) -> str:
        """Run a SLURM client command against this cluster; its output, or ``ClusterError`` with its error."""
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise ClusterError(f"`{' '.join(command)}` did not answer within {timeout_s:.0f} s") from None
        if done.returncode:
            raise ClusterError(f"`{' '.join(command)}` failed: {(done.stderr or done.stdout).strip()}")
        return done.stdout

    def jobs(self) -> list[str]:
        """Ids of the jobs the cluster holds (pending, running, completing), array tasks as ``<array>_<task>``."""
        return self.run("squeue", "--noheader", "--format=%i").split()

    def node_state(self) -> str:
        return self.run("sinfo", "--noheader", "--format=%T", f"--partition={PARTITION}").strip()

    def pids(self) -> dict[str, int]:
        path = self.root / PIDS_FILE
        return json.loads(path.read_text()) if path.exists() else {}


def start(root: Path = DEFAULT_DIR, timeout_s: float = 60) -> LocalCluster:
    """Write the configuration, start the daemons, and return once the node is idle (or stop them and raise)."""
    reason = unavailable()
    if reason:
        raise ClusterError(reason)
    cluster = LocalCluster(root.expanduser().resolve())
    if any(_is_daemon(pid, cluster) for pid in cluster.pids().values()):
        raise ClusterError(f"a local cluster already runs from {cluster.root}: stop it first (down --dir {root})")
    socket_path = cluster.root / "munge" / "munge.sock"
    if len(str(socket_path)) > _SOCKET_PATH_MAX:
        raise ClusterError(f"{cluster.root} is too deep for munge's socket path: choose a shorter --dir")
    closed = [parent for parent in cluster.root.parents if parent.is_dir() and not parent.stat().st_mode & 0o001]
    if closed:  # munged refuses a socket that some user could not reach
        raise ClusterError(
            f"munged needs every directory above its socket open to all users, and {closed[0]} is not: "
            f"choose a --dir under {tempfile.gettempdir()}"
        )
    _write_config(cluster)
    deadline = time.monotonic() + timeout_s
    started: dict[str, int] = {}
    try:
        for name in DAEMONS:
            started[name] = _launch(cluster, name)
            write_text(cluster.root / PIDS_FILE, json.dumps(started))
            _wait_ready(cluster, name, started[name], deadline)
    except BaseException:
        stop(cluster.root)
        raise
    return cluster


def stop(root: Path = DEFAULT_DIR, timeout_s: float = 60) -> list[str]:
    """Cancel the cluster's jobs, wait for them to end, then stop its daemons by pid; the jobs it cancelled."""
    cluster = LocalCluster(root.expanduser().resolve())
    pids = cluster.pids()
    cancelled: list[str] = []
    if _is_daemon(pids.get("slurmctld"), cluster) and _is_daemon(pids.get("munged"), cluster):
        # Jobs first: slurmd leaves running jobs (and their slurmstepd) alive when it stops, by design.
        with contextlib.suppress(ClusterError):
            cancelled = cluster.jobs()
            if cancelled:
                cluster.run("scancel", *cancelled)
            deadline = time.monotonic() + timeout_s
            while cluster.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
    for name in reversed(DAEMONS):
        pid = pids.get(name)
        if _is_daemon(pid, cluster):
            assert pid is not None
            _terminate(pid)
    (cluster.root / PIDS_FILE).unlink(missing_ok=True)
    return cancelled


def processes(cluster: LocalCluster) -> dict[int, str]:
    """Every running process that uses this cluster (pid: command line), found by ``SLURM_CONF`` in its environment.

    That is its daemons, what they started (job steps, jobs, their sruns) and anything run with its ``SLURM_CONF``
    (a submitting command, a shell that exported it): what must be gone once the cluster is down.
    """
    marker = f"SLURM_CONF={cluster.conf}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0") and _alive(int(entry.name)):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return found


# ---------------------------------------------------------------------------------------------------------------
# Configuration and daemons


def _write_config(cluster: LocalCluster) -> None:
    root = cluster.root
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # munged wants its socket's directory, and every one above, open to every user (they all authenticate).
    for folder in (root, root / "munge"):
        folder.chmod(folder.stat().st_mode | 0o055)
    key = root / "munge" / "munge.key"
    if not key.exists():
        descriptor = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # munged refuses a readable key
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(os.urandom(1024))
    node, hardware = _this_node()
    lines = [
        "# A one-node SLURM cluster on this machine, written by `python -m posenc.cluster.local up`.",
        "ClusterName=posenc-local",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.sock,cred_expire={REQUEUE_DELAY_S}",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "JobRequeue=1",
        "EnforcePartLimits=ALL",  # a job no node could run is refused by sbatch, not left pending forever
        "ReturnToService=2",
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName={node} NodeAddr=127.0.0.1 {hardware} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    write_text(cluster.conf, "\n".join(lines) + "\n")


def _this_node() -> tuple[str, str]:
    """The node name and hardware line (CPUs, sockets, cores, threads, memory) slurmd detects on this machine.

    Declaring exactly what slurmd finds keeps the node from being drained for a mismatch.
    """
    slurmd = which("slurmd")
    assert slurmd is not None
    detected = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    fields = dict(item.split("=", 1) for item in (detected[0].split() if detected else []) if "=" in item)
    if "NodeName" not in fields or "CPUs" not in fields:
        raise ClusterError(f"`slurmd -C` did not describe this machine (it printed {detected!r})")
    name = fields.pop("NodeName")
    return name, " ".join(f"{key}={value}" for key, value in fields.items())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _command(cluster: LocalCluster, name: str) -> list[str]:
    root, program = cluster.root, which(name)
    assert program is not None
    if name == "munged":
        munge = root / "munge"
        return [
            program,
            "--foreground",
            f"--key-file={munge / 'munge.key'}",
            f"--socket={munge / 'munge.sock'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--seed-file={munge / 'munged.seed'}",
        ]
    if name == "slurmctld":
        return [program, "-D", "-i", "-f", str(cluster.conf)]  # -i: a fresh start, no jobs from an earlier one
    node, _ = _this_node()
    return [program, "-D", "-N", node, "-f", str(cluster.conf)]


def _launch(cluster: LocalCluster, name: str) -> int:
    log = (cluster.root / "log" / f"{name}.out").open("ab")
    with log:
        process = subprocess.Popen(
            _command(cluster, name),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **cluster.env},
            start_new_session=True,  # a Ctrl-C meant for the caller's terminal does not reach the daemons
        )
    return process.pid


def _wait_ready(cluster: LocalCluster, name: str, pid: int, deadline: float) -> None:
    """Wait until the daemon answers: munged's socket, slurmctld's ping, slurmd's node idle."""
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise ClusterError(f"{name} stopped while starting: {_log_tail(cluster, name)}")
        with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
            if name == "munged" and (cluster.root / "munge" / "munge.sock").exists():
                return
            if name == "slurmctld" and "UP" in cluster.run("scontrol", "ping", timeout_s=5):
                return
            if name == "slurmd" and cluster.node_state() == "idle":
                return
        time.sleep(0.3)
    raise ClusterError(f"{name} was not ready in time: {_log_tail(cluster, name)}")


def _log_tail(cluster: LocalCluster, name: str) -> str:
    logs = [cluster.root / "log" / f"{name}.out", cluster.root / "log" / f"{name}.log"]
    lines = [line for path in logs if path.exists() for line in path.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if "error" in line.lower()] or lines
    return " | ".join(errors[-3:]) or f"nothing logged (see {cluster.root / 'log'})"


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a child that exited is reaped here, so it does not linger as a zombie)."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_daemon(pid: int | None, cluster: LocalCluster) -> bool:
    """Whether ``pid`` is alive and still one of this cluster's daemons (a pid can be reused after a reboot)."""
    if pid is None or not _alive(pid):
        return False
    with contextlib.suppress(OSError):
        return str(cluster.root) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    return False


def _terminate(pid: int, grace_s: float = 15) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> None:
    """``up`` starts a cluster in ``--dir`` and prints how to use it; ``down`` stops it."""
    parser = argparse.ArgumentParser(prog="python -m posenc.cluster.local", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the cluster's directory ({DEFAULT_DIR})")
    args = parser.parse_args(argv)
    if args.action == "down":
        if not LocalCluster(args.dir.expanduser().resolve()).pids():
            print(f"no local SLURM cluster runs from {args.dir}")
            return
        cancelled = stop(args.dir)
        print(
            f"local SLURM cluster in {args.dir} stopped"
            + (f" (cancelled jobs {' '.join(cancelled)})" if cancelled else "")
        )
        return
    cluster = start(args.dir)
    cpus = cluster.run("sinfo", "--noheader", "--format=%c").strip()
    print(f"local SLURM cluster up: one node, {cpus} CPUs, partition {PARTITION}; daemon logs in {cluster.root}/log")
    print(f"  export SLURM_CONF={cluster.conf}")
    print(
        "then, e.g.: python -m posenc.train -m -cd sweeps -cn smoke launcher=submitit_slurm "
        "hydra.launcher.cpus_per_task=1"
    )
    print(f"stop it with: python -m posenc.cluster.local down --dir {args.dir}")


if __name__ == "__main__":
    main()
