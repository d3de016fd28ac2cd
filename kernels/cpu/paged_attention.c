/* Decode attention over a paged KV cache: each query row is the newest token of its sequence.
 *
 * q [B, H, D] fp32, caches [num_blocks, block_size, KVH, row] of rows of D values as kv_row.h lays
 * them out (`cache_kind`: fp32; bf16, which widens exactly; int8 with a scale per row, dequantised
 * as the reference dequantises), block_tables [B, max_blocks] (int64),
 * seq_lens [B] (int32, the query token included), out [B, H, D] fp32. A key is visible when
 * k_pos >= seq_len - window (window 0: no sliding window).
 *
 * One task per (sequence, KV head, cell of keys): the GQA group's query heads share each key and value read
 * (bf16 and int8 rows are converted to fp32 once per task). Per head three passes (scores eight keys at a time,
 * softmax, a weighted sum of V accumulated in registers) instead of an online softmax: the
 * rescaling an online softmax needs per key costs more than keeping the scores (one float per
 * key and head). Matches llmd.kernels.attention_ref.decode_attention within fp32 rounding.
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
 * A span's rows share their tasks (a cell and a KV head): each key and value is read (and widened) once for all
 * of them, and each row attends to the keys up to its own position, so verifying k drafts costs
 * about one row's cache reads, not k + 1.
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

/* K/V rows ahead of the one being widened to prefetch: they live in scattered blocks, so the
 * hardware prefetcher alone stalls at every block boundary. */
#define PREFETCH_AHEAD 8

/* dot(a, k), both fp32 */
static inline float dot_k(const float *a, const float *k, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    /* two accumulators: a head is 64-128 wide, so one chain of dependent FMAs would be latency-bound */
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(k + i), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(k + i + 8), acc2);
    }
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(k + i), acc);
    s = llmd_hsum8(_mm256_add_ps(acc, acc2));
#endif
    for (; i < n; i++) s += a[i] * k[i];
    return s;
}

/* s[i] = scale * dot(qh, rows[i]) for n rows of D. Four keys at a time, their partial sums reduced
 * together (one 4x4 transpose) instead of a horizontal sum per key, in exactly dot_k's order of
 * additions, so the scores do not depend on which path computed them. */
static void scores_for(const float *qh, const float *const *rows, int64_t n, int64_t D, float scale, float *s) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (; i + 4 <= n; i += 4) {
            __m128 h[4];
            for (int j = 0; j < 4; j++) {
                const float *k = rows[i + j];
                __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
                int64_t d = 0;
                for (; d + 16 <= D; d += 16) {
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(k + d), acc);
                    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8), _mm256_loadu_ps(k + d + 8), acc2);
                }
                for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(k + d), acc);
                acc = _mm256_add_ps(acc, acc2);
                h[j] = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            }
            _MM_TRANSPOSE4_PS(h[0], h[1], h[2], h[3]); /* h[l] = lane l of the four keys */
            const __m128 sums = _mm_add_ps(_mm_add_ps(h[0], h[2]), _mm_add_ps(h[1], h[3]));
            _mm_storeu_ps(s + i, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
    }
#endif
    for (; i < n; i++) s[i] = dot_k(qh, rows[i], D) * scale;
}

/* out[0:D] = sum_i p[i] * rows[i][0:D]. Accumulates 64 columns at a time in registers over all rows,
 * storing once, instead of a load-add-store of the output per row. */
static void weighted_sum(const float *const *rows, const float *p, int64_t n, int64_t D, float *out) {
    int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const __m256 w = _mm256_set1_ps(p[i]);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[i] + d0 + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + d0 + 8 * j, acc[j]);
    }
#endif
    for (; d0 < D; d0++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) acc += p[i] * rows[i][d0];
        out[d0] = acc;
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

void llmd_decode_attention_body(const float *q, int64_t ldq, const void *k_cache, const void *v_cache, int cache_kind,
                                const int64_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                const int64_t *spans, int64_t num_spans, int64_t H, int64_t KVH, int64_t D,
                                int64_t block_size, int64_t window, float scale, float *partial, float *out) {
    const int64_t group = H / KVH;
    const int64_t row_bytes = llmd_kv_row_bytes(cache_kind, D);
    const int converted = cache_kind != LLMD_CACHE_F32;
    const int64_t B = spans[num_spans];
    const int64_t *cells = spans + B + 1, *ncells = spans + 2 * (B + 1), *tasks = spans + 3 * (B + 1);
    int64_t max_n = 1; /* the largest cell: this thread's scratch */
    for (int64_t b = 0; b < B; b++) max_n = cell_keys(seq_lens[b]) > max_n ? cell_keys(seq_lens[b]) : max_n;
    float *scores = malloc(sizeof(float) * (size_t)max_n);
    /* K and V rows as fp32: the cache's own rows, or converted once for the whole group (bf16, int8) */
    const float **k_rows = malloc(sizeof(float *) * (size_t)max_n);
    const float **v_rows = malloc(sizeof(float *) * (size_t)max_n);
    float *k_widened = converted ? malloc(sizeof(float) * (size_t)(max_n * D)) : NULL;
    float *v_widened = converted ? malloc(sizeof(float) * (size_t)(max_n * D)) : NULL;
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
        for (int64_t pos = start; pos < end; pos++) {
            const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
            const int64_t offset = (slot * KVH + kvh) * row_bytes, i = pos - start;
            if (pos + PREFETCH_AHEAD < end) { /* the cache is read once per step: mostly from DRAM */
                const int64_t ahead = pos + PREFETCH_AHEAD;
                const int64_t next = ((table[ahead / block_size] * block_size + ahead % block_size) * KVH + kvh)
                                     * row_bytes;
                for (int64_t byte = 0; byte < row_bytes; byte += 64) {
                    __builtin_prefetch((const char *)k_cache + next + byte);
                    __builtin_prefetch((const char *)v_cache + next + byte);
                }
            }
            k_rows[i] = llmd_kv_load_row((const char *)k_cache + offset, cache_kind, D,
                                         converted ? k_widened + i * D : NULL);
            v_rows[i] = llmd_kv_load_row((const char *)v_cache + offset, cache_kind, D,
                                         converted ? v_widened + i * D : NULL);
        }
        for (int64_t b = b0; b < b1; b++) {
            /* this row's keys within the cell's: [lo, hi) */
            const int64_t row_first = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
            const int64_t lo = row_first > start ? row_first : start;
            const int64_t hi = seq_lens[b] < end ? seq_lens[b] : end;
            const int64_t n = hi > lo ? hi - lo : 0;
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kvh * group + g;
                float *s = scores;
                scores_for(q + b * ldq + h * D, k_rows + (lo - start), n, D, scale, s);
                float mx = -INFINITY;
                const float total = n > 0 ? softmax_numerators(s, n, &mx) : 0.0f;
                /* One cell: the row's output at once. Several: its part, combined below. Both end
                 * as sum(e^(s - m) v) / sum(e^(s - m)) in the same bits when a row has one cell
                 * with keys in it (the combination's weight is then e^0 = 1): the same result
                 * whichever way a row's span was cut. */
                float *o = ncells[span] == 1 ? out + (b * H + h) * D
                                             : partial + ((b * H + h) * LLMD_ATTN_MAX_CELLS + cell) * (D + 2) + 2;
                weighted_sum(v_rows + (lo - start), s, n, D, o);
                if (ncells[span] == 1) { /* a row sees at least its own key: n > 0 but for a padding row's 0 */
                    for (int64_t d = 0; d < D; d++) o[d] = n > 0 ? o[d] / total : 0.0f;
                } else { /* an empty part (total 0) is skipped in the combination */
                    o[-2] = mx;
                    o[-1] = total;
                }
            }
        }
    }
    free(scores);
    free(k_rows);
    free(v_rows);
    free(k_widened);
    free(v_widened);
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
