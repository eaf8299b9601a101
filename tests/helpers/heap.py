"""Bytes the C heap holds right now (glibc mallinfo2: arena + mmapped chunks), where torch's CPU
tensors live: a test samples it while code runs to bound peak memory."""

from __future__ import annotations

import ctypes


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_bytes_in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd
