"""Every rank of a split target watches the others: a rank that dies or hangs mid-generation ends the job
with one error line within seconds, instead of leaving the others waiting in a collective forever.

MLX's ring backend notices a peer whose sockets close (a killed process on a live host) and fails the
pending collective: `lost` turns that into one line. It does not notice a peer that stops without closing
them (a Mac that loses power or its cable, a process stopped or stuck): the ranks' collectives then wait
forever. So each rank also sends a small UDP datagram to every other rank every `interval` seconds, on
the address and port the ring itself uses for that rank (`MLX_HOSTFILE`, written by `mlx.launch`; UDP,
so the ring's TCP port stays the ring's), and a peer heard once and then silent for `timeout` seconds
ends the job. A rank's heartbeats come from their own thread: MLX releases the GIL while it computes, so
a long forward is not silence. A rank stuck inside a collective cannot raise: the watch exits the process.

`mlx.launch` itself ends the job when one rank exits with an error: it sends the others SIGTERM, often
before their own collective has failed. A rank says so in one line too, from a thread (the main thread
may be inside a collective, where a Python signal handler would wait for it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

MAGIC = b"mlx_dspark rank "
ENDED = 3  # the exit status of a rank that lost another


_ENDING = threading.Lock()  # the first caller of `lost` writes the line; a second (SIGTERM beside the watch) leaves it


def lost(rank: int, why: str) -> None:
    """One error line on stderr and the process ends now (a thread stuck in a collective cannot be woken).
    Safe from a signal handler and from several threads at once: the line goes out in one unbuffered write
    (a buffered stderr written from a handler while a thread writes raises a reentrant-call error)."""
    if not _ENDING.acquire(blocking=False):
        return  # another thread is ending the process with its own line
    try:
        sys.stderr.flush()  # what the rank wrote before; from a handler that interrupted a write it may refuse
    except (RuntimeError, OSError, ValueError):
        pass
    try:
        os.write(2, f"error: rank {rank}: {why}; stopping this rank (restart the job)\n".encode())
    finally:  # whatever writing the line met (a full pipe), the rank ends, with no traceback of its own
        os._exit(ENDED)


def _quietly(end, *args) -> None:
    """A signal handler's body that ends the process: nothing it meets (a signal arriving while the process
    is already ending) prints a traceback over the one error line."""
    try:
        end(*args)
    except BaseException:  # noqa: BLE001  (a handler's last word: the rank ends either way)
        os._exit(ENDED)


def ring_addresses(hostfile: Optional[str] = None) -> Optional[list[tuple[str, int]]]:
    """Each rank's first ring address (ip, port) from `MLX_HOSTFILE`, or None (another backend, no file)."""
    text = os.environ.get("MLX_HOSTFILE", "") if hostfile is None else hostfile
    try:
        hosts = json.loads(open(text).read() if text and os.path.isfile(text) else text)
        return [(str(h[0]).rsplit(":", 1)[0], int(str(h[0]).rsplit(":", 1)[1])) for h in hosts]
    except (ValueError, TypeError, IndexError, OSError):
        return None


class RankWatch:
    """Heartbeats to and from every other rank; `lost` is called once a peer heard before is silent for `timeout` s."""

    def __init__(self, rank: int, addresses: list[tuple[str, int]], *, timeout: float = 5.0, interval: float = 0.25) -> None:
        self.rank, self.addresses, self.timeout, self.interval = rank, addresses, timeout, interval
        self.heard: dict[int, float] = {}
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind(("", addresses[rank][1]))
        self.socket.settimeout(interval)

    def start(self) -> "RankWatch":
        threading.Thread(target=self._run, name="mlx_dspark-rank-watch", daemon=True).start()
        return self

    def _run(self) -> None:
        beat = MAGIC + str(self.rank).encode()
        peers = [(r, a) for r, a in enumerate(self.addresses) if r != self.rank]
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                for _, address in peers:
                    try:
                        self.socket.sendto(beat, address)
                    except OSError:  # a peer's host unreachable for now: its silence is what counts
                        pass
                next_beat = now + self.interval
            try:
                data, _ = self.socket.recvfrom(64)
                if data.startswith(MAGIC):
                    self.heard[int(data[len(MAGIC):])] = time.monotonic()
            except (socket.timeout, ConnectionRefusedError, ValueError):
                pass
            silent = [(r, now - t) for r, t in self.heard.items() if now - t > self.timeout]
            if silent:
                peer, seconds = silent[0]
                lost(self.rank, f"rank {peer} has not answered for {seconds:.0f} s (it died or hung, or the network "
                                "between the ranks is down)")


def end_on_terminate(rank: int) -> None:
    """SIGTERM (mlx.launch stopping the job) becomes one error line, whatever the main thread is doing.
    Call from the main thread."""
    why = "mlx.launch stopped this rank (another rank ended first: its line says why; or the job was interrupted)"
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)  # the signal's number is written there as soon as it arrives
    # (repeated SIGTERMs fill the pair's buffer once the reader has ended the process: nothing to warn about)
    signal.signal(signal.SIGTERM, lambda *_: _quietly(lost, rank, why))

    def wait() -> None:
        while True:
            if signal.SIGTERM in reader.recv(16):  # other signals' numbers (SIGINT) are the main thread's
                lost(rank, why)

    threading.Thread(target=wait, name="mlx_dspark-sigterm", daemon=True).start()


def watch_ranks(rank: int, *, timeout: float = 5.0, terminate: bool = True) -> Optional[RankWatch]:
    """Start watching the other ranks of an `mlx.launch` ring job (and, with `terminate`, SIGTERM from it: the
    server's rank 0 keeps SIGTERM for its own shutdown); None where there is no ring hostfile."""
    if terminate:
        end_on_terminate(rank)
    addresses = ring_addresses()
    if addresses is None or len(addresses) < 2:
        return None
    try:
        watch = RankWatch(rank, addresses, timeout=timeout)
    except OSError as err:  # its UDP port taken (another job on this host): run without, said once
        print(f"warning: rank {rank}: no heartbeat on UDP port {addresses[rank][1]} ({err.strerror}); a rank that "
              "hangs is not detected in this job", file=sys.stderr, flush=True)
        return None
    return watch.start()
