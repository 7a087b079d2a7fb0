/* kvstore._copyhash: copy bytes and take their xxh3-64 in one pass over them.
 *
 * Runs wherever a block's bytes are copied and checked: the worker (loads out of the shared
 * arena, saves into it), the SGLang backend's host-pool copies, the node agent. A `Hasher` is
 * a streaming xxh3-64 (the digest python-xxhash's xxh3_64 gives for the same bytes, however
 * they are split) with one more verb, `copy(destination, source)`: each 64-byte stripe is
 * loaded once, stored into the destination and fed to the hash from the same register, so the
 * digest is of the bytes the destination received, and the hash costs no second pass over
 * memory. On x86-64 with AVX2 the loop is fused in registers and prefetches the source ahead
 * (a long copy of an engine's KV rows into a payload streams its stores past the cache: no
 * line is read before it is written);
 * elsewhere it copies 16 KiB at a time and hashes it from L1 with xxHash's own vector code.
 *
 * The state follows XXH3's streaming state (xxhash.h, vendored): 8 accumulators, the stripe
 * count within a 1 KiB block, a buffer of the bytes not yet consumed (under a stripe, or up to
 * 256 bytes before any is consumed: shorter inputs hash otherwise), and the last stripe
 * consumed, which the digest's last stripe may reach back into. XXH3 leaves the input's final
 * whole stripe out of its loop; here every whole stripe of a piece is consumed at once, and
 * when a piece ends on a stripe boundary the accumulators from before its last stripe are kept
 * (`before_last`), for the digest to go back to if no byte follows. So pieces of any length,
 * the runs of a strided copy among them, each make one pass of the fused loop, and the digest
 * equals XXH3_64bits over the whole input however it was split.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define HAVE_AVX2_PATH 1
#include <immintrin.h>
#endif

/* A source page may change under the copy (another process reuses it): what is hashed must be
 * what was written, never a second read of the source. The barriers keep a compiler from
 * re-loading a stripe from the source for the hash, or from reading the source for what the
 * code reads back from the destination. */
#if defined(__GNUC__)
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")
#define REGISTER_BARRIER(value) __asm__ volatile("" : "+x"(value))
#else
#define MEMORY_BARRIER() ((void)0)
#define REGISTER_BARRIER(value) ((void)0)
#endif

#define STRIPE 64
#define STRIPES_PER_BLOCK 16             /* (sizeof(XXH3_kSecret) - STRIPE) / 8 */
#define SECRET_LIMIT 128                 /* sizeof(XXH3_kSecret) - STRIPE */
#define BUFFER_BYTES 256
#define PREFETCH_BYTES 1024              /* measured: 256-8192 all hide the DRAM latency */
#define RELEASE_GIL_BYTES (64 << 10)
#define PORTABLE_GROUP_STRIPES 256       /* 16 KiB: copied, then hashed while in L1 */

enum isa { ISA_PORTABLE = 0, ISA_AVX2 = 1 };
static const char *const ISA_NAMES[] = {"portable", "avx2"};

typedef struct { /* inside a Python object, so only 8- or 16-byte aligned: xxHash's vector
                   code runs on aligned copies of the accumulators (consume_stripes, digest) */
    xxh_u64 acc[8];
    xxh_u8 buffer[BUFFER_BYTES];
    xxh_u8 last_consumed[STRIPE];
    xxh_u64 before_last[8];                /* acc before the last stripe, if nothing follows it */
    int last_is_final;                     /* no byte after the last consumed stripe yet */
    xxh_u64 total_bytes;
    size_t buffered;
    size_t stripes_in_block;
} hash_state;

typedef struct {
    PyObject_HEAD
    hash_state state;
    enum isa isa;
    int busy;
} Hasher;

static const xxh_u64 INIT_ACC[8] = XXH3_INIT_ACC;

static void state_reset(hash_state *s) {
    memcpy(s->acc, INIT_ACC, sizeof(s->acc));
    s->total_bytes = 0;
    s->buffered = 0;
    s->stripes_in_block = 0;
    s->last_is_final = 0;
}

static void keep_before_last(hash_state *s) {
    memcpy(s->before_last, s->acc, sizeof(s->acc));
}

/* Feed `count` stripes at `input` (xxHash's compiled-in vector code, which needs its
 * accumulators aligned: it runs on an aligned copy), scrambling after each full block, as
 * XXH3_consumeStripes does. */
static void consume_stripes(xxh_u64 *state_acc, size_t *stripes_in_block, const xxh_u8 *input,
                            size_t count) {
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[8];
    memcpy(acc, state_acc, sizeof(acc));
    for (size_t i = 0; i < count; i++, input += STRIPE) {
        XXH3_accumulate_512(acc, input, XXH3_kSecret + *stripes_in_block * XXH_SECRET_CONSUME_RATE);
        if (++*stripes_in_block == STRIPES_PER_BLOCK) {
            XXH3_scrambleAcc(acc, XXH3_kSecret + SECRET_LIMIT);
            *stripes_in_block = 0;
        }
    }
    memcpy(state_acc, acc, sizeof(acc));
}

/* Portable bulk: copy a group of stripes, then hash them from the destination (still in L1). */
static void copy_stripes_portable(hash_state *s, xxh_u8 *dst, const xxh_u8 *src, size_t count) {
    while (count) {
        size_t now = PORTABLE_GROUP_STRIPES;
        if (now > count) now = count;
        if (dst != src) memcpy(dst, src, now * STRIPE);
        MEMORY_BARRIER();
        consume_stripes(s->acc, &s->stripes_in_block, dst, now);
        dst += now * STRIPE;
        src += now * STRIPE;
        count -= now;
    }
}

#ifdef HAVE_AVX2_PATH
#define AVX2 __attribute__((target("avx2"), always_inline)) static inline

AVX2 __m256i accumulate_avx2(__m256i acc, __m256i data, const xxh_u8 *secret) {
    __m256i data_key = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)secret));
    __m256i data_key_lo = _mm256_shuffle_epi32(data_key, _MM_SHUFFLE(0, 3, 0, 1));
    __m256i product = _mm256_mul_epu32(data_key, data_key_lo);
    __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(product, _mm256_add_epi64(acc, swapped));
}

AVX2 __m256i scramble_avx2(__m256i acc, const xxh_u8 *secret) {
    const __m256i prime32 = _mm256_set1_epi32((int)XXH_PRIME32_1);
    __m256i data = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
    __m256i data_key = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)secret));
    __m256i low = _mm256_mul_epu32(data_key, prime32);
    __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(data_key, 32), prime32);
    return _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
}

/* One stripe: loaded once, stored (`store`: 0 not, 1 through the cache, 2 streamed around
 * it, `dst` 32-byte aligned) and hashed from the same registers. */
AVX2 void fused_stripe(__m256i *low, __m256i *high, size_t *in_block, xxh_u8 *dst,
                       const xxh_u8 *src, int store) {
    __m256i first = _mm256_loadu_si256((const __m256i *)src);
    __m256i second = _mm256_loadu_si256((const __m256i *)(src + 32));
    REGISTER_BARRIER(first);
    REGISTER_BARRIER(second);
    if (store == 2) {
        _mm256_stream_si256((__m256i *)dst, first);
        _mm256_stream_si256((__m256i *)(dst + 32), second);
    } else if (store) {
        _mm256_storeu_si256((__m256i *)dst, first);
        _mm256_storeu_si256((__m256i *)(dst + 32), second);
    }
    const xxh_u8 *secret = XXH3_kSecret + *in_block * XXH_SECRET_CONSUME_RATE;
    *low = accumulate_avx2(*low, first, secret);
    *high = accumulate_avx2(*high, second, secret + 32);
    if (++*in_block == STRIPES_PER_BLOCK) {
        *low = scramble_avx2(*low, XXH3_kSecret + SECRET_LIMIT);
        *high = scramble_avx2(*high, XXH3_kSecret + SECRET_LIMIT + 32);
        *in_block = 0;
    }
}

AVX2 void keep_before_last_avx2(hash_state *s, __m256i low, __m256i high) {
    _mm256_storeu_si256((__m256i *)s->before_last, low);
    _mm256_storeu_si256((__m256i *)(s->before_last + 4), high);
}

/* Fused bulk over one piece; the accumulators are kept before stripe `keep_before` (none
 * when it is `count` or more). */
__attribute__((target("avx2"))) static void copy_stripes_avx2(hash_state *s, xxh_u8 *dst,
                                                             const xxh_u8 *src, size_t count,
                                                             size_t keep_before) {
    const int copying = dst != src;
    __m256i low = _mm256_loadu_si256((const __m256i *)s->acc);
    __m256i high = _mm256_loadu_si256((const __m256i *)(s->acc + 4));
    size_t in_block = s->stripes_in_block;
    for (size_t i = 0; i < count; i++, src += STRIPE, dst += STRIPE) {
        if (i + PREFETCH_BYTES / STRIPE < count) /* within the piece: past it is someone else's */
            _mm_prefetch((const char *)src + PREFETCH_BYTES, _MM_HINT_T0);
        if (i == keep_before) keep_before_last_avx2(s, low, high);
        fused_stripe(&low, &high, &in_block, dst, src, copying);
    }
    _mm256_storeu_si256((__m256i *)s->acc, low);
    _mm256_storeu_si256((__m256i *)(s->acc + 4), high);
    s->stripes_in_block = in_block;
}

/* The fused loop's copy without its hash: a limit for benchmarks to compare with. */
__attribute__((target("avx2"))) static void plain_copy_avx2(xxh_u8 *dst, const xxh_u8 *src,
                                                           size_t length) {
    size_t count = length / STRIPE;
    for (size_t i = 0; i < count; i++, src += STRIPE, dst += STRIPE) {
        if (i + PREFETCH_BYTES / STRIPE < count)
            _mm_prefetch((const char *)src + PREFETCH_BYTES, _MM_HINT_T0);
        __m256i first = _mm256_loadu_si256((const __m256i *)src);
        __m256i second = _mm256_loadu_si256((const __m256i *)(src + 32));
        _mm256_storeu_si256((__m256i *)dst, first);
        _mm256_storeu_si256((__m256i *)(dst + 32), second);
    }
    memcpy(dst, src, length % STRIPE);
}
#endif

static void plain_copy(enum isa isa, xxh_u8 *dst, const xxh_u8 *src, size_t length) {
#ifdef HAVE_AVX2_PATH
    if (isa == ISA_AVX2) {
        plain_copy_avx2(dst, src, length);
        return;
    }
#endif
    (void)isa;
    memcpy(dst, src, length);
}

/* Consume `count` stripes (copying them, unless dst == src) and remember the last one; if it
 * ends the input so far (`final`), keep the accumulators from before it. */
static void copy_stripes(hash_state *s, enum isa isa, xxh_u8 *dst, const xxh_u8 *src,
                         size_t count, int final) {
#ifdef HAVE_AVX2_PATH
    if (isa == ISA_AVX2) {
        copy_stripes_avx2(s, dst, src, count, final ? count - 1 : count);
    } else
#endif
    {
        (void)isa;
        copy_stripes_portable(s, dst, src, count - final);
        if (final) {
            keep_before_last(s);
            copy_stripes_portable(s, dst + (count - 1) * STRIPE, src + (count - 1) * STRIPE, 1);
        }
    }
    MEMORY_BARRIER();
    memcpy(s->last_consumed, dst + (count - 1) * STRIPE, STRIPE);
    s->last_is_final = final;
}

static void take(hash_state *s, xxh_u8 *dst, const xxh_u8 *src, size_t length) {
    if (dst != src) memcpy(dst, src, length);
    MEMORY_BARRIER();
    memcpy(s->buffer + s->buffered, dst, length);
    s->buffered += length;
}

/* Copy `length` bytes of `src` into `dst` (dst == src: hash only) and hash them. Whatever is
 * hashed is read from `dst` or from the register stored into it: the digest is of the copy. */
static void update(hash_state *s, enum isa isa, xxh_u8 *dst, const xxh_u8 *src, size_t length) {
    if (length == 0) return;
    s->total_bytes += length;
    if (s->total_bytes <= BUFFER_BYTES) { /* nothing is consumed before 256 bytes */
        take(s, dst, src, length);
        return;
    }
    s->last_is_final = 0; /* bytes follow it now */
    size_t fill = (STRIPE - s->buffered % STRIPE) % STRIPE; /* complete a partial stripe */
    if (fill > length) fill = length;
    take(s, dst, src, fill);
    dst += fill, src += fill, length -= fill;
    if (s->buffered % STRIPE == 0 && s->buffered) {
        copy_stripes(s, isa, s->buffer, s->buffer, s->buffered / STRIPE, length == 0);
        s->buffered = 0;
    }
    if (length >= STRIPE) {
        size_t count = length / STRIPE;
        copy_stripes(s, isa, dst, src, count, length % STRIPE == 0);
        dst += count * STRIPE, src += count * STRIPE, length -= count * STRIPE;
    }
    take(s, dst, src, length);
}

static xxh_u64 digest(const hash_state *s) {
    if (s->total_bytes <= XXH3_MIDSIZE_MAX) return XXH3_64bits(s->buffer, (size_t)s->total_bytes);
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[8];
    xxh_u8 last_stripe[STRIPE];
    const xxh_u8 *last = last_stripe;
    size_t stripes_in_block = s->stripes_in_block;
    memcpy(acc, s->acc, sizeof(acc));
    if (s->total_bytes <= BUFFER_BYTES) { /* all of it is in the buffer */
        consume_stripes(acc, &stripes_in_block, s->buffer, (s->buffered - 1) / STRIPE);
        last = s->buffer + s->buffered - STRIPE;
    } else if (s->last_is_final) { /* XXH3's loop left that stripe out: so does the digest */
        memcpy(acc, s->before_last, sizeof(acc));
        last = s->last_consumed;
    } else { /* the tail of the last consumed stripe, then what is buffered */
        size_t catch_up = STRIPE - s->buffered;
        memcpy(last_stripe, s->last_consumed + s->buffered, catch_up);
        memcpy(last_stripe + catch_up, s->buffer, s->buffered);
    }
    XXH3_accumulate_512(acc, last, XXH3_kSecret + SECRET_LIMIT - XXH_SECRET_LASTACC_START);
    return XXH3_mergeAccs(acc, XXH3_kSecret + XXH_SECRET_MERGEACCS_START,
                          s->total_bytes * XXH_PRIME64_1);
}

/* ---- strided copies: the bytes of two same-shaped buffers, in C order --------------------- */

typedef struct {
    int outer_dims;              /* dimensions walked one index at a time */
    Py_ssize_t run_bytes;        /* bytes contiguous in both buffers */
    Py_ssize_t total_bytes;
} copy_plan;

/* [*low, *high): the bytes a buffer's elements span. */
static void byte_extent(const Py_buffer *view, const char **low, const char **high) {
    *low = *high = view->buf;
    for (int d = 0; d < view->ndim; d++) {
        Py_ssize_t reach = view->strides[d] * (view->shape[d] - 1);
        if (reach < 0) *low += reach; else *high += reach;
    }
    *high += view->itemsize;
}

static int refuse(const char *why) {
    PyErr_SetString(PyExc_ValueError, why);
    return -1;
}

/* Whether some byte may be two elements of `view`: with its dimensions ordered by |stride|,
 * each must step past all the bytes the ones inside it span (conservative: exotic interleaved
 * strides that never collide are refused too; engines' layouts are permuted dense arrays). */
static int repeats_bytes(const Py_buffer *view) {
    Py_ssize_t steps[PyBUF_MAX_NDIM], counts[PyBUF_MAX_NDIM];
    int dims = 0;
    for (int d = 0; d < view->ndim; d++) {
        if (view->shape[d] < 2) continue;
        Py_ssize_t step = view->strides[d] < 0 ? -view->strides[d] : view->strides[d];
        int at = dims++;
        for (; at > 0 && steps[at - 1] > step; at--) /* insertion: dims are few */
            steps[at] = steps[at - 1], counts[at] = counts[at - 1];
        steps[at] = step, counts[at] = view->shape[d];
    }
    Py_ssize_t spanned = view->itemsize;
    for (int d = 0; d < dims; d++) {
        if (steps[d] < spanned) return 1;
        spanned += steps[d] * (counts[d] - 1);
    }
    return 0;
}

/* ValueError unless `dst` and `src` are the same shape, `dst` writes each byte once, and the
 * two share no byte (the digest must be of what the destination holds afterwards). Sharing
 * is judged by the byte ranges the two span: interleaved views of one buffer are refused. */
static int check_copy(const Py_buffer *dst, const Py_buffer *src) {
    if (dst->ndim > PyBUF_MAX_NDIM) return refuse("copy: more dimensions than Python allows");
    if (repeats_bytes(dst))
        return refuse("copy: the destination repeats bytes (its strides overlap)");
    if (dst->len == 0 || src->len == 0) return 0;
    const char *dst_low, *dst_high, *src_low, *src_high;
    byte_extent(dst, &dst_low, &dst_high);
    byte_extent(src, &src_low, &src_high);
    if (dst_low < src_high && src_low < dst_high)
        return refuse("copy: the destination and the source overlap");
    return 0;
}

static int plan_copy(const Py_buffer *dst, const Py_buffer *src, copy_plan *plan) {
    if (dst->ndim != src->ndim || dst->itemsize != src->itemsize) goto mismatch;
    for (int d = 0; d < dst->ndim; d++)
        if (dst->shape[d] != src->shape[d]) goto mismatch;
    if (check_copy(dst, src) < 0) return -1;
    plan->run_bytes = dst->itemsize;
    plan->outer_dims = dst->ndim;
    while (plan->outer_dims > 0) {
        int d = plan->outer_dims - 1;
        if (dst->strides[d] != plan->run_bytes || src->strides[d] != plan->run_bytes) break;
        plan->run_bytes *= dst->shape[d];
        plan->outer_dims = d;
    }
    plan->total_bytes = dst->len;
    return 0;
mismatch:
    PyErr_Format(PyExc_ValueError,
                 "copy: the destination (%d dims, itemsize %zd, %zd bytes) and the source "
                 "(%d dims, itemsize %zd, %zd bytes) differ in shape",
                 dst->ndim, dst->itemsize, dst->len, src->ndim, src->itemsize, src->len);
    return -1;
}

/* Where the next run of a strided copy starts, in C order of the outer dimensions. */
typedef struct {
    Py_ssize_t index[PyBUF_MAX_NDIM];
    xxh_u8 *to;
    const xxh_u8 *from;
} odometer;

/* Advance to the next run; 0 when the last one is done. */
static inline int next_run(odometer *o, const Py_buffer *dst, const Py_buffer *src,
                           int outer_dims) {
    for (int d = outer_dims - 1; d >= 0; d--) {
        o->to += dst->strides[d], o->from += src->strides[d];
        if (++o->index[d] < dst->shape[d]) return 1;
        o->to -= dst->strides[d] * dst->shape[d], o->from -= src->strides[d] * src->shape[d];
        o->index[d] = 0;
    }
    return 0;
}

/* Advance the destination to the next index of its first `axes` axes, and the C-contiguous
 * source by one slab of `slab_bytes`; 0 when the last one is done. */
static inline int next_outer(odometer *o, const Py_buffer *dst, int axes, Py_ssize_t slab_bytes) {
    o->from += slab_bytes;
    for (int d = axes - 1; d >= 0; d--) {
        o->to += dst->strides[d];
        if (++o->index[d] < dst->shape[d]) return 1;
        o->to -= dst->strides[d] * dst->shape[d];
        o->index[d] = 0;
    }
    return 0;
}

#ifdef HAVE_AVX2_PATH
/* Short runs at scattered addresses (a K or V row of 256 bytes, the next one a head or a
 * block away, or a V row away) lose the hardware's stream prefetch: in a source whose runs
 * are not back to back, the lines of the run PREFETCH_AHEAD bytes of runs further on are
 * fetched early (measured: saves of 16 chunks of Llama-3-8B, head-major LBHNC and token-major
 * BLNHC, streamed stores: 2 KiB ahead where runs were over two runs apart 11.0 and 10.4 GB/s,
 * 4 KiB there 13.5 and 10.1, 4 KiB whatever the gap 14.0 and 13.7, 8 KiB 12.4 and 12.3). A
 * run's own prefetch, PREFETCH_BYTES ahead, covers the rest of a long one. */
#define PREFETCH_AHEAD (4 << 10)

/* A copy at least this long that its caller asks to stream (`copy(..., stream=True)`: a save
 * into its arena page, which nobody reads soon) writes with non-temporal stores where its
 * destination's runs are 32-byte aligned: whole lines written around the caches, never read
 * first, and combined in write buffers however scattered. A load into an engine's KV keeps its
 * stores in the cache: the layer's attention reads them next (`kvstore bench serve`'s
 * 1,792-token prompts load 7 MiB a layer, which a 32 MiB L3 keeps; streamed around it, the
 * attention would read them from memory). Measured on the K rows of a head-major layout,
 * 1 GiB: 17.4 GB/s stored through the cache, 27.5 streamed (a contiguous copy through the
 * cache: 21.6). */
#define STREAM_MIN_BYTES (256 << 10)

/* Whether `view`'s runs are not back to back (the next one along the innermost walked axis
 * starts past the end of this one). */
static int scattered(const Py_buffer *view, const copy_plan *plan) {
    if (plan->outer_dims == 0) return 0;
    Py_ssize_t step = view->strides[plan->outer_dims - 1];
    return step != plan->run_bytes;
}

/* Whether every run of `view` starts 32-byte aligned (what a streaming store needs). */
static int aligned_runs(const Py_buffer *view, const copy_plan *plan) {
    if ((uintptr_t)view->buf % 32) return 0;
    for (int d = 0; d < plan->outer_dims; d++)
        if (view->strides[d] % 32) return 0;
    return 1;
}

__attribute__((target("avx2"))) static inline void prefetch_run(const xxh_u8 *from,
                                                               Py_ssize_t run_bytes) {
    Py_ssize_t reach = run_bytes < PREFETCH_BYTES ? run_bytes : PREFETCH_BYTES;
    for (Py_ssize_t offset = 0; offset < reach; offset += STRIPE)
        _mm_prefetch((const char *)from + offset, _MM_HINT_T0);
}

/* A copy whose runs are whole stripes, after whole stripes (nothing buffered) and past the
 * short-input bound: one fused pass, the accumulators in registers from run to run, so a run
 * of 256 bytes (one kv head's row of a token) costs no call. The last stripe is final. */
__attribute__((target("avx2"))) static void copy_runs_avx2(hash_state *s, const Py_buffer *dst,
                                                          const Py_buffer *src,
                                                          const copy_plan *plan, int stream) {
    __m256i low = _mm256_loadu_si256((const __m256i *)s->acc);
    __m256i high = _mm256_loadu_si256((const __m256i *)(s->acc + 4));
    size_t in_block = s->stripes_in_block;
    size_t per_run = (size_t)plan->run_bytes / STRIPE;
    size_t left = (size_t)plan->total_bytes / STRIPE;
    const int store = stream && plan->total_bytes >= STREAM_MIN_BYTES && aligned_runs(dst, plan)
                          ? 2
                          : 1;
    odometer o = {.to = dst->buf, .from = src->buf};
    odometer ahead = o; /* PREFETCH_AHEAD bytes of runs further on: fetched early */
    int more_ahead = scattered(src, plan);
    for (Py_ssize_t k = 0; k < PREFETCH_AHEAD && more_ahead; k += plan->run_bytes)
        more_ahead = next_run(&ahead, dst, src, plan->outer_dims);
    xxh_u8 *last_run;
    do {
        if (more_ahead) {
            prefetch_run(ahead.from, plan->run_bytes);
            more_ahead = next_run(&ahead, dst, src, plan->outer_dims);
        }
        xxh_u8 *to = last_run = o.to;
        const xxh_u8 *from = o.from;
        for (size_t i = 0; i < per_run; i++, to += STRIPE, from += STRIPE) {
            if (i + PREFETCH_BYTES / STRIPE < per_run)
                _mm_prefetch((const char *)from + PREFETCH_BYTES, _MM_HINT_T0);
            if (--left == 0) keep_before_last_avx2(s, low, high);
            fused_stripe(&low, &high, &in_block, to, from, store);
        }
    } while (next_run(&o, dst, src, plan->outer_dims));
    if (store == 2) _mm_sfence(); /* streamed stores are ordered before whatever follows */
    _mm256_storeu_si256((__m256i *)s->acc, low);
    _mm256_storeu_si256((__m256i *)(s->acc + 4), high);
    s->stripes_in_block = in_block;
    MEMORY_BARRIER();
    memcpy(s->last_consumed, last_run + plan->run_bytes - STRIPE, STRIPE);
    s->last_is_final = 1;
    s->total_bytes += (xxh_u64)plan->total_bytes;
}
#endif

/* ---- transposing copies: a destination whose smallest stride is not its last axis -------- */

/* A destination that keeps an earlier axis `r` at a stride of one item while the source is
 * C-contiguous: vLLM's CPU kernels keep K as [head][dim][token] and a payload holds
 * [token][head][dim]. Walked in C order, its runs would be single items. Instead, for each
 * index of the axes before r, TILE_ROWS indices of r at a time (with every axis after r: one
 * contiguous slab of the source) are copied and hashed into a private tile, in C order, then
 * written out of the tile transposed: 8 x 8 items in registers, each store 8 consecutive
 * indices of r. The destination receives the tile, which nothing else writes, so the digest
 * is of what it received, as in every other copy. */
#define TILE_ROWS 8

typedef struct {
    int axis;                     /* r */
    Py_ssize_t row_items;         /* items per index of r: all the axes after it */
    Py_ssize_t row_bytes;
} transpose_plan;

/* Whether `dst` <- `src` is such a copy, and its plan; 0 when the runs path suits it. */
static int plan_transpose(const Py_buffer *dst, const Py_buffer *src, const copy_plan *plan,
                          transpose_plan *t) {
    if (plan->run_bytes >= STRIPE || dst->ndim < 2 || !PyBuffer_IsContiguous(src, 'C'))
        return 0;
    Py_ssize_t item = dst->itemsize;
    if (dst->strides[dst->ndim - 1] == item) return 0;
    for (int d = dst->ndim - 2; d >= 0; d--) {
        if (dst->shape[d] > 1 && dst->strides[d] == item) {
            t->axis = d;
            t->row_items = 1;
            for (int inner = d + 1; inner < dst->ndim; inner++) t->row_items *= dst->shape[inner];
            t->row_bytes = t->row_items * item;
            return 1;
        }
    }
    return 0;
}

/* Item `p` of the slab's rows (C order over the axes after r) is at this offset of a row's
 * first item in the destination. */
static Py_ssize_t inner_offset(const Py_buffer *dst, int axis, Py_ssize_t p) {
    Py_ssize_t offset = 0;
    for (int d = dst->ndim - 1; d > axis; d--) {
        offset += (p % dst->shape[d]) * dst->strides[d];
        p /= dst->shape[d];
    }
    return offset;
}

/* Any item size, any row count: item by item out of the tile (still in L1). */
static void untile_items(const Py_buffer *dst, const transpose_plan *t, xxh_u8 *to,
                         const xxh_u8 *tile, Py_ssize_t rows) {
    Py_ssize_t item = dst->itemsize;
    for (Py_ssize_t p = 0; p < t->row_items; p++) {
        xxh_u8 *column = to + inner_offset(dst, t->axis, p);
        for (Py_ssize_t i = 0; i < rows; i++)
            memcpy(column + i * item, tile + i * t->row_bytes + p * item, (size_t)item);
    }
}

#ifdef HAVE_AVX2_PATH
/* 8 rows of 8 4-byte items -> 8 columns, stored at `to` + j * `step`. */
AVX2 void transpose_8x8_words(xxh_u8 *to, Py_ssize_t step, const xxh_u8 *from,
                              Py_ssize_t row_bytes) {
    __m256 r[8], u[8], v[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps((const float *)(from + i * row_bytes));
    for (int i = 0; i < 8; i += 2) {
        u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        v[i] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        v[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        v[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        v[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps((float *)(to + j * step), _mm256_permute2f128_ps(v[j], v[j + 4], 0x20));
        _mm256_storeu_ps((float *)(to + (j + 4) * step),
                         _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
    }
}

/* 8 rows of 8 2-byte items -> 8 columns, stored at `to` + j * `step`. */
AVX2 void transpose_8x8_halves(xxh_u8 *to, Py_ssize_t step, const xxh_u8 *from,
                               Py_ssize_t row_bytes) {
    __m128i a[8], b[8], c[8];
    for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i *)(from + i * row_bytes));
    for (int i = 0; i < 8; i += 2) {
        b[i] = _mm_unpacklo_epi16(a[i], a[i + 1]);
        b[i + 1] = _mm_unpackhi_epi16(a[i], a[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        c[i] = _mm_unpacklo_epi32(b[i], b[i + 2]);
        c[i + 1] = _mm_unpackhi_epi32(b[i], b[i + 2]);
        c[i + 2] = _mm_unpacklo_epi32(b[i + 1], b[i + 3]);
        c[i + 3] = _mm_unpackhi_epi32(b[i + 1], b[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        _mm_storeu_si128((__m128i *)(to + 2 * j * step), _mm_unpacklo_epi64(c[j], c[j + 4]));
        _mm_storeu_si128((__m128i *)(to + (2 * j + 1) * step), _mm_unpackhi_epi64(c[j], c[j + 4]));
    }
}

/* A full tile of 4- or 2-byte items whose last axis holds whole groups of 8: 8 x 8 at once. */
__attribute__((target("avx2"))) static void untile_vectors(const Py_buffer *dst,
                                                          const transpose_plan *t, xxh_u8 *to,
                                                          const xxh_u8 *tile) {
    Py_ssize_t last = dst->shape[dst->ndim - 1], step = dst->strides[dst->ndim - 1];
    for (Py_ssize_t p = 0; p < t->row_items; p += last) {
        xxh_u8 *row = to + inner_offset(dst, t->axis, p);
        const xxh_u8 *from = tile + p * dst->itemsize;
        for (Py_ssize_t k = 0; k < last; k += 8, from += 8 * dst->itemsize) {
            if (dst->itemsize == 4)
                transpose_8x8_words(row + k * step, step, from, t->row_bytes);
            else
                transpose_8x8_halves(row + k * step, step, from, t->row_bytes);
        }
    }
}
#endif

static void untile(enum isa isa, const Py_buffer *dst, const transpose_plan *t, xxh_u8 *to,
                   const xxh_u8 *tile, Py_ssize_t rows) {
#ifdef HAVE_AVX2_PATH
    int vector_items = dst->itemsize == 4 || dst->itemsize == 2;
    if (isa == ISA_AVX2 && rows == TILE_ROWS && vector_items && dst->shape[dst->ndim - 1] % 8 == 0) {
        untile_vectors(dst, t, to, tile);
        return;
    }
#endif
    (void)isa;
    untile_items(dst, t, to, tile, rows);
}

/* The transposing copy of `plan_transpose`; 0 when no tile could be allocated. */
static int copy_transposed(hash_state *s, enum isa isa, const Py_buffer *dst,
                           const Py_buffer *src, const transpose_plan *t) {
    xxh_u8 *tile = malloc((size_t)(TILE_ROWS * t->row_bytes));
    if (tile == NULL) return 0;
    Py_ssize_t rows = dst->shape[t->axis], item = dst->itemsize;
    odometer o = {.to = dst->buf, .from = src->buf};
    do {
        for (Py_ssize_t first = 0; first < rows; first += TILE_ROWS) {
            Py_ssize_t count = rows - first < TILE_ROWS ? rows - first : TILE_ROWS;
            update(s, isa, tile, o.from + first * t->row_bytes, (size_t)(count * t->row_bytes));
            MEMORY_BARRIER();
            untile(isa, dst, t, o.to + first * item, tile, count);
        }
    } while (next_outer(&o, dst, t->axis, rows * t->row_bytes));
    free(tile);
    return 1;
}

static void copy_strided(hash_state *s, enum isa isa, const Py_buffer *dst, const Py_buffer *src,
                         const copy_plan *plan, int stream) {
    if (plan->total_bytes == 0) return;
    transpose_plan transpose;
    if (plan_transpose(dst, src, plan, &transpose) && copy_transposed(s, isa, dst, src, &transpose))
        return;
#ifdef HAVE_AVX2_PATH
    if (isa == ISA_AVX2 && plan->run_bytes % STRIPE == 0 && s->buffered == 0 &&
        s->total_bytes + (xxh_u64)plan->total_bytes > BUFFER_BYTES) {
        copy_runs_avx2(s, dst, src, plan, stream);
        return;
    }
#endif
    odometer o = {.to = dst->buf, .from = src->buf};
    do {
        update(s, isa, o.to, o.from, (size_t)plan->run_bytes);
    } while (next_run(&o, dst, src, plan->outer_dims));
}

/* ---- the Python type ---------------------------------------------------------------------- */

static int claim(Hasher *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "a Hasher was used by two threads at once");
        return -1;
    }
    self->busy = 1;
    return 0;
}

static PyObject *Hasher_copy(Hasher *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer dst, src;
    copy_plan plan;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "copy(destination, source, stream=False) takes two buffers and a flag");
        return NULL;
    }
    int stream = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (stream < 0) return NULL;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    int failed = plan_copy(&dst, &src, &plan) < 0 || claim(self) < 0;
    if (!failed) {
        if (plan.total_bytes >= RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            copy_strided(&self->state, self->isa, &dst, &src, &plan, stream);
            Py_END_ALLOW_THREADS
        } else {
            copy_strided(&self->state, self->isa, &dst, &src, &plan, stream);
        }
        self->busy = 0;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Hasher_update(Hasher *self, PyObject *data) {
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (claim(self) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    xxh_u8 *bytes = view.buf;
    if (view.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        update(&self->state, self->isa, bytes, bytes, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        update(&self->state, self->isa, bytes, bytes, (size_t)view.len);
    }
    self->busy = 0;
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *Hasher_intdigest(Hasher *self, PyObject *Py_UNUSED(ignored)) {
    if (claim(self) < 0) return NULL;
    xxh_u64 value = digest(&self->state);
    self->busy = 0;
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *Hasher_reset(Hasher *self, PyObject *Py_UNUSED(ignored)) {
    if (claim(self) < 0) return NULL;
    state_reset(&self->state);
    self->busy = 0;
    Py_RETURN_NONE;
}

static enum isa best_isa(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) return ISA_AVX2;
#endif
    return ISA_PORTABLE;
}

static PyObject *Hasher_new(PyTypeObject *type, PyObject *Py_UNUSED(args),
                            PyObject *Py_UNUSED(kwargs)) {
    Hasher *self = (Hasher *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->isa = best_isa();
    self->busy = 0;
    state_reset(&self->state);
    return (PyObject *)self;
}

static int Hasher_init(Hasher *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"isa", NULL};
    const char *name = NULL;
    enum isa isa = best_isa();
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|z:Hasher", keywords, &name)) return -1;
    if (name != NULL && strcmp(name, "portable") == 0) {
        isa = ISA_PORTABLE;
    } else if (name != NULL && (strcmp(name, "avx2") != 0 || isa != ISA_AVX2)) {
        PyErr_Format(PyExc_ValueError, "isa %s: this CPU runs 'portable'%s", name,
                     isa == ISA_AVX2 ? " and 'avx2'" : " only");
        return -1;
    }
    if (claim(self) < 0) return -1;
    self->isa = isa;
    state_reset(&self->state);
    self->busy = 0;
    return 0;
}

static PyObject *Hasher_get_isa(Hasher *self, void *Py_UNUSED(closure)) {
    return PyUnicode_FromString(ISA_NAMES[self->isa]);
}

static PyMethodDef Hasher_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))Hasher_copy, METH_FASTCALL,
     "copy(destination, source, stream=False): copy `source` into `destination` (writable; "
     "the same shape and item size, any strides) in C order, and hash the copied bytes in that "
     "order. `stream`: write a long copy around the caches (a destination nobody reads soon)."},
    {"update", (PyCFunction)Hasher_update, METH_O,
     "update(data): hash the bytes of a C-contiguous buffer."},
    {"intdigest", (PyCFunction)Hasher_intdigest, METH_NOARGS,
     "The xxh3-64 of every byte fed so far (the state is kept: more may follow)."},
    {"reset", (PyCFunction)Hasher_reset, METH_NOARGS, "Forget every byte fed so far."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Hasher_getset[] = {
    {"isa", (getter)Hasher_get_isa, NULL, "The copy loop in use: 'avx2' or 'portable'.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HasherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._copyhash.Hasher",
    .tp_basicsize = sizeof(Hasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hasher(isa=None): a streaming xxh3-64 that can copy what it hashes in the same "
              "pass. Not for two threads at once (RuntimeError).",
    .tp_new = Hasher_new,
    .tp_init = (initproc)Hasher_init,
    .tp_methods = Hasher_methods,
    .tp_getset = Hasher_getset,
};

static PyObject *module_best_isa(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    return PyUnicode_FromString(ISA_NAMES[best_isa()]);
}

static PyObject *module_plain_copy(PyObject *Py_UNUSED(module), PyObject *const *args,
                                   Py_ssize_t nargs) {
    Py_buffer dst, src;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "plain_copy(destination, source) takes two buffers");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    int failed = dst.len != src.len;
    if (failed) {
        PyErr_Format(PyExc_ValueError, "plain_copy: %zd bytes into %zd", src.len, dst.len);
    } else if (check_copy(&dst, &src) < 0) {
        failed = 1;
    } else {
        Py_BEGIN_ALLOW_THREADS
        plain_copy(best_isa(), dst.buf, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"best_isa", module_best_isa, METH_NOARGS, "The fastest copy loop this CPU runs."},
    {"plain_copy", (PyCFunction)(void (*)(void))module_plain_copy, METH_FASTCALL,
     "plain_copy(destination, source): Hasher.copy's loop without the hash, between two "
     "C-contiguous buffers of one length (a benchmark's limit to compare with)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef copyhash_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvstore._copyhash",
    .m_doc = "Copy and xxh3-64 in one pass over the bytes (see kvstore/native/copyhash.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__copyhash(void) {
    if (PyType_Ready(&HasherType) < 0) return NULL;
    PyObject *module = PyModule_Create(&copyhash_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Hasher", (PyObject *)&HasherType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
