"""The shared-memory segment of a CPU tensor-parallel group's collectives (shm_collectives.py):
one file in /dev/shm, created by rank 0 with its pages reserved, mapped by every rank at the
size it expects, and unlinked once every rank has mapped it, so nothing is left in /dev/shm
however the ranks end.
"""

from __future__ import annotations

import mmap
import os
import secrets

SEGMENT_DIR = "/dev/shm"
SEGMENT_PREFIX = "splitserve-tp-"


def new_segment_path() -> str:
    """A fresh name in SEGMENT_DIR: this process's pid and a random tail."""
    return os.path.join(SEGMENT_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")


def map_segment(path: str, nbytes: int, create: bool) -> mmap.mmap:
    """Map the segment: create it (exclusively, its pages reserved) or open one of exactly
    nbytes. OSError when it cannot be (no room, another /dev/shm, another size)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            # Reserve the pages now: a tmpfs that runs out later would SIGBUS a rank mid-step.
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise OSError(f"the segment has {os.fstat(fd).st_size} bytes, this rank expects {nbytes}")
        return mmap.mmap(fd, nbytes)
    except BaseException:
        if create:
            unlink_segment(path)
        raise
    finally:
        os.close(fd)


def unlink_segment(path: str) -> None:
    """Remove the segment's file (gone already is fine); the mappings stay valid."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
