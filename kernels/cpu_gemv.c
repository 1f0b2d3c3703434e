/* int4 (and int8) weights times int8-quantized activations on AVX2 CPUs, a few rows at a time (decode).
 *
 * The arithmetic is llama.cpp's Q4 x Q8_0: each row of x is quantized in blocks of 32 to int8
 * (d = max|x| / 127, xq = round(x / d)), each block's dot with the 4-bit codes is exact integer SIMD
 * (maddubs, madd), and the float scales are applied per block. With w = s_g * (q - z_g):
 *
 *     y[m, n] = sum_g s_g * sum_{b in g} d_{m,b} * <q_b, xq_{m,b}>  +  sum_g (-s_g * z_g) * sum_{b in g} d_{m,b} * sum(xq_{m,b})
 *
 * i.e. exactly the dequantized weight times the dequantized activations: the zero term takes the
 * sum of the *quantized* x, so the rounding of x is multiplied by w = s * (q - z) and not by the
 * uncentred s * q (with the exact sum there, the relative error on random g64 layers was 1.3-1.5 %
 * against 0.5 % this way; rounding x to bf16 alone gives 0.17 %). The
 * plain PyTorch form is quantkit.kernels.cpu_gemv.reference_int4_gemv; the tests hold the two together.
 *
 * Weight layout (quantkit.kernels.cpu_gemv.pack_int4): tiles of 8 output rows (N padded to a multiple
 * of 8 with zero rows), each one sequential stream of its groups; a group is its 8 rows' scales and
 * zero offsets (2 x 8 floats) followed by its blocks of 32 inputs, 128 bytes each = 4 vectors of 32:
 * in vector L, byte 4r + i holds row r's code 4L + i in its low nibble and code 16 + 4L + i in its
 * high nibble, so one load and two masks give the 4-input chunks L and L + 4 of all 8 rows. Each
 * chunk is multiplied (maddubs) by its 4 activations broadcast to every lane, the 8 chunks' int16
 * pair sums add up exactly (|sum| <= 8 * 2 * 15 * 127 = 30480 < 2^15), and one madd then leaves row
 * r's integer block dot product in lane r: one int32 -> float conversion and one FMA per block serve
 * 8 rows, where a row-major layout needs them per row plus a horizontal sum at the end (llama.cpp's
 * CPU backend repacks Q4_0 the same way: ggml-cpu/repack.cpp, block_q4_0x8, ggml_gemv_q4_0_8x8_q8_0).
 * Scales inside the stream, not in a [rows, groups] array beside it: a tile then reads one
 * sequential run of memory, which the hardware prefetcher follows (a group-major scale array read
 * tile by tile is a strided walk, and with g32 it cost as much as the arithmetic saved).
 *
 * Threads: output rows are split over OpenMP threads. The library links libgomp.so.1, which the
 * loader resolves to the copy PyTorch already loaded (same soname), so this kernel and PyTorch
 * share one thread pool; cpu_gemv checks that before it uses more than one thread.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32        /* activation block */
#define MAX_ROWS 4  /* rows of x handled per pass over the weights */

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x [M, K] -> xq [M, K] int8, xd [M, K/32] block scales, xs [M, K/G] group sums of the dequantized x. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t G, int8_t *xq, float *xd, float *xs) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        for (int64_t b = 0; b < K / QK; b++) {
            const float *xb = xr + b * QK;
            float amax = 0.0f, poison = 0.0f;
            for (int j = 0; j < QK; j++) {
                amax = fmaxf(amax, fabsf(xb[j]));  /* fmaxf skips NaN: ... */
                poison += xb[j] * 0.0f;            /* ... so NaN/inf are caught here (x * 0 is NaN only for them) */
            }
            float d = isnan(poison) ? NAN : amax / 127.0f;  /* a non-finite input makes the outputs NaN, as in PyTorch */
            float id = d > 0.0f && !isnan(d) ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int j = 0; j < QK; j++) {
                const int8_t v = (int8_t)nearbyintf(xb[j] * id);
                xq[m * K + b * QK + j] = v;
                sum += v;
            }
            xd[m * (K / QK) + b] = d;
            if (b % (G / QK) == 0) xs[m * (K / G) + b / (G / QK)] = 0.0f;
            xs[m * (K / G) + b / (G / QK)] += d * (float)sum;
        }
    }
}

/* One tile: MR rows of x (quantized) against the 8 output rows of tile t, lane r of each
 * accumulator one output. Per output the same operations in the same order whatever MR and t
 * (exact integer block dots; over blocks acc = fma(dot, s * d, acc); over groups
 * zacc = fma(zoff, xs, zacc); y = acc + zacc), so a row's result does not depend on the other rows,
 * the tile or the thread count. Called with a constant MR, so each is its own unrolled loop nest. */
#define TILE_ROWS 8
static inline __attribute__((always_inline)) void tile(const int MR, const int8_t *xq, const float *xd,
                                                       const float *xs, int64_t K, int64_t N, const uint8_t *w,
                                                       int64_t G, int64_t t, float *y) {
    const int64_t nb = K / QK, ng = K / G, bpg = G / QK;
    const int64_t group_bytes = 2 * TILE_ROWS * (int64_t)sizeof(float) + bpg * (TILE_ROWS * QK / 2);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *wt = w + t * ng * group_bytes;
    __m256 acc[4], zacc[4];
    for (int m = 0; m < MR; m++) acc[m] = zacc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wg = wt + g * group_bytes;
        const __m256 sv = _mm256_loadu_ps((const float *)wg), zv = _mm256_loadu_ps((const float *)wg + TILE_ROWS);
        for (int m = 0; m < MR; m++) zacc[m] = _mm256_fmadd_ps(zv, _mm256_set1_ps(xs[m * ng + g]), zacc[m]);
        for (int64_t bi = 0; bi < bpg; bi++) {
            const int64_t b = g * bpg + bi;
            const uint8_t *wb = wg + 2 * TILE_ROWS * sizeof(float) + bi * (TILE_ROWS * QK / 2);
            __m256i s16[4];
            for (int m = 0; m < MR; m++) s16[m] = _mm256_setzero_si256();
            for (int L = 0; L < 4; L++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 32 * L));
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int m = 0; m < MR; m++) {
                    const int8_t *xb = xq + m * K + b * QK;
                    int32_t xl, xh;
                    memcpy(&xl, xb + 4 * L, 4);
                    memcpy(&xh, xb + 16 + 4 * L, 4);
                    const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl));
                    const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh));
                    s16[m] = _mm256_add_epi16(s16[m], _mm256_add_epi16(pl, ph));
                }
            }
            for (int m = 0; m < MR; m++) {
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[m], ones));
                acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sv, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
            }
        }
    }
    const int64_t n0 = t * TILE_ROWS, valid = N - n0 < TILE_ROWS ? N - n0 : TILE_ROWS;
    for (int m = 0; m < MR; m++) {
        const __m256 out = _mm256_add_ps(acc[m], zacc[m]);
        if (valid == TILE_ROWS) {
            _mm256_storeu_ps(y + m * N + n0, out);
        } else {  /* the last tile of an N that is not a multiple of 8: its padding rows are dropped */
            float tmp[TILE_ROWS];
            _mm256_storeu_ps(tmp, out);
            memcpy(y + m * N + n0, tmp, sizeof(float) * (size_t)valid);
        }
    }
}

/* y [M, N] = x [M, K] @ w.T for M <= MAX_ROWS (4 here), given x quantized (xq, xd, xs); one per weight type. */
typedef void (*rows_fn)(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, int64_t N,
                        const void *w, const float *scale, const float *zoff, int64_t G, float *y, int nthreads);

/* rows_fn for 4-bit w (pack_int4's tiles, scales and zero offsets inside: scale and zoff unused). */
static void gemv_rows(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, int64_t N,
                      const void *w, const float *scale, const float *zoff, int64_t G, float *y, int nthreads) {
    (void)scale; (void)zoff;
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        switch (M) {
        case 1: tile(1, xq, xd, xs, K, N, w, G, t, y); break;
        case 2: tile(2, xq, xd, xs, K, N, w, G, t, y); break;
        case 3: tile(3, xq, xd, xs, K, N, w, G, t, y); break;
        default: tile(4, xq, xd, xs, K, N, w, G, t, y); break;
        }
    }
}

/* The int8 weights' tile: w [N, K] int8 with one scale per output row (w = scale_n * q),
 * signed x signed through the sign trick (|q| unsigned times x with q's sign), as llama.cpp's Q8_0. */
static inline __attribute__((always_inline)) void tile8(const int MR, const int NR, const int8_t *xq, const float *xd,
                                                        int64_t K, int64_t N, const int8_t *w, const float *scale,
                                                        int64_t n0, float *y) {
    const int64_t nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4][4];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i q[4], qabs[4];
        for (int r = 0; r < NR; r++) {
            q[r] = _mm256_loadu_si256((const __m256i *)(w + (n0 + r) * K + b * QK));
            qabs[r] = _mm256_sign_epi8(q[r], q[r]);
        }
        for (int m = 0; m < MR; m++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + b * QK));
            const __m256 d = _mm256_set1_ps(xd[m * nb + b]);
            for (int r = 0; r < NR; r++) {
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qabs[r], _mm256_sign_epi8(xv, q[r])), ones);
                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[m][r]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) y[m * N + n0 + r] = scale[n0 + r] * hsum256(acc[m][r]);
}

/* rows_fn for int8 w [N, K], one scale per row (xs, zoff and G unused). */
static void gemv8_rows(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, int64_t N,
                       const void *w, const float *scale, const float *zoff, int64_t G, float *y, int nthreads) {
    (void)xs; (void)zoff; (void)G;
    const int NR = M <= 2 ? 4 : 2;
    const int64_t tiles = N / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NR;
        switch (M * 10 + NR) {
        case 14: tile8(1, 4, xq, xd, K, N, w, scale, n0, y); break;
        case 24: tile8(2, 4, xq, xd, K, N, w, scale, n0, y); break;
        case 32: tile8(3, 2, xq, xd, K, N, w, scale, n0, y); break;
        default: tile8(4, 2, xq, xd, K, N, w, scale, n0, y); break;
        }
    }
    for (int64_t n0 = tiles * NR; n0 < N; n0++)
        for (int64_t m = 0; m < M; m++) tile8(1, 1, xq + m * K, xd + m * (K / QK), K, N, w, scale, n0, y + m * N);
}

/* Quantize x, then run `rows` over it MAX_ROWS rows per pass over the weights. Returns 0, or -1
 * when the scratch allocation fails. K must be a multiple of G, and G of 32. */
static int gemm(rows_fn rows, const float *x, int64_t M, int64_t K, int64_t N, const void *w, const float *scale,
                const float *zoff, int64_t G, float *y, int nthreads) {
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xd = (float *)malloc(sizeof(float) * (size_t)(M * (K / QK)));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * (K / G)));
    if (!xq || !xd || !xs) {
        free(xq); free(xd); free(xs);
        return -1;
    }
    quantize_rows(x, M, K, G, xq, xd, xs);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t n_rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
        rows(xq + m0 * K, xd + m0 * (K / QK), xs + m0 * (K / G), n_rows, K, N, w, scale, zoff, G, y + m0 * N,
             nthreads);
    }
    free(xq); free(xd); free(xs);
    return 0;
}

/* 4-bit weights in pack_int4's tiles (their scales and zero offsets inside): any M. */
int quantkit_int4_gemm(const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *w, int64_t G, float *y,
                       int nthreads) {
    return gemm(gemv_rows, x, M, K, N, w, NULL, NULL, G, y, nthreads);
}

/* int8 weights [N, K] with one scale per row: any M. K % 32 == 0. */
int quantkit_int8_gemm(const float *x, int64_t M, int64_t K, int64_t N, const int8_t *w, const float *scale,
                       float *y, int nthreads) {
    return gemm(gemv8_rows, x, M, K, N, w, scale, NULL, K, y, nthreads);
}

/* ---- fp32 weights times fp32 activations (no quantization), for an unquantized model's few-row products ----
 *
 * MKL's fp32 F.linear of 2-5 rows runs one matrix-vector product per row, so a speculative verification
 * of k + 1 rows reads the weights k + 1 times; here a call of up to 16 rows (F32_PASS_ROWS) streams them
 * from memory once: each tile of output rows takes the x rows 4 at a time (MAX_ROWS) while its weight
 * rows are in L1.
 *
 * Batch invariance: every output y[m, n] is the same sequence of operations whichever tile (or the
 * one-output tail) computes it and whatever the other rows are: one 8-lane accumulator, one FMA per
 * step of 8 inputs in order (the last K % 8 inputs as one more step, loaded masked: the missing lanes
 * read 0 for both x and w, and nothing past the row is touched), hsum256's fixed horizontal sum, then
 * + bias[n]. Intrinsics and no -ffast-math, so the compiler may not reorder any of it.
 *
 * Speed: one row is bound by the weight stream. Two to four rows do 2-4 FMAs per 32 bytes of weight,
 * enough that the core falls behind the hardware prefetcher when the weights come from DRAM (as every
 * layer's do in a real decode step); a software prefetch F32_PREFETCH floats ahead on each weight
 * row in the tile brought 4 rows from 1.6-1.7x to 1.2-1.3x the 1-row time on DRAM-resident weights
 * (Zen 3, 2 threads), and costs up to ~20 % where the weight sits in L3. The x vectors are pinned in
 * registers (the empty asm): left to itself gcc re-loads them from memory for every FMA, and the
 * loads, not the FMAs, then bound the L3-resident case. */
#define F32_PREFETCH 2048

static inline __attribute__((always_inline)) void tile32(const int MR, const int NR, const float *x, int64_t K,
                                                         int64_t N, const float *w, const float *bias, int64_t n0,
                                                         float *y) {
    const int64_t k8 = K & ~(int64_t)7;
    const int rem = (int)(K - k8);
    __m256 acc[4][4];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 wv[4];
        for (int r = 0; r < NR; r++) wv[r] = _mm256_loadu_ps(w + (n0 + r) * K + k);
        if (MR >= 2 && (k & 15) == 0) /* one per 64-byte line of each weight row; past the end it is a no-op */
            for (int r = 0; r < NR; r++)
                _mm_prefetch((const char *)((uintptr_t)(w + (n0 + r) * K + k) + 4 * F32_PREFETCH), _MM_HINT_T0);
        for (int m = 0; m < MR; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * K + k);
            __asm__("" : "+x"(xv)); /* keep it in a register (MR * NR + MR + NR <= 15 for every tile) */
            for (int r = 0; r < NR; r++) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
    if (rem) {
        const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 wv[4];
        for (int r = 0; r < NR; r++) wv[r] = _mm256_maskload_ps(w + (n0 + r) * K + k8, tail);
        for (int m = 0; m < MR; m++) {
            const __m256 xv = _mm256_maskload_ps(x + m * K + k8, tail);
            for (int r = 0; r < NR; r++) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) {
            const float s = hsum256(acc[m][r]);
            y[m * N + n0 + r] = bias ? s + bias[n0 + r] : s;
        }
}

/* y [M, N] = x [M, K] @ w.T (+ bias) for M <= MAX_ROWS, w [N, K] fp32: tiles of NR outputs over the threads
 * (1x4, 2x4, 3x3, 4x2: 8-9 independent accumulators, enough to cover the FMA latency). */
static void gemv32_rows(const float *x, int64_t M, int64_t K, int64_t N, const float *w, const float *bias, float *y,
                        int nthreads) {
    const int NR = M <= 2 ? 4 : M == 3 ? 3 : 2;
    const int64_t tiles = N / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NR;
        switch (M * 10 + NR) {
        case 14: tile32(1, 4, x, K, N, w, bias, n0, y); break;
        case 24: tile32(2, 4, x, K, N, w, bias, n0, y); break;
        case 33: tile32(3, 3, x, K, N, w, bias, n0, y); break;
        default: tile32(4, 2, x, K, N, w, bias, n0, y); break;
        }
    }
    for (int64_t n0 = tiles * NR; n0 < N; n0++) /* the last N % NR outputs, one at a time */
        for (int64_t m = 0; m < M; m++) tile32(1, 1, x + m * K, K, N, w, bias, n0, y + m * N);
}

/* The same for MAX_ROWS < M <= F32_PASS_ROWS in one pass over the weights: each tile of 4 outputs takes
 * all the rows, 4 at a time, so its 4 weight rows come from memory once and from L1 for the later row
 * groups (a 4-row pass per group would stream the weights from memory once per group). */
#define F32_PASS_ROWS 16
static void gemv32_many_rows(const float *x, int64_t M, int64_t K, int64_t N, const float *w, const float *bias,
                             float *y, int nthreads) {
    const int64_t tiles = N / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * 4;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N;
            switch (M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS) {
            case 1: tile32(1, 4, xm, K, N, w, bias, n0, ym); break;
            case 2: tile32(2, 4, xm, K, N, w, bias, n0, ym); break;
            case 3:
                tile32(2, 4, xm, K, N, w, bias, n0, ym);
                tile32(1, 4, xm + 2 * K, K, N, w, bias, n0, ym + 2 * N);
                break;
            default: tile32(4, 2, xm, K, N, w, bias, n0, ym); tile32(4, 2, xm, K, N, w, bias, n0 + 2, ym); break;
            }
        }
    }
    for (int64_t n0 = tiles * 4; n0 < N; n0++)
        for (int64_t m = 0; m < M; m++) tile32(1, 1, x + m * K, K, N, w, bias, n0, y + m * N);
}

/* fp32 weights [N, K] row-major, bias [N] or NULL: any M, K, N, in passes of up to F32_PASS_ROWS rows.
 * Returns 0 (there is no scratch to allocate). */
int quantkit_f32_gemm(const float *x, int64_t M, int64_t K, int64_t N, const float *w, const float *bias, float *y,
                      int nthreads) {
    for (int64_t m0 = 0; m0 < M; m0 += F32_PASS_ROWS) {
        const int64_t n_rows = M - m0 < F32_PASS_ROWS ? M - m0 : F32_PASS_ROWS;
        (n_rows <= MAX_ROWS ? gemv32_rows : gemv32_many_rows)(x + m0 * K, n_rows, K, N, w, bias, y + m0 * N,
                                                              nthreads);
    }
    return 0;
}
