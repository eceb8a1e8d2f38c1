"""This process's memory, as the tests that free pages measure it (Linux's /proc)."""

from pathlib import Path


def rss() -> int:
    """Bytes resident in this process now (/proc/self/status VmRSS)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024
