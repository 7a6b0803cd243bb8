"""What the sidecar may be asked to serve, and by whom (docs/design.md, "Online").

The operator's ``rlctl serve --policy`` is trusted: a path on the command line (or, with
``--allow-baselines``, a baseline spec). A client's ``ReloadPolicy`` is not: it names a policy
file inside the operator's ``--policy-dir`` (``steady`` or ``steady.rlpolicy``), nothing else.
Without ``--policy-dir`` reloading is off; a baseline spec (``static:K``, ``watermark``, ...) is
served or reloaded only with ``--allow-baselines``, so that no client can switch an engine to
``random`` or ``static:1e9``.

A name that is not a plain file name, a missing file, a directory, a FIFO, a symlink leading out
of the directory: every one gets ``NoSuchPolicy`` with the same words, so that a client learns
nothing about files outside the directory (whether they exist, what they are, how big). A file
inside it is opened once and read from that descriptor, capped at ``max_bytes``
(agents/export.py ``read_capped``), so a big file is never read whole.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from agents.export import MAX_POLICY_BYTES, POLICY_SUFFIX


class NoSuchPolicy(LookupError):
    """A reload's name does not lead to a policy file inside the policy directory (why is not said)."""

    def __init__(self) -> None:
        super().__init__(f"no policy by that name in the sidecar's policy directory (a name is a file name "
                         f"there, e.g. steady or steady{POLICY_SUFFIX})")


class ReloadOff(PermissionError):
    """The sidecar was started without ``--policy-dir``."""


class BaselineRefused(PermissionError):
    """A baseline spec, and the sidecar was started without ``--allow-baselines``."""


@dataclass(frozen=True)
class Confinement:
    """What ``rlctl serve`` was told to allow: where reloads come from (None: reloads are off),
    whether baseline specs may be served, and how big a policy file may be."""

    policy_dir: Path | None = None  # resolved, by policy_dir()
    allow_baselines: bool = False
    max_bytes: int = MAX_POLICY_BYTES

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"the policy file size cap must be > 0 bytes, got {self.max_bytes}")


def policy_dir(path: str | Path) -> Path:
    """``--policy-dir``, resolved once at startup (symlinks included): reloads must stay inside it."""
    root = Path(path).resolve()
    if not root.is_dir():
        raise ValueError(f"--policy-dir {path}: not a directory")
    return root


def _file_name(name: str) -> str:
    """The file a reload's name means; ``NoSuchPolicy`` for anything but a plain file name."""
    if (not isinstance(name, str) or not name or "/" in name or "\\" in name or "\0" in name
            or name.startswith(".") or len(name.encode("utf-8", "surrogatepass")) > 255):
        raise NoSuchPolicy()  # absolute paths, ../x, hidden and temporary files (export's .NAME.PID.tmp)
    return name if name.endswith(POLICY_SUFFIX) else name + POLICY_SUFFIX


def _inside(root: Path, path: str) -> bool:
    return Path(path).is_relative_to(root) and Path(path) != root


def open_policy(root: Path, name: str) -> tuple[BinaryIO, str]:
    """The policy file ``name`` inside ``root``, opened for reading, and its file name."""
    file_name = _file_name(name)
    real = os.path.realpath(root / file_name)  # symlinks resolved: one leading out is refused before opening
    if not _inside(root, real):
        raise NoSuchPolicy()
    try:
        # O_NONBLOCK: a FIFO must not hang the reload; O_NOFOLLOW: the resolved path is no symlink,
        # unless one was swapped in since, which is then refused
        fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        raise NoSuchPolicy() from None
    try:
        opened = _opened_path(fd)  # what was opened, if a directory on the way was swapped for a link meanwhile
        if not stat.S_ISREG(os.fstat(fd).st_mode) or (opened is not None and not _inside(root, opened)):
            raise NoSuchPolicy()
        return os.fdopen(fd, "rb"), file_name
    except BaseException:
        os.close(fd)
        raise


def _opened_path(fd: int) -> str | None:
    """The path of the file behind ``fd`` (Linux's /proc), or None where the system does not say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
