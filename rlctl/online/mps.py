"""NVIDIA MPS pinned device-memory limits through ``nvidia-cuda-mps-control``.

The control binary, run without arguments, is the MPS control daemon's client: it reads commands
on its standard input, one per line, and prints the daemon's answers on its standard output. Each
call here runs it once with one command, as ``echo CMD | nvidia-cuda-mps-control`` does:

    set_default_device_pinned_mem_limit <dev> <value>      (prints nothing when it succeeds)
    get_default_device_pinned_mem_limit <dev>              (prints the limit: "2G", "2048M")
    set_device_pinned_mem_limit <server pid> <dev> <value>
    get_device_pinned_mem_limit <server pid> <dev>

``<value>`` is an integer followed by "G" or "M" (binary units); ``<dev>`` a device ordinal or
UUID. A set command that prints anything was refused, and the text is the daemon's reason; an
answer to a get command that is not a limit is an error too. With no daemon running the client
prints "Cannot find MPS control daemon process" and exits non-zero.

MPS applies a pinned-memory limit only to clients that start after it is set: the default binds
the MPS servers started next, a server's limit the clients that server starts next. So
``MPSLimit`` keeps the limit that the next engine process should start with in step with the
policy; it never resizes a running engine, and every report says so.

The default is daemon-wide: every MPS server started on the host afterwards takes it, not only
the next engine's; and an engine process whose user's server already runs joins that server and
takes the server's limit, not the default (each report names the servers running). ``apply`` reads
the default it replaces, and ``restore`` puts it back as the daemon showed it (``rlctl replay
--mps-next-limit`` does when the replay ends, on an error, a SIGTERM or a SIGHUP too; a SIGKILL or a
lost host leaves the new default in place). The daemon shows a default of 1 GiB or more in whole
GiB, so one set between whole GiB comes back rounded down, and the report says so. Where no
default is set (no command clears one again) or it cannot be read, ``apply`` changes nothing. A client can also carry a
limit of its own, in its environment (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G``), which touches no
one else: the GPU check (tests/gpu/checks.py) tests MPS that way.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

from rlctl.online.actuators import ActuatorReport, engine_memory_bytes

DEFAULT_BINARY = "nvidia-cuda-mps-control"
NOT_AVAILABLE = "MPS is not available"
# what a limit reaches, by where it is set (nvidia-cuda-mps-control(1)): a process of a user whose MPS
# server runs joins that server, so the default reaches it only through a server started later
NEXT_CLIENTS = {"default": "MPS applies it only to the MPS servers started from now on and their clients: an "
                           "engine process started while its user's server runs joins that server and takes the "
                           "server's limit, and a running engine keeps the limit it started with",
                "server": "MPS applies it only to clients started from now on: the next engine process of that "
                          "server's user takes it, and a running engine keeps the limit it started with"}
MiB, GiB = 1 << 20, 1 << 30
_UNITS = {"": 1, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}
_LIMIT = re.compile(r"(\d+)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_DEVICE = re.compile(r"[A-Za-z0-9-]+")  # an ordinal or a UUID ("GPU-...", "MIG-..."): nothing else reaches the daemon


def format_limit(nbytes: int) -> str:
    """``nbytes`` as the daemon takes it: whole GiB as "<n>G", else whole MiB as "<n>M" (rounded
    down: a limit never grows by rounding)."""
    nbytes = int(nbytes)
    if nbytes < MiB:
        raise ValueError(f"an MPS memory limit must be at least 1 MiB, got {nbytes} B")
    return f"{nbytes // GiB}G" if nbytes % GiB == 0 else f"{nbytes // MiB}M"


def parse_limit(text: str) -> int | None:
    """Bytes of a limit as the daemon prints it ("2G", "2048M"); None if ``text`` is not one."""
    m = _LIMIT.fullmatch(text.strip())
    return int(m.group(1)) * _UNITS[m.group(2).upper()] if m else None


CLIENT_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"  # a client's own limits, read when it starts


def client_limit_value(limits: dict[int | str, int]) -> str:
    """The value of ``CLIENT_LIMIT_ENV`` that pins a client's memory on each device of ``limits``
    (device ordinal or UUID -> bytes): ``"0=2048M"``, ``"0=2G,1=512M"``."""
    if not limits:
        raise ValueError("an MPS client limit needs at least one device")
    return ",".join(f"{MPSLimit._device(dev)}={format_limit(nbytes)}" for dev, nbytes in limits.items())


def parse_client_limit(value: str) -> dict[str, int]:
    """The limits (device -> bytes) a ``CLIENT_LIMIT_ENV`` value sets; ``ValueError`` names a bad entry."""
    limits = {}
    for entry in value.split(","):
        dev, sep, limit = entry.strip().partition("=")
        nbytes = parse_limit(limit) if sep else None
        if not _DEVICE.fullmatch(dev) or not nbytes or dev in limits:
            raise ValueError(f"{CLIENT_LIMIT_ENV}={value!r}: {entry.strip()!r} is not <device>=<limit> (such as "
                             "0=2048M), or names its device twice")
        limits[dev] = nbytes
    return limits


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


class MPSLimit:
    """Pinned device-memory limits of MPS clients, set and read back through the control binary.

    ``binary`` is the control binary's name or path (tests point it at a fake); ``env`` the
    environment it runs in (None: this process's, where ``CUDA_MPS_PIPE_DIRECTORY`` names the
    daemon to talk to).
    """

    name = "mps_pinned_mem_limit"

    def __init__(self, binary: str = DEFAULT_BINARY, timeout_s: float = 5.0, env: dict | None = None) -> None:
        self.binary, self.timeout_s, self.env = binary, timeout_s, env
        self._replaced: dict[str, ActuatorReport] = {}  # device -> the default read before the first apply set it
        self._timed_out = False  # whether the last command got no answer in time (whatever the daemon did with it)

    # ---- the control channel ------------------------------------------------------------------
    def _run(self, command: str) -> tuple[str | None, str]:
        """Send one command. Returns (why MPS is not available, or None; the daemon's answer)."""
        path = shutil.which(self.binary)
        if path is None:
            return f"{NOT_AVAILABLE}: {self.binary} was not found", ""
        self._timed_out = False
        try:
            done = subprocess.run([path], input=command + "\n", capture_output=True, text=True,
                                  timeout=self.timeout_s, env=self.env)
        except subprocess.TimeoutExpired:
            self._timed_out = True
            return f"{NOT_AVAILABLE}: the control daemon did not answer within {self.timeout_s:g} s", ""
        except OSError as exc:
            return f"{NOT_AVAILABLE}: {self.binary} could not be run ({exc})", ""
        answer = (done.stdout + done.stderr).strip()
        if "cannot find mps control daemon" in answer.lower():
            return f"{NOT_AVAILABLE}: the control daemon is not running ({answer})", answer
        if done.returncode != 0:
            return f"{NOT_AVAILABLE}: {self.binary} exited with status {done.returncode}" + (
                f" ({answer})" if answer else ""), answer
        return None, answer

    def available(self) -> str | None:
        """None when a control daemon answers, else why MPS is not available."""
        return self._run("get_server_list")[0]

    def server_pids(self) -> list[int]:
        """PIDs of the MPS servers running now (``get_server_list``); empty if none or unavailable."""
        reason, answer = self._run("get_server_list")
        return [] if reason else [int(t) for t in answer.split() if t.isdigit()]

    @staticmethod
    def _device(device: int | str) -> str:
        dev = str(device)
        if not _DEVICE.fullmatch(dev):
            raise ValueError(f"MPS device must be an ordinal or a UUID, got {device!r}")
        return dev

    @staticmethod
    def _pid(pid: int) -> str:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"MPS server pid must be a positive integer, got {pid!r}")
        return str(pid)

    # ---- get / set ----------------------------------------------------------------------------
    def _get(self, command: str, what: str) -> ActuatorReport:
        reason, answer = self._run(command)
        if reason:
            return ActuatorReport(self.name, False, reason)
        nbytes = parse_limit(answer)
        if nbytes is None:
            return ActuatorReport(self.name, False, f"the MPS control daemon answered {command!r} with: {answer!r}")
        shown = "no limit" if nbytes == 0 else f"{answer} ({_gib(nbytes)})"
        return ActuatorReport(self.name, True, f"{what}: {shown}", nbytes)

    def _set(self, set_command: str, get_command: str, what: str, nbytes: int, reaches: str) -> ActuatorReport:
        value = format_limit(nbytes)
        reason, answer = self._run(f"{set_command} {value}")
        # whether the daemon may have taken it: no answer in time, or taken and not read back (``unknown``)
        unknown = {"requested": value, "requested_bytes": parse_limit(value), "outcome": "unknown"}
        if reason:
            return ActuatorReport(self.name, False, reason, unknown if self._timed_out else None)
        if answer:
            return ActuatorReport(self.name, False, f"the MPS control daemon refused {set_command} {value}: {answer}")
        read = self._get(get_command, what)
        if not read.applied:
            return ActuatorReport(self.name, False, f"{what} set to {value}, but reading it back failed: {read.detail}",
                                  unknown)
        detail = f"{what} set to {value}, read back {_gib(read.value)}"
        if read.value != parse_limit(value):
            detail += " (the daemon shows it coarser than it was set)"
        return ActuatorReport(self.name, True, f"{detail}; {NEXT_CLIENTS[reaches]}", {
            "requested": value, "requested_bytes": parse_limit(value), "read_back_bytes": read.value})

    def get_default(self, device: int | str = 0) -> ActuatorReport:
        dev = self._device(device)
        return self._get(f"get_default_device_pinned_mem_limit {dev}", f"default pinned memory limit of device {dev}")

    def set_default(self, nbytes: int, device: int | str = 0) -> ActuatorReport:
        """The daemon-wide default limit on ``device`` for the MPS servers (and so every client)
        started next on this host."""
        dev = self._device(device)
        return self._set(f"set_default_device_pinned_mem_limit {dev}", f"get_default_device_pinned_mem_limit {dev}",
                         f"daemon-wide default pinned memory limit of device {dev}", nbytes, "default")

    def get_server(self, server_pid: int, device: int | str = 0) -> ActuatorReport:
        pid, dev = self._pid(server_pid), self._device(device)
        return self._get(f"get_device_pinned_mem_limit {pid} {dev}",
                         f"pinned memory limit of MPS server {pid} on device {dev}")

    def set_server(self, server_pid: int, nbytes: int, device: int | str = 0) -> ActuatorReport:
        """The limit on ``device`` for the clients that MPS server ``server_pid`` starts next."""
        pid, dev = self._pid(server_pid), self._device(device)
        return self._set(f"set_device_pinned_mem_limit {pid} {dev}", f"get_device_pinned_mem_limit {pid} {dev}",
                         f"pinned memory limit of MPS server {pid} on device {dev}", nbytes, "server")

    # ---- the policy's side ----------------------------------------------------------------------
    def apply(self, nbytes: int, device: int | str = 0) -> ActuatorReport:
        """Keep the default limit for the next engine process at ``nbytes``. The first time it
        sets the default on a device, the default it replaces is kept for ``restore`` before the set
        goes out (whether the daemon took a set that failed cannot be told); a
        default that could not be put back (none set, which no command restores, or one that
        cannot be read) is left alone, and the report says how to give the engine its own limit."""
        dev = self._device(device)
        before = self.get_default(dev) if dev not in self._replaced else None
        if before is not None and not before.applied and before.detail.startswith(NOT_AVAILABLE):
            return before  # no daemon to talk to: nothing changed, and the report says why
        if before is not None and (not before.applied or before.value < MiB):
            was = "no limit" if before.applied else f"unreadable: {before.detail}"
            return ActuatorReport(self.name, False, (
                f"daemon-wide default pinned memory limit of device {dev} not changed: the default there ({was}) "
                "could not be put back afterwards, and every MPS server started on this host would keep the new "
                f"one; give the engine process its own limit instead ({CLIENT_LIMIT_ENV}={dev}=<limit> in its "
                "environment)"))
        if before is not None:  # kept before the set: one the daemon took without an answer in time (or a
            self._replaced[dev] = before  # signal while it was on its way) is put back too
        report = self.set_default(nbytes, dev)
        if not report.applied:
            if before is None:
                return report
            if not (isinstance(report.value, dict) and report.value.get("outcome") == "unknown"):
                del self._replaced[dev]  # refused, or never sent: the default is as it was, nothing to put back
                return report
            return dataclasses.replace(report, detail=(
                f"{report.detail}; the set may have reached the daemon, so the default it would replace "
                f"({_gib(before.value)}) is put back at the end all the same"))
        notes = [report.detail]
        servers = self.server_pids()
        if servers:  # the default does not reach a process that joins one of these
            notes.append(f"MPS servers running now: {', '.join(map(str, servers))}, so an engine process of their "
                         "users started before they exit joins one and does not take this default")
        if before is not None and before.value >= GiB and before.value % GiB == 0:
            notes.append(f"the default it replaced showed {_gib(before.value)}, and the daemon shows a default of "
                         "1 GiB or more in whole GiB: one set between whole GiB is put back rounded down to that")
        return dataclasses.replace(report, detail="; ".join(notes))

    def restore(self) -> list[ActuatorReport]:
        """Put back every default ``apply`` changed, as it was before; a report per device, saying
        why not where it cannot."""
        reports = []
        for dev, before in self._replaced.items():  # each a limit read back (apply changes no other)
            report = self.set_default(before.value, dev)
            reports.append(dataclasses.replace(report, detail=f"restored (as the daemon showed it before): "
                                                              f"{report.detail}"))
        self._replaced.clear()
        return reports

    def apply_for(self, engine, device: int | str = 0, margin_bytes: int = 512 * MiB) -> ActuatorReport:
        """The limit the next process of ``engine``'s shape needs: its weights, workspace and KV
        capacity (``engine_memory_bytes``) plus ``margin_bytes`` (the CUDA context, library workspaces)."""
        return self.apply(engine_memory_bytes(engine) + margin_bytes, device)
