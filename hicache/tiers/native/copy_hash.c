/* Copy pages and hash them in one call, for the storage tier's reader and writer threads.
 *
 * hicache_copy_hash_segments copies n buffers, each into one or more destinations, and computes
 * the XXH3-64 of every buffer in the same pass: chunk by chunk, each chunk hashed right after it
 * is copied, while it is still in the CPU's caches. XXH3 itself is not here: the caller
 * passes the streaming functions of the xxHash library it already has (python-xxhash's
 * extension module exports them), so the values are exactly xxHash's. Called through
 * ctypes, which releases the GIL for the whole call: a reader thread needs the GIL once per
 * group of pages instead of twice per page. Thread-safe: no state outside the call.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

/* hicache_copy_hash_segments copies n sources, each into its own run of destinations: source i's
 * nbytes[i] bytes go, in order, to the nseg[i] destinations dst[k] of seg[k] bytes each (k running on
 * across sources; their sizes sum to nbytes[i]), and out[i] is the XXH3-64 of source i's bytes. (A
 * page: one destination; a hybrid SWA model's whole L3 value: its full layers' rows go to the L2 page,
 * its sliding layers' to the host window page.) A NULL
 * destination takes no copy: its bytes are hashed from the source. fns: XXH3_createState,
 * XXH3_freeState, XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest. Returns 0, or -1 when
 * the hash state could not be allocated (nothing copied then). */
int hicache_copy_hash_segments(size_t n, void *const *src, const size_t *nbytes, const size_t *nseg,
                               void *const *dst, const size_t *seg, size_t chunk, uint64_t *out,
                               void *const *fns) {
    create_fn create = (create_fn)fns[0];
    free_fn release = (free_fn)fns[1];
    reset_fn reset = (reset_fn)fns[2];
    update_fn update = (update_fn)fns[3];
    digest_fn digest = (digest_fn)fns[4];
    void *state = create();
    if (state == NULL) return -1;
    if (chunk == 0) chunk = (size_t)1 << 17;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const char *s = (const char *)src[i];
        size_t done = 0;
        reset(state);
        for (size_t j = 0; j < nseg[i]; j++, k++) {
            char *d = (char *)dst[k];
            size_t total = seg[k];
            if (done + total > nbytes[i]) total = nbytes[i] - done; /* never past the source */
            for (size_t off = 0; off < total; off += chunk) {
                size_t len = total - off < chunk ? total - off : chunk;
                if (d != NULL) {
                    memcpy(d + off, s + done + off, len);
                    update(state, d + off, len);
                } else {
                    update(state, s + done + off, len);
                }
            }
            done += total;
        }
        if (done < nbytes[i]) update(state, s + done, nbytes[i] - done); /* (segments too short: hashed) */
        out[i] = digest(state);
    }
    release(state);
    return 0;
}
