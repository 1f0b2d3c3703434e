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
 * Attention is softmax(q.k * scale) @ v in fp32 over the fp32 cache [slots, KVH, D].
 * The plain PyTorch form is the engine's own layer loop (quantkit.engine.model_runner); the tests
 * hold the two together.
 */
#include "cpu_gemv.c"

#include <string.h>

typedef struct {
    int32_t bits;              /* 4: int4 (pack_int4 layout, groups of G); 8: int8, one scale per row; 32: fp32 */
    int64_t K, N, G;
    const void *w;
    const float *scale, *zoff; /* zoff: 4-bit only (-scale * zero per group); neither for fp32 */
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
    const int rc = p->bits == 4 ? gemm(gemv_rows, x, M, p->K, p->N, p->w, p->scale, p->zoff, p->G, y, nthreads)
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

static inline int64_t slot_of(const int32_t *table, int64_t pos, int64_t block_size) {
    return (int64_t)table[pos / block_size] * block_size + pos % block_size;
}

/* out [H * D] for one row: each head over positions 0..pos of its sequence (table), scores [pos + 1]. */
static void attend(const qk_decoder *m, const qk_layer *L, const float *q, const int32_t *table, int64_t pos,
                   float *scores, float *out) {
    const int64_t H = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim, group = H / KVH;
    for (int64_t h = 0; h < H; h++) {
        const float *qh = q + h * D;
        const int64_t kvh = h / group;
        float mx = -INFINITY;
        for (int64_t t = 0; t <= pos; t++) {
            const float *k = L->k_cache + (slot_of(table, t, m->block_size) * KVH + kvh) * D;
            float s = 0.0f;
            for (int64_t j = 0; j < D; j++) s += qh[j] * k[j];
            scores[t] = s * m->attn_scale;
            mx = fmaxf(mx, scores[t]);
        }
        float sum = 0.0f;
        for (int64_t t = 0; t <= pos; t++) {
            scores[t] = expf(scores[t] - mx);
            sum += scores[t];
        }
        float *o = out + h * D;
        for (int64_t j = 0; j < D; j++) o[j] = 0.0f;
        for (int64_t t = 0; t <= pos; t++) {
            const float *v = L->v_cache + (slot_of(table, t, m->block_size) * KVH + kvh) * D;
            const float p = scores[t] / sum;
            for (int64_t j = 0; j < D; j++) o[j] += p * v[j];
        }
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
    float *scores = malloc(sizeof(float) * (size_t)(longest > D ? longest : D));
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
        for (int64_t r = 0; r < R; r++)
            attend(m, L, qkv + r * width, tables + r * table_width, positions[r], scores, attn + r * H * D);
        if ((rc = project(&L->o, attn, R, y, nthreads)) != 0) break;
        for (int64_t i = 0; i < R * E; i++) x[i] += y[i];
        rms_norm_rows(x, L->mlp_norm, R, E, m->eps, h);
        if ((rc = project_stacked(&L->gate_up, h, R, gu, tmp, nthreads)) != 0) break;
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < I; i++) {
                const float g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i];
                act[r * I + i] = g / (1.0f + expf(-g)) * u;
            }
        if ((rc = project(&L->down, act, R, y, nthreads)) != 0) break;
        for (int64_t i = 0; i < R * E; i++) x[i] += y[i];
    }
    free(h); free(qkv); free(attn); free(gu); free(act); free(y); free(scores); free(tmp);
    return rc;
}
