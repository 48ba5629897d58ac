"""The host's memory as /proc/meminfo reports it (Linux; None elsewhere)."""

from __future__ import annotations


def host_free_now() -> int | None:
    """The host's MemAvailable in bytes, or None when unknown."""
    return _meminfo("MemAvailable")


def host_memory_total() -> int | None:
    """Total host memory in bytes (MemTotal), or None when unknown."""
    return _meminfo("MemTotal")


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
