/* A whole decode step of a Llama-family model in one call: every decoder layer of M sequences'
 * newest tokens, from their embeddings to the final norm's output (the LM head stays outside).
 *
 * Why: at one sequence a decoder layer's arithmetic takes microseconds, and running it as ~40 torch
 * operations cost more in dispatch and Python than in arithmetic (~1,200 operations a step). Here
 * one OpenMP parallel region runs the whole step: each phase below is a worksharing loop over the
 * region's threads (torch's own OpenMP pool: the library links the libgomp torch loaded), ending in
 * a barrier, and the weights are read by the quantised matmuls of quant_gemm.c.
 *
 * Per layer:  h = rmsnorm(x) * w_in;  qkv = h Wqkv (+ b);  q/k norms (Qwen3);  RoPE on q and k;
 *             k, v into the paged cache at the tokens' slots;  a = attention(q, cache);
 *             x += a Wo (+ b);  h = rmsnorm(x) * w_post;  g, u = h Wgu;  x += (silu(g) * u) Wdown.
 * The residual stream x stays fp32 whatever the model dtype (the cache is fp32, bf16 or int8); each
 * matmul quantises its input to int8 per 32 (llama.cpp's Q8 activations). The reference is the
 * model's torch code (llmd.daemon.models.llama); the two agree to within the activation
 * quantisation, which tests measure by log-probabilities and perplexity, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_row.h"
#include "llmd_cpu.h"
#include "scalar.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DS_AVX2 1
#endif

/* The structs are mirrored by ctypes in llmd.kernels.decode_cpu: change both together. */
typedef struct {
    int32_t kind, group; /* enum llmd_weight_kind; inputs per scale */
    int64_t n, k;        /* output and input features (n unpadded) */
    const uint8_t *w;
    const uint16_t *scales, *mins; /* fp16 [ceil(n/8), k/group, 8]; mins NULL for Q8X8 and symmetric Q4X8 */
    const float *bias;             /* [n] or NULL */
} llmd_linear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], or NULL */
    llmd_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, row]: rows of cache_kind (kv_row.h) */
    int64_t window;          /* sliding window, 0 for none */
    const float *k_centre;   /* [num_kv_heads * head_dim] subtracted from keys before they are stored, or NULL
                              * (an int8 cache's key centring: llmd.daemon.engine.key_centres) */
} llmd_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int32_t cache_kind, nthreads; /* enum llmd_cache_kind */
    float eps, scale;        /* RMSNorm epsilon, attention scale */
    const float *inv_freq;   /* [head_dim / 2] RoPE inverse frequencies (scaling applied) */
    const float *final_norm; /* [hidden] */
    const llmd_layer *layers;
} llmd_model;

/* ---- the step's buffers, carved out of one workspace ---- */

typedef struct {
    float *h, *qkv, *attn, *tmp, *gu, *act, *xd, *xm, *cos, *sin, *partial;
    int8_t *xq;
    int64_t *spans;
} buffers;

#define ALIGN 64
static size_t carve(buffers *b, const llmd_model *md, int64_t M, char *base) {
    const int64_t H = md->hidden, D = md->head_dim, q = md->num_heads * D, kv = md->num_kv_heads * D;
    int64_t kmax = H > q ? H : q;
    kmax = kmax > md->intermediate ? kmax : md->intermediate;
    size_t off = 0;
#define TAKE(field, type, count)                                              \
    do {                                                                      \
        if (base) b->field = (type *)(base + off);                            \
        off += ((sizeof(type) * (size_t)(count) + ALIGN - 1) / ALIGN) * ALIGN; \
    } while (0)
    TAKE(h, float, M * H);
    TAKE(qkv, float, M * (q + 2 * kv));
    TAKE(attn, float, M * q);
    TAKE(tmp, float, M * H);
    TAKE(gu, float, M * 2 * md->intermediate);
    TAKE(act, float, M * md->intermediate);
    TAKE(xq, int8_t, M * kmax);
    TAKE(xd, float, M * kmax / LLMD_QK);
    TAKE(xm, float, M * kmax / LLMD_QK);
    TAKE(cos, float, M * D / 2);
    TAKE(sin, float, M * D / 2);
    TAKE(partial, float, llmd_attention_partial_floats(M, md->num_heads, D));
    TAKE(spans, int64_t, llmd_attention_spans_size(M));
#undef TAKE
    return off;
}

/* Bytes of workspace a step of M rows needs (the caller keeps one and grows it). */
int64_t llmd_decode_workspace_bytes(const llmd_model *md, int64_t M) {
    buffers b;
    return (int64_t)carve(&b, md, M, NULL) + ALIGN;
}

/* ---- elementwise pieces (one row each; the caller splits rows between threads) ---- */

static inline float sum_squares(const float *x, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef DS_AVX2
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc = _mm256_fmadd_ps(a, a, acc);
        acc2 = _mm256_fmadd_ps(b, b, acc2);
    }
    total = llmd_hsum8(_mm256_add_ps(acc, acc2));
#endif
    for (; i < n; i++) total += x[i] * x[i];
    return total;
}

/* y = w * (x / sqrt(mean(x^2) + eps)), as the reference RMSNorm (normalise, then weight). */
static inline void rmsnorm_row(const float *x, const float *w, int64_t n, float eps, float *y) {
    const float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}


/* act = silu(gate) * up = gate / (1 + e^-gate) * up */
static inline void silu_mul_row(const float *gate, const float *up, int64_t n, float *act) {
    int64_t i = 0;
#ifdef DS_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = llmd_exp8(_mm256_xor_ps(g, neg));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* Rotate-half RoPE of `heads` heads of D in place (cos/sin [D/2]: the two halves share them). */
static inline void rope_row(float *v, int64_t heads, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x = v + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

/* Quantise row m of x [M, k] into the matmul inputs (the rows' phases do it, saving a barrier). */
static inline void quantize_row(const float *x, int64_t m, int64_t k, const buffers *b) {
    const int64_t nb = k / LLMD_QK;
    llmd_q8_quantize_row(x + m * k, k, b->xq + m * k, b->xd + m * nb, b->xm + m * nb);
}

/* out = xq W^T (+ b) for activations quantise_row() left in the buffers (a worksharing loop). */
static void linear(const llmd_linear *l, int64_t M, const buffers *b, float *out) {
    llmd_qgemm_body(l->kind, b->xq, b->xd, l->kind == LLMD_Q4X8 ? b->xm : NULL, M, l->k, l->w, l->scales, l->mins,
                    l->n, l->group, out, l->n);
    if (l->bias) {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < l->n; i++) out[m * l->n + i] += l->bias[i];
    }
}

/* x [M, hidden] fp32: the tokens' embeddings in, the residual stream after the last layer out
 * (overwritten); out [M, hidden]: the final norm of it. positions/slots [M]; block_tables
 * [M, max_blocks]; seq_lens [M] (the new token included). workspace: at least
 * llmd_decode_workspace_bytes(md, M) bytes. Returns 0, or -1 for a shape it does not take. */
int llmd_decode_step(const llmd_model *md, float *x, int64_t M, const int64_t *positions, const int64_t *slots,
                     const int64_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, void *workspace,
                     float *out) {
    const int64_t H = md->hidden, D = md->head_dim, NH = md->num_heads, KVH = md->num_kv_heads, I = md->intermediate;
    const int64_t q_size = NH * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size, half = D / 2;
    if (M < 1 || D % 2 || NH % KVH || H % LLMD_QK || q_size % LLMD_QK || I % LLMD_QK) return -1;
    buffers b;
    char *base = (char *)(((uintptr_t)workspace + ALIGN - 1) / ALIGN * ALIGN);
    carve(&b, md, M, base);
    /* a verified span of drafts is rows of one context, which attention reads once for all of them */
    const int64_t num_spans = llmd_attention_spans(block_tables, max_blocks, seq_lens, M, md->block_size, KVH, b.spans);
    const int kind = md->cache_kind;
    const int64_t row_bytes = llmd_kv_row_bytes(kind, D), token_bytes = KVH * row_bytes;
#pragma omp parallel num_threads(md->nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            for (int64_t i = 0; i < half; i++) {
                const float f = (float)positions[m] * md->inv_freq[i];
                b.cos[m * half + i] = cosf(f);
                b.sin[m * half + i] = sinf(f);
            }
            rmsnorm_row(x + m * H, md->layers[0].input_norm, H, md->eps, b.h + m * H);
            quantize_row(b.h, m, H, &b);
        }
        for (int64_t l = 0; l < md->num_layers; l++) {
            const llmd_layer *ly = &md->layers[l];
            linear(&ly->qkv, M, &b, b.qkv);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                float *qr = b.qkv + m * qkv_size, *kr = qr + q_size, *vr = kr + kv_size;
                if (ly->q_norm) {
                    for (int64_t h = 0; h < NH; h++) rmsnorm_row(qr + h * D, ly->q_norm, D, md->eps, qr + h * D);
                    for (int64_t h = 0; h < KVH; h++) rmsnorm_row(kr + h * D, ly->k_norm, D, md->eps, kr + h * D);
                }
                rope_row(qr, NH, D, b.cos + m * half, b.sin + m * half);
                rope_row(kr, KVH, D, b.cos + m * half, b.sin + m * half);
                if (slots[m] >= 0) { /* a negative slot: a padding row, which writes nothing */
                    if (ly->k_centre) /* kr is not read again: attention reads the stored rows */
                        for (int64_t i = 0; i < kv_size; i++) kr[i] -= ly->k_centre[i];
                    char *kd = (char *)ly->k_cache + slots[m] * token_bytes, *vd = (char *)ly->v_cache + slots[m] * token_bytes;
                    for (int64_t h = 0; h < KVH; h++) { /* a row per KV head (an int8 row's scale is its own) */
                        llmd_kv_store_row(kd + h * row_bytes, kr + h * D, D, kind);
                        llmd_kv_store_row(vd + h * row_bytes, vr + h * D, D, kind);
                    }
                }
            }
            llmd_decode_attention_body(b.qkv, qkv_size, ly->k_cache, ly->v_cache, kind, block_tables, max_blocks,
                                       seq_lens, b.spans, num_spans, NH, KVH, D, md->block_size, ly->window,
                                       md->scale, b.partial, b.attn);
            llmd_q8_quantize_body(b.attn, M, q_size, b.xq, b.xd, b.xm);
            linear(&ly->o, M, &b, b.tmp);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                float *xr = x + m * H;
                for (int64_t i = 0; i < H; i++) xr[i] += b.tmp[m * H + i];
                rmsnorm_row(xr, ly->post_norm, H, md->eps, b.h + m * H);
                quantize_row(b.h, m, H, &b);
            }
            linear(&ly->gate_up, M, &b, b.gu);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                silu_mul_row(b.gu + m * 2 * I, b.gu + m * 2 * I + I, I, b.act + m * I);
                quantize_row(b.act, m, I, &b);
            }
            linear(&ly->down, M, &b, b.tmp);
            /* the residual, then the next layer's input norm (or the final one) on the same rows */
            const float *next_norm = l + 1 < md->num_layers ? md->layers[l + 1].input_norm : md->final_norm;
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                float *xr = x + m * H;
                for (int64_t i = 0; i < H; i++) xr[i] += b.tmp[m * H + i];
                rmsnorm_row(xr, next_norm, H, md->eps, (l + 1 < md->num_layers ? b.h : out) + m * H);
                if (l + 1 < md->num_layers) quantize_row(b.h, m, H, &b);
            }
        }
    }
    return 0;
}
