/* Weights into the native kernels' layouts at load (kernels/quant_cpu.py says the layouts).
 *
 * Both layouts interleave 8 rows 4 bytes at a time: for each group g of 8 rows and block b, chunk
 * c of 4 bytes of row i goes to byte 32c + 4i + t of the group's block. A GGUF Q4_0/Q4_1 tensor's
 * nibbles and an INT8 weight's rows differ only in where a row's chunks are (a row's stride, a
 * block's stride, an offset in the block) and how many a block has. These are byte moves, so the
 * result is the torch path's (a permute and a copy) bit for bit; torch's copy of 4-byte runs took
 * ~0.8 s of a 1B model's 2 s load.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scalar.h"

/* dst[((g * nb + b) * chunks + c) * 32 + 4 i + t] = src[(8 g + i) * row + b * block + off + 4 c + t].
 * dst may be src itself when a group's rows are where its output goes (compact rows: row = nb *
 * block, off = 0, block = 4 * chunks): each group is read whole into a buffer first. Returns 0, or
 * -1 when a buffer cannot be had (nothing written). */
int llmd_repack_x8(const uint8_t *src, int64_t groups, int64_t nb, int64_t row, int64_t block, int64_t off,
                   int64_t chunks, uint8_t *dst, int nthreads) {
    const int in_place = (const void *)src == (const void *)dst;
    const int64_t group_bytes = 8 * nb * chunks * 4;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint8_t *buf = in_place ? malloc((size_t)group_bytes) : NULL;
        if (in_place && buf == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (in_place && buf == NULL) continue;
            const uint8_t *rows = src + 8 * g * row;
            if (in_place) {
                memcpy(buf, rows, (size_t)group_bytes);
                rows = buf;
            }
            uint8_t *out = dst + g * nb * chunks * 32;
            for (int64_t b = 0; b < nb; b++)
                for (int64_t c = 0; c < chunks; c++)
                    for (int i = 0; i < 8; i++)
                        memcpy(out + (b * chunks + c) * 32 + 4 * i, rows + i * row + b * block + off + 4 * c, 4);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* Per-row 16-bit values (fp16 scales) into [groups, nb, 8]: dst[(g * nb + b) * 8 + i] = the two
 * bytes at src + (8 g + i) * row + b * block + off. */
void llmd_gather_x8_u16(const uint8_t *src, int64_t groups, int64_t nb, int64_t row, int64_t block, int64_t off,
                        uint16_t *dst, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < 8; i++)
                memcpy(dst + (g * nb + b) * 8 + i, src + (8 * g + i) * row + b * block + off, 2);
}

/* Rows ids[0..n) of an INT8 weight in the Q8X8 layout (w, and scales [N/8, k/group, 8] fp16), as fp32
 * [n, k]: q * scale, the product llmd.kernels.int_layout.dequantize_int8 takes, so the same bits. A
 * tied model's token embeddings are read this way from its head's blocks each step: one call where
 * the torch indexing and dequantising took ten operations (~0.13 ms a decode step, their code cold
 * after the step). Row r is byte 32c + 4(r % 8) + t of block b of group r / 8: input 32b + 4c + t.
 * Returns 0, or -1 for an id outside 0..rows-1 (nothing written). */
int llmd_q8x8_rows(const uint8_t *w, const uint16_t *scales, int64_t rows, int64_t k, int64_t group,
                   const int64_t *ids, int64_t n, float *out) {
    const int64_t nb = k / 32, ng = k / group, bpg = group / 32;
    for (int64_t j = 0; j < n; j++)
        if (ids[j] < 0 || ids[j] >= rows) return -1; /* nothing written */
    for (int64_t j = 0; j < n; j++) {
        const int64_t g = ids[j] / 8, i = ids[j] % 8;
        const int8_t *blocks = (const int8_t *)w + g * nb * 256;
        const uint16_t *s = scales + g * ng * 8 + i;
        float *row = out + j * k;
        for (int64_t b = 0; b < nb; b++) {
            const float scale = llmd_f16_to_f32(s[(b / bpg) * 8]);
            for (int c = 0; c < 8; c++)
                for (int t = 0; t < 4; t++)
                    row[32 * b + 4 * c + t] = (float)blocks[b * 256 + 32 * c + 4 * i + t] * scale;
        }
    }
    return 0;
}
