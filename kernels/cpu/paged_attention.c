/* Decode attention over a paged KV cache: each query row is the newest token of its sequence.
 *
 * q [B, H, D] fp32, caches [num_blocks, block_size, KVH, row] of rows of D values as kv_row.h lays
 * them out (`cache_kind`: fp32; bf16, which widens exactly; int8 with a scale per row, dequantised
 * as the reference dequantises), block_tables [B, max_blocks] (int64),
 * seq_lens [B] (int32, the query token included), out [B, H, D] fp32. A key is visible when
 * k_pos >= seq_len - window (window 0: no sliding window).
 *
 * One task per (sequence, KV head, cell of keys), in three passes over its queries (the GQA group's
 * query heads, for every row of a span): the scores of every query, K read KEY_CHUNK rows at a time;
 * each query's softmax; every query's weighted sum of V, read the same way. A chunk of rows is read
 * from the cache once (bf16 and int8 rows converted to fp32 then) and stays in L1 while every query
 * of the task uses it. Keeping the scores (one float per key and query) costs less than the
 * rescaling an online softmax needs per key. Up to QT query heads of a row (its GQA group) go
 * through a chunk together: each K or V row is loaded once for all of them; scores take four keys at
 * a time (one FMA chain per query and key, reduced together). Matches
 * llmd.kernels.attention_ref.decode_attention within fp32 rounding.
 *
 * Batch invariance: a row's result is the same bits whatever else is in the batch. A context's keys
 * are cut into cells at multiples of a cell size that depends on that context's length alone
 * (cell_keys); each cell is a task, and a row's cells are combined by log-sum-exp in order. So one
 * stream's keys are spread over the threads (a task per cell, not per KV head), and a token decoded
 * alone, beside other sequences or in a verified span of drafts gets the same attention: greedy
 * output does not change with speculation or with the load (issue 22). Splitting by the thread
 * count, as this kernel once did, moved the cut with the batch and changed the last bits.
 *
 * Rows may share a context: a span of draft tokens being verified (speculative decoding) comes as
 * consecutive rows of one sequence, each one position further (llmd_attention_spans finds them).
 * A span's rows share their tasks (a cell and a KV head): each key and value is read (and widened)
 * once for all of them, and each row attends to the keys up to its own position, so verifying k
 * drafts costs about one row's cache reads, not k + 1 (its arithmetic is still k + 1 rows').
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_row.h"
#include "llmd_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
/* AVX-512 (Zen 4+, Intel servers since Skylake): scores take two keys per 512-bit FMA, weighted sums 16
 * columns, each lane doing what the 256-bit code's does in the same order: the same bits, with half
 * the instructions per query row (a verified span's rows are most of its attention). */
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__)
#define LLMD_ATTN_ZMM 1
#endif

/* How far ahead of the row being read (or widened) to prefetch K/V rows: they live in scattered
 * blocks, so the hardware prefetcher alone stalls at every block boundary. In bytes of this KV head's
 * rows, so a bf16 or int8 cache looks as far ahead as an fp32 one: 8 rows of fp32 (as this once was
 * for every format), 16 of bf16, 31 of int8. On a 2-core Zen 5, 12 alternated rounds, one
 * 4000-token context and 16 of 500 tokens (with and without spans of 4), against 8 rows ahead: a bf16
 * cache 0.83-0.91x the time (AVX2 build), 0.79-0.87x (AVX-512); an int8 one 0.82-0.93x in both; fp32
 * with 16 or 32 rows 0.96-1.04x of 8. In the engine, `edit` chats ran 1.06x faster without
 * speculation and 1.04x with it (native profile, bf16 cache: benchmarks/engine_lib_ab.py). */
#ifndef PREFETCH_BYTES_AHEAD
#define PREFETCH_BYTES_AHEAD 2048
#endif

/* One lane of a score's products: a fused multiply-add where the build has FMA, as the vector path's
 * lanes are; a multiply and an add in a portable build (whose every score takes score_one). */
#if defined(__AVX2__) && defined(__FMA__)
#define LANE_FMA(a, b, c) fmaf((a), (b), (c))
#else
#define LANE_FMA(a, b, c) ((a) * (b) + (c))
#endif

/* Keeps a loaded K or V row in a register. Left alone, the compiler folds the load into each FMA
 * that uses it (an FMA with a memory operand), so a row serving QT queries was loaded QT times, and
 * in the 512-bit weighted sums the loads, not the FMAs, set the pace. An empty asm: no instruction,
 * the same bits. A span of 4-8 rows at a 450-token context (bf16 cache, AVX-512 build, alternated):
 * 0.93-0.94x the time with the cache from memory, 0.85-0.91x in cache; `edit` chats in the engine
 * 1.01x faster without speculation, 1.03x with it (benchmarks/engine_lib_ab.py, a 2-core Zen 5).
 * The AVX2 build folded fewer and is unchanged (0.98-1.01x). */
#if defined(__GNUC__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

/* The queries a pass over a chunk of keys serves at once: the query heads of one row that share a
 * KV head (GQA). Each key (and value) row loaded from L1 then feeds QT dot products or weighted sums,
 * not one: ~20% faster over a 600-token context, AVX-512 and AVX2 builds alike. 3 keeps an AVX2
 * tile in its 16 vector registers (12 accumulators, a row, the queries' vectors or weights). */
#define QT 3

/* dot(q, k) for a head of D values, in the order every path uses: lane l (of 8) accumulates the
 * products at d = l, l + 8, l + 16, ... in turn, and the lanes are added as ((l0 + l1) + (l2 + l3)) +
 * ((l4 + l5) + (l6 + l7)), what scores_for's horizontal adds do. A head of no multiple of 8 is one
 * plain sum: every key of it takes this path. */
static inline float score_one(const float *q, const float *k, int64_t D) {
    if (D % 8) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; d++) s += q[d] * k[d];
        return s;
    }
    float l[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t c = 0; c < D; c += 8)
        for (int j = 0; j < 8; j++) l[j] = LANE_FMA(q[c + j], k[c + j], l[j]);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

#if defined(__AVX2__) && defined(__FMA__)
/* s[j][i] = scale * dot(q[j], rows[i]) for t <= QT queries and the first multiple of four of the n
 * rows; returns how many rows it did. Four keys at a time, one accumulator per (query, key): lane l
 * holds the products at d = l, l + 8, ... in turn, and two rounds of horizontal adds and an add of
 * the halves sum each as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), score_one's order. Always
 * inlined with constant t and, for the common head sizes, D, so its loops unroll. */
static inline __attribute__((always_inline)) int64_t scores_tile(const float *const *q, const float *const *rows,
                                                                  int64_t i, int64_t n, const int64_t D, float scale,
                                                                  float *const *s, const int t) {
    const __m128 vs = _mm_set1_ps(scale);
    for (; i + 4 <= n; i += 4) {
        __m256 acc[QT][4];
        for (int j = 0; j < t; j++)
            for (int k = 0; k < 4; k++) acc[j][k] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 qv[QT];
            for (int j = 0; j < t; j++) qv[j] = _mm256_loadu_ps(q[j] + d);
            for (int k = 0; k < 4; k++) {
                __m256 kv = _mm256_loadu_ps(rows[i + k] + d);
                IN_REGISTER(kv);
                for (int j = 0; j < t; j++) acc[j][k] = _mm256_fmadd_ps(qv[j], kv, acc[j][k]);
            }
        }
        for (int j = 0; j < t; j++) {
            /* hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] */
            const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[j][0], acc[j][1]), _mm256_hadd_ps(acc[j][2], acc[j][3]));
            /* u: keys 0-3's (l0+l1)+(l2+l3) in its low half, their (l4+l5)+(l6+l7) in its high half */
            const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
            _mm_storeu_ps(s[j] + i, _mm_mul_ps(sum, vs));
        }
    }
    return i;
}

#ifdef LLMD_ATTN_ZMM
/* _mm256_hadd_ps within each 128-bit lane of a 512-bit vector: [a0+a1, a2+a3, b0+b1, b2+b3] per lane */
static inline __m512 hadd512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* scores_tile eight keys at a time, two per 512-bit vector: key 2p's 8-lane chunk in the low half,
 * key 2p + 1's in the high half, against the query's chunk in both. Each half's lanes take the same
 * products in the same order as scores_tile's, and the reductions below add them in its order: three
 * rounds of in-lane horizontal adds leave, per 128-bit lane, the even keys' (l0+l1)+(l2+l3) (lane 0)
 * and (l4+l5)+(l6+l7) (lane 1), the odd keys' in lanes 2 and 3; lane 0 + lane 1 and lane 2 + lane 3
 * are then score_one's sums. Returns how many keys it did. */
static inline __attribute__((always_inline)) int64_t scores_tile16(const float *const *q, const float *const *rows,
                                                                    int64_t n, const int64_t D, float scale,
                                                                    float *const *s, const int t) {
    const __m128 vs = _mm_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512 acc[QT][4];
        for (int j = 0; j < t; j++)
            for (int p = 0; p < 4; p++) acc[j][p] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m512 qv[QT];
            for (int j = 0; j < t; j++) qv[j] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[j] + d));
            for (int p = 0; p < 4; p++) {
                const __m512 kv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(rows[i + 2 * p] + d)),
                                                     _mm256_loadu_ps(rows[i + 2 * p + 1] + d), 1);
                for (int j = 0; j < t; j++) acc[j][p] = _mm512_fmadd_ps(qv[j], kv, acc[j][p]);
            }
        }
        for (int j = 0; j < t; j++) {
            const __m512 h = hadd512(hadd512(acc[j][0], acc[j][1]), hadd512(acc[j][2], acc[j][3]));
            const __m512 sum = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 3, 0, 1)));
            const __m128 even = _mm512_castps512_ps128(sum), odd = _mm512_extractf32x4_ps(sum, 2);
            _mm_storeu_ps(s[j] + i, _mm_mul_ps(_mm_unpacklo_ps(even, odd), vs));
            _mm_storeu_ps(s[j] + i + 4, _mm_mul_ps(_mm_unpackhi_ps(even, odd), vs));
        }
    }
    return i;
}
#define SCORES_TILE16(Dc, T) scores_tile16(q, rows, n, Dc, scale, s, T)
#else
#define SCORES_TILE16(Dc, T) 0
#endif

#define SCORES_TILE_D(T)                                                                            \
    switch (D) {                                                                                    \
    case 64: i = scores_tile(q, rows, SCORES_TILE16(64, T), n, 64, scale, s, T); break;             \
    case 128: i = scores_tile(q, rows, SCORES_TILE16(128, T), n, 128, scale, s, T); break;          \
    default: i = D % 8 ? 0 : scores_tile(q, rows, SCORES_TILE16(D, T), n, D, scale, s, T); break;   \
    }
#endif

/* s[j][i] = scale * dot(q[j], rows[i]) for t <= QT queries and n rows of D: score_one's order of
 * additions on every path, so a score is the same bits whichever keys and queries share its tile. */
static void scores_for(const float *const *q, const float *const *rows, int64_t n, int64_t D, float scale,
                       float *const *s, int t) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    switch (t) {
    case 3: SCORES_TILE_D(3); break;
    case 2: SCORES_TILE_D(2); break;
    default: SCORES_TILE_D(1); break;
    }
#endif
    for (int j = 0; j < t; j++)
        for (int64_t k = i; k < n; k++) s[j][k] = score_one(q[j], rows[k], D) * scale;
}

/* out[j][0:D] += sum_i p[j][i] * rows[i][0:D] for t <= QT queries, the rows in order. Accumulates 32
 * columns of every query at a time in registers over all rows (each row's chunk loaded once for all
 * the queries), loading and storing the outputs once, instead of a load-add-store per row. A context's
 * keys come in chunks (KEY_CHUNK): continuing from the stored sums gives each column the same
 * additions in the same order as one call over all of them. The columns past the last multiple of 64
 * take the scalar loop (as when this went 64 columns at a time: the same bits). */
static inline __attribute__((always_inline)) void weighted_sum_tile(const float *const *rows, const float *const *p,
                                                                    int64_t n, int64_t D, float *const *out,
                                                                    const int t) {
    int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t vector_cols = D / 64 * 64;
#ifdef LLMD_ATTN_ZMM
    for (; d0 < vector_cols; d0 += 64) { /* each column as below, 16 to a vector */
        __m512 acc[QT][4];
        for (int j = 0; j < t; j++)
            for (int c = 0; c < 4; c++) acc[j][c] = _mm512_loadu_ps(out[j] + d0 + 16 * c);
        for (int64_t i = 0; i < n; i++) {
            __m512 w[QT];
            for (int j = 0; j < t; j++) w[j] = _mm512_set1_ps(p[j][i]);
            for (int c = 0; c < 4; c++) {
                __m512 r = _mm512_loadu_ps(rows[i] + d0 + 16 * c);
                IN_REGISTER(r);
                for (int j = 0; j < t; j++) acc[j][c] = _mm512_fmadd_ps(w[j], r, acc[j][c]);
            }
        }
        for (int j = 0; j < t; j++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(out[j] + d0 + 16 * c, acc[j][c]);
    }
#endif
    for (; d0 < vector_cols; d0 += 32) {
        __m256 acc[QT][4];
        for (int j = 0; j < t; j++)
            for (int c = 0; c < 4; c++) acc[j][c] = _mm256_loadu_ps(out[j] + d0 + 8 * c);
        for (int64_t i = 0; i < n; i++) {
            __m256 w[QT];
            for (int j = 0; j < t; j++) w[j] = _mm256_set1_ps(p[j][i]);
            for (int c = 0; c < 4; c++) {
                __m256 r = _mm256_loadu_ps(rows[i] + d0 + 8 * c);
                IN_REGISTER(r);
                for (int j = 0; j < t; j++) acc[j][c] = _mm256_fmadd_ps(w[j], r, acc[j][c]);
            }
        }
        for (int j = 0; j < t; j++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(out[j] + d0 + 8 * c, acc[j][c]);
    }
#endif
    for (int j = 0; j < t; j++)
        for (int64_t d = d0; d < D; d++) {
            float acc = out[j][d];
            for (int64_t i = 0; i < n; i++) acc += p[j][i] * rows[i][d];
            out[j][d] = acc;
        }
}

static void weighted_sum_add(const float *const *rows, const float *const *p, int64_t n, int64_t D,
                             float *const *out, int t) {
    switch (t) {
    case 3: weighted_sum_tile(rows, p, n, D, out, 3); break;
    case 2: weighted_sum_tile(rows, p, n, D, out, 2); break;
    default: weighted_sum_tile(rows, p, n, D, out, 1); break;
    }
}

/* s[i] = e^(s[i] - max) in place, for n > 0 scores; returns the max (through *mx) and the sum.
 * Vectorised: the exponentials are most of a row's softmax, which at a few hundred keys is as
 * much work as its two dot products. */
static float softmax_numerators(float *s, int64_t n, float *mx_out) {
    int64_t i = 0;
    float mx = -INFINITY, total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 m8 = _mm256_loadu_ps(s);
        for (i = 8; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + i));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        mx = _mm_cvtss_f32(m4);
    }
#endif
    for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = llmd_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = llmd_hsum8(acc);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - mx);
        total += s[i];
    }
    *mx_out = mx;
    return total;
}

/* A context's keys per cell: the smallest power of two from ATTN_MIN_CELL that leaves at most
 * LLMD_ATTN_MAX_CELLS cells. Small enough that one stream's context is a few tasks per thread, large
 * enough that a task's fixed costs stay small; bounded in number so a row's parts fit a fixed scratch. */
#define ATTN_MIN_CELL 128
static int64_t cell_keys(int64_t len) {
    int64_t c = ATTN_MIN_CELL;
    while (c * LLMD_ATTN_MAX_CELLS < len) c *= 2;
    return c;
}

int64_t llmd_attention_spans(const int64_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, int64_t B,
                             int64_t block_size, int64_t KVH, int64_t *spans) {
    int64_t *first = spans, *cells = spans + B + 1;
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) {
        /* NOTE: rows whose tables agree over every block the later one reads see the same keys,
         * so grouping them is exact whatever they are; in practice only a verified span matches
         * (another sequence's table differs at least in the block its new token is written to).
         * Rows join only with the same cell size: each row's cells are its own length's. */
        const int64_t blocks = (seq_lens[b] + block_size - 1) / block_size;
        const int joins = b > 0 && seq_lens[b] == seq_lens[b - 1] + 1 && blocks <= max_blocks &&
                          cell_keys(seq_lens[b]) == cell_keys(seq_lens[b - 1]) &&
                          memcmp(block_tables + b * max_blocks, block_tables + (b - 1) * max_blocks,
                                 sizeof(int64_t) * (size_t)blocks) == 0;
        if (!joins) first[n++] = b;
    }
    first[n] = B;
    /* per span: how many cells its last row's keys fill, then the tasks before each span, KVH x
     * cells each. NOTE: not the window's: a sliding window's cells before its first key are empty
     * tasks, which read nothing, so the spans serve every layer of a model whose layers differ. */
    int64_t *ncells = spans + 2 * (B + 1), *tasks = spans + 3 * (B + 1);
    tasks[0] = 0;
    for (int64_t s = 0; s < n; s++) {
        const int64_t len = seq_lens[first[s + 1] - 1], c = cell_keys(len);
        ncells[s] = len > c ? (len + c - 1) / c : 1;
        for (int64_t b = first[s]; b < first[s + 1]; b++) cells[b] = ncells[s];
        tasks[s + 1] = tasks[s] + KVH * ncells[s];
    }
    return n;
}

int64_t llmd_attention_spans_size(int64_t B) { return 4 * (B + 1); }

/* per row, query head and cell: the max score, the sum of exponentials and the unnormalised output */
int64_t llmd_attention_partial_floats(int64_t B, int64_t H, int64_t D) {
    return B * H * LLMD_ATTN_MAX_CELLS * (D + 2);
}

/* Keys read per chunk of a cell: K or V rows of 64 values widened to fp32 are 16 KB, in L1 (32 KB
 * and more) while every query of the task uses them. 64, not 32: a chunk's fixed costs (each query's
 * output sums loaded and stored, its calls) took ~10% of a 600-token context's attention; 128 was
 * slower again. The chunk does not change a result's bits (weighted_sum_add). */
#define KEY_CHUNK 64

/* The first key row b sees within a cell that starts at `start` (a sliding window may start later). */
static inline int64_t key_first(int64_t b, const int32_t *seq_lens, int64_t window, int64_t start) {
    const int64_t first = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
    return first > start ? first : start;
}

/* Where query head h of row b puts its output: the row's output itself when its context is one cell,
 * else its part for `cell` (after the part's max and sum of exponentials). */
static inline float *query_out(float *out, float *partial, int64_t b, int64_t h, int64_t H, int64_t D, int64_t cell,
                               int64_t ncells) {
    return ncells == 1 ? out + (b * H + h) * D : partial + ((b * H + h) * LLMD_ATTN_MAX_CELLS + cell) * (D + 2) + 2;
}

/* rows[i] = the fp32 row of KV head kvh at position c0 + i, for positions [c0, c1): the cache's own
 * rows (fp32) or widened into `widened` (bf16, int8). Block by block: a block's rows are one table
 * lookup. Prefetches the rows PREFETCH_BYTES_AHEAD further on (before `end`): in this block or,
 * mostly, the next one. */
static void gather_rows(const void *cache, int kind, const int64_t *table, int64_t block_size, int64_t KVH,
                        int64_t kvh, int64_t row_bytes, int64_t D, int64_t c0, int64_t c1, int64_t end,
                        const float **rows, float *widened) {
    const int64_t stride = KVH * row_bytes; /* from a token's row of this KV head to the next token's */
    const int64_t rows_ahead = PREFETCH_BYTES_AHEAD / row_bytes > 1 ? PREFETCH_BYTES_AHEAD / row_bytes : 1;
#define ROW_BASE(blk) ((table[(blk)] * block_size * KVH + kvh) * row_bytes - (blk) * block_size * stride)
    for (int64_t pos = c0; pos < c1;) {
        const int64_t blk = pos / block_size, limit = (blk + 1) * block_size, stop = limit < c1 ? limit : c1;
        const int64_t base = ROW_BASE(blk), next_base = limit < end ? ROW_BASE(blk + 1) : 0;
        for (; pos < stop; pos++) {
            const int64_t ahead = pos + rows_ahead;
            if (ahead < end) { /* the cache is read once per step: mostly from DRAM */
                const int64_t at = ahead < limit ? base + ahead * stride
                                   : ahead < limit + block_size ? next_base + ahead * stride
                                   : ROW_BASE(ahead / block_size) + ahead * stride;
                for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch((const char *)cache + at + byte);
            }
            rows[pos - c0] = llmd_kv_load_row((const char *)cache + base + pos * stride, kind, D,
                                              widened ? widened + (pos - c0) * D : NULL);
        }
    }
#undef ROW_BASE
}

void llmd_decode_attention_body(const float *q, int64_t ldq, const void *k_cache, const void *v_cache, int cache_kind,
                                const int64_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                const int64_t *spans, int64_t num_spans, int64_t H, int64_t KVH, int64_t D,
                                int64_t block_size, int64_t window, float scale, float *partial, float *out) {
    const int64_t group = H / KVH;
    const int64_t row_bytes = llmd_kv_row_bytes(cache_kind, D);
    const int converted = cache_kind != LLMD_CACHE_F32;
    const int64_t B = spans[num_spans];
    const int64_t *cells = spans + B + 1, *ncells = spans + 2 * (B + 1), *tasks = spans + 3 * (B + 1);
    int64_t max_n = 1, max_rows = 1; /* the largest cell and span: this thread's scratch */
    for (int64_t b = 0; b < B; b++) max_n = cell_keys(seq_lens[b]) > max_n ? cell_keys(seq_lens[b]) : max_n;
    for (int64_t sp = 0; sp < num_spans; sp++)
        max_rows = spans[sp + 1] - spans[sp] > max_rows ? spans[sp + 1] - spans[sp] : max_rows;
    /* a task's queries (its span's rows x the KV head's query heads): their scores over the cell,
     * and each one's max and sum of exponentials */
    float *scores = malloc(sizeof(float) * (size_t)(max_rows * group * max_n));
    float *stats = malloc(sizeof(float) * (size_t)(max_rows * group * 2));
    /* one chunk of K or V rows as fp32: the cache's own rows, or converted (bf16, int8) */
    const float **rows = malloc(sizeof(float *) * KEY_CHUNK);
    float *widened = converted ? malloc(sizeof(float) * (size_t)(KEY_CHUNK * D)) : NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks[num_spans]; task++) {
        int64_t span = 0; /* the span this task is in: the last whose first task is <= task */
        for (int64_t lo = 0, hi = num_spans; lo < hi;) {
            const int64_t mid = (lo + hi) / 2;
            if (tasks[mid] <= task) span = mid, lo = mid + 1;
            else hi = mid;
        }
        const int64_t local = task - tasks[span], kvh = local / ncells[span], cell = local % ncells[span];
        const int64_t b0 = spans[span], b1 = spans[span + 1];
        const int64_t len = seq_lens[b1 - 1], c = cell_keys(len);
        /* the cell's keys, from the first the span's first row sees to the last its last row sees */
        const int64_t from = window > 0 && seq_lens[b0] > window ? seq_lens[b0] - window : 0;
        const int64_t end = (cell + 1) * c < len ? (cell + 1) * c : len;
        const int64_t start = cell * c > from ? cell * c : (from < end ? from : end);
        const int64_t *table = block_tables + b0 * max_blocks;
        const int64_t nq = (b1 - b0) * group; /* query (b, g) is number (b - b0) * group + g */
        /* Three passes over the cell: every query's scores (K a chunk at a time), each query's
         * softmax (at the start of the V pass), every query's weighted sum of V (a chunk at a
         * time). A chunk of rows is read from the cache and widened once for all the queries, and
         * stays in L1 while they use it. */
        for (int pass = 0; pass < 2; pass++) {
            const void *cache = pass == 0 ? k_cache : v_cache;
            if (pass == 1) {
                for (int64_t qi = 0; qi < nq; qi++) {
                    const int64_t b = b0 + qi / group, lo = key_first(b, seq_lens, window, start);
                    const int64_t hi = seq_lens[b] < end ? seq_lens[b] : end;
                    float *st = stats + 2 * qi;
                    st[0] = -INFINITY;
                    st[1] = hi > lo ? softmax_numerators(scores + qi * max_n + (lo - start), hi - lo, st) : 0.0f;
                    float *o = query_out(out, partial, b, kvh * group + qi % group, H, D, cell, ncells[span]);
                    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                }
            }
            for (int64_t c0 = start; c0 < end; c0 += KEY_CHUNK) {
                const int64_t c1 = c0 + KEY_CHUNK < end ? c0 + KEY_CHUNK : end;
                gather_rows(cache, cache_kind, table, block_size, KVH, kvh, row_bytes, D, c0, c1, end, rows, widened);
                for (int64_t qi = 0; qi < nq;) {
                    /* up to QT query heads of one row (its GQA group shares the KV head), whose keys
                     * within the chunk are the same: [x0, x1) */
                    const int64_t b = b0 + qi / group, g = qi % group, t = group - g < QT ? group - g : QT;
                    const int64_t lo = key_first(b, seq_lens, window, start);
                    const int64_t x0 = lo > c0 ? lo : c0, x1 = seq_lens[b] < c1 ? seq_lens[b] : c1;
                    if (x1 > x0) {
                        const float *qs[QT];
                        float *sq[QT], *o[QT];
                        for (int64_t j = 0; j < t; j++) {
                            const int64_t h = kvh * group + g + j;
                            qs[j] = q + b * ldq + h * D;
                            sq[j] = scores + (qi + j) * max_n + (x0 - start);
                            o[j] = query_out(out, partial, b, h, H, D, cell, ncells[span]);
                        }
                        if (pass == 0) scores_for(qs, rows + (x0 - c0), x1 - x0, D, scale, sq, (int)t);
                        else weighted_sum_add(rows + (x0 - c0), (const float *const *)sq, x1 - x0, D, o, (int)t);
                    }
                    qi += t;
                }
            }
        }
        for (int64_t qi = 0; qi < nq; qi++) {
            /* One cell: the row's output at once. Several: its part, combined below. Both end as
             * sum(e^(s - m) v) / sum(e^(s - m)) in the same bits when a row has one cell with keys
             * in it (the combination's weight is then e^0 = 1): the same result whichever way a
             * row's span was cut. */
            const int64_t b = b0 + qi / group;
            const float *st = stats + 2 * qi;
            float *o = query_out(out, partial, b, kvh * group + qi % group, H, D, cell, ncells[span]);
            if (ncells[span] == 1) { /* a row sees at least its own key: a total > 0 but for a padding row's */
                for (int64_t d = 0; d < D; d++) o[d] = st[1] > 0.0f ? o[d] / st[1] : 0.0f;
            } else { /* an empty part (total 0) is skipped in the combination */
                o[-2] = st[0];
                o[-1] = st[1];
            }
        }
    }
    free(scores);
    free(stats);
    free(rows);
    free(widened);
    /* log-sum-exp combination: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, cells in order */
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t nc = cells[bh / H];
        if (nc == 1) continue;
        const float *parts = partial + bh * LLMD_ATTN_MAX_CELLS * (D + 2);
        float mx = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < nc; c++)
            if (parts[c * (D + 2) + 1] != 0.0f && parts[c * (D + 2)] > mx) mx = parts[c * (D + 2)];
        float *o = out + bh * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t c = 0; c < nc; c++) {
            const float *part = parts + c * (D + 2);
            if (part[1] == 0.0f) continue; /* none of this row's keys are in this cell */
            const float w = expf(part[0] - mx);
            total += w * part[1];
            for (int64_t d = 0; d < D; d++) o[d] += w * part[2 + d];
        }
        for (int64_t d = 0; d < D; d++) o[d] /= total;
    }
}

/* Public: q [B, H, D] fp32 contiguous, out [B, H, D] fp32. */
void llmd_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int cache_kind,
                                 const int64_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                 int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                 int64_t window, float scale, float *out, int nthreads) {
    int64_t *spans = malloc(sizeof(int64_t) * (size_t)llmd_attention_spans_size(B));
    const int64_t num_spans = llmd_attention_spans(block_tables, max_blocks, seq_lens, B, block_size, KVH, spans);
    float *partial = malloc(sizeof(float) * (size_t)llmd_attention_partial_floats(B, H, D));
#pragma omp parallel num_threads(nthreads)
    llmd_decode_attention_body(q, H * D, k_cache, v_cache, cache_kind, block_tables, max_blocks, seq_lens, spans,
                               num_spans, H, KVH, D, block_size, window, scale, partial, out);
    free(partial);
    free(spans);
}

/* Public: n rows of D fp32 values stored as cache rows of `cache_kind`, exactly as the decode step
 * stores a token's K and V (tests hold this against llmd.kernels.kv_format). */
void llmd_kv_store_rows(const float *src, int64_t n, int64_t D, int cache_kind, void *dst) {
    const int64_t row_bytes = llmd_kv_row_bytes(cache_kind, D);
    for (int64_t r = 0; r < n; r++) llmd_kv_store_row((char *)dst + r * row_bytes, src + r * D, D, cache_kind);
}

/* Public: the K or V rows of T new tokens, src [T, KVH, D] fp32, stored into a cache of `cache_kind`
 * at their slots (slot * KVH + head; a negative slot writes nothing), as the decode step stores them:
 * the prompt chunks' writes (llmd.kernels.attention_cpu.write_kv). */
void llmd_kv_write(const float *src, const int64_t *slots, int64_t T, int64_t KVH, int64_t D, int cache_kind,
                   void *cache, int nthreads) {
    const int64_t row_bytes = llmd_kv_row_bytes(cache_kind, D);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * KVH >= 256)
    for (int64_t r = 0; r < T * KVH; r++) {
        const int64_t t = r / KVH, h = r % KVH;
        if (slots[t] >= 0)
            llmd_kv_store_row((char *)cache + (slots[t] * KVH + h) * row_bytes, src + r * D, D, cache_kind);
    }
}
