/* The top-k kernel's walk over a list's keys (_topk.h): a list's positions within a span,
   cut where the key buffers change, each piece scanned (and, for keys on disk, its pages
   dropped behind the scan) or only asked into the cache ahead of its scan. */

#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "_topk.h"

/* Drops the pages wholly inside [from, to) from this process (MADV_DONTNEED): for buffers
   that are clean private file mappings (--kv-on-disk) only, whose pages a later read maps
   again from the page cache. The pages at either end, which may hold rows another task
   still reads, are kept (the caller releases the layer's pages after its call). */
static void drop_pages(const char *from, const char *to) {
#ifdef MADV_DONTNEED
    const long size = sysconf(_SC_PAGESIZE), page = size > 0 ? size : 4096;
    const uintptr_t a = ((uintptr_t)from + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page;
    const uintptr_t b = (uintptr_t)to / (uintptr_t)page * (uintptr_t)page;
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
#else
    (void)from;
    (void)to;
#endif
}

void topk_list_range(const starqa_lists *lists, int64_t n, int64_t c, int64_t h, int64_t a,
                     int64_t b, int64_t *lo, int64_t *hi) {
    const int64_t *offsets = lists->offsets;
    const int64_t first = offsets ? offsets[h * (lists->count + 1) + c] : 0;
    const int64_t last = offsets ? offsets[h * (lists->count + 1) + c + 1] : n;
    *lo = first > a ? first : a;
    *hi = last < b ? last : b;
}

/* The piece of head h's keys (D elements each) from position lo up to hi or to the end of
   lo's buffer, whichever is first: its address, and its end in *end. */
static const char *piece_at(const starqa_buffers *keys, int64_t h, int64_t d, int64_t lo,
                            int64_t hi, int64_t *end) {
    const int64_t kb = buffer_of(keys->start, keys->count, lo);
    const size_t kes = keys->bf16 ? 2 : 4;
    *end = hi < keys->start[kb + 1] ? hi : keys->start[kb + 1];
    return (const char *)(intptr_t)keys->ptr[kb] +
           ((size_t)(h * keys->stride[kb]) + (size_t)(lo - keys->start[kb]) * d) * kes;
}

void topk_scan_list(const starqa_buffers *keys, int64_t h, int64_t lo, int64_t hi, int64_t c,
                    const scan_rows *rows, int drop) {
    const size_t row_bytes = (size_t)rows->d * (keys->bf16 ? 2 : 4);
    while (lo < hi) {
        int64_t end;
        const char *base = piece_at(keys, h, rows->d, lo, hi, &end);
        topk_scan(base, row_bytes, keys->bf16, lo, end, c, rows);
        if (drop) drop_pages(base, base + (size_t)(end - lo) * row_bytes);
        lo = end;
    }
}

void topk_prefetch_list(const starqa_buffers *keys, int64_t h, int64_t d, int64_t lo,
                        int64_t hi) {
    const size_t row_bytes = (size_t)d * (keys->bf16 ? 2 : 4);
    while (lo < hi) {
        int64_t end;
        const char *base = piece_at(keys, h, d, lo, hi, &end);
        if (end - lo <= PREFETCH_KEYS)
            for (size_t y = 0; y < (size_t)(end - lo) * row_bytes; y += 64)
                __builtin_prefetch(base + y, 0, TO_L2);
        lo = end;
    }
}
