/* INT4 / INT8 weight-only matmuls on the CPU: out[M, N] = x[M, K] @ W[N, K]^T, llama.cpp's way.
 *
 * The activations are quantised to int8 per block of 32 inputs: xd = amax / 127,
 * xq = round(x / xd) (half to even), and xm = xd * sum(xq). A block's product is then an exact
 * integer dot product scaled once:
 *     int4:  sum_b  (w_scale * xd_b) * dot(q_b, xq_b) + w_min * xm_b     (w = scale * q + min)
 *     int8:  sum_b  (w_scale * xd_b) * dot(q_b, xq_b)                      (w = scale * q)
 * with the weight's fp16 scale (and min) of the group the block is in (32, 64 or 128 inputs).
 *
 * Weights are repacked once at load (llmd.kernels.quant_cpu.repack_q4x8 / repack_q8x8) so that
 * eight output rows share each vector: for rows 8G..8G+7 and block b, the 32 weights of each row
 * come as 8 chunks of 4 inputs, and one 32-byte vector holds a chunk for all 8 rows (row i in
 * bytes 4i..4i+3). Multiplied by the activation chunk broadcast to every lane
 * (vpmaddubsw + vpmaddwd), lane i gathers row i's dot product: no horizontal sums, and the scales
 * of the 8 rows are one vector. INT4 packs two chunks per vector (chunk j in the low nibbles, chunk
 * j + 4 in the high ones): 128 bytes per 8 rows and block; INT8 takes 256. Scales (and INT4 mins)
 * are fp16 [N/8, K/group, 8]. A symmetric INT4 weight (GGUF Q4_0: w = scale * (q - 8)) comes without
 * mins (NULL): each is -8 * scale, computed exactly in fp32, so the same bits as with them stored,
 * and 2 bytes fewer per group and row to hold and read.
 *
 * Order of operations, the same in every build (AVX2 or portable C: the same bits), batch size and
 * thread count: per output, blocks in order, acc = fma(float(dot), w_scale * xd, acc), then for int4
 * acc = fma(w_min, xm, acc). The integer dots are exact (maddubs' int16 pairs stay below 2^15: int4
 * values are <= 15, int8 weights enter as |w| <= 128 against |x| <= 127).
 *
 * Threads split the groups of 8 rows; each thread runs its weights through every activation row (MT
 * at a time), so a batch pays the unpacking once per tile of rows, and many rows go a chunk of them
 * at a time (CHUNK_BYTES), whose activations stay in L1. With AVX-512 and VNNI,
 * two groups go together in 512-bit vectors (q4x16_tile, q8x16_offset_tile): each activation
 * broadcast and vpdpbusd then serves 16 outputs. Past a few rows these per-row instructions, not
 * the weights' unpacking or reading, bound the time, so that is 1.2-1.6x at 16-512 rows (prompt
 * chunks, many streams) and 1.04-1.2x at one (benchmarks/quant_matmul_cpu.py --lib).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmd_cpu.h"
#include "scalar.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMD_AVX2 1
/* VNNI (AVX512-VNNI with VL: AMD Zen 4+, Intel Ice Lake+ servers; AVX-VNNI: Intel Alder Lake+):
 * one vpdpbusd adds four u8 x s8 products into each int32 lane, replacing maddubs + madd (+ add).
 * The integer sums are exact either way (maddubs' int16 pairs never saturate here), so VNNI builds
 * compute the same bits as the AVX2 and portable ones. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LLMD_VNNI 1
#define dpbusd(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define LLMD_VNNI 1
#define dpbusd(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#endif
/* AVX-512 with VNNI (Zen 4+, Ice Lake+): INT4 and INT8 weights go two groups of 8 rows at a time in
 * 512-bit vectors (q4x16_tile, q8x16_offset_tile), so each activation broadcast and vpdpbusd serves
 * 16 outputs, not 8. */
#if defined(LLMD_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLMD_ZMM 1
#endif
#endif

#define QK LLMD_QK
/* GROUP_OF_BLOCK: the tiles' block loops count each block's group (g = b / bpg) rather than divide:
 * bpg is a run-time value (1, 2 or 4 blocks, or a whole row for per-channel INT8), so b / bpg was a
 * 64-bit division per block; without it 512 rows of the gate/up projection ran ~8% faster (one
 * thread, AVX-512 VNNI, the best of 6 alternated runs: 14.7 against 15.9 ms). */
/* Activation rows per register tile: a step verifying up to 7 drafts (8 rows of one sequence)
 * unpacks each weight once, not twice. AVX-512's 32 registers hold 8 rows' sums and accumulators
 * beside the weights; AVX2's 16 do not, and the 256-bit tiles keep the accumulators (touched once
 * per block) on the stack, which costs less than unpacking again: with 4 rows per tile a span of 8
 * rows alone cost 3.6x one row's step, with 8 2.7x (the AVX2 build, the default model's whole engine
 * step at a 500-token context, in process, on a 2-core Xeon; measured before the INT4 tile took
 * its rows one at a time after unpacking a block, see q4x8_tile, which made 8 rows up to 1.3x
 * faster again). */
#define MT 8

/* Many rows (a prompt chunk, a batch of verified drafts) go through a thread's weights in blocks:
 * WEIGHT_BLOCK_BYTES of its weights (in L2: 512 KB on Zen 3, 1 MB on Zen 4 and Cascade Lake) against
 * a chunk of CHUNK_BYTES of quantised activation rows (K bytes each; in L1, 32 KB on all three) at a
 * time. Every group of 8 outputs in the block reads the chunk from L1, where without chunks they read
 * every row from L2; and a block of weights is read from memory once, where the chunks alone read
 * weights larger than L2 (the LM head) once per chunk. At 256-512 rows of the default model's shapes,
 * INT4 ran 1.03-1.11x as fast in the AVX-512 VNNI build and 1.02-1.16x in the AVX2 one (INT8 within
 * 3%, up to 64 rows unchanged: benchmarks/quant_matmul_cpu.py --lib, on a 2-core Cascade Lake); a
 * 350-token prompt's prefill 1.05-1.08x in both, in process. A chunk is a whole number of tiles: the
 * same bits. */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES 16384
#endif
#ifndef WEIGHT_BLOCK_BYTES
#define WEIGHT_BLOCK_BYTES (256 * 1024)
#endif
/* The 512-bit build takes two groups a unit (q4x16_tile, q8x16_offset_tile) from this many rows on;
 * fewer go a group at a time. Why: at a few rows the matmuls wait on the weights' reads, and a unit
 * of two groups reads two streams, each broken off where the other begins (groups are stored one
 * after the other), which the prefetchers probably follow worse than one unbroken stream (this VM
 * has no counters to show it). Measured on a 2-core Zen 5: the default model's 120 projections at
 * one row ran 1.2x faster a group at a time (34.9 against 28.6 GB/s, 8 alternated rounds), edit chats
 * 1.10x faster in the engine (benchmarks/engine_lib_ab.py); at 4 rows 1.05-1.12x, at 5 even, from 6
 * rows on the pairs win (0.97-0.76x), their broadcasts serving 16 outputs once arithmetic is the
 * bound. The same bits either way (each lane is q4x8_tile's). */
#ifndef PAIR_MIN_ROWS
#define PAIR_MIN_ROWS 5
#endif
/* The tiles prefetch the weights this many bytes ahead of the block they unpack. Each thread streams
 * one contiguous share of them (llmd_qgemm_body), yet with the hardware prefetchers alone the loads
 * waited on memory, and the rows' arithmetic did not hide it: the default model's 120 projections
 * at 1-4 rows took ~0.5 ms more than with the weights in cache. Measured on a 2-core Zen 5, weights
 * from memory, 16 alternated rounds: the projections at 1, 2, 4, 16 rows 0.81, 0.83, 0.91, 0.95x the
 * time in the AVX2 build, 0.85, 0.74, 0.83, 0.78x in the AVX-512 one; in the engine (edit chats, one
 * stream, benchmarks/engine_lib_ab.py) 1.08x faster without speculation and 1.05x with it (AVX2),
 * 1.08x and 1.12x (AVX-512). 2 KB ahead gave less, 6-16 KB no more. The scales' and mins' own
 * streams prefetched as well measured the same. A prefetch never faults, so reading past the end of
 * the weights is harmless. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
/* `bytes` (a block's: 128 INT4, 256 INT8) at p + PREFETCH_BYTES */
static inline void prefetch_ahead(const uint8_t *p, int bytes) {
#if PREFETCH_BYTES > 0
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + PREFETCH_BYTES + off);
#else
    (void)p, (void)bytes;
#endif
}

int llmd_has_avx2(void) {
#ifdef LLMD_AVX2
    return 1;
#else
    return 0;
#endif
}

int llmd_has_vnni(void) {
#ifdef LLMD_VNNI
    return 1;
#else
    return 0;
#endif
}

/* Whether INT4 and INT8 weights take the 512-bit tiles (two groups of 8 rows at once). */
int llmd_has_avx512(void) {
#ifdef LLMD_ZMM
    return 1;
#else
    return 0;
#endif
}

/* Activation rows the matmuls take per pass over a weight tile: the rows up to this many unpack
 * each weight once (a step verifying drafts of one sequence up to it pays only their arithmetic). */
int llmd_rows_per_pass(void) { return MT; }

/* ---- activations ---- */

#ifdef LLMD_AVX2
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* One block of 32: the scalar definition, which the vector code reproduces bit for bit. */
static inline void quantize_block(const float *src, int8_t *dst, float *d_out, float *m_out) {
    int i = 0;
    float amax = 0.0f;
    int32_t sum = 0;
#ifdef LLMD_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    amax = hmax8(mx);
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sum = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    /* packs work within 128-bit lanes: restore the order with one permute */
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d_out = d;
    *m_out = d * (float)sum;
    (void)i;
#else
    for (i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(src[i]));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (i = 0; i < QK; i++) {
        const int32_t q = (int32_t)nearbyintf(src[i] * id);
        dst[i] = (int8_t)q;
        sum += q;
    }
    *d_out = d;
    *m_out = d * (float)sum;
#endif
}

void llmd_q8_quantize_row(const float *x, int64_t K, int8_t *xq, float *xd, float *xm) {
    for (int64_t b = 0; b < K / QK; b++) quantize_block(x + b * QK, xq + b * QK, xd + b, xm + b);
}

void llmd_q8_quantize_body(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xm) {
    const int64_t nb = K / QK;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M * nb; r++) quantize_block(x + r * QK, xq + r * QK, xd + r, xm + r);
}

/* Public: x [M, K] fp32 (K % 32 == 0). */
void llmd_quantize_q8(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xm, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (M * K >= 65536)
    llmd_q8_quantize_body(x, M, K, xq, xd, xm);
}

/* ---- matmuls ---- */

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* res[m * 8 + i] for mt activation rows and the 8 rows of one group. Always inlined with a
 * constant mt, so each count gets its own unrolled loops. */
static inline __attribute__((always_inline)) void q4x8_tile(const uint8_t *wg, const uint16_t *sg, const uint16_t *mg,
                                                            const int8_t *xq, const float *xd, const float *xm,
                                                            int64_t K, int64_t bpg, float *res, const int mt) {
    const int64_t nb = K / QK;
#ifdef LLMD_AVX2
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    (void)ones; /* unused by VNNI builds */
    __m256 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0, g = 0, e = 0; b < nb; b++, e++) {
        if (e == bpg) e = 0, g++; /* g = b / bpg (see GROUP_OF_BLOCK) */
        const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + g * 8)));
        const __m256 wm = mg ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mg + g * 8)))
                             : _mm256_mul_ps(ws, _mm256_set1_ps(-8.0f)); /* symmetric: min = -8 scale */
        /* The block's weights unpacked once, before the rows, into 8 registers: w[j] holds inputs
         * 4j..4j+3 of the 8 rows (the low nibbles of vector j < 4, the high ones of vector j - 4).
         * Each row then runs its 8 products into registers and out. Unpacking inside the rows' loop
         * (as q4x16_tile does, with 32 registers) had the compiler keep 8 rows' partial sums on
         * the stack in AVX2's 16, a store and a load per product: 64-512 rows of the default model's
         * projections ran 1.3-1.4x slower, 8 rows up to 1.3x (benchmarks/quant_matmul_cpu.py --lib,
         * x86-64-v3 build; built with AVX512-VNNI on 256 bits, 1.0-1.2x: an AVX-VNNI CPU without
         * AVX-512 has only 16 registers for w, p and the broadcasts, and has not been timed). */
        const uint8_t *wb = wg + b * 128;
        prefetch_ahead(wb, 128);
        __m256i w[8];
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 32 * j));
            w[j] = _mm256_and_si256(v, nibble);
            w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
        for (int m = 0; m < mt; m++) {
            const int8_t *x = xq + m * K + b * QK;
#ifdef LLMD_VNNI
            /* int32 sums in four chains: one chain of 8 vpdpbusd waits on their latency (0.72-0.85x) */
            __m256i p[4];
            for (int j = 0; j < 8; j++) {
                const __m256i xj = _mm256_set1_epi32(load_i32(x + 4 * j));
                p[j % 4] = dpbusd(j < 4 ? _mm256_setzero_si256() : p[j % 4], w[j], xj);
            }
            const __m256i s = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
            const __m256 dot = _mm256_cvtepi32_ps(s);
#else
            /* int16 lanes of 8 pairs (16 products of <= 15 * 127): at most 30480, no overflow */
            __m256i s = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++)
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(load_i32(x + 4 * j))));
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
#endif
            acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ws, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
            acc[m] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xm[m * nb + b]), acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) _mm256_storeu_ps(res + 8 * m, acc[m]);
#else
    for (int m = 0; m < mt; m++)
        for (int i = 0; i < 8; i++) res[8 * m + i] = 0.0f;
    for (int64_t b = 0, g = 0, e = 0; b < nb; b++, e++) {
        if (e == bpg) e = 0, g++; /* g = b / bpg (see GROUP_OF_BLOCK) */
        const uint8_t *wb = wg + b * 128;
        int16_t w[8][QK]; /* the block's weights, row by row: plain loops the compiler vectorises */
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 4; j++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t byte = wb[32 * j + 4 * i + t];
                    w[i][4 * j + t] = byte & 0x0f;
                    w[i][16 + 4 * j + t] = byte >> 4;
                }
        for (int m = 0; m < mt; m++) {
            const int8_t *x = xq + m * K + b * QK;
            for (int i = 0; i < 8; i++) {
                int32_t dot = 0;
                for (int k = 0; k < QK; k++) dot += w[i][k] * x[k];
                float acc = res[8 * m + i];
                acc = fmaf((float)dot, llmd_f16_to_f32(sg[g * 8 + i]) * xd[m * nb + b], acc);
                const float wmin = mg ? llmd_f16_to_f32(mg[g * 8 + i]) : -8.0f * llmd_f16_to_f32(sg[g * 8 + i]);
                res[8 * m + i] = fmaf(wmin, xm[m * nb + b], acc);
            }
        }
    }
#endif
}

#ifdef LLMD_VNNI
/* q8x8_tile for several activation rows where the CPU has VNNI: vpdpbusd multiplies u8 by s8, and
 * the plain tile makes each row's activations carry the weights' signs (vpsignb) against |w|, an
 * extra operation per row and chunk. Here the activations come offset to u8 (xu = x + 128, once per
 * call) against the weights as they are, and 128 * sum(w), one vpdpbusd per chunk for all the rows,
 * is taken off: the same integer sums, exactly, so the same bits, with a third fewer operations per
 * row (the LM head's verification rows, several streams' decode rows, INT8 layers' prompts). */
static inline __attribute__((always_inline)) void q8x8_offset_tile(const uint8_t *wg, const uint16_t *sg,
                                                                   const uint8_t *xu, const float *xd, int64_t K,
                                                                   int64_t bpg, float *res, const int mt) {
    const int64_t nb = K / QK;
    const __m256i one8 = _mm256_set1_epi8(1);
    __m256 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0, g = 0, e = 0; b < nb; b++, e++) {
        if (e == bpg) e = 0, g++; /* g = b / bpg (see GROUP_OF_BLOCK) */
        const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + g * 8)));
        const uint8_t *wb = wg + b * 256;
        prefetch_ahead(wb, 256);
        __m256i s32[MT], wsum = _mm256_setzero_si256();
        for (int m = 0; m < mt; m++) s32[m] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + 32 * c));
            wsum = dpbusd(wsum, one8, w); /* each row's sum of its 4 weights, added up over the block */
            for (int m = 0; m < mt; m++)
                s32[m] = dpbusd(s32[m], _mm256_set1_epi32(load_i32((const int8_t *)xu + m * K + b * QK + 4 * c)), w);
        }
        const __m256i offset = _mm256_slli_epi32(wsum, 7); /* 128 * sum(w): what the +128 added */
        for (int m = 0; m < mt; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s32[m], offset)),
                                     _mm256_mul_ps(ws, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
    }
    for (int m = 0; m < mt; m++) _mm256_storeu_ps(res + 8 * m, acc[m]);
}
#endif

static inline __attribute__((always_inline)) void q8x8_tile(const uint8_t *wg, const uint16_t *sg, const int8_t *xq,
                                                            const uint8_t *xu, const float *xd, int64_t K, int64_t bpg,
                                                            float *res, const int mt) {
    const int64_t nb = K / QK;
#ifdef LLMD_VNNI
    if (xu) { /* the activations offset to u8 (see q8x8_offset_tile) */
        q8x8_offset_tile(wg, sg, xu, xd, K, bpg, res, mt);
        return;
    }
#else
    (void)xu;
#endif
#ifdef LLMD_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones; /* unused by VNNI builds */
    __m256 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0, g = 0, e = 0; b < nb; b++, e++) {
        if (e == bpg) e = 0, g++; /* g = b / bpg (see GROUP_OF_BLOCK) */
        const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + g * 8)));
        const uint8_t *wb = wg + b * 256;
        prefetch_ahead(wb, 256);
        __m256i s32[MT];
        for (int m = 0; m < mt; m++) s32[m] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + 32 * c));
            const __m256i aw = _mm256_abs_epi8(w); /* maddubs is u8 x s8: |w| against x carrying w's sign */
            for (int m = 0; m < mt; m++) {
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq + m * K + b * QK + 4 * c)), w);
#ifdef LLMD_VNNI
                s32[m] = dpbusd(s32[m], aw, x);
#else
                s32[m] = _mm256_add_epi32(s32[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones));
#endif
            }
        }
        for (int m = 0; m < mt; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[m]), _mm256_mul_ps(ws, _mm256_set1_ps(xd[m * nb + b])),
                                     acc[m]);
    }
    for (int m = 0; m < mt; m++) _mm256_storeu_ps(res + 8 * m, acc[m]);
#else
    for (int m = 0; m < mt; m++)
        for (int i = 0; i < 8; i++) res[8 * m + i] = 0.0f;
    for (int64_t b = 0, g = 0, e = 0; b < nb; b++, e++) {
        if (e == bpg) e = 0, g++; /* g = b / bpg (see GROUP_OF_BLOCK) */
        const int8_t *wb = (const int8_t *)wg + b * 256;
        int16_t w[8][QK]; /* the block's weights, row by row: plain loops the compiler vectorises */
        for (int i = 0; i < 8; i++)
            for (int c = 0; c < 8; c++)
                for (int t = 0; t < 4; t++) w[i][4 * c + t] = wb[32 * c + 4 * i + t];
        for (int m = 0; m < mt; m++) {
            const int8_t *x = xq + m * K + b * QK;
            for (int i = 0; i < 8; i++) {
                int32_t dot = 0;
                for (int k = 0; k < QK; k++) dot += w[i][k] * x[k];
                res[8 * m + i] = fmaf((float)dot, llmd_f16_to_f32(sg[g * 8 + i]) * xd[m * nb + b],
                                      res[8 * m + i]);
            }
        }
    }
#endif
}

#ifdef LLMD_ZMM
/* 32 bytes of group G (at p) and the same 32 of group G + 1 (a group's stride on), in one vector */
static inline __m512i load_pair(const uint8_t *p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + stride)), 1);
}

/* The 8 fp16 scales (or mins) of group G at s and of group G + 1 (a group's stride on), as fp32 */
static inline __m512 scales_pair(const uint16_t *s, int64_t stride) {
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(s + stride)),
                                            _mm_loadu_si128((const __m128i *)s)));
}

/* q4x8_tile for groups G and G + 1 at once (wg, sg, mg: G's; G + 1's are a group's stride on), res
 * [mt, 16]: lanes 0-7 are G's rows, 8-15 G + 1's. Each lane computes what q4x8_tile's does, in the
 * same order: the same bits. The prompt chunks' matmuls (many rows) are bound by these per-row
 * instructions, not by the weights' unpacking, so halving them per output is what makes them fast. */
static inline __attribute__((always_inline)) void q4x16_tile(const uint8_t *wg, int64_t wstride, const uint16_t *sg,
                                                             const uint16_t *mg, int64_t sstride, const int8_t *xq,
                                                             const float *xd, const float *xm, int64_t K, int64_t bpg,
                                                             float *res, const int mt) {
    const int64_t nb = K / QK;
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0, g = 0, e = 0; b < nb; b++, e++) {
        if (e == bpg) e = 0, g++; /* g = b / bpg (see GROUP_OF_BLOCK) */
        const __m512 ws = scales_pair(sg + g * 8, sstride);
        const __m512 wm = mg ? scales_pair(mg + g * 8, sstride) : _mm512_mul_ps(ws, _mm512_set1_ps(-8.0f));
        const uint8_t *wb = wg + b * 128;
        prefetch_ahead(wb, 128);
        prefetch_ahead(wb + wstride, 128);
        __m512i s[MT];
        for (int m = 0; m < mt; m++) s[m] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i v = load_pair(wb + 32 * j, wstride);
            const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            for (int m = 0; m < mt; m++) {
                const int8_t *x = xq + m * K + b * QK;
                s[m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[m], lo, _mm512_set1_epi32(load_i32(x + 4 * j))), hi,
                                           _mm512_set1_epi32(load_i32(x + 4 * j + 16)));
            }
        }
        for (int m = 0; m < mt; m++) {
            const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(xd[m * nb + b]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), scale, acc[m]);
            acc[m] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xm[m * nb + b]), acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(res + 16 * m, acc[m]);
}

/* q8x8_offset_tile for groups G and G + 1 at once, as q4x16_tile is q4x8_tile's: the same bits. */
static inline __attribute__((always_inline)) void q8x16_offset_tile(const uint8_t *wg, int64_t wstride,
                                                                    const uint16_t *sg, int64_t sstride,
                                                                    const uint8_t *xu, const float *xd, int64_t K,
                                                                    int64_t bpg, float *res, const int mt) {
    const int64_t nb = K / QK;
    const __m512i one8 = _mm512_set1_epi8(1);
    __m512 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0, g = 0, e = 0; b < nb; b++, e++) {
        if (e == bpg) e = 0, g++; /* g = b / bpg (see GROUP_OF_BLOCK) */
        const __m512 ws = scales_pair(sg + g * 8, sstride);
        const uint8_t *wb = wg + b * 256;
        prefetch_ahead(wb, 256);
        prefetch_ahead(wb + wstride, 256);
        __m512i s32[MT], wsum = _mm512_setzero_si512();
        for (int m = 0; m < mt; m++) s32[m] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            const __m512i w = load_pair(wb + 32 * c, wstride);
            wsum = _mm512_dpbusd_epi32(wsum, one8, w);
            for (int m = 0; m < mt; m++) {
                const __m512i x = _mm512_set1_epi32(load_i32((const int8_t *)xu + m * K + b * QK + 4 * c));
                s32[m] = _mm512_dpbusd_epi32(s32[m], x, w);
            }
        }
        const __m512i offset = _mm512_slli_epi32(wsum, 7);
        for (int m = 0; m < mt; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s32[m], offset)),
                                     _mm512_mul_ps(ws, _mm512_set1_ps(xd[m * nb + b])), acc[m]);
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(res + 16 * m, acc[m]);
}

/* Groups G and G + 1 against every activation row: INT4 weights (xq, xm), or INT8 ones (xu, the
 * activations offset to u8). */
static void group_pair(int kind, const uint8_t *w, int64_t wstride, const uint16_t *scales, const uint16_t *mins,
                       int64_t ng, int64_t G, const int8_t *xq, const uint8_t *xu, const float *xd, const float *xm,
                       int64_t M, int64_t K, int64_t bpg, int64_t N, float *out, int64_t ldo) {
    const int64_t nb = K / QK, rows = N - 8 * (G + 1) < 8 ? N - 8 * (G + 1) : 8, ss = ng * 8;
    const uint8_t *wg = w + G * wstride;
    const uint16_t *sg = scales + G * ss, *mg = mins ? mins + G * ss : NULL;
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t mt = M - m0 < MT ? M - m0 : MT;
        const int8_t *x = xq + m0 * K;
        const uint8_t *u = xu ? xu + m0 * K : NULL;
        const float *d = xd + m0 * nb, *s = xm ? xm + m0 * nb : NULL;
        float res[MT * 16];
#define Q4_CASE(T) case T: q4x16_tile(wg, wstride, sg, mg, ss, x, d, s, K, bpg, res, T); break;
#define Q8_CASE(T) case T: q8x16_offset_tile(wg, wstride, sg, ss, u, d, K, bpg, res, T); break;
        if (kind == LLMD_Q4X8) {
            switch (mt) {
            Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4) Q4_CASE(5) Q4_CASE(6) Q4_CASE(7)
            default: q4x16_tile(wg, wstride, sg, mg, ss, x, d, s, K, bpg, res, MT); break;
            }
        } else {
            switch (mt) {
            Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) Q8_CASE(5) Q8_CASE(6) Q8_CASE(7)
            default: q8x16_offset_tile(wg, wstride, sg, ss, u, d, K, bpg, res, MT); break;
            }
        }
#undef Q4_CASE
#undef Q8_CASE
        for (int64_t m = 0; m < mt; m++) {
            memcpy(out + (m0 + m) * ldo + 8 * G, res + 16 * m, sizeof(float) * 8);
            memcpy(out + (m0 + m) * ldo + 8 * (G + 1), res + 16 * m + 8, sizeof(float) * rows);
        }
    }
}
#endif

/* Units [u0, u1) (a unit: a group of 8 outputs, or a pair of them in the 512-bit build) against
 * rows [0, M). */
static void units_rows(int kind, const int8_t *xq, const uint8_t *xu, const float *xd, const float *xm, int64_t M,
                       int64_t K, const uint8_t *w, const uint16_t *scales, const uint16_t *mins, int64_t N,
                       int64_t group, float *out, int64_t ldo, int64_t per_unit, int64_t u0, int64_t u1) {
    const int64_t nb = K / QK, ng = K / group, bpg = group / QK;
    const int64_t wstride = nb * (kind == LLMD_Q4X8 ? 128 : 256);
    for (int64_t unit = u0; unit < u1; unit++) {
        const int64_t G = unit * per_unit;
#ifdef LLMD_ZMM
        if (per_unit == 2 && 8 * (G + 1) < N) { /* group G + 1 exists */
            group_pair(kind, w, wstride, scales, mins, ng, G, xq, xu, xd, xm, M, K, bpg, N, out, ldo);
            continue;
        }
#endif
        const uint8_t *wg = w + G * wstride;
        const uint16_t *sg = scales + G * ng * 8, *mg = mins ? mins + G * ng * 8 : NULL;
        const int64_t rows = N - 8 * G < 8 ? N - 8 * G : 8;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int64_t mt = M - m0 < MT ? M - m0 : MT;
            const int8_t *x = xq + m0 * K;
            const float *d = xd + m0 * nb, *s = xm ? xm + m0 * nb : NULL;
            float res[MT * 8];
            const uint8_t *u = xu && mt > 1 ? xu + m0 * K : NULL; /* (one row: the plain tile) */
#define Q4_CASE(T) case T: q4x8_tile(wg, sg, mg, x, d, s, K, bpg, res, T); break;
#define Q8_CASE(T) case T: q8x8_tile(wg, sg, x, u, d, K, bpg, res, T); break;
            if (kind == LLMD_Q4X8) {
                switch (mt) {
                Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4) Q4_CASE(5) Q4_CASE(6) Q4_CASE(7)
                default: q4x8_tile(wg, sg, mg, x, d, s, K, bpg, res, MT); break;
                }
            } else {
                switch (mt) {
                Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) Q8_CASE(5) Q8_CASE(6) Q8_CASE(7)
                default: q8x8_tile(wg, sg, x, u, d, K, bpg, res, MT); break;
                }
            }
#undef Q4_CASE
#undef Q8_CASE
            for (int64_t m = 0; m < mt; m++) memcpy(out + (m0 + m) * ldo + 8 * G, res + 8 * m, sizeof(float) * rows);
        }
    }
}

void llmd_qgemm_body(int kind, const int8_t *xq, const float *xd, const float *xm, int64_t M, int64_t K,
                     const uint8_t *w, const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t group,
                     float *out, int64_t ldo) {
    const int64_t nb = K / QK, ng = K / group, groups = (N + 7) / 8;
    /* INT8 weights with VNNI, several rows (a row alone takes the plain tile, also in the 512-bit
     * build, where the pairs start at PAIR_MIN_ROWS): the activations offset to u8, this thread's copy */
    uint8_t *xu = NULL;
#ifdef LLMD_VNNI
    const int64_t min_rows = PAIR_MIN_ROWS < 2 ? PAIR_MIN_ROWS : 2;
    if (kind == LLMD_Q8X8 && M >= min_rows && (xu = malloc((size_t)(M * K))) != NULL)
        for (int64_t i = 0; i < M * K; i++) xu[i] = (uint8_t)xq[i] ^ 0x80; /* x + 128 */
#endif
#ifdef LLMD_ZMM
    /* groups per iteration: a pair (group_pair) from PAIR_MIN_ROWS rows on, else one (and INT8 weights
     * whose u8 copy failed) */
    const int64_t per_unit = (kind == LLMD_Q4X8 || xu) && M >= PAIR_MIN_ROWS ? 2 : 1;
#else
    const int64_t per_unit = 1;
#endif
    /* This thread's units: one contiguous share, as schedule(static) gives. NOTE: static, because
     * each thread then streams one contiguous share of the weights, which the hardware prefetcher
     * follows; dynamic chunks of 32 rows (to even out the threads' finishing times) made a one-row
     * decode step ~30% slower. */
    const int64_t units = (groups + per_unit - 1) / per_unit;
    int64_t tid = 0, nth = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num(), nth = omp_get_num_threads();
#endif
    const int64_t q = units / nth, r = units % nth;
    const int64_t u0 = tid * q + (tid < r ? tid : r), u1 = u0 + q + (tid < r);
    /* L2 blocks of those units' weights, and L1 chunks of rows (CHUNK_BYTES) */
    const int64_t unit_bytes = per_unit * (nb * (kind == LLMD_Q4X8 ? 128 : 256) + ng * 8 * (mins ? 4 : 2));
    const int64_t block = WEIGHT_BLOCK_BYTES / unit_bytes > 1 ? WEIGHT_BLOCK_BYTES / unit_bytes : 1;
    const int64_t chunk = CHUNK_BYTES / K / MT * MT > MT ? CHUNK_BYTES / K / MT * MT : MT;
    for (int64_t b0 = u0; b0 < u1; b0 += block) {
        const int64_t b1 = b0 + block < u1 ? b0 + block : u1;
        for (int64_t c0 = 0; c0 < M; c0 += chunk)
            units_rows(kind, xq + c0 * K, xu ? xu + c0 * K : NULL, xd + c0 * nb, xm ? xm + c0 * nb : NULL,
                       M - c0 < chunk ? M - c0 : chunk, K, w, scales, mins, N, group, out + c0 * ldo, ldo, per_unit,
                       b0, b1);
    }
#pragma omp barrier
    free(xu);
}

/* Public: quantise x [M, K] fp32 into the caller's buffers (xq [M, K], xd and xm [M, K/32]) and
 * multiply: out [M, N] fp32. */
void llmd_qgemm(int kind, const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xm, const uint8_t *w,
                const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t group, float *out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        llmd_q8_quantize_body(x, M, K, xq, xd, xm);
        llmd_qgemm_body(kind, xq, xd, kind == LLMD_Q4X8 ? xm : NULL, M, K, w, scales, mins, N, group, out, N);
    }
}

/* Public: the matmul alone, on activations quantised before (tests; sharing them between matmuls). */
void llmd_qgemm_q8(int kind, const int8_t *xq, const float *xd, const float *xm, int64_t M, int64_t K,
                   const uint8_t *w, const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t group,
                   float *out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    llmd_qgemm_body(kind, xq, xd, kind == LLMD_Q4X8 ? xm : NULL, M, K, w, scales, mins, N, group, out, N);
}
