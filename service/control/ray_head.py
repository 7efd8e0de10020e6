"""The control plane's side of Ray: the Ray head on 127.0.0.1 that it starts when
``RAY_ADDRESS`` is unset, and the cluster's inventory read through Ray's dashboard (the
control plane is not a Ray driver).

The head runs as a separate ``ray start --head --block`` process in its own session, so it
outlives the service: a restarted (even SIGKILLed) service finds it through
``<state_dir>/ray_head.json`` and re-attaches, and running jobs go on. ``stop()`` ends
that session and every process started with the head's private temp dir, then removes
that dir; it never runs ``ray stop``, which would end every Ray process on the machine.
A service that shuts down (Ctrl-C, SIGTERM) stops its head unless told to keep it
(``DMUON_KEEP_RAY``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from service.job.plan.inventory import NodeInfo

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
STATE_FILE = "ray_head.json"
TEMP_PREFIX = "dmuon-ray-"  # a head's own temp dir; stop() removes only these


def inventory_from_dashboard(address: str, timeout_s: float = 5) -> list[NodeInfo]:
    """The same, read through the Ray dashboard at ``address`` by Ray's state API: for the
    control plane, which is not a Ray driver."""
    from ray.util.state import list_nodes

    return [NodeInfo(n.node_id, n.node_ip, n.resources_total.get("CPU", 0),
                     n.resources_total.get("GPU", 0), dict(n.resources_total))
            for n in list_nodes(address=address, detail=True, timeout=int(timeout_s),
                                raise_on_missing_output=False)
            if n.state == "ALIVE"]


class CachedInventory:
    """The cluster's alive nodes, read at most every ``ttl_s`` (submissions come in
    bursts); [] while the cluster cannot be read."""

    def __init__(self, address: str, ttl_s: float, log):
        self.address, self.ttl_s, self._log = address, ttl_s, log
        self._read: tuple[float, list[NodeInfo]] = (-math.inf, [])
        self._lock = threading.Lock()

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            read_at, nodes = self._read
            if time.monotonic() - read_at > self.ttl_s:
                try:
                    nodes = inventory_from_dashboard(self.address)
                    # none yet (a new head registers its node within a second): ask again
                    read_at = time.monotonic() if nodes else -math.inf
                except Exception as e:  # noqa: BLE001 - Ray raises several kinds
                    self._log(f"cannot read the cluster's nodes: {e}")
                    nodes, read_at = [], time.monotonic()
                self._read = (read_at, nodes)
            return nodes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed service's head may wait to be reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class LocalRayHead:
    pid: int
    port: int
    dashboard_port: int
    temp_dir: str

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @classmethod
    def start(cls, num_cpus: int = 4, ready_timeout: float = 90) -> LocalRayHead:
        head = cls(0, free_port(), free_port(), tempfile.mkdtemp(prefix=TEMP_PREFIX))
        # the head's processes' own temp files (the dashboard's multiprocessing
        # forkserver makes a pymp-* dir, left behind when it is killed) go in its temp
        # dir, which stop() removes
        os.makedirs(scratch := os.path.join(head.temp_dir, "tmp"))
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "RAY_USAGE_STATS_ENABLED": "0", "TMPDIR": scratch}
        env.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 turns token auth on
        proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             f"--port={head.port}", f"--num-cpus={num_cpus}", f"--temp-dir={head.temp_dir}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={head.dashboard_port}",
             # Ray's fixed defaults (10001, 52365) would go to whichever head came first:
             # a second head on the machine then has no job agent
             f"--ray-client-server-port={free_port()}",
             f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        head.pid = proc.pid
        deadline = time.time() + ready_timeout
        while not head.ready():
            if proc.poll() is not None or time.time() > deadline:
                head._end()  # its temp dir stays: the reason is in its logs
                raise RuntimeError(f"the local Ray head did not come up (ray start exit "
                                   f"code {proc.poll()}, temp dir {head.temp_dir})")
            time.sleep(0.5)
        return head

    @classmethod
    def attach_or_start(cls, state_dir: str, num_cpus: int = 4) -> tuple[LocalRayHead, bool]:
        """The head recorded in ``state_dir`` if it still answers, else a new one;
        the flag says whether it was re-attached."""
        path = os.path.join(state_dir, STATE_FILE)
        try:
            with open(path) as fh:
                head = cls(**json.load(fh))
            if _alive(head.pid) and head.ready():
                return head, True
        except (OSError, ValueError, TypeError):
            pass
        head = cls.start(num_cpus)
        os.makedirs(state_dir, exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            json.dump(asdict(head), fh)
        os.replace(path + ".tmp", path)
        return head, False

    def ready(self) -> bool:
        """The dashboard answers and lists the head's node as alive: until then jobs
        and plans would see a cluster of no nodes."""
        try:
            return bool(inventory_from_dashboard(self.dashboard, timeout_s=2))
        except Exception:  # noqa: BLE001 - not up yet: Ray raises several kinds
            return False

    def _processes(self) -> list[int]:
        """Every process of the head: those whose command line names its private temp
        dir, and the members of its session (``ray start`` leads it), whatever process
        group they moved to."""
        return sorted(set(pids_with(self.temp_dir)) | set(_in_session(self.pid)))

    def stop(self) -> None:
        """End the head's processes, then remove its temp dir (its sessions' logs,
        sockets and spilled objects: a few MB a head, which Ray leaves behind)."""
        if self._end() and os.path.basename(self.temp_dir).startswith(TEMP_PREFIX):
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _end(self) -> bool:
        """SIGTERM, then SIGKILL, to every process of the head; whether all ended."""
        for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            for kill, target in ((os.killpg, self.pid), *((os.kill, p)
                                                           for p in self._processes())):
                try:
                    kill(target, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.time() + wait_s
            while time.time() < deadline and (_alive(self.pid) or self._processes()):
                _reap(self.pid)
                time.sleep(0.5)
            if not _alive(self.pid) and not self._processes():
                return True
        return False


def pids_with(*parts: str) -> list[int]:
    """Processes whose command line (arguments joined by spaces) contains every part:
    how we find the Ray processes we started, by their private temp dir, by PID."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ")
        except OSError:
            continue
        if all(part.encode() in cmd for part in parts):
            pids.append(int(pid))
    return pids


def _in_session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the sixth field of /proc/<pid>/stat)."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state, _, _, session = fh.read().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session) == sid and state != "Z" and int(pid) != os.getpid():
            members.append(int(pid))
    return members


def _reap(pid: int) -> None:
    """Collect our child's exit status so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def recorded_head(state_dir: str) -> LocalRayHead | None:
    """The head recorded in ``state_dir``, if any (alive or not)."""
    try:
        with open(os.path.join(state_dir, STATE_FILE)) as fh:
            return LocalRayHead(**json.load(fh))
    except (OSError, ValueError, TypeError):
        return None


def stop_head(head: LocalRayHead, state_dir: str) -> None:
    """Stop ``head`` by PID and forget it, if ``state_dir`` still records it."""
    head.stop()
    if recorded_head(state_dir) == head:
        os.remove(os.path.join(state_dir, STATE_FILE))


def stop_recorded(state_dir: str) -> LocalRayHead | None:
    """Stop the head recorded in ``state_dir`` (``dmuon-serve --stop-ray``, ``make demo``
    on exit); returns it, None if none is recorded."""
    head = recorded_head(state_dir)
    if head is not None:
        stop_head(head, state_dir)
    return head
