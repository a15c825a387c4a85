/* Softmax attention for the CPU, forward and backward, one (batch, kv head) at a time
 * (erniekit/nn/fused_attention.py).
 *
 * Why: Paddle's path is three transposes in (q, k, v to heads-major), two batched GEMMs, the
 * masked softmax and a transpose out, and autograd mirrors each; at the embedded default's shapes
 * (32 tokens, heads of 16) those copies and small GEMMs cost more than the arithmetic, and none of
 * them uses a second thread. Here each task reads q, k, v in the model's [B, S, heads, D] layout,
 * keeps its kv head's keys (transposed) and gradient sums in a scratch buffer, and writes its own
 * outputs, so tasks run on any thread with the same bits (no sum crosses a task).
 *
 * Arithmetic (every operation rounds as written: built without -ffast-math, -ffp-contract=off):
 *   qs = q * scale; s[j] = sum_d qs[d] * k[j][d] (in order of d)
 *   z = s + bias; p = exp_neg(z - max z) / sum16(...)     (as kernels/masked_softmax.c)
 *   o[d] = sum_j p[j] * v[j][d] (in order of j)
 * backward, with dO the output's gradient:
 *   dp[j] = sum_d dO[d] * v[j][d]; ds = p * (dp - sum16(p * dp))
 *   dq = (sum_j ds[j] * k[j]) * scale; dk[j] += ds[j] * qs; dv[j] += p[j] * dO
 *   (dk, dv summed over the kv head's query heads and rows in order)
 *
 * Layout: q, o, dq [B, Sq, H, D]; k, v, dk, dv [B, Sk, KVH, D]; bias [Bb, 1, Sq, Sk] (Bb = 1 or B).
 * For the backward the forward keeps either p [B, H, Sq, Sk] or, per row, the softmax's max and
 * reciprocal sum, stats [B, H, Sq, 2] (8 bytes a row instead of 4 * Sk): the backward then computes
 * s and p again with the forward's operations in the forward's order, so p has the same bits either
 * way and so do the gradients (long sequences: p is 1 GiB a layer at 4096 tokens and 16 heads).
 * Both NULL at inference: rows live in scratch. Query head h reads kv head h / (H / KVH). D is a
 * multiple of 16. A call handles tasks [t0, t1) of B * KVH.
 */
#include <stdlib.h>
#include <string.h>

#include "lanes.h"

/* The row blocks' sums are elementwise, so the vector width changes no bit: 16 floats with AVX-512,
 * else 8 (AVX2's ymm). With 64-byte vectors on AVX2, GCC kept the blocks' accumulators on the stack
 * (283 of the kernel's 613 ymm instructions touched it). */
#ifdef __AVX512F__
#define VF 16
#else
#define VF 8
#endif
typedef float vec __attribute__((vector_size(VF * 4)));
#define ROWS 4 /* query rows per block: their 4 x 16 score lanes stay in registers */
/* rows_times' vectors of a row per pass (then one at a time for the rest of D): 4 x 4 zmm or 4 x 2
 * ymm accumulators stay in registers, and a pass over the values reads 64 floats of each row, not
 * 16 (a KV cache's rows lie KVH * D apart: past L1 every pass went to L2) */
#if VF == 16
#define CB 4
#else
#define CB 2
#endif

static inline vec loadv(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vec v) { memcpy(p, &v, sizeof v); }

#if VF == 16
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }
#endif

/* n rounded up to a whole number of 16-float vectors (key rows are padded to it) */
static inline int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

#define INLINE static inline __attribute__((always_inline))
/* Each helper below takes R (rows in the block) as an argument and is always inlined, with the
 * common R == ROWS call spelled out by `BY_ROWS`: its loops over rows then unroll and their
 * accumulators stay in registers. */
#define BY_ROWS(R, call_) \
    do {                  \
        if ((R) == ROWS) {          \
            const int R_ = ROWS;    \
            call_;                  \
        } else {                    \
            const int R_ = (R);     \
            call_;                  \
        }                           \
    } while (0)

/* out[t][j] = sum_d a[t][d] * bT[d][j] for t < R rows and j in [j0, j1), both multiples of 16
 * (a: R x D, rows `lda` apart; bT: D x Skp) */
INLINE void rows_times_t(const float *restrict a, int64_t lda, const int R, const float *restrict bT, int64_t D,
                         int64_t Skp, float *restrict out, int64_t j0, int64_t j1) {
    for (int64_t jb = j0; jb < j1; jb += VF) {
        vec acc[ROWS];
        for (int t = 0; t < R; t++) acc[t] = splat(0.0f);
        for (int64_t d = 0; d < D; d++) {
            const vec b = loadv(bT + d * Skp + jb);
            for (int t = 0; t < R; t++) acc[t] += splat(a[t * lda + d]) * b;
        }
        for (int t = 0; t < R; t++) storev(out + t * Skp + jb, acc[t]);
    }
}

/* out[t][:] = sum_j w[t][j] * m[j][:] (j in [j0, j1) in order) for t < R (w rows Skp apart; m rows `ldm` apart),
 * times `scale` when `scaled` */
INLINE void rows_times_pass(const float *restrict w, int64_t Skp, const int R, const float *restrict m, int64_t ldm,
                            int64_t j0, int64_t j1, int64_t c0, const int NB, float *restrict out, int64_t ldo,
                            float scale, int scaled) {
    vec acc[ROWS][CB];
    for (int t = 0; t < R; t++)
        for (int b = 0; b < NB; b++) acc[t][b] = splat(0.0f);
    for (int64_t j = j0; j < j1; j++) {
        vec x[CB];
        for (int b = 0; b < NB; b++) x[b] = loadv(m + j * ldm + c0 + b * VF);
        for (int t = 0; t < R; t++) {
            const vec wt = splat(w[t * Skp + j]);
            for (int b = 0; b < NB; b++) acc[t][b] += wt * x[b];
        }
    }
    for (int t = 0; t < R; t++)
        for (int b = 0; b < NB; b++) storev(out + t * ldo + c0 + b * VF, scaled ? acc[t][b] * splat(scale) : acc[t][b]);
}

INLINE void rows_times(const float *restrict w, int64_t Skp, const int R, const float *restrict m, int64_t ldm,
                       int64_t j0, int64_t j1, int64_t D, float *restrict out, int64_t ldo, float scale, int scaled) {
    int64_t c0 = 0;
    for (; c0 + CB * VF <= D; c0 += CB * VF)
        rows_times_pass(w, Skp, R, m, ldm, j0, j1, c0, CB, out, ldo, scale, scaled);
    for (; c0 < D; c0 += VF) rows_times_pass(w, Skp, R, m, ldm, j0, j1, c0, 1, out, ldo, scale, scaled);
}

/* acc[j][:] += sum_t w[t][j] * x[t][:] (in order of t) for j in [j0, j1) (w rows `ldw` apart, x rows `ldx` apart) */
INLINE void add_outer(float *restrict acc, const float *restrict w, int64_t ldw, const int R, const float *restrict x,
                      int64_t ldx, int64_t j0, int64_t j1, int64_t D) {
    for (int64_t c = 0; c < D; c += VF) {
        vec xs[ROWS];
        for (int t = 0; t < R; t++) xs[t] = loadv(x + t * ldx + c);
        for (int64_t j = j0; j < j1; j++) {
            vec a = loadv(acc + j * D + c);
            for (int t = 0; t < R; t++) a += splat(w[t * ldw + j]) * xs[t];
            storev(acc + j * D + c, a);
        }
    }
}

/* lane-wise halving: a[0] ends as the tree sum (max) of a[0..15] */
INLINE float tree_sum(float *a) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] = a[l] + a[l + w];
    return a[0];
}

INLINE float tree_max(float *a) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] = a[l + w] > a[l] ? a[l + w] : a[l];
    return a[0];
}

/* z = softmax(z + bias) in place over the keys [j0, j1) (j0 a multiple of 16, j1 <= Sk): the keys
 * outside are masked for this row block, and their exact 0 is what the full row would give them.
 * z's slots up to j1 rounded up to 16 are used (the padding is overwritten). */
static void softmax_row(float *restrict z, const float *restrict brow, int64_t j0, int64_t j1, float *stats) {
    const int64_t j16 = up16(j1);
    for (int64_t j = j0; j < j1; j++) z[j] = z[j] + brow[j];
    for (int64_t j = j1; j < j16; j++) z[j] = -__builtin_inff();
    float mx[LANES];
    for (int l = 0; l < LANES; l++) mx[l] = -__builtin_inff();
    for (int64_t jb = j0; jb < j16; jb += LANES)
        for (int l = 0; l < LANES; l++) mx[l] = z[jb + l] > mx[l] ? z[jb + l] : mx[l];
    const float m = tree_max(mx);
    float acc[LANES] = {0};
    for (int64_t jb = j0; jb < j16; jb += LANES)
        for (int l = 0; l < LANES; l++) {
            const float e = exp_neg(z[jb + l] - m);
            z[jb + l] = e;
            acc[l] += e;
        }
    const float inv = 1.0f / tree_sum(acc);
    for (int64_t j = j0; j < j1; j++) z[j] = z[j] * inv;
    if (stats) stats[0] = m, stats[1] = inv;
}

/* softmax_row's p again from its max and reciprocal sum, with its operations in its order (the
 * same bits); every slot of z outside [j0, j1) up to Skp becomes 0, as in a saved p row */
static void softmax_row_again(float *restrict z, const float *restrict brow, int64_t j0, int64_t j1, int64_t Skp,
                              const float *stats) {
    const float m = stats[0], inv = stats[1];
    memset(z, 0, sizeof(float) * j0);
    for (int64_t j = j0; j < j1; j++) {
        const float e = exp_neg((z[j] + brow[j]) - m);
        z[j] = e * inv;
    }
    memset(z + j1, 0, sizeof(float) * (Skp - j1));
}

/* The keys [*j0, *j1) that R rows (`ld` apart) may see: outside it every row's entry is `none`
 * (an additive mask's -1e30 or below, or a probability of exactly 0), so skipping those keys
 * changes no sum. *j0 is rounded down to a multiple of 16; a row that sees nothing widens the
 * range to all Sk keys (the full row's arithmetic then decides). */
static void key_range(const float *rows, int64_t ld, int R, int64_t Sk, int is_mask, int64_t *j0, int64_t *j1) {
    int64_t lo = Sk, hi = 0;
    for (int t = 0; t < R; t++) {
        const float *r = rows + t * ld;
        int64_t a = 0, b = Sk;
        if (is_mask) {
            while (a < Sk && r[a] <= -1e30f) a++;
            while (b > a && r[b - 1] <= -1e30f) b--;
        } else {
            while (a < Sk && r[a] == 0.0f) a++;
            while (b > a && r[b - 1] == 0.0f) b--;
        }
        if (a == b) a = 0, b = Sk;
        lo = a < lo ? a : lo;
        hi = b > hi ? b : hi;
    }
    *j0 = lo / 16 * 16;
    *j1 = hi;
}

/* p * dp's row sum over the slots [j0, j16) (multiples of 16; p is zero past Sk) */
INLINE float row_dot(const float *restrict p, const float *restrict dp, int64_t j0, int64_t j16) {
    float acc[LANES] = {0};
    for (int64_t jb = j0; jb < j16; jb += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += p[jb + l] * dp[jb + l];
    return tree_sum(acc);
}

/* kT[d][j] = k[j][d] for one kv head, zero past Sk (rows of k `ldk` apart; D a multiple of 16).
 * Blocks of 16 keys x 16 columns go through a tile in L1 (element by element, 64 stores a key
 * into 64 rows of kT): with rows_times' wider passes, a decode step's attention at 16 sequences of
 * 16 heads, 96 keys, one thread, cache hot, 368-384 -> 297-310 us (old and new interleaved, Intel
 * Xeon). A decode step copies every cached key each step. */
static void pack_t(const float *k, int64_t ldk, int64_t Sk, int64_t D, int64_t Skp, float *kT) {
    int64_t j = 0;
    for (; j + 16 <= Sk; j += 16)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            float t[16][16];
            for (int a = 0; a < 16; a++) memcpy(t[a], k + (j + a) * ldk + d0, sizeof t[a]);
            for (int c = 0; c < 16; c++)
                for (int a = 0; a < 16; a++) kT[(d0 + c) * Skp + j + a] = t[a][c];
        }
    for (int64_t d = 0; d < D; d++) {
        for (int64_t i = j; i < Sk; i++) kT[d * Skp + i] = k[i * ldk + d];
        for (int64_t i = Sk; i < Skp; i++) kT[d * Skp + i] = 0.0f;
    }
}

/* qs = q * scale for the R rows of a block (rows `ldq` apart): the forward and the backward scale alike */
INLINE void scaled_rows(const float *restrict q0, int64_t ldq, const int R, int64_t D, float scale, float *restrict qs) {
    for (int t = 0; t < R; t++)
        for (int64_t d = 0; d < D; d++) qs[t * D + d] = q0[t * ldq + d] * scale;
}

/* A row block's keys and scores: the range [*j0, *j1) its mask lets it see (its mask rows `ldb`
 * apart), and s = qs kT over it (to *j1 rounded up to 16). The forward and the backward that
 * recomputes take this one path, so the backward's scores are the forward's bits. */
static void block_scores(const float *restrict qs, const int R, const float *restrict brows, int64_t ldb,
                         int64_t Sk, const float *restrict kT, int64_t D, int64_t Skp, float *restrict s,
                         int64_t *j0, int64_t *j1) {
    key_range(brows, ldb, R, Sk, 1, j0, j1);
    BY_ROWS(R, rows_times_t(qs, D, R_, kT, D, Skp, s, *j0, up16(*j1)));
}

static float *scratch(int64_t n) { return aligned_alloc(64, sizeof(float) * (size_t)up16(n)); }

/* The forward of R query rows against one kv head's keys kT and values vg: their rows lie `ld` apart in
 * q and in o, their mask rows `ldb` apart, their p / stats rows are r0, r0 + 1, ... A block is either
 * R rows of one query head or, in a decode step (Sq = 1), R query heads of one kv head against the
 * one mask row (ldb = 0). Every row's operations are the same either way (each sum runs over d or j
 * alone, and a decode block's rows all see the same keys), so a decode row has the bits it had one
 * head at a time, while the block's sums fill the registers (2.5-2.8x faster on one thread). */
INLINE void forward_rows(const float *q0, float *o0, int64_t ld, const int R, const float *brows, int64_t ldb,
                         int64_t r0, const float *kT, const float *vg, float *s, float *qs, float *p, float *stats,
                         float scale, int64_t Sk, int64_t Skp, int64_t KVH, int64_t D) {
    BY_ROWS(R, scaled_rows(q0, ld, R_, D, scale, qs));
    int64_t j0, j1;
    block_scores(qs, R, brows, ldb, Sk, kT, D, Skp, s, &j0, &j1);
    for (int t = 0; t < R; t++) {
        float *row = s + t * Skp;
        softmax_row(row, brows + t * ldb, j0, j1, stats ? stats + 2 * (r0 + t) : NULL);
        if (p) {
            float *pr = p + (r0 + t) * Sk;
            memset(pr, 0, sizeof(float) * j0);
            memcpy(pr + j0, row + j0, sizeof(float) * (j1 - j0));
            memset(pr + j1, 0, sizeof(float) * (Sk - j1));
        }
    }
    BY_ROWS(R, rows_times(s, Skp, R_, vg, KVH * D, j0, j1, D, o0, ld, 0.0f, 0));
}

/* kv_rows: the rows of k and v per batch entry, Sk or more (a decode step reads a KV cache's
 * buffers [B, capacity, KVH, D] in place, where the first Sk of each entry's rows are valid) */
void erniekit_attention_fwd(const float *q, const float *k, const float *v, const float *bias, float *o, float *p,
                            float *stats, float scale, int64_t Sq, int64_t Sk, int64_t kv_rows, int64_t H,
                            int64_t KVH, int64_t D, int64_t bias_batched, int64_t t0, int64_t t1) {
    const int64_t rep = H / KVH, Skp = up16(Sk);
    float *kT = scratch(D * Skp), *s = scratch(ROWS * Skp), *qs = scratch(ROWS * D);
    for (int64_t task = t0; task < t1; task++) {
        const int64_t b = task / KVH, g = task % KVH;
        pack_t(k + (b * kv_rows * KVH + g) * D, KVH * D, Sk, D, Skp, kT);
        const float *vg = v + (b * kv_rows * KVH + g) * D;
        if (Sq == 1) { /* a decode step: the kv head's query heads are the blocks' rows */
            const float *brow = bias + (bias_batched ? b : 0) * Sk;
            for (int64_t h0 = g * rep; h0 < (g + 1) * rep; h0 += ROWS) {
                const int R = (int)((g + 1) * rep - h0 < ROWS ? (g + 1) * rep - h0 : ROWS);
                const int64_t r0 = b * H + h0;
                forward_rows(q + r0 * D, o + r0 * D, D, R, brow, 0, r0, kT, vg, s, qs, p, stats, scale, Sk, Skp, KVH,
                             D);
            }
            continue;
        }
        for (int64_t h = g * rep; h < (g + 1) * rep; h++)
            for (int64_t i0 = 0; i0 < Sq; i0 += ROWS) {
                const int R = (int)(Sq - i0 < ROWS ? Sq - i0 : ROWS);
                const int64_t r0 = (b * Sq + i0) * H + h; /* q's and o's row; p's and stats' is (b * H + h) * Sq + i0 */
                forward_rows(q + r0 * D, o + r0 * D, H * D, R, bias + ((bias_batched ? b : 0) * Sq + i0) * Sk, Sk,
                             (b * H + h) * Sq + i0, kT, vg, s, qs, p, stats, scale, Sk, Skp, KVH, D);
            }
    }
    free(kT), free(s), free(qs);
}

void erniekit_attention_bwd(const float *q, const float *k, const float *v, const float *bias, const float *p,
                            const float *stats, const float *dout, float *dq, float *dk, float *dv, float scale,
                            int64_t Sq, int64_t Sk, int64_t H, int64_t KVH, int64_t D, int64_t bias_batched,
                            int64_t t0, int64_t t1) {
    const int64_t rep = H / KVH, Skp = up16(Sk);
    float *vT = scratch(D * Skp), *dp = scratch(ROWS * Skp), *pr = scratch(ROWS * Skp), *qs = scratch(ROWS * D);
    float *dka = scratch(Sk * D), *dva = scratch(Sk * D), *kT = p ? NULL : scratch(D * Skp);
    memset(pr, 0, sizeof(float) * ROWS * Skp); /* the padding stays 0: row_dot reads it */
    for (int64_t task = t0; task < t1; task++) {
        const int64_t b = task / KVH, g = task % KVH;
        const float *kg = k + (b * Sk * KVH + g) * D;
        pack_t(v + (b * Sk * KVH + g) * D, KVH * D, Sk, D, Skp, vT);
        if (kT) pack_t(kg, KVH * D, Sk, D, Skp, kT);
        memset(dka, 0, sizeof(float) * Sk * D);
        memset(dva, 0, sizeof(float) * Sk * D);
        for (int64_t h = g * rep; h < (g + 1) * rep; h++)
            for (int64_t i0 = 0; i0 < Sq; i0 += ROWS) {
                const int R = (int)(Sq - i0 < ROWS ? Sq - i0 : ROWS);
                const float *dor = dout + ((b * Sq + i0) * H + h) * D;
                const int64_t r0 = (b * H + h) * Sq + i0;
                BY_ROWS(R, scaled_rows(q + ((b * Sq + i0) * H + h) * D, H * D, R_, D, scale, qs));
                int64_t j0, j1;
                if (p) {
                    key_range(p + r0 * Sk, Sk, R, Sk, 0, &j0, &j1);
                    for (int t = 0; t < R; t++) memcpy(pr + t * Skp, p + (r0 + t) * Sk, sizeof(float) * Sk);
                } else { /* the forward's scores and probabilities over the forward's key range */
                    const float *brows = bias + ((bias_batched ? b : 0) * Sq + i0) * Sk;
                    block_scores(qs, R, brows, Sk, Sk, kT, D, Skp, pr, &j0, &j1);
                    for (int t = 0; t < R; t++)
                        softmax_row_again(pr + t * Skp, brows + t * Sk, j0, j1, Skp, stats + 2 * (r0 + t));
                }
                const int64_t j16 = up16(j1);
                BY_ROWS(R, rows_times_t(dor, H * D, R_, vT, D, Skp, dp, j0, j16));
                for (int t = 0; t < R; t++) {
                    float *drow = dp + t * Skp, *prt = pr + t * Skp;
                    const float dot = row_dot(prt, drow, j0, j16);
                    for (int64_t j = j0; j < j1; j++) drow[j] = prt[j] * (drow[j] - dot); /* ds */
                }
                float *dqr = dq + ((b * Sq + i0) * H + h) * D;
                BY_ROWS(R, rows_times(dp, Skp, R_, kg, KVH * D, j0, j1, D, dqr, H * D, scale, 1));
                BY_ROWS(R, add_outer(dva, pr, Skp, R_, dor, H * D, j0, j1, D));
                BY_ROWS(R, add_outer(dka, dp, Skp, R_, qs, D, j0, j1, D));
            }
        for (int64_t j = 0; j < Sk; j++) {
            memcpy(dk + ((b * Sk + j) * KVH + g) * D, dka + j * D, sizeof(float) * D);
            memcpy(dv + ((b * Sk + j) * KVH + g) * D, dva + j * D, sizeof(float) * D);
        }
    }
    free(vT), free(dp), free(pr), free(qs), free(dka), free(dva), free(kT);
}
