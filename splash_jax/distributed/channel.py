"""The command channel: process 0 streams commands to every other process over TCP.

Why TCP and not the coordination service's key-value store: a KV round trip measured 0.44 ms per
key on CPU (and keys must be garbage-collected), a socket send is a few microseconds, and a dead
peer shows up at once as a closed connection. Both ends send heartbeats; a peer that closes its
connection or stays silent for `timeout_s` is reported to `on_failure` (default: log and exit the
process, because its main thread may be blocked inside a collective that will never complete).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

from splash_jax.distributed.wire import Command, encode, recv_command

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 3
HEARTBEAT = Command("hb")


class PeerLost(RuntimeError):
    """Another process of the engine died, disconnected or stopped answering."""


def exit_on_failure(message: str) -> None:
    """Log the failure and end this process now: no cleanup can complete with a peer gone."""
    log.critical("%s", message)
    print(f"splash-jax: fatal: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(EXIT_PEER_LOST)


class _Heartbeat(threading.Thread):
    def __init__(self, send, interval: float):
        super().__init__(name="splash-heartbeat", daemon=True)
        self._send, self._interval, self.stopped = send, interval, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self._interval):
            try:
                self._send(HEARTBEAT)
            except OSError:
                return  # the reader side reports the failure


class LeaderChannel:
    """Process 0's end: accepts one connection per follower, broadcasts commands in order."""

    def __init__(self, num_followers: int, port: int = 0, timeout_s: float = 10.0, on_failure=exit_on_failure):
        self.num_followers = num_followers
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        if socket.has_dualstack_ipv6():
            self._server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self._server = socket.create_server(("", port))
        self.port = self._server.getsockname()[1]
        self._peers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._heartbeat = _Heartbeat(self._send_all, timeout_s / 4)
        self.num_sent = 0

    def accept(self, timeout_s: float) -> None:
        """Wait for every follower to connect and say which process it is."""
        self._server.settimeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        while len(self._peers) < self.num_followers:
            self._server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, addr = self._server.accept()
            except TimeoutError:
                missing = self.num_followers - len(self._peers)
                raise PeerLost(f"{missing} process(es) did not connect to the command channel within {timeout_s:.0f}s") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout_s)
            hello = recv_command(sock)
            pid = int(hello.fields["process_id"])
            self._peers[pid] = sock
            log.info("process %d connected to the command channel from %s", pid, addr[0])
        self._server.close()
        for pid, sock in self._peers.items():
            sock.settimeout(self.timeout_s)
            threading.Thread(target=self._watch, args=(pid, sock), name=f"splash-watch-{pid}", daemon=True).start()
        self._heartbeat.start()

    def send(self, cmd: Command) -> None:
        """Send a command to every follower (before this process runs it, so nobody waits)."""
        try:
            self._send_all(cmd)
        except OSError as e:
            self._lost(f"sending a command failed ({type(e).__name__}: {e})")
        self.num_sent += 1

    def _send_all(self, cmd: Command) -> None:
        data = encode(cmd)
        with self._lock:
            for sock in self._peers.values():
                sock.sendall(data)

    def _watch(self, pid: int, sock: socket.socket) -> None:
        """Followers only send heartbeats; EOF or silence means the process is gone."""
        while True:
            try:
                recv_command(sock)
            except TimeoutError:
                reason = f"no heartbeat from process {pid} for {self.timeout_s:.0f}s (hung, or its host is unreachable)"
                break
            except (ConnectionError, OSError) as e:
                reason = f"process {pid} closed its connection ({type(e).__name__}: {e}); it exited or crashed"
                break
        if not self._closing:
            self._lost(reason)

    def _lost(self, reason: str) -> None:
        if self._closing:
            return
        self._closing = True
        self.on_failure(f"the multi-process engine lost a process: {reason}. Stopping the engine.")

    def close(self) -> None:
        """Tell every follower to stop, then close the connections."""
        if self._closing:
            return
        self._closing = True  # before `stop`: the followers' closing connections are expected now
        self._heartbeat.stopped.set()
        try:
            self._send_all(Command("stop"))
        except OSError:
            pass
        for sock in self._peers.values():
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass


class FollowerChannel:
    """A follower's end: connects to process 0, receives commands, sends heartbeats."""

    def __init__(self, host: str, port: int, process_id: int, timeout_s: float = 10.0, connect_timeout_s: float = 300.0):
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=min(10.0, connect_timeout_s))
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise PeerLost(f"could not connect to process 0's command channel at {host}:{port}: {e}") from e
                time.sleep(0.2)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(timeout_s)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._send(Command("hello", {"process_id": process_id}))
        self._heartbeat = _Heartbeat(self._send, timeout_s / 4)
        self._heartbeat.start()

    def _send(self, cmd: Command) -> None:
        with self._lock:
            self._sock.sendall(encode(cmd))

    def recv(self) -> Command:
        """The next command from process 0 (heartbeats skipped); PeerLost if process 0 is gone."""
        while True:
            try:
                cmd = recv_command(self._sock)
            except TimeoutError:
                raise PeerLost(f"no heartbeat from process 0 for {self.timeout_s:.0f}s") from None
            except (ConnectionError, OSError) as e:
                raise PeerLost(f"process 0 closed the command channel ({type(e).__name__}: {e})") from None
            if cmd.op != "hb":
                return cmd

    def close(self) -> None:
        self._heartbeat.stopped.set()
        try:
            self._sock.close()
        except OSError:
            pass
