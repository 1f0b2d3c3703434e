/* A whole stack of Llama-shaped decoder layers for a few new tokens, in one call (CPU decode).
 *
 * Why: a batch-1 decode step of a small model through PyTorch makes ~15 op calls per layer around its
 * four projections (norms, rotary, K/V writes, attention, SiLU, residuals), each a few microseconds
 * of dispatch for a few hundred floats of work: on the demo model (30 layers) that is 9-10 ms of a
 * ~21 ms step, as long as the projections themselves. Here the layer loop is C, the projections are
 * cpu_gemv.c's int4/int8 kernels (same arithmetic as the engine's Python path), and what is left of
 * a step in Python is the embedding, the final norm and the LM head. Unquantized fp32 projections take
 * cpu_gemv.c's fp32 kernel (each output one fixed-order dot product, whatever the batch).
 *
 * Per layer, for R rows (tokens), each with its position p and its sequence's block table:
 *   h = rms_norm(x) * attn_norm;  [q|k|v] = qkv(h) (+ bias; one fused weight or three);  each q and k
 *   head RMS-normed over its head_dim where the family does it (Qwen3);  q, k rotated (rotate_half form, cos and
 *   half-negated sin given per row);  k, v written to the paged cache at the row's slot (unless
 *   slot < 0);  then, every row's K/V written, each query head attends over positions 0..p of its
 *   sequence (so several rows of one sequence are causal: speculative verification);
 *   x += o(attn);  h = rms_norm(x) * mlp_norm;  [g|u] = gate_up(h);  x += down(silu(g) * u).
 * Attention is softmax(q.k * scale) @ v in fp32 over the fp32 cache [slots, KVH, D], 8-lane FMAs
 * block by block of the paged cache, each (row, query head) pair one task for the threads: scalar
 * code with a division per cached position made it ~2 ms of a step per 100 positions, as long as
 * the demo's int4 projections at a 400-token context.
 * The plain PyTorch form is the engine's own layer loop (quantkit.engine.model_runner); the tests
 * hold the two together.
 */
#include "cpu_gemv.c"

#include <omp.h>
#include <string.h>

typedef struct {
    int32_t bits;              /* 4: int4 (pack_int4 layout, groups of G); 8: int8, one scale per row; 32: fp32 */
    int64_t K, N, G;
    const void *w;             /* 4-bit: pack_int4's tiles, their scales and zero offsets inside */
    const float *scale;        /* int8 only: one per output row */
    const float *bias;         /* [N] or NULL */
} qk_proj;

/* A projection whose output is the side-by-side outputs of 1-3 matmuls on one input: q/k/v and
 * gate/up, fused into one weight (quantized layers, engine.fused) or apart (unquantized ones). */
typedef struct {
    int32_t parts;
    qk_proj part[3];
} qk_stacked;

typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    const float *q_norm, *k_norm;      /* [head_dim] per-head RMSNorm of q and k before rotary (Qwen3), or NULL */
    qk_stacked qkv;
    qk_proj o;
    qk_stacked gate_up;
    qk_proj down;
    float *k_cache, *v_cache;          /* [slots, KVH, D] */
} qk_layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size;
    float eps, attn_scale;
    const qk_layer *layers;
} qk_decoder;

static int project(const qk_proj *p, const float *x, int64_t M, float *y, int nthreads) {
    if (p->bits == 32) return quantkit_f32_gemm(x, M, p->K, p->N, p->w, p->bias, y, nthreads);
    const int rc = p->bits == 4 ? gemm(gemv_rows, x, M, p->K, p->N, p->w, NULL, NULL, p->G, y, nthreads)
                                : gemm(gemv8_rows, x, M, p->K, p->N, p->w, p->scale, NULL, p->K, y, nthreads);
    if (rc == 0 && p->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < p->N; n++) y[m * p->N + n] += p->bias[n];
    return rc;
}

/* y [M, sum of the parts' N]: each part's output into its columns (through `tmp` when there are several). */
static int project_stacked(const qk_stacked *s, const float *x, int64_t M, float *y, float *tmp, int nthreads) {
    if (s->parts == 1) return project(&s->part[0], x, M, y, nthreads);
    int64_t width = 0, offset = 0;
    for (int i = 0; i < s->parts; i++) width += s->part[i].N;
    for (int i = 0; i < s->parts; i++) {
        const int64_t n = s->part[i].N;
        const int rc = project(&s->part[i], x, M, tmp, nthreads);
        if (rc != 0) return rc;
        for (int64_t m = 0; m < M; m++) memcpy(y + m * width + offset, tmp + m * n, sizeof(float) * (size_t)n);
        offset += n;
    }
    return 0;
}

/* out = weight * x / sqrt(mean(x^2) + eps), per row of n. */
static void rms_norm_rows(const float *x, const float *weight, int64_t R, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) out[r * n + i] = weight[i] * (xr[i] * inv);
    }
}

/* v = v * cos + roll(v, D/2) * sin_signed for each of `heads` vectors of D (rotate_half form). */
static void rotate(float *v, int64_t heads, int64_t D, const float *cos, const float *sin_signed, float *tmp) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x = v + h * D;
        memcpy(tmp, x, sizeof(float) * (size_t)D);
        for (int64_t j = 0; j < D; j++) x[j] = tmp[j] * cos[j] + tmp[(j + half) % D] * sin_signed[j];
    }
}

/* The cache rows of one kv head for the block holding positions t0.. of a sequence (table): a
 * block's slots are consecutive, so its positions are `stride` floats apart from this start. */
static inline const float *block_rows(const float *cache, const int32_t *table, int64_t t0, int64_t bs,
                                      int64_t KVH, int64_t kvh, int64_t D) {
    return cache + ((int64_t)table[t0 / bs] * bs * KVH + kvh) * D;
}

/* q . k over D floats: 8-lane FMAs in order, the fixed horizontal sum, then a scalar tail (D % 8). */
static inline float dot_d(const float *q, const float *k, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= D; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j), acc);
    float s = hsum256(acc);
    for (; j < D; j++) s += q[j] * k[j];
    return s;
}

/* o += p * v over D floats. */
static inline void axpy_d(float *o, float p, const float *v, int64_t D) {
    const __m256 pv = _mm256_set1_ps(p);
    int64_t j = 0;
    for (; j + 8 <= D; j += 8) _mm256_storeu_ps(o + j, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + j), _mm256_loadu_ps(o + j)));
    for (; j < D; j++) o[j] += p * v[j];
}

/* exp(x) for 8 lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1e-7 relative). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* v[i] = exp(v[i] - shift) for n values; returns their sum (8 lanes in order, then the tail). */
static inline float exp_shifted(float *v, int64_t n, float shift) {
    const __m256 sh = _mm256_set1_ps(shift);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(v + i), sh));
        _mm256_storeu_ps(v + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum256(acc);
    for (; i < n; i++) {
        v[i] = expf(v[i] - shift);
        sum += v[i];
    }
    return sum;
}

/* out = silu(g) * u = g / (1 + exp(-g)) * u over n values. */
static inline void silu_mul(const float *g, const float *u, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* One query head of one row over positions 0..pos of its sequence (table): out [D]; scores [pos + 1].
 * Softmax with the max subtracted; the weights are divided by their sum once, at the end. */
static void attend_head(const qk_decoder *m, const qk_layer *L, const float *qh, int64_t kvh, const int32_t *table,
                        int64_t pos, float *scores, float *out) {
    const int64_t KVH = m->num_kv_heads, D = m->head_dim, bs = m->block_size, stride = KVH * D;
    float mx = -INFINITY;
    for (int64_t t0 = 0; t0 <= pos; t0 += bs) {  /* block by block */
        const float *k = block_rows(L->k_cache, table, t0, bs, KVH, kvh, D);
        const int64_t n = pos + 1 - t0 < bs ? pos + 1 - t0 : bs;
        for (int64_t i = 0; i < n; i++) {
            scores[t0 + i] = dot_d(qh, k + i * stride, D) * m->attn_scale;
            mx = fmaxf(mx, scores[t0 + i]);
        }
    }
    const float sum = exp_shifted(scores, pos + 1, mx);
    for (int64_t j = 0; j < D; j++) out[j] = 0.0f;
    for (int64_t t0 = 0; t0 <= pos; t0 += bs) {
        const float *v = block_rows(L->v_cache, table, t0, bs, KVH, kvh, D);
        const int64_t n = pos + 1 - t0 < bs ? pos + 1 - t0 : bs;
        for (int64_t i = 0; i < n; i++) axpy_d(out, scores[t0 + i], v + i * stride, D);
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < D; j++) out[j] *= inv;
}

/* attn [R, H * D]: every (row, query head) pair is one task, split over the threads; a row's result
 * does not depend on the others or on the split. scores: [nthreads, longest]. */
static void attend_rows(const qk_decoder *m, const qk_layer *L, const float *qkv, int64_t width, int64_t R,
                        const int64_t *positions, const int32_t *tables, int64_t table_width, float *scores,
                        int64_t longest, float *attn, int nthreads) {
    const int64_t H = m->num_heads, D = m->head_dim, group = H / m->num_kv_heads;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t task = 0; task < R * H; task++) {
        const int64_t r = task / H, h = task % H;
        attend_head(m, L, qkv + r * width + h * D, h / group, tables + r * table_width, positions[r],
                    scores + (int64_t)omp_get_thread_num() * longest, attn + r * H * D + h * D);
    }
}

/* x [R, hidden] (updated in place) through every layer. Row r: position positions[r], cache slot
 * slots[r] (< 0: K/V not written, a padding row), block table tables + r * table_width, rotary
 * cos/sin_signed [R, head_dim]. Returns 0, or -1 when scratch memory could not be allocated. */
int quantkit_decoder_layers(const qk_decoder *m, float *x, int64_t R, const int64_t *positions, const int64_t *slots,
                            const int32_t *tables, int64_t table_width, const float *cos, const float *sin_signed,
                            int nthreads) {
    const int64_t H = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim, E = m->hidden, I = m->intermediate;
    const int64_t width = (H + 2 * KVH) * D;
    int64_t longest = 0;
    for (int64_t r = 0; r < R; r++) longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    float *h = malloc(sizeof(float) * (size_t)(R * E));
    float *qkv = malloc(sizeof(float) * (size_t)(R * width));
    float *attn = malloc(sizeof(float) * (size_t)(R * H * D));
    float *gu = malloc(sizeof(float) * (size_t)(R * 2 * I));
    float *act = malloc(sizeof(float) * (size_t)(R * I));
    float *y = malloc(sizeof(float) * (size_t)(R * E));
    const int64_t score_len = longest > D ? longest : D;  /* also rotate's scratch */
    float *scores = malloc(sizeof(float) * (size_t)(score_len * (nthreads > 1 ? nthreads : 1)));
    float *tmp = malloc(sizeof(float) * (size_t)(R * (width > 2 * I ? width : 2 * I)));  /* one part's output */
    int rc = (h && qkv && attn && gu && act && y && scores && tmp) ? 0 : -1;
    for (int64_t l = 0; l < m->num_layers && rc == 0; l++) {
        const qk_layer *L = m->layers + l;
        rms_norm_rows(x, L->attn_norm, R, E, m->eps, h);
        if ((rc = project_stacked(&L->qkv, h, R, qkv, tmp, nthreads)) != 0) break;
        for (int64_t r = 0; r < R; r++) {
            float *row = qkv + r * width;
            if (L->q_norm) {  /* in place: each head's D values are one norm row */
                rms_norm_rows(row, L->q_norm, H, D, m->eps, row);
                rms_norm_rows(row + H * D, L->k_norm, KVH, D, m->eps, row + H * D);
            }
            rotate(row, H + KVH, D, cos + r * D, sin_signed + r * D, scores);  /* q and k heads, side by side */
            if (slots[r] < 0) continue;
            memcpy(L->k_cache + slots[r] * KVH * D, row + H * D, sizeof(float) * (size_t)(KVH * D));
            memcpy(L->v_cache + slots[r] * KVH * D, row + (H + KVH) * D, sizeof(float) * (size_t)(KVH * D));
        }
        attend_rows(m, L, qkv, width, R, positions, tables, table_width, scores, score_len, attn, nthreads);
        if ((rc = project(&L->o, attn, R, y, nthreads)) != 0) break;
        for (int64_t i = 0; i < R * E; i++) x[i] += y[i];
        rms_norm_rows(x, L->mlp_norm, R, E, m->eps, h);
        if ((rc = project_stacked(&L->gate_up, h, R, gu, tmp, nthreads)) != 0) break;
        for (int64_t r = 0; r < R; r++) silu_mul(gu + r * 2 * I, gu + r * 2 * I + I, I, act + r * I);
        if ((rc = project(&L->down, act, R, y, nthreads)) != 0) break;
        for (int64_t i = 0; i < R * E; i++) x[i] += y[i];
    }
    free(h); free(qkv); free(attn); free(gu); free(act); free(y); free(scores); free(tmp);
    return rc;
}
