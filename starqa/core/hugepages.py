"""Huge pages for torch's large tensors, asked for the moment starqa is imported (before any
starqa process imports torch): `starqa/__init__.py` imports this module first, for its
effect."""

import os

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def ask_for_huge_pages(setting: str = THP_SETTING, environ=os.environ) -> None:
    """Torch's CPU allocator puts tensors of 2 MB or more in transparent huge pages when
    THP_MEM_ALLOC_ENABLE=1 (read once, at its first allocation: so here, before any starqa
    process imports torch; workers, servers and the head start inherit it). Where the
    kernel gives huge pages only on request (`[madvise]`), the KV, the weights and the ivf
    lists would otherwise sit in 4 KB pages, and top-k's reads of scattered lists and rows
    miss the TLB at nearly every one: SmolLM2 at 32K on a Zen 3, the top-k (ivf) kernel
    ~5% faster over the same keys in huge pages than in 4 KB ones (one process, alternating),
    and the top-k workers' peak memory 12-19% lower (docs/topk.md). A value the
    user set is kept (THP_MEM_ALLOC_ENABLE=0 turns it off)."""
    try:
        with open(setting) as fh:
            if "[madvise]" in fh.read():
                environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    except OSError:  # not Linux, or no THP: nothing to ask for
        pass


ask_for_huge_pages()
