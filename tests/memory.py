"""This process's memory, as the tests that free pages measure it (Linux's /proc)."""

from pathlib import Path


def rss() -> int:
    """Bytes resident in this process now (/proc/self/status VmRSS)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def mapped_pages(address: int, length: int) -> int:
    """Pages of [address, address + length) mapped in this process now (/proc/self/pagemap's
    present bit): a range's own pages, where a mapping's Rss counts the whole mapping."""
    import mmap
    import struct

    first, count = address // mmap.PAGESIZE, length // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(first * 8)
        entries = struct.unpack(f"{count}Q", fh.read(count * 8))
    return sum(entry >> 63 for entry in entries)
