/* tensorkiln's native CPU kernels: small convolutions on channels-last float32 data.

   Compiled on the user's machine at first use (cpu_native.py: the system C compiler, -O3
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

int tk_vector_floats(void) { return VL; }
int tk_panel_floats(void) { return NR; }

/* exp on every lane: Cephes' expf (range reduction by ln 2, degree-6 polynomial), about 1 ulp;
   inf above 88.38, 0 below -87.34, NaN kept */
static inline vf vexp(vf x) {
    const vf hi = bc(88.3762626647949f), lo = bc(-87.3365447505531f);
    vf xc = sel(x > hi, hi, x);
    xc = sel(xc < lo, lo, xc);
    vf fx = xc * 1.44269504088896341f + 0.5f;
    vf t = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
    vf n = sel(t > fx, t - 1.0f, t); /* floor */
    vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = bc(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf y = p * (vf)e;
    y = sel(x > hi, bc(__builtin_inff()), y);
    y = sel(x < lo, bc(0.0f), y);
    return sel(x != x, x, y);
}

/* comparisons are false for NaN, so each select below keeps a NaN as it is */
static inline vf act_v(vf v, int act, float a0, float a1) {
    switch (act) {
    case A_RELU:
        return sel(v <= 0.0f, bc(0.0f), v);
    case A_CLIP:
        v = sel(v < a0, bc(a0), v);
        return sel(v > a1, bc(a1), v);
    case A_HSWISH: {
        vf t = v + 3.0f;
        t = sel(t < 0.0f, bc(0.0f), t);
        t = sel(t > 6.0f, bc(6.0f), t);
        return v * t * (1.0f / 6.0f);
    }
    case A_HSIG: {
        vf t = v * a0 + a1;
        t = sel(t < 0.0f, bc(0.0f), t);
        return sel(t > 1.0f, bc(1.0f), t);
    }
    case A_SIGMOID:
        return 1.0f / (1.0f + vexp(-v));
    case A_SILU:
        return v / (1.0f + vexp(-v));
    case A_LEAKY:
        return sel(v < 0.0f, v * a0, v);
    default:
        return v;
    }
}

/* the epilogue of one output row of nv <= NR values at y (residual at res, or NULL) */
static inline void epilogue(vf acc[2], const float *bias, float *y, const float *res, long nv,
                            int order, int act, float a0, float a1) {
    float rt[NR], yt[NR];
    if (res && nv < NR) {
        memset(rt, 0, sizeof rt);
        memcpy(rt, res, (size_t)nv * sizeof(float));
        res = rt;
    }
    int halves = nv > VL ? 2 : 1;
    for (int h = 0; h < halves; h++) {
        vf v = acc[h] + ld(bias + h * VL);
        if (res && order == 0) v += ld(res + h * VL);
        v = act_v(v, act, a0, a1);
        if (res && order == 1) v += ld(res + h * VL);
        if (nv == NR)
            st(y + h * VL, v);
        else
            st(yt + h * VL, v);
    }
    if (nv < NR) memcpy(y, yt, (size_t)nv * sizeof(float));
}

/* MR rows a[i][0..K) times one packed panel b (K x NR): acc[i][0..2) */
#define MICRO(NV)                                                                             \
    for (long k = 0; k < K; k++) {                                                            \
        vf b0 = ld(b + k * NR), b1 = NV > 1 ? ld(b + k * NR + VL) : bc(0.0f);                 \
        for (int i = 0; i < MR; i++) {                                                        \
            vf s = bc(a[i][k]);                                                               \
            acc[i][0] += s * b0;                                                              \
            if (NV > 1) acc[i][1] += s * b1;                                                  \
        }                                                                                     \
    }

static inline void panel(const float *const a[MR], long K, const float *b, long nv,
                         vf acc[MR][2]) {
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = bc(0.0f);
    if (nv > VL) {
        MICRO(2)
    } else {
        MICRO(1)
    }
}

/* y = act(x @ w + bias [+ res]), a 1x1 convolution over M = B*H*W rows of K channels:
   wp holds the (K x N) weight in ceil(N / NR) panels of K x NR (zero padded), bias
   ceil(N / NR) * NR values (zero padded) */
void tk_gemm_rows(const float *x, long M, long K, const float *wp, const float *bias, long N,
                  float *y, const float *res, int order, int act, float a0, float a1) {
    long panels = (N + NR - 1) / NR, blocks = (M + MR - 1) / MR;
    long tasks = panels * blocks;
#pragma omp parallel for schedule(static) if (M * K * N > 400000)
    for (long t = 0; t < tasks; t++) {
        long pb = t % panels, m0 = (t / panels) * MR, n0 = pb * NR;
        long nv = N - n0 < NR ? N - n0 : NR;
        const float *a[MR];
        for (int i = 0; i < MR; i++) a[i] = x + (m0 + i < M ? m0 + i : M - 1) * K;
        vf acc[MR][2];
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
#pragma omp parallel for schedule(static) if (M * K * N > 400000)
    for (long mb = 0; mb < blocks; mb++) {
        float buf[MR * TK_CONV_MAX_K];
        const float *a[MR];
        long m0 = mb * MR;
        for (int i = 0; i < MR; i++) {
            long m = m0 + i < M ? m0 + i : M - 1;
            long b = m / (Ho * Wo), ho = (m / Wo) % Ho, wo = m % Wo;
            float *row = buf + i * K;
            for (long u = 0; u < kh; u++) {
                long hi = ho * sh - pt + u * dh;
                for (long v = 0; v < kw; v++) {
                    long wi = wo * sw - pl + v * dw;
                    float *dst = row + (u * kw + v) * C;
                    if (hi < 0 || hi >= H || wi < 0 || wi >= W)
                        memset(dst, 0, (size_t)C * sizeof(float));
                    else
                        memcpy(dst, x + ((b * H + hi) * W + wi) * C, (size_t)C * sizeof(float));
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

/* depthwise convolution: w (kh, kw, C), bias C values; one output channel per input channel */
#define DW_TAPS(KW)                                                                           \
    for (long i = i0; i < i1; i++) {                                                          \
        const float *xr = x + ((b * H + hi0 + i * dh) * W + wi0) * C + c;                     \
        const float *wr = w + i * kw * C + c;                                                 \
        for (long j = 0; j < KW; j++) acc += ld(xr + j * C) * ld(wr + j * C);                 \
    }

void tk_dwconv(const float *x, long B, long H, long W, long C, const float *w, const float *bias,
               long kh, long kw, long sh, long sw, long pt, long pl, long dh, long dw, long Ho,
               long Wo, float *y, const float *res, int order, int act, float a0, float a1) {
    long Cv = C - C % VL;
#pragma omp parallel for collapse(2) schedule(static) if (B * Ho * Wo * C * kh * kw > 200000)
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
                int full = j0 == 0 && j1 == kw && dw == 1;
                float *yp = y + ((b * Ho + ho) * Wo + wo) * C;
                const float *rp = res ? res + ((b * Ho + ho) * Wo + wo) * C : NULL;
                for (long c = 0; c < Cv; c += VL) {
                    vf acc = ld(bias + c);
                    if (full && kw == 3) {
                        DW_TAPS(3)
                    } else if (full && kw == 5) {
                        DW_TAPS(5)
                    } else {
                        for (long i = i0; i < i1; i++) {
                            const float *xr = x + ((b * H + hi0 + i * dh) * W) * C + c;
                            const float *wr = w + i * kw * C + c;
                            for (long j = j0; j < j1; j++)
                                acc += ld(xr + (wi0 + j * dw) * C) * ld(wr + j * C);
                        }
                    }
                    if (rp && order == 0) acc += ld(rp + c);
                    acc = act_v(acc, act, a0, a1);
                    if (rp && order == 1) acc += ld(rp + c);
                    st(yp + c, acc);
                }
                if (Cv < C) { /* the last C % VL channels, through a zero-padded vector */
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
