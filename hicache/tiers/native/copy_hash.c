/* Copy pages and hash them in one call, for the storage tier's reader and writer threads.
 *
 * hicache_copy_hash copies n buffers (src[i] -> dst[i], nbytes[i] each) and computes the
 * XXH3-64 of every copy in the same pass: chunk by chunk, each chunk hashed right after it
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

/* fns: XXH3_createState, XXH3_freeState, XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest.
 * Returns 0, or -1 when the hash state could not be allocated (nothing copied then). */
int hicache_copy_hash(size_t n, void *const *src, void *const *dst, const size_t *nbytes, size_t chunk,
                      uint64_t *out, void *const *fns) {
    create_fn create = (create_fn)fns[0];
    free_fn release = (free_fn)fns[1];
    reset_fn reset = (reset_fn)fns[2];
    update_fn update = (update_fn)fns[3];
    digest_fn digest = (digest_fn)fns[4];
    void *state = create();
    if (state == NULL) return -1;
    if (chunk == 0) chunk = (size_t)1 << 17;
    for (size_t i = 0; i < n; i++) {
        const char *s = (const char *)src[i];
        char *d = (char *)dst[i];
        reset(state);
        for (size_t off = 0; off < nbytes[i]; off += chunk) {
            size_t len = nbytes[i] - off < chunk ? nbytes[i] - off : chunk;
            memcpy(d + off, s + off, len);
            update(state, d + off, len);
        }
        out[i] = digest(state);
    }
    release(state);
    return 0;
}
