/*
 * The staging copy's inner loop: many (destination, source, length) pieces,
 * copied with non-temporal stores, which write whole cache lines to memory
 * without reading them first. Why: slurm_ckpt/engine/memcopy.py.
 *
 * No Python API: memcopy.py loads this with ctypes, whose foreign calls
 * release the GIL, and falls back to ctypes.memmove where it was not built.
 * The pieces never overlap (a state's tensors into a buffer of our own), so
 * this is memcpy, not memmove.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) /* every x86-64 CPU */
#include <emmintrin.h>
#define NONTEMPORAL 1
#else
#define NONTEMPORAL 0
#endif

struct piece {
    uint64_t dst, src, len;
};

/* Below this a piece (or the part of one in a claimed chunk) is copied through
 * the cache: too short for whole lines to pay. */
enum { STREAM_MIN = 4096 };
/* stream() copies up to 63 bytes before its first whole line. */
_Static_assert(STREAM_MIN >= 64, "stream() needs at least a line");

int sckpt_nontemporal(void) { return NONTEMPORAL; }

#if NONTEMPORAL
static void stream(char *dst, const char *src, size_t len) {
    size_t head = -(uintptr_t)dst & 63; /* up to the destination's next cache line */
    memcpy(dst, src, head);
    dst += head, src += head, len -= head;
    for (size_t lines = len / 64; lines; lines--) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        dst += 64, src += 64;
    }
    memcpy(dst, src, len & 63);
}
#endif

/* One piece: through the cache if it is short, else streamed. */
static void copy_one(char *dst, const char *src, size_t len) {
#if NONTEMPORAL
    if (len >= STREAM_MIN) {
        stream(dst, src, len);
        return;
    }
#endif
    memcpy(dst, src, len);
}

/* Copy every piece; those of STREAM_MIN bytes or more bypass the cache. On
 * return, this thread's bytes are visible to other threads and to devices.
 *
 * Every thread that calls this with the same arguments shares the copy (one
 * alone copies it all): the pieces, end to end, are one run of bytes cut into
 * chunks of `chunk` bytes, and each thread copies whichever chunk nobody has
 * claimed yet (`*cursor`, zero at the start, counts the bytes claimed). A
 * thread that starts late or runs slow copies fewer chunks, so all of them
 * finish within about a chunk's copy of one another, where an even split in
 * advance makes the trainer wait for the slowest. */
void sckpt_copy_shared(const struct piece *pieces, size_t count, uint64_t *cursor, uint64_t chunk) {
    if (chunk == 0) /* no chunk would ever reach the end */
        chunk = 1;
    size_t i = 0;     /* the piece that holds the claimed chunk's first byte */
    uint64_t at = 0;  /* where piece i starts in the run */
    for (;;) {
        uint64_t lo = __atomic_fetch_add(cursor, chunk, __ATOMIC_RELAXED);
        uint64_t hi = lo + chunk;
        while (i < count && at + pieces[i].len <= lo) /* claims only grow: never look back */
            at += pieces[i++].len;
        if (i == count)
            break;
        uint64_t k_at = at;
        for (size_t k = i; k < count && k_at < hi; k_at += pieces[k++].len) {
            uint64_t from = lo > k_at ? lo - k_at : 0;
            uint64_t to = hi - k_at < pieces[k].len ? hi - k_at : pieces[k].len;
            copy_one((char *)(uintptr_t)(pieces[k].dst + from), (const char *)(uintptr_t)(pieces[k].src + from),
                     (size_t)(to - from));
        }
    }
#if NONTEMPORAL
    /* Non-temporal stores are weakly ordered: fence them before the caller
     * hands the buffer to another thread or to a device. */
    _mm_sfence();
#endif
}
