"""Hosts on one machine (two by default): network namespaces joined by a private bridge,
a Ray head in host a and Ray worker nodes in the others, and the faults the multi-node
tests inject.

Everything this makes is named after this process (namespaces) or lives in temp dirs of
its own (processes), and ``close()`` removes exactly that: processes by the process
groups we started and by our temp dirs, then our namespaces (which takes their veths
and bridge with them). Never ``ray stop``, ``pkill`` or ``killall``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from service.control.ray_head import pids_with

IFACE = "dmnet0"  # the same name in both hosts, so one GLOO_SOCKET_IFNAME serves both
SUBNET = "10.200.0"
RAY_PORT = 6379
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# node death seen in ~3 s instead of Ray's default ~56 s (tests only; see deploy/)
HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "3"}


def namespaces_available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    def __init__(self, names: tuple[str, ...] = ("a", "b")):
        tag = f"{os.getpid() % 100000}"
        self.names = names
        self.ns = {**{h: f"dm{h}{tag}" for h in names}, "bridge": f"dmbr{tag}"}
        self.ip = {h: f"{SUBNET}.{11 + i}" for i, h in enumerate(names)}
        self.root = tempfile.mkdtemp(prefix="dmuon-hosts-")
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._nodes = 0
        try:
            self._network()
        except BaseException:
            self.close()
            raise

    # -- network ---------------------------------------------------------------------
    def _network(self) -> None:
        for name in self.ns.values():
            _sh("ip", "netns", "add", name)
            self._made.append(name)
        br = self.ns["bridge"]
        _sh("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", br, "link", "set", "br0", "up")
        for host in self.names:
            ns, peer = self.ns[host], f"v{host}"
            _sh("ip", "link", "add", IFACE, "netns", ns, "type", "veth",
                "peer", "name", peer, "netns", br)
            _sh("ip", "-n", br, "link", "set", peer, "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", IFACE)
            _sh("ip", "-n", ns, "link", "set", IFACE, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        self._check_connectivity()

    def _check_connectivity(self) -> None:
        listen = ("import socket; s=socket.socket(); s.bind(('{ip}', 7001)); s.listen(1); "
                  "c, _ = s.accept(); c.sendall(b'ok')").format(ip=self.ip["b"])
        server = subprocess.Popen(["ip", "netns", "exec", self.ns["b"], sys.executable, "-c",
                                   listen])
        try:
            probe = ("import socket, time\nfor _ in range(50):\n    try:\n"
                     f"        print(socket.create_connection(('{self.ip['b']}', 7001), 1)"
                     ".recv(2).decode()); break\n    except OSError: time.sleep(0.1)")
            out = subprocess.run(["ip", "netns", "exec", self.ns["a"], sys.executable, "-c",
                                  probe], capture_output=True, text=True, timeout=30).stdout
            if out.strip() != "ok":
                raise RuntimeError("host a cannot reach host b over the bridge")
        finally:
            server.kill()
            server.wait()

    def link(self, host: str, up: bool) -> None:
        _sh("ip", "-n", self.ns[host], "link", "set", IFACE, "up" if up else "down")

    def link_bytes(self, host: str) -> int:
        """Bytes through ``host``'s veth so far, both ways (its tx_bytes + rx_bytes, read
        inside its namespace): with two hosts, every byte that crossed between them.
        Traffic between a host's own processes stays on its loopback."""
        stats = f"/sys/class/net/{IFACE}/statistics"
        out = subprocess.run(["ip", "netns", "exec", self.ns[host], "cat", f"{stats}/tx_bytes",
                              f"{stats}/rx_bytes"], check=True, capture_output=True,
                             text=True, timeout=30).stdout
        return sum(int(n) for n in out.split())

    # -- processes -------------------------------------------------------------------
    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        env.update(GLOO_SOCKET_IFNAME=IFACE, RAY_USAGE_STATS_ENABLED="0",
                   RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", **HEALTH_CHECK, **extra)
        return env

    def popen(self, host: str, argv: list[str], log: str, **extra_env) -> subprocess.Popen:
        out = open(os.path.join(self.root, log), "w")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=self.env(**extra_env),
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def _ray_node(self, host: str, head: bool, num_cpus: int) -> str:
        self._nodes += 1
        temp = os.path.join(self.root, f"ray{self._nodes}")
        args = [RAY, "start", "--block", f"--node-ip-address={self.ip[host]}",
                f"--num-cpus={num_cpus}", f"--temp-dir={temp}", "--disable-usage-stats"]
        args += ([ "--head", f"--port={RAY_PORT}", f"--dashboard-host={self.ip['a']}"]
                 if head else [f"--address={self.ip['a']}:{RAY_PORT}"])
        log = f"ray{self._nodes}.log"
        self.popen(host, args, log)
        deadline = time.time() + 90
        while time.time() < deadline:
            with open(os.path.join(self.root, log)) as fh:
                if "Ray runtime started" in fh.read():
                    return temp
            time.sleep(0.5)
        raise TimeoutError(f"Ray node on host {host} did not start; see {log}")

    def start_head(self, num_cpus: int = 2) -> str:
        return self._ray_node("a", True, num_cpus)

    def add_worker_node(self, num_cpus: int = 2, host: str = "b") -> str:
        """Start (or re-add) a host's Ray worker node; returns its temp dir."""
        return self._ray_node(host, False, num_cpus)

    def pids_of(self, marker: str, name: str = "") -> list[int]:
        return pids_with(marker, name)

    def kill_raylet(self, temp_dir: str) -> int:
        (pid,) = self.pids_of(temp_dir, "raylet/raylet")
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_node(self, temp_dir: str) -> None:
        for pid in self.pids_of(temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- teardown --------------------------------------------------------------------
    def close(self) -> None:
        # a short grace for SIGTERM: Ray's daemons take 10 s and more to exit on it, and
        # nothing of a test's cluster needs a clean shutdown
        for sig, grace in ((signal.SIGTERM, 2), (signal.SIGKILL, 10)):
            for proc in self.procs:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            for pid in self.pids_of(self.root):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + grace
            while time.time() < deadline and self.pids_of(self.root):
                time.sleep(0.3)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()

    def leftovers(self) -> list[str]:
        """What of ours still exists (should be nothing after ``close``)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        left = [f"netns {n}" for n in self.ns.values() if n in listed]
        left += [f"pid {p}" for p in self.pids_of(self.root)]
        return left
