/* tensorkiln's native CPU kernels: small convolutions on channels-last float32 data.

   Compiled on the user's machine at first use (native.py: the system C compiler, -O3
   -march=native, OpenMP) and called through ctypes. They exist for the layers where oneDNN's
   per-call cost dominates at small batch (depthwise convolutions, small 1x1 and stem
   convolutions of mobile networks); the cpu backend times them against oneDNN and torch's GEMM
   per layer and input shape and keeps the faster.

   Written with GCC/Clang vector extensions (no intrinsics): VL floats per vector for the widest
   registers the compiler targets. Every function reads and writes only the sizes its arguments
   give; the Python side checks shapes, dtypes, layouts and weight packing before calling.

   Layouts: x (B, H, W, C) contiguous (a channels-last NCHW tensor), y and res likewise;
   activation `act` with scalars a0, a1 (see enum); `order` 0: act(conv + bias + res),
   1: act(conv + bias) + res. */

#include <stddef.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#define MR 8
#elif defined(__AVX__)
#define VL 8
#define MR 6
#else
#define VL 4
#define MR 8
#endif
#define NR (2 * VL)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int vi __attribute__((vector_size(VL * 4)));

static inline vf ld(const float *p) { return *(const vfu *)p; }
static inline void st(float *p, vf v) { *(vfu *)p = v; }
static inline vf bc(float s) { return (vf){0} + s; }
static inline vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

enum { A_NONE, A_RELU, A_CLIP, A_HSWISH, A_HSIG, A_SIGMOID, A_SILU, A_LEAKY };

/* work (multiply-adds, or values for passes over memory) from which a kernel runs on all
   threads; smaller work stays on the calling thread */
static long par_min = 50000;
void tk_set_parallel_min(long v) { par_min = v; }

int tk_vector_floats(void) { return VL; }
int tk_panel_floats(void) { return NR; }

/* Lane operations that keep a NaN of v: max(c, v), min(c, v), floor, a reciprocal estimate
   and "x where x is NaN else y". With AVX-512 or AVX one instruction each (max/min return their
   second operand when either is NaN, so v goes second); elsewhere through selects. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define M_(x) ((__m512)(x))
static inline vf vmaxc(vf v, float c) { return (vf)_mm512_max_ps(_mm512_set1_ps(c), M_(v)); }
static inline vf vminc(vf v, float c) { return (vf)_mm512_min_ps(_mm512_set1_ps(c), M_(v)); }
static inline vf vfloor(vf v) {
    return (vf)_mm512_roundscale_ps(M_(v), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
static inline vf vzero_below(vf v, float c, vf y) { /* y, or 0 where v < c */
    return (vf)_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(M_(v), _mm512_set1_ps(c), _CMP_NLT_UQ), M_(y));
}
static inline vf vnan_keep(vf x, vf y) {
    return (vf)_mm512_mask_blend_ps(_mm512_cmp_ps_mask(M_(x), M_(x), _CMP_UNORD_Q), M_(y), M_(x));
}
static inline vf vrecip(vf d) { /* 14-bit estimate, one Newton step */
    vf r = (vf)_mm512_rcp14_ps(M_(d));
    return r * (2.0f - d * r);
}
#elif defined(__AVX__) && VL == 8
#include <immintrin.h>
#define M_(x) ((__m256)(x))
static inline vf vmaxc(vf v, float c) { return (vf)_mm256_max_ps(_mm256_set1_ps(c), M_(v)); }
static inline vf vminc(vf v, float c) { return (vf)_mm256_min_ps(_mm256_set1_ps(c), M_(v)); }
static inline vf vfloor(vf v) {
    return (vf)_mm256_round_ps(M_(v), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
static inline vf vzero_below(vf v, float c, vf y) {
    return (vf)_mm256_and_ps(_mm256_cmp_ps(M_(v), _mm256_set1_ps(c), _CMP_NLT_UQ), M_(y));
}
static inline vf vnan_keep(vf x, vf y) {
    return (vf)_mm256_blendv_ps(M_(y), M_(x), _mm256_cmp_ps(M_(x), M_(x), _CMP_UNORD_Q));
}
static inline vf vrecip(vf d) { /* 12-bit estimate, two Newton steps */
    vf r = (vf)_mm256_rcp_ps(M_(d));
    r = r * (2.0f - d * r);
    return r * (2.0f - d * r);
}
#else
static inline vf vmaxc(vf v, float c) { return sel(v < c, bc(c), v); }
static inline vf vminc(vf v, float c) { return sel(v > c, bc(c), v); }
static inline vf vfloor(vf v) {
    vf t = __builtin_convertvector(__builtin_convertvector(v, vi), vf);
    return sel(t > v, t - 1.0f, t);
}
static inline vf vzero_below(vf v, float c, vf y) { return sel(v < c, bc(0.0f), y); }
static inline vf vnan_keep(vf x, vf y) { return sel(x != x, x, y); }
static inline vf vrecip(vf d) { /* for 1 <= d < 1e38: an estimate from the exponent bits
                                   (within 12.5%), three Newton steps */
    vf r = (vf)((vi){0} + 0x7EF311C3 - (vi)d);
    r = r * (2.0f - d * r);
    r = r * (2.0f - d * r);
    return r * (2.0f - d * r);
}
#endif

/* exp(x) for x in [-87.34, 88.38]: Cephes' expf (range reduction by ln 2, degree-6
   polynomial), about 1 ulp */
static inline vf vexp_in_range(vf x) {
    vf n = vfloor(x * 1.44269504088896341f + 0.5f);
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = bc(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

/* 1 / (1 + exp(-v)) to float precision without a division: exp of -v clamped to its range
   (the sum stays below 2.4e38, where the reciprocal estimate holds), 0 below -87.3 (sigmoid is
   under 1e-38 there, and -inf gives 0 as the reference's 1 / (1 + inf) does), NaN kept */
static inline vf vsigmoid(vf v) {
    vf t = vminc(vmaxc(-v, -87.3365447505531f), 87.3365447505531f);
    vf s = vrecip(1.0f + vexp_in_range(t));
    return vnan_keep(v, vzero_below(v, -87.3365447505531f, s));
}

/* comparisons are false for NaN, so each select below keeps a NaN as it is */
static inline vf act_v(vf v, int act, float a0, float a1) {
    switch (act) {
    case A_RELU:
        return vmaxc(v, 0.0f);
    case A_CLIP:
        return vminc(vmaxc(v, a0), a1);
    case A_HSWISH:
        return v * vminc(vmaxc(v + 3.0f, 0.0f), 6.0f) * (1.0f / 6.0f);
    case A_HSIG:
        return vminc(vmaxc(v * a0 + a1, 0.0f), 1.0f);
    case A_SIGMOID:
        return vsigmoid(v);
    case A_SILU:
        return v * vsigmoid(v);
    case A_LEAKY:
        return sel(v < 0.0f, v * a0, v);
    default:
        return v;
    }
}

/* the epilogue of one output row of nv <= NR values at y (residual at res, or NULL): whole
   vectors straight to memory, a partial one through a buffer */
static inline void epilogue(vf acc[2], const float *bias, float *y, const float *res, long nv,
                            int order, int act, float a0, float a1) {
    int halves = nv > VL ? 2 : 1;
    for (int h = 0; h < halves; h++) {
        long left = nv - h * VL;
        vf v = acc[h] + ld(bias + h * VL);
        vf r = bc(0.0f);
        if (res && left >= VL) {
            r = ld(res + h * VL);
        } else if (res) {
            float rt[VL] = {0};
            memcpy(rt, res + h * VL, (size_t)left * sizeof(float));
            r = ld(rt);
        }
        if (order == 0) v += r;
        v = act_v(v, act, a0, a1);
        if (order == 1) v += r;
        if (left >= VL) {
            st(y + h * VL, v);
        } else {
            float yt[VL];
            st(yt, v);
            memcpy(y + h * VL, yt, (size_t)left * sizeof(float));
        }
    }
}

/* MR rows a[i][0..K) times one packed panel b (K x NR): acc[i][0..2) */
#define MICRO(NV)                                                                             \
    for (long k = 0; k < K; k++) {                                                            \
        vf b0 = ld(b + k * NR), b1 = NV > 1 ? ld(b + k * NR + VL) : bc(0.0f);                 \
        for (int i = 0; i < MR; i++) {                                                        \
            float s = a[i][k];                                                                \
            acc[i][0] += b0 * s;                                                              \
            if (NV > 1) acc[i][1] += b1 * s;                                                  \
        }                                                                                     \
    }

/* acc += rows a[i][0..K) times the panel rows b[0..K) */
static inline void panel_add(const float *const a[MR], long K, const float *b, long nv,
                             vf acc[MR][2]) {
    if (nv > VL) {
        MICRO(2)
    } else {
        MICRO(1)
    }
}

static inline void panel(const float *const a[MR], long K, const float *b, long nv,
                         vf acc[MR][2]) {
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = bc(0.0f);
    panel_add(a, K, b, nv, acc);
}

/* one row a[0..K) times a panel (fewer rows than MR: a small batch of vectors, the GEMV of a
   classifier head), two chains of accumulators */
static inline void row_panel(const float *a, long K, const float *b, long nv, vf acc[2]) {
    vf s0 = bc(0.0f), s1 = bc(0.0f), t0 = bc(0.0f), t1 = bc(0.0f);
    long k = 0;
    for (; k + 2 <= K; k += 2) {
        s0 += ld(b + k * NR) * a[k];
        t0 += ld(b + (k + 1) * NR) * a[k + 1];
        if (nv > VL) {
            s1 += ld(b + k * NR + VL) * a[k];
            t1 += ld(b + (k + 1) * NR + VL) * a[k + 1];
        }
    }
    for (; k < K; k++) {
        s0 += ld(b + k * NR) * a[k];
        if (nv > VL) s1 += ld(b + k * NR + VL) * a[k];
    }
    acc[0] = s0 + t0;
    acc[1] = s1 + t1;
}

/* y = act(x @ w + bias [+ res]), a 1x1 convolution over M = B*H*W rows of K channels:
   wp holds the (K x N) weight in ceil(N / NR) panels of K x NR (zero padded), bias
   ceil(N / NR) * NR values (zero padded) */
void tk_gemm_rows(const float *x, long M, long K, const float *wp, const float *bias, long N,
                  float *y, const float *res, int order, int act, float a0, float a1) {
    long panels = (N + NR - 1) / NR, blocks = (M + MR - 1) / MR;
    /* (two loops collapsed: an index division per task cost as much as a small K's products) */
#pragma omp parallel for collapse(2) schedule(static) if (M * K * N > 2 * par_min)
    for (long mb = 0; mb < blocks; mb++)
    for (long pb = 0; pb < panels; pb++) {
        long m0 = mb * MR, n0 = pb * NR;
        long nv = N - n0 < NR ? N - n0 : NR;
        const float *a[MR];
        vf acc[MR][2];
        if (M - m0 < MR) { /* the last rows, fewer than a block: one at a time */
            for (long m = m0; m < M; m++) {
                row_panel(x + m * K, K, wp + pb * K * NR, nv, acc[0]);
                epilogue(acc[0], bias + n0, y + m * N + n0, res ? res + m * N + n0 : NULL, nv,
                         order, act, a0, a1);
            }
            continue;
        }
        for (int i = 0; i < MR; i++) a[i] = x + (m0 + i) * K;
        panel(a, K, wp + pb * K * NR, nv, acc);
        for (int i = 0; i < MR && m0 + i < M; i++)
            epilogue(acc[i], bias + n0, y + (m0 + i) * N + n0,
                     res ? res + (m0 + i) * N + n0 : NULL, nv, order, act, a0, a1);
    }
}

/* a convolution of one group: each block of MR output pixels gathers its patches (kh x kw x C,
   zeros outside the input) into rows of K = kh*kw*C and multiplies them with the packed weight
   (as tk_gemm_rows, rows in (i, j, c) order); K is at most TK_CONV_MAX_K */
#define TK_CONV_MAX_K 1152
long tk_conv_max_k(void) { return TK_CONV_MAX_K; }

void tk_conv_gemm(const float *x, long B, long H, long W, long C, const float *wp,
                  const float *bias, long N, long kh, long kw, long sh, long sw, long pt, long pl,
                  long dh, long dw, long Ho, long Wo, float *y, const float *res, int order,
                  int act, float a0, float a1) {
    long K = kh * kw * C, M = B * Ho * Wo;
    if (K > TK_CONV_MAX_K) return;
    long panels = (N + NR - 1) / NR, blocks = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static) if (M * K * N > 2 * par_min)
    for (long mb = 0; mb < blocks; mb++) {
        float buf[MR * TK_CONV_MAX_K];
        const float *a[MR];
        long m0 = mb * MR;
        /* the block's output pixels (b, ho, wo), stepping from the first (no division each) */
        long pb_[MR], ph_[MR], pw_[MR];
        {
            long m = m0, b = m / (Ho * Wo), r = m % (Ho * Wo), ho = r / Wo, wo = r % Wo;
            for (int i = 0; i < MR; i++) {
                pb_[i] = b, ph_[i] = ho, pw_[i] = wo;
                if (m0 + i + 1 < M && ++wo == Wo) {
                    wo = 0;
                    if (++ho == Ho) ho = 0, b++;
                }
            }
        }
        /* where every window of the block lies inside the input (and dw == 1), each kernel row
           of a window is kw*C contiguous floats: multiply them in place, kernel row by row */
        int inside = dw == 1;
        long base[MR];
        for (int i = 0; i < MR && inside; i++) {
            long hi = ph_[i] * sh - pt, wi = pw_[i] * sw - pl;
            inside = hi >= 0 && hi + (kh - 1) * dh < H && wi >= 0 && wi + kw - 1 < W;
            base[i] = ((pb_[i] * H + hi) * W + wi) * C;
        }
        if (inside) {
            long seg = kw * C;
            for (long pb = 0; pb < panels; pb++) {
                long n0 = pb * NR, nv = N - n0 < NR ? N - n0 : NR;
                vf acc[MR][2];
                for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = bc(0.0f);
                for (long u = 0; u < kh; u++) {
                    for (int i = 0; i < MR; i++) a[i] = x + base[i] + u * dh * W * C;
                    panel_add(a, seg, wp + pb * K * NR + u * seg * NR, nv, acc);
                }
                for (int i = 0; i < MR && m0 + i < M; i++)
                    epilogue(acc[i], bias + n0, y + (m0 + i) * N + n0,
                             res ? res + (m0 + i) * N + n0 : NULL, nv, order, act, a0, a1);
            }
            continue;
        }
        for (int i = 0; i < MR; i++) {
            long b = pb_[i], ho = ph_[i], wo = pw_[i];
            float *row = buf + i * K;
            for (long u = 0; u < kh; u++) {
                long hi = ho * sh - pt + u * dh;
                for (long v = 0; v < kw; v++) {
                    long wi = wo * sw - pl + v * dw;
                    float *dst = row + (u * kw + v) * C;
                    if (hi < 0 || hi >= H || wi < 0 || wi >= W) {
                        for (long c = 0; c < C; c++) dst[c] = 0.0f;
                    } else {
                        const float *src = x + ((b * H + hi) * W + wi) * C;
                        for (long c = 0; c < C; c++) dst[c] = src[c];
                    }
                }
            }
            a[i] = row;
        }
        for (long pb = 0; pb < panels; pb++) {
            long n0 = pb * NR, nv = N - n0 < NR ? N - n0 : NR;
            vf acc[MR][2];
            panel(a, K, wp + pb * K * NR, nv, acc);
            for (int i = 0; i < MR && m0 + i < M; i++)
                epilogue(acc[i], bias + n0, y + (m0 + i) * N + n0,
                         res ? res + (m0 + i) * N + n0 : NULL, nv, order, act, a0, a1);
        }
    }
}

/* depthwise K x K (3 or 5, no dilation) of at least VL channels: per output row and block of
   VL channels, the K*K weight vectors held in registers across the row, so each tap loads only
   the input (one load per multiply-add, not two); rows and channel blocks shared by threads */
#define DW_REG(K)                                                                             \
    static void dw_reg_##K(const float *x, long B, long H, long W, long C, const float *w,     \
                           const float *bias, long sh, long sw, long pt, long pl, long Ho,    \
                           long Wo, float *y, const float *res, int order, int act, float a0, \
                           float a1) {                                                        \
        long nb = (C + VL - 1) / VL, work = B * Ho * Wo * C * K * K;                          \
        _Pragma("omp parallel for collapse(3) schedule(static) if (work > par_min)")            \
        for (long b = 0; b < B; b++)                                                          \
            for (long ho = 0; ho < Ho; ho++)                                                  \
                for (long cb = 0; cb < nb; cb++) {                                            \
                    long c = cb * VL + VL <= C ? cb * VL : C - VL;                            \
                    long hi0 = ho * sh - pt;                                                  \
                    long i0 = hi0 < 0 ? -hi0 : 0, i1 = H - hi0 < K ? H - hi0 : K;             \
                    vf wv[K * K];                                                             \
                    for (int t = 0; t < K * K; t++) wv[t] = ld(w + t * C + c);                \
                    vf bv = ld(bias + c);                                                     \
                    for (long wo = 0; wo < Wo; wo++) {                                        \
                        long wi0 = wo * sw - pl;                                              \
                        long j0 = wi0 < 0 ? -wi0 : 0, j1 = W - wi0 < K ? W - wi0 : K;         \
                        vf acc = bv;                                                          \
                        const float *xb = x + ((b * H + hi0) * W + wi0) * C + c;             \
                        if (i0 == 0 && i1 == K && j0 == 0 && j1 == K) {                       \
                            for (int i = 0; i < K; i++)                                       \
                                for (int j = 0; j < K; j++)                                   \
                                    acc += ld(xb + (i * W + j) * C) * wv[i * K + j];          \
                        } else {                                                              \
                            for (long i = i0; i < i1; i++)                                    \
                                for (long j = j0; j < j1; j++)                                \
                                    acc += ld(xb + (i * W + j) * C) * wv[i * K + j];          \
                        }                                                                     \
                        long o = ((b * Ho + ho) * Wo + wo) * C + c;                           \
                        vf r = res ? ld(res + o) : bc(0.0f);                                  \
                        if (order == 0) acc += r;                                             \
                        acc = act_v(acc, act, a0, a1);                                        \
                        if (order == 1) acc += r;                                             \
                        st(y + o, acc);                                                       \
                    }                                                                         \
                }                                                                             \
    }
DW_REG(3)
DW_REG(5)

/* depthwise convolution: w (kh, kw, C), bias C values; one output channel per input channel */
void tk_dwconv(const float *x, long B, long H, long W, long C, const float *w, const float *bias,
               long kh, long kw, long sh, long sw, long pt, long pl, long dh, long dw, long Ho,
               long Wo, float *y, const float *res, int order, int act, float a0, float a1) {
    if (C >= VL && kh == kw && dh == 1 && dw == 1 && (kh == 3 || kh == 5)) {
        (kh == 3 ? dw_reg_3 : dw_reg_5)(x, B, H, W, C, w, bias, sh, sw, pt, pl, Ho, Wo, y, res,
                                        order, act, a0, a1);
        return;
    }
    /* channels in vectors of VL; where C is no multiple of VL but at least VL, the last vector
       starts at C - VL and overlaps the one before (those channels are computed twice, the same
       way); only C < VL takes the zero-padded path below */
    long Cv = C >= VL ? C : 0;
#pragma omp parallel for collapse(2) schedule(static) if (B * Ho * Wo * C * kh * kw > par_min)
    for (long b = 0; b < B; b++) {
        for (long ho = 0; ho < Ho; ho++) {
            long hi0 = ho * sh - pt;
            long i0 = 0, i1 = kh;
            while (i0 < kh && hi0 + i0 * dh < 0) i0++;
            while (i1 > i0 && hi0 + (i1 - 1) * dh >= H) i1--;
            for (long wo = 0; wo < Wo; wo++) {
                long wi0 = wo * sw - pl;
                long j0 = 0, j1 = kw;
                while (j0 < kw && wi0 + j0 * dw < 0) j0++;
                while (j1 > j0 && wi0 + (j1 - 1) * dw >= W) j1--;
                float *yp = y + ((b * Ho + ho) * Wo + wo) * C;
                const float *rp = res ? res + ((b * Ho + ho) * Wo + wo) * C : NULL;
                for (long c0 = 0; c0 < Cv; c0 += VL) {
                    long c = c0 + VL <= C ? c0 : C - VL;
                    vf acc = ld(bias + c);
                    for (long i = i0; i < i1; i++) {
                        const float *xr = x + ((b * H + hi0 + i * dh) * W) * C + c;
                        const float *wr = w + i * kw * C + c;
                        for (long j = j0; j < j1; j++)
                            acc += ld(xr + (wi0 + j * dw) * C) * ld(wr + j * C);
                    }
                    if (rp && order == 0) acc += ld(rp + c);
                    acc = act_v(acc, act, a0, a1);
                    if (rp && order == 1) acc += ld(rp + c);
                    st(yp + c, acc);
                }
                if (Cv < C) { /* fewer channels than a vector: through a zero-padded one */
                    float xt[VL], wt[VL], rt[VL], yt[VL];
                    size_t nt = (size_t)(C - Cv) * sizeof(float);
                    memset(xt, 0, sizeof xt);
                    memset(wt, 0, sizeof wt);
                    memset(rt, 0, sizeof rt);
                    memcpy(xt, bias + Cv, nt);
                    vf acc = ld(xt);
                    for (long i = i0; i < i1; i++)
                        for (long j = j0; j < j1; j++) {
                            memcpy(xt, x + ((b * H + hi0 + i * dh) * W + wi0 + j * dw) * C + Cv,
                                   nt);
                            memcpy(wt, w + (i * kw + j) * C + Cv, nt);
                            acc += ld(xt) * ld(wt);
                        }
                    if (rp) memcpy(rt, rp + Cv, nt);
                    if (rp && order == 0) acc += ld(rt);
                    acc = act_v(acc, act, a0, a1);
                    if (rp && order == 1) acc += ld(rt);
                    st(yt, acc);
                    memcpy(yp + Cv, yt, nt);
                }
            }
        }
    }
}

/* m[c] = mean over HW rows of x[., c] (x: HW rows of C floats), four partial sums a vector */
static void spatial_mean(const float *xb, long HW, long C, float *m) {
    long Cv = C - C % VL;
    for (long c = 0; c < Cv; c += VL) {
        vf s0 = bc(0.0f), s1 = bc(0.0f), s2 = bc(0.0f), s3 = bc(0.0f);
        long i = 0;
        for (; i + 4 <= HW; i += 4) {
            s0 += ld(xb + i * C + c);
            s1 += ld(xb + (i + 1) * C + c);
            s2 += ld(xb + (i + 2) * C + c);
            s3 += ld(xb + (i + 3) * C + c);
        }
        for (; i < HW; i++) s0 += ld(xb + i * C + c);
        st(m + c, ((s0 + s1) + (s2 + s3)) / (float)HW);
    }
    for (long c = Cv; c < C; c++) {
        float s = 0.0f;
        for (long i = 0; i < HW; i++) s += xb[i * C + c];
        m[c] = s / (float)HW;
    }
}

/* global average pooling of channels-last x (B, HW, C) into y (B, C); one thread per image
   where that pays (a wake of idle threads costs more than a small pooling) */
void tk_spatial_mean(const float *x, long B, long HW, long C, float *y) {
#pragma omp parallel for schedule(static) if (B > 1 && B * HW * C > 5 * par_min)
    for (long b = 0; b < B; b++) spatial_mean(x + b * HW * C, HW, C, y + b * C);
}

/* out[0..np) = act(bias + v[0..n) @ wt), wt (n, np) with np a multiple of VL: the weight rows
   outermost, so each output vector is an independent accumulator */
static void small_fc(const float *v, long n, const float *wt, long np, const float *bias,
                     float *out, int act, float a0, float a1) {
    memcpy(out, bias, (size_t)np * sizeof(float));
    for (long i = 0; i < n; i++) {
        vf vi = bc(v[i]);
        const float *wr = wt + i * np;
        for (long o = 0; o < np; o += VL) st(out + o, ld(out + o) + vi * ld(wr + o));
    }
    for (long o = 0; o < np; o += VL) st(out + o, act_v(ld(out + o), act, a0, a1));
}

/* squeeze-and-excitation: y = x * gate(W2 act(W1 mean(x) + b1) + b2), x and y (B, HW, C):
   w1t (C, Sp) is W1 transposed with S padded to Sp (a multiple of VL) by zeros, b1 Sp values,
   w2t (S, Cp) is W2 transposed with C padded to Cp, b2 Cp values; scratch holds
   B * (2 * Cp + Sp) floats */
void tk_se(const float *x, long B, long HW, long C, const float *w1t, const float *b1, long S,
           long Sp, const float *w2t, const float *b2, long Cp, int act1, float a10, float a11,
           int act2, float a20, float a21, float *y, float *scratch) {
    long Cv = C - C % VL;
#pragma omp parallel for schedule(static) if (B > 1 && B * HW * C > par_min)
    for (long b = 0; b < B; b++) {
        float *m = scratch + b * (2 * Cp + Sp), *h = m + Cp, *g = h + Sp;
        const float *xb = x + b * HW * C;
        spatial_mean(xb, HW, C, m); /* (m's padding past C is never read) */
        small_fc(m, C, w1t, Sp, b1, h, act1, a10, a11);
        small_fc(h, S, w2t, Cp, b2, g, act2, a20, a21);
    }
    long chunks = (HW + 63) / 64; /* rows of an image in chunks of 64, shared by threads */
#pragma omp parallel for collapse(2) schedule(static) if (B * HW * C > par_min)
    for (long b = 0; b < B; b++)
        for (long q = 0; q < chunks; q++) {
            const float *g = scratch + b * (2 * Cp + Sp) + Cp + Sp;
            long r1 = (q + 1) * 64 < HW ? (q + 1) * 64 : HW;
            for (long r = b * HW + q * 64; r < b * HW + r1; r++) {
                const float *xr = x + r * C;
                float *yr = y + r * C;
                for (long c = 0; c < Cv; c += VL) st(yr + c, ld(xr + c) * ld(g + c));
                for (long c = Cv; c < C; c++) yr[c] = xr[c] * g[c];
            }
        }
}

/* The entry points ctypes calls: the layer's fixed arguments in one int64 array (sizes, weight
   and bias addresses, activation codes) and one float array (activation scalars), the tensors
   of the call apart. ctypes converts each argument it passes (about 0.4 us apiece). */
#include <stdint.h>
#define PTR(i) ((const float *)(intptr_t)p[i])

void tk_gemm_rows_p(const int64_t *p, const float *f, const float *x, float *y, const float *res) {
    tk_gemm_rows(x, p[0], p[1], PTR(2), PTR(3), p[4], y, res, (int)p[5], (int)p[6], f[0], f[1]);
}

void tk_conv_gemm_p(const int64_t *p, const float *f, const float *x, float *y, const float *res) {
    tk_conv_gemm(x, p[0], p[1], p[2], p[3], PTR(4), PTR(5), p[6], p[7], p[8], p[9], p[10], p[11],
                 p[12], p[13], p[14], p[15], p[16], y, res, (int)p[17], (int)p[18], f[0], f[1]);
}

void tk_dwconv_p(const int64_t *p, const float *f, const float *x, float *y, const float *res) {
    tk_dwconv(x, p[0], p[1], p[2], p[3], PTR(4), PTR(5), p[6], p[7], p[8], p[9], p[10], p[11],
              p[12], p[13], p[14], p[15], y, res, (int)p[16], (int)p[17], f[0], f[1]);
}

void tk_se_p(const int64_t *p, const float *f, const float *x, float *y, float *scratch) {
    tk_se(x, p[0], p[1], p[2], PTR(3), PTR(4), p[5], p[6], PTR(7), PTR(8), p[9], (int)p[10], f[0],
          f[1], (int)p[11], f[2], f[3], y, scratch);
}

/* a (B, C, H*W) array as (B, H*W, C): the channels-last copy of an NCHW input */
void tk_to_channels_last(const float *x, long B, long C, long HW, float *y) {
#pragma omp parallel for collapse(2) schedule(static) if (B * C * HW > par_min / 2)
    for (long b = 0; b < B; b++)
        for (long p0 = 0; p0 < HW; p0 += 64) {
            long p1 = p0 + 64 < HW ? p0 + 64 : HW;
            for (long c = 0; c < C; c++) {
                const float *src = x + (b * C + c) * HW;
                float *dst = y + b * HW * C + c;
                for (long p = p0; p < p1; p++) dst[p * C] = src[p];
            }
        }
}
