/* Decode-sized GEMMs: a few rows of activations against a whole float32 weight, on the OpenMP
 * team of Paddle's libiomp5 (the threads its MKL already runs, so the two never fight for cores).
 *
 * Why: at 1-7 rows a GEMM only streams its weight, and MKL 2019's small-M sgemm streams it well
 * under the memory's rate; the tied head reads its [V, H] weight transposed (nn/small_gemm.py has
 * the measurements).
 *
 * The arithmetic is fixed per output element, whatever the thread count or tiling, so numpy
 * reproduces it bit for bit (built with -ffp-contract=off: every operation rounds as written):
 *   kn: y[m, n] = (P0 + P1) (+ b[n]), P0 = the in-order sum over k < K / 2 of x[m, k] * w[k, n] by
 *       fused multiply-adds (P = fma(x[m, k], w[k, n], P), one rounding each: native.fma32), P1 the
 *       same over K / 2 <= k < K; w is [K, N] (nn.Linear's layout).
 *   nk: y[m, n] = the 16-lane sum of x[m, k] * w[n, k] (each product rounded; lane k % 16 in
 *       order, then the lanes in order: native.sum16); w is [N, K] (the tied head's embedding).
 * The two halves of kn are what lets two threads each stream one contiguous half of w.
 * K and N must be multiples of 16 (nn/small_gemm.py checks).
 *
 * Why fused in kn: at 32-64 rows the packed kernel below is bound by its arithmetic, and a separate
 * multiply and add are two instructions where an FMA is one. On an Intel Xeon (AVX-512, one core, a
 * 6 x 64 tile on a panel in L1) 56 GFLOP/s -> 110; nk is bound by reading its weight, so it keeps
 * its products rounded (its twin is shared with the other kernels' lane sums).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

#define ACC_FLOATS 4096 /* 16 KB of accumulators per column chunk: they stay in L1 */

static inline v16 load(const float *p) { return *(const v16 *)p; }
static inline void store(float *p, v16 v) { *(v16 *)p = v; }

/* vt: one vector register (16 floats with AVX-512, else 8); the kernels compute in these */
#ifdef __AVX512F__
typedef v16 vt;
#define VT_FLOATS 16
#define VPT 4

static inline vt splat_t(float a) { return (vt){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }

/* a * b + c, rounded once in each lane */
static inline vt fmadd_t(vt a, vt b, vt c) { return (vt)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
typedef float vt __attribute__((vector_size(32), aligned(4), may_alias));
#define VT_FLOATS 8
#define VPT 2

/* a in every lane (a lane loop compiles to 16-byte stores and a reload) */
static inline vt splat_t(float a) { return (vt){a, a, a, a, a, a, a, a}; }

/* a * b + c, rounded once in each lane; without the FMA instructions by libm's fmaf: the same bits,
 * 15-20x slower, so nn/small_gemm.py leaves such builds alone (erniekit_small_gemm_fast_fma) */
static inline vt fmadd_t(vt a, vt b, vt c) {
#ifdef __FMA__
    return (vt)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int l = 0; l < 8; l++) c[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return c;
#endif
}
#endif
static inline vt load_t(const float *p) { return *(const vt *)p; }
static inline void store_t(float *p, vt v) { *(vt *)p = v; }

/* 1 where fmadd_t is an instruction (GCC and Clang define __FP_FAST_FMAF then), else 0 */
int erniekit_small_gemm_fast_fma(void) {
#if defined(__AVX512F__) || defined(__FP_FAST_FMAF)
    return 1;
#else
    return 0;
#endif
}

/* out[m, n] (row stride N) = in-order sum over k0 <= k < k1 of x[m, k] * w[k, n], n0 <= n < n1 */
static void kn_part(const float *x, const float *w, float *out, int64_t M, int64_t K, int64_t N, int64_t k0,
                    int64_t k1, int64_t n0, int64_t n1) {
    int64_t C = ACC_FLOATS / M;
    C -= C % 16;
    if (C < 16) C = 16;
    for (int64_t c0 = n0; c0 < n1; c0 += C) {
        int64_t c1 = c0 + C < n1 ? c0 + C : n1;
        for (int64_t m = 0; m < M; m++) memset(out + m * N + c0, 0, sizeof(float) * (c1 - c0));
        int64_t k = k0;
        for (; k + 4 <= k1; k += 4) { /* four rows of w per pass over the accumulators */
            const float *r0 = w + k * N, *r1 = r0 + N, *r2 = r1 + N, *r3 = r2 + N;
            for (int64_t j = c0; j < c1; j += VT_FLOATS) {
                vt a = load_t(r0 + j), b = load_t(r1 + j), c = load_t(r2 + j), d = load_t(r3 + j);
                for (int64_t m = 0; m < M; m++) {
                    const float *xm = x + m * K + k;
                    float *o = out + m * N + j;
                    vt v = load_t(o);
                    v = fmadd_t(splat_t(xm[0]), a, v);
                    v = fmadd_t(splat_t(xm[1]), b, v);
                    v = fmadd_t(splat_t(xm[2]), c, v);
                    v = fmadd_t(splat_t(xm[3]), d, v);
                    store_t(o, v);
                }
            }
        }
        for (; k < k1; k++)
            for (int64_t j = c0; j < c1; j += VT_FLOATS) {
                vt a = load_t(w + k * N + j);
                for (int64_t m = 0; m < M; m++)
                    store_t(out + m * N + j, fmadd_t(splat_t(x[m * K + k]), a, load_t(out + m * N + j)));
            }
    }
}

/* y [M, N] = x [M, K] @ w [K, N] (+ b); tmp: [M, N] scratch for P1 */
void erniekit_small_gemm_kn(const float *x, const float *w, const float *b, float *y, float *tmp, int64_t M,
                            int64_t K, int64_t N, int64_t threads) {
    int64_t kh = K / 2;
#pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t chunks = T >= 2 ? T / 2 : 1, units = 2 * chunks, vecs = N / 16;
        for (int64_t u = t; u < units; u += T) { /* unit u: half u % 2 of k, column chunk u / 2 */
            int64_t h = u % 2, c = u / 2;
            int64_t n0 = vecs * c / chunks * 16, n1 = vecs * (c + 1) / chunks * 16;
            kn_part(x, w, h ? tmp : y, M, K, N, h ? kh : 0, h ? K : kh, n0, n1);
        }
#pragma omp barrier
        int64_t a = vecs * t / T * 16, e = vecs * (t + 1) / T * 16;
        for (int64_t m = 0; m < M; m++) /* P0 + P1 (+ b), each thread its own columns */
            for (int64_t j = a; j < e; j += 16) {
                v16 v = load(y + m * N + j) + load(tmp + m * N + j);
                if (b) v = v + load(b + j);
                store(y + m * N + j, v);
            }
    }
}

/* G products y_g [M_g, N] = x_g [M_g, K] @ w_g [K, N] (addresses in xs, ws, ys; M_g in rows), each
 * with kn's arithmetic, in one parallel region: the 2G halves spread over the threads, then each
 * thread adds P0 + P1 for its share of the groups. For a MoE block's expert groups of a few rows
 * (nn/grouped_gemm.py), where one call per group paid a fork and join per 1 MB expert.
 * tmp: sum(M_g) x N floats. */
void erniekit_small_gemm_kn_groups(const int64_t *xs, const int64_t *ws, const int64_t *ys, const int64_t *rows,
                                   int64_t G, float *tmp, int64_t K, int64_t N, int64_t threads) {
    int64_t kh = K / 2;
#pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int64_t u = t; u < 2 * G; u += T) {
            int64_t g = u / 2, h = u % 2, at = 0;
            for (int64_t i = 0; i < g; i++) at += rows[i];
            const float *x = (const float *)xs[g], *w = (const float *)ws[g];
            if (rows[g] <= 0) continue; /* nothing to write (kn_part sizes its chunks by the rows) */
            kn_part(x, w, h ? tmp + at * N : (float *)ys[g], rows[g], K, N, h ? kh : 0, h ? K : kh, 0, N);
        }
#pragma omp barrier
        int64_t at = 0;
        for (int64_t g = 0; g < G; at += rows[g], g++) {
            if (g % T != t) continue;
            float *y = (float *)ys[g];
            for (int64_t j = 0; j < rows[g] * N; j += 16) store(y + j, load(y + j) + load(tmp + at * N + j));
        }
    }
}

/* the 16 lanes of v summed in order */
static inline float lanes_sum(v16 v) {
    float s = v[0];
    for (int i = 1; i < 16; i++) s += v[i];
    return s;
}

#ifdef __AVX512F__
#define NK_T 4 /* rows of x and of w per nk block: 4 x 4 v16 sums, 16 of the 32 zmm registers */

/* y[m, n0:n0+R] for R (<= 4) rows of w: x rows in blocks of 4 against those rows */
static void nk_rows(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N, int64_t n0,
                    int64_t R) {
    const float *wr[4];
    for (int64_t r = 0; r < 4; r++) wr[r] = w + (n0 + (r < R ? r : 0)) * K;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        int64_t mb = M - m0 < 4 ? M - m0 : 4;
        v16 acc[4][4];
        memset(acc, 0, sizeof(acc));
        for (int64_t k = 0; k < K; k += 16) {
            v16 a0 = load(wr[0] + k), a1 = load(wr[1] + k), a2 = load(wr[2] + k), a3 = load(wr[3] + k);
            for (int64_t i = 0; i < mb; i++) {
                v16 xv = load(x + (m0 + i) * K + k);
                acc[i][0] = acc[i][0] + xv * a0;
                acc[i][1] = acc[i][1] + xv * a1;
                acc[i][2] = acc[i][2] + xv * a2;
                acc[i][3] = acc[i][3] + xv * a3;
            }
        }
        for (int64_t i = 0; i < mb; i++)
            for (int64_t r = 0; r < R; r++) y[(m0 + i) * N + n0 + r] = lanes_sum(acc[i][r]);
    }
}

#else
#define NK_T 2 /* 2 x 2 sums of 16 lanes, each two 8-float halves: 8 of AVX2's 16 registers (4 x 4 spilled) */

typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));

static inline v8 load8(const float *p) { return *(const v8 *)p; }

/* lanes_sum of the 16 lanes lo[0..7], hi[0..7]: the same order, so the same bits */
static inline float halves_sum(v8 lo, v8 hi) {
    float s = lo[0];
    for (int i = 1; i < 8; i++) s += lo[i];
    for (int i = 0; i < 8; i++) s += hi[i];
    return s;
}

/* nk_rows of AVX-512 with blocks of 2: y[m, n0:n0+R] for R (<= 2) rows of w */
static void nk_rows(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N, int64_t n0,
                    int64_t R) {
    const float *wr[2];
    for (int64_t r = 0; r < 2; r++) wr[r] = w + (n0 + (r < R ? r : 0)) * K;
    for (int64_t m0 = 0; m0 < M; m0 += 2) {
        int64_t mb = M - m0 < 2 ? M - m0 : 2;
        v8 lo[2][2] = {{{0}}}, hi[2][2] = {{{0}}};
        for (int64_t k = 0; k < K; k += 16) {
            v8 a0 = load8(wr[0] + k), b0 = load8(wr[0] + k + 8), a1 = load8(wr[1] + k), b1 = load8(wr[1] + k + 8);
            for (int64_t i = 0; i < mb; i++) {
                v8 xl = load8(x + (m0 + i) * K + k), xh = load8(x + (m0 + i) * K + k + 8);
                lo[i][0] = lo[i][0] + xl * a0;
                hi[i][0] = hi[i][0] + xh * b0;
                lo[i][1] = lo[i][1] + xl * a1;
                hi[i][1] = hi[i][1] + xh * b1;
            }
        }
        for (int64_t i = 0; i < mb; i++)
            for (int64_t r = 0; r < R; r++) y[(m0 + i) * N + n0 + r] = halves_sum(lo[i][r], hi[i][r]);
    }
}
#endif

#define NK_BLOCK 64 /* rows of w per block: 256 KB at K = 1024, kept in L2 while every block of x passes */

/* y [M, N] = x [M, K] @ w [N, K]^T */
void erniekit_small_gemm_nk(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N,
                            int64_t threads) {
    int64_t blocks = (N + NK_BLOCK - 1) / NK_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t end = (b + 1) * NK_BLOCK < N ? (b + 1) * NK_BLOCK : N;
        for (int64_t m0 = 0; m0 < M; m0 += NK_T) /* NK_T rows of x (L1) against the block's rows of w (L2) */
            for (int64_t n0 = b * NK_BLOCK; n0 < end; n0 += NK_T)
                nk_rows(x + m0 * K, w, y + m0 * N, M - m0 < NK_T ? M - m0 : NK_T, K, N, n0,
                        end - n0 < NK_T ? end - n0 : NK_T);
    }
}

/* Packed projections: w [K, N] copied once into panels [N / PANEL][K][PANEL], each one tile wide, so
 * that a tile's accumulators (6 rows x PANEL columns) stay in registers while its panel streams in
 * order. Worth its copy of the weights at 8-64 rows (the server's batches), where the kernels above
 * are bound by their accumulators' traffic. The arithmetic is kn's (two halves of k, each in order,
 * added), so both give the same bits, whatever the panel width.
 *
 * With AVX-512 a tile is 6 x 4 zmm (24 of the 32 registers), 64 columns. Without, it is 6 x 2 ymm
 * (12 of AVX2's 16), 16 columns, and so is the panel: with panels 64 columns wide a 16-column tile
 * read 64 of every 256 bytes, and a [16, 1024] x [1024, 3072] product took 3.1 ms against MKL's
 * 2.6; with 16-column panels 1.7 ms (AMD EPYC without AVX-512, 2 threads, weights out of cache).
 * With 64-byte vectors there GCC kept the accumulators on the stack (34 tokens/s at batch-8 decode
 * against 109 unpacked). */
#define PANEL (VT_FLOATS * VPT) /* columns per panel and per tile */

void erniekit_small_gemm_pack(const float *w, float *p, int64_t K, int64_t N) {
    for (int64_t j = 0; j < N; j += PANEL)
        for (int64_t k = 0; k < K; k++) memcpy(p + j * K + k * PANEL, w + k * N + j, PANEL * sizeof(float));
}

/* the same panels from w [N, K] (the tied head's embedding): panel j holds w^T's columns j..j+PANEL-1 */
void erniekit_small_gemm_pack_t(const float *w, float *p, int64_t K, int64_t N) {
    for (int64_t j = 0; j < N; j += PANEL)
        for (int64_t c = 0; c < PANEL; c++)
            for (int64_t k = 0; k < K; k++) p[j * K + k * PANEL + c] = w[(j + c) * K + k];
}


/* acc[i] += x[m0 + i, k] * panel row k for k in [k0, k1), in order; the first n_ahead of those
 * iterations also prefetch a panel row each, from `ahead` on (stream_panel; 0 for the tile order) */
static inline __attribute__((always_inline)) void sum_rows(const float *x, const float *panel, vt acc[6][VPT],
                                                           int64_t K, int64_t k0, int64_t k1, int64_t m0,
                                                           const int MB, const float *ahead, int64_t n_ahead) {
    for (int64_t k = k0; k < k1; k++) {
        const float *pk = panel + k * PANEL;
        if (k - k0 < n_ahead) /* a panel row is one 64-byte line with AVX2, four with AVX-512 */
            for (int c = 0; c < PANEL; c += 16) __builtin_prefetch(ahead + (k - k0) * PANEL + c, 0, 3);
        vt a[VPT];
        for (int v = 0; v < VPT; v++) a[v] = load_t(pk + VT_FLOATS * v);
        for (int i = 0; i < MB; i++) {
            vt xv = splat_t(x[(m0 + i) * K + k]);
            for (int v = 0; v < VPT; v++) acc[i][v] = fmadd_t(xv, a[v], acc[i][v]);
        }
    }
}

/* a tile's sums of half h into y: P0 is stored, and waits there while P1 is summed; then P1 is
 * added to it (+ b) */
static inline __attribute__((always_inline)) void put_half(float *y, const float *b, vt acc[6][VPT], int64_t N,
                                                           int64_t j, int64_t m0, const int MB, int h) {
    for (int i = 0; i < MB; i++)
        for (int v = 0; v < VPT; v++) {
            float *o = y + (m0 + i) * N + j + VT_FLOATS * v;
            if (h == 0) {
                store_t(o, acc[i][v]);
                continue;
            }
            vt s = load_t(o) + acc[i][v];
            if (b) s = s + load_t(b + j + VT_FLOATS * v);
            store_t(o, s);
        }
}

static inline __attribute__((always_inline)) void packed_tile(const float *x, const float *panel, const float *b,
                                                              float *y, int64_t K, int64_t N, int64_t j, int64_t m0,
                                                              const int MB) {
    vt acc[6][VPT];
    for (int h = 0; h < 2; h++) {
        for (int i = 0; i < MB; i++)
            for (int v = 0; v < VPT; v++) acc[i][v] = (vt){0};
        sum_rows(x, panel, acc, K, h ? K / 2 : 0, h ? K : K / 2, m0, MB, panel, 0);
        put_half(y, b, acc, N, j, m0, MB, h);
    }
}

#ifdef __AVX512F__
/* One row against P (1 or 2) panels from column j, both halves of k at once: 2P streams of the
 * weight where the streamed path below reads one. Same sums, in the same order (P0, P1, P0 + P1,
 * + b), so the same bits. Why: on an Intel Xeon (AVX-512 and AMX, 2 threads, weights out of cache,
 * medians of 21 interleaved runs) one stream a thread read 18-20 GB/s where the kn kernel's four
 * rows at a time read 22-24 (a plain 2-thread read: 20-23). With this: [1, 1024] x [1024, 3072]
 * 19.8 -> 24.8 GB/s, [1, 3072] x [3072, 1024] 20.5 -> 23.5, the dense-1024 head [1, 1024] x
 * [1024, 32000] 19.9 -> 23.3; a two-panel weight (N = 128) keeps one panel a thread (two
 * streams), as fast as before. The AVX2 build keeps the streamed path (measured on an AMD EPYC
 * without AVX-512, where it was the faster). */
static inline __attribute__((always_inline)) void one_row(const float *x, const float *panel, const float *b,
                                                          float *y, int64_t K, int64_t j, const int P) {
    vt p0[2][VPT], p1[2][VPT];
    int64_t kh = K / 2;
    for (int q = 0; q < P; q++)
        for (int v = 0; v < VPT; v++) p0[q][v] = p1[q][v] = (vt){0};
    for (int64_t k = 0; k < kh; k++) {
        vt xa = splat_t(x[k]), xb = splat_t(x[kh + k]);
        for (int q = 0; q < P; q++)
            for (int v = 0; v < VPT; v++) {
                const float *pq = panel + q * PANEL * K + VT_FLOATS * v;
                p0[q][v] = fmadd_t(xa, load_t(pq + k * PANEL), p0[q][v]);
                p1[q][v] = fmadd_t(xb, load_t(pq + (kh + k) * PANEL), p1[q][v]);
            }
    }
    for (int q = 0; q < P; q++)
        for (int v = 0; v < VPT; v++) {
            int64_t c = j + q * PANEL + VT_FLOATS * v;
            vt s = p0[q][v] + p1[q][v];
            if (b) s = s + load_t(b + c);
            store_t(y + c, s);
        }
}

/* y [1, N] = x @ w (+ b): pairs of panels a unit where every thread gets two pairs or more */
static void packed_one_row(const float *x, const float *p, const float *b, float *y, int64_t K, int64_t N,
                           int64_t threads) {
    int64_t panels = N / PANEL, pair = panels >= 4 * threads ? 2 : 1, units = (panels + pair - 1) / pair;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t u = 0; u < units; u++) {
        int64_t t = u * pair;
        if (pair == 2 && t + 1 < panels)
            one_row(x, p + t * PANEL * K, b, y, K, t * PANEL, 2);
        else
            one_row(x, p + t * PANEL * K, b, y, K, t * PANEL, 1);
    }
}
#endif

/* Up to STREAM_TILES row tiles (batches of up to 18 rows without AVX-512, with it up to 66; batch-1
 * decoding without AVX-512) go a chunk of STREAM_LINES panel rows at a time through every tile, each
 * tile asking the memory for its
 * share of the next chunk as it starts: the weights stream while the tiles compute on the chunk in
 * cache, where tile by tile the first tile waited on the memory and the others left it idle. Each
 * accumulator waits in `save` between chunks, so it sums the same k in the same order: the same
 * bits. Measured on an AMD EPYC without AVX-512, 2 threads, the dense-1024 model's products and head
 * (interleaved, medians of 13-15): 1.03-1.09x at 1 row, 1.10-1.23x at 8, 1.03-1.23x at 16; at 32
 * and 64 rows it lost 2-21% (the chunks' share of x crowds the L1), so without AVX-512 those keep
 * the tile order. With AVX-512 and fused multiply-adds the tiles compute twice as fast and the
 * order of reads is what bounds them: every tile streamed its 256 KB panel (K = 1024) from L2, once
 * per 6 rows. There up to 66 rows (all of PACKED_ROWS, 64) stream, in chunks of 32 panel rows
 * (8 KB, shared by up to 11 tiles in L1). Measured on an Intel Xeon (2 threads, 16 weights out of cache, 3 runs of medians of 21; GB/s
 * of weight read, tile order -> this): [1024, 3072] and [3072, 1024] at 32 rows 6.1-8.3 -> 9.2-13.3,
 * at 64 rows 4.4-4.6 -> 5.0-5.5; the dense-1024 head [1024, 32000] at 32 rows 6.6-7.2 -> 8.9-12.3;
 * at 8 rows 1.0-1.1x. Up to 4 tiles (24 rows) take chunks of 16 lines: a dense-1024 decode step's
 * products and head (320 MB, 2 threads, interleaved, medians of 21, four runs) 6-9% faster at 8
 * rows, 3-6% at 12, 7-11% at 16, 5-7% at 24, the same at 4; at 32 rows 16 lines lost up to 13%.
 * moe16-top4's [512, 512-8192] (in L3) 5-9% faster at 8 and 16 rows; the tiny MoE's head [128,
 * 1024] (in cache, 2 chunks of 32 a half) 5-9% slower at 8 rows, so K under 512 keeps 32. */
#ifdef __AVX512F__
#define STREAM_TILES 11
#define STREAM_LINES 32
#define SHORT_LINES 16 /* the chunk for up to SHORT_TILES tiles (24 rows) and K >= 512 */
#define SHORT_TILES 4
#else
#define STREAM_TILES 3
#define STREAM_LINES 128
#define SHORT_LINES 128
#define SHORT_TILES 0
#endif

static inline __attribute__((always_inline)) void stream_tile(const float *x, const float *panel, vt save[6][VPT],
                                                              int64_t K, int64_t k0, int64_t k1, int64_t m0,
                                                              const int MB, int first, const float *ahead,
                                                              int64_t n_ahead) {
    vt acc[6][VPT];
    for (int i = 0; i < MB; i++)
        for (int v = 0; v < VPT; v++) acc[i][v] = first ? (vt){0} : save[i][v];
    sum_rows(x, panel, acc, K, k0, k1, m0, MB, ahead, n_ahead);
    for (int i = 0; i < MB; i++)
        for (int v = 0; v < VPT; v++) save[i][v] = acc[i][v];
}

/* panel t for M <= 6 * STREAM_TILES rows; `lines` = panels * K, the packed weight's panel rows (a
 * tile's share of the next chunk may be the next panel's first rows: the thread's next panel) */
static void stream_panel(const float *x, const float *p, const float *b, float *y, int64_t M, int64_t K, int64_t N,
                         int64_t t, int64_t lines) {
    const float *panel = p + t * PANEL * K;
    int64_t j = t * PANEL, tiles = (M + 5) / 6, chunk = tiles <= SHORT_TILES && K >= 512 ? SHORT_LINES : STREAM_LINES;
    int64_t share = (chunk + tiles - 1) / tiles;
    static _Thread_local vt save[STREAM_TILES][6][VPT] __attribute__((aligned(64))); /* per thread, off the stack */
    for (int h = 0; h < 2; h++) {
        int64_t k0 = h ? K / 2 : 0, k1 = h ? K : K / 2;
        for (int64_t kc = k0; kc < k1; kc += chunk) {
            int64_t ke = kc + chunk < k1 ? kc + chunk : k1;
            for (int64_t tile = 0; tile < tiles; tile++) {
                int64_t m0 = tile * 6, start = t * K + ke + tile * share; /* the next chunk: ke on */
                int64_t n_ahead = start >= lines ? 0 : (lines - start < share ? lines - start : share);
                const float *ahead = n_ahead ? p + start * PANEL : p;
                int first = kc == k0;
                switch (M - m0 < 6 ? M - m0 : 6) {
                case 6: stream_tile(x, panel, save[tile], K, kc, ke, m0, 6, first, ahead, n_ahead); break;
                case 5: stream_tile(x, panel, save[tile], K, kc, ke, m0, 5, first, ahead, n_ahead); break;
                case 4: stream_tile(x, panel, save[tile], K, kc, ke, m0, 4, first, ahead, n_ahead); break;
                case 3: stream_tile(x, panel, save[tile], K, kc, ke, m0, 3, first, ahead, n_ahead); break;
                case 2: stream_tile(x, panel, save[tile], K, kc, ke, m0, 2, first, ahead, n_ahead); break;
                default: stream_tile(x, panel, save[tile], K, kc, ke, m0, 1, first, ahead, n_ahead); break;
                }
            }
        }
        for (int64_t tile = 0; tile < tiles; tile++)
            put_half(y, b, save[tile], N, j, tile * 6, M - tile * 6 < 6 ? M - tile * 6 : 6, h);
    }
}

/* y [M, N] = x [M, K] @ w (+ b), w packed by erniekit_small_gemm_pack; N a multiple of PANEL
 * (nn/small_gemm.py packs only weights with N a multiple of 64, either width's multiple) */
void erniekit_small_gemm_packed(const float *x, const float *p, const float *b, float *y, int64_t M, int64_t K,
                                int64_t N, int64_t threads) {
    int64_t panels = N / PANEL;
#ifdef __AVX512F__
    if (M == 1) {
        packed_one_row(x, p, b, y, K, N, threads);
        return;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < panels; t++) {
        if (M <= 6 * STREAM_TILES) {
            stream_panel(x, p, b, y, M, K, N, t, panels * K);
            continue;
        }
        const float *panel = p + t * PANEL * K;
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            switch (M - m0 < 6 ? M - m0 : 6) {
            case 6: packed_tile(x, panel, b, y, K, N, t * PANEL, m0, 6); break;
            case 5: packed_tile(x, panel, b, y, K, N, t * PANEL, m0, 5); break;
            case 4: packed_tile(x, panel, b, y, K, N, t * PANEL, m0, 4); break;
            case 3: packed_tile(x, panel, b, y, K, N, t * PANEL, m0, 3); break;
            case 2: packed_tile(x, panel, b, y, K, N, t * PANEL, m0, 2); break;
            default: packed_tile(x, panel, b, y, K, N, t * PANEL, m0, 1); break;
            }
        }
    }
}
