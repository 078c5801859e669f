"""C++ of Adafactor's passes (torch.optim.Adafactor's update; tiermem/optim/adafactor.py drives them).

Adafactor is not elementwise: its update needs reductions over the whole tensor before any element is
written (the factored second moment's row and column means, the weights' RMS for the step size, and
the update's RMS for clipping), so it takes more than one pass: for a matrix (leading dimensions are
a batch of matrices) (1) stats: row and column sums of g^2 and the sum of p^2, reading grad and
master; (2) rms: the sum of the update's squares, reading grad; (3) apply, reading grad and master and
writing master and ``out``. For a vector, (1) and (2) are one pass (the variance is elementwise).
Sums are taken in double over fixed chunks of rows or elements combined in a fixed order, so the
result does not depend on the number of threads.
"""

from __future__ import annotations

SOURCE = r"""
namespace {

const int64_t CHUNK = 4096;  // elements (vector) or at least this many elements' worth of rows per partial

template <class M, class G>
void stats_rows(int64_t r0, int64_t r1, int64_t C, const M* __restrict__ master, const G* __restrict__ grad,
                const float* s, double* __restrict__ row_sum, double* __restrict__ col_part, double& p_part) {
    const float inv = s[0], clip = s[1];
    double ps = 0.0;
    for (int64_t r = r0; r < r1; r++) {
        double rs = 0.0;
        const int64_t o = r * C;
        #pragma omp simd reduction(+:rs, ps)
        for (int64_t c = 0; c < C; c++) {
            const float g = load(grad, o + c) * inv * clip, p = load(master, o + c);
            const double g2 = (double)g * (double)g;
            rs += g2;
            col_part[c] += g2;
            ps += (double)p * (double)p;
        }
        row_sum[r] = rs;
    }
    p_part = ps;
}

// Row r of batch b is row b*R + r; its columns' sums go to col_sum[b*C + c].
template <class M, class G>
void stats_t(int64_t B, int64_t R, int64_t C, const M* master, const G* grad, const float* s, double* row_sum,
             double* col_sum, double* p_sumsq, int nt) {
    // at least CHUNK elements a part, and at most 64 parts a matrix (each keeps a row of column sums)
    const int64_t rows_per = std::max((CHUNK + C - 1) / C, (R + 63) / 64);
    const int64_t parts_per_batch = (R + rows_per - 1) / rows_per, parts = B * parts_per_batch;
    double* col_parts = new double[parts * C]();
    double* p_parts = new double[parts]();
    parallel(parts, B * R * C >= PAR_MIN ? nt : 1, 1, [&](int64_t a, int64_t b) {
        for (int64_t k = a; k < b; k++) {
            const int64_t batch = k / parts_per_batch, r0 = batch * R + (k % parts_per_batch) * rows_per;
            const int64_t r1 = r0 + rows_per < (batch + 1) * R ? r0 + rows_per : (batch + 1) * R;
            stats_rows(r0, r1, C, master, grad, s, row_sum, col_parts + k * C, p_parts[k]);
        }
    }, 2);
    double p = 0.0;
    for (int64_t k = 0; k < parts; k++) p += p_parts[k];
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < C; c++) {
            double acc = 0.0;
            for (int64_t k = b * parts_per_batch; k < (b + 1) * parts_per_batch; k++) acc += col_parts[k * C + c];
            col_sum[b * C + c] = acc;
        }
    *p_sumsq = p;
    delete[] col_parts;
    delete[] p_parts;
}

// The factored second moment of element (r, c) is v = rs[r] * col[c] (rs: the row's variance over its
// batch's mean row variance), and its update g / sqrt(max(v, eps1^2)) = g * (rr[r] * rc[c]) with
// rr = 1/sqrt(rs) and rc = 1/sqrt(col) taken once per row and column (tiermem/optim/adafactor.py).
// ``f`` holds rs, rr (B*R each), then col, rc (B*C each).
TM_INLINE float factored_scale(float rs, float rr, float col, float rc, float eps1sq, float inv_eps1) {
    return rs * col < eps1sq ? inv_eps1 : rr * rc;
}

template <class G>
double rms_rows(int64_t r0, int64_t r1, int64_t R, int64_t C, const G* __restrict__ grad, const float* s,
                const float* __restrict__ f, int64_t B) {
    const float inv = s[0], clip = s[1], eps1sq = s[2], inv_eps1 = s[7];
    const float *rs = f, *rr = f + B * R;
    double us = 0.0;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t o = r * C, b = r / R;
        const float row_s = rs[r], row_r = rr[r];
        const float* __restrict__ col = f + 2 * B * R + b * C;
        const float* __restrict__ rc = col + B * C;
        #pragma omp simd reduction(+:us)
        for (int64_t c = 0; c < C; c++) {
            const float u = load(grad, o + c) * inv * clip
                            * factored_scale(row_s, row_r, col[c], rc[c], eps1sq, inv_eps1);
            us += (double)u * (double)u;
        }
    }
    return us;
}

template <class G>
double rms_t(int64_t B, int64_t R, int64_t C, const G* grad, const float* s, const float* f, int nt) {
    const int64_t rows = B * R, rows_per = (CHUNK + C - 1) / C, parts = (rows + rows_per - 1) / rows_per;
    double* part = new double[parts]();
    parallel(parts, rows * C >= PAR_MIN ? nt : 1, 1, [&](int64_t a, int64_t b) {
        for (int64_t k = a; k < b; k++) {
            const int64_t r1 = (k + 1) * rows_per < rows ? (k + 1) * rows_per : rows;
            part[k] = rms_rows(k * rows_per, r1, R, C, grad, s, f, B);
        }
    }, 2);
    double total = 0.0;
    for (int64_t k = 0; k < parts; k++) total += part[k];
    delete[] part;
    return total;
}

template <class M, class G, class O>
void apply_rows(int64_t r0, int64_t r1, int64_t R, int64_t C, M* __restrict__ master, const G* __restrict__ grad,
                O* __restrict__ out, const float* __restrict__ f, int64_t B, const float* s, const SR& sr_) {
    const SR sr = sr_;
    const float inv = s[0], clip = s[1], eps1sq = s[2], decay_mul = s[3], neg_step = s[4], inv_eps1 = s[7];
    const float *rs = f, *rr = f + B * R;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t o = r * C, b = r / R;
        const float row_s = rs[r], row_r = rr[r];
        const float* __restrict__ col = f + 2 * B * R + b * C;
        const float* __restrict__ rc = col + B * C;
        #pragma omp simd
        for (int64_t c = 0; c < C; c++) {
            const float u = load(grad, o + c) * inv * clip
                            * factored_scale(row_s, row_r, col[c], rc[c], eps1sq, inv_eps1);
            const float p = load(master, o + c) * decay_mul;           // param.mul_(1 - lr*wd)
            store(out, o + c, store_master(master, o + c, fmaf(u, neg_step, p), sr));  // add_(u, alpha=...)
        }
    }
}

// Vectors: the variance is elementwise (lerp towards g^2), so the variance update and the RMS sums
// are one pass.
TM_INLINE float lerp_var(float v, float g2, float w, bool from_end) {  // torch's lerp_, as in Adam
    return fmaf(from_end ? w - 1.f : w, g2 - v, from_end ? g2 : v);
}

template <class M, class G>
void vec_stats_range(int64_t a, int64_t b, const M* __restrict__ master, const G* __restrict__ grad,
                     float* __restrict__ var, const float* s, double& u_part, double& p_part) {
    const float inv = s[0], clip = s[1], eps1sq = s[2], w = s[5];
    const bool from_end = s[6] != 0.f;
    double us = 0.0, ps = 0.0;
    #pragma omp simd reduction(+:us, ps)
    for (int64_t i = a; i < b; i++) {
        const float g = load(grad, i) * inv * clip, p = load(master, i);
        const float v = lerp_var(var[i], g * g, w, from_end);
        var[i] = v;
        const float u = g * (1.f / sqrtf(v < eps1sq ? eps1sq : v));
        us += (double)u * (double)u;
        ps += (double)p * (double)p;
    }
    u_part = us;
    p_part = ps;
}

template <class M, class G, class O>
void vec_apply_range(int64_t a, int64_t b, M* __restrict__ master, const G* __restrict__ grad, O* __restrict__ out,
                     const float* __restrict__ var, const float* s, const SR& sr_) {
    const SR sr = sr_;
    const float inv = s[0], clip = s[1], eps1sq = s[2], decay_mul = s[3], neg_step = s[4];
    #pragma omp simd
    for (int64_t i = a; i < b; i++) {
        const float v = var[i];
        const float u = load(grad, i) * inv * clip * (1.f / sqrtf(v < eps1sq ? eps1sq : v));
        const float p = load(master, i) * decay_mul;
        store(out, i, store_master(master, i, fmaf(u, neg_step, p), sr));
    }
}

// The floor: Adafactor's three passes' streams (read grad and master; read grad; read grad and
// master, write master and out) and next to no arithmetic.
template <class M, class G, class O>
double floor_t(int64_t n, M* master, const G* grad, O* out, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    const int64_t parts = (n + CHUNK - 1) / CHUNK;
    double* part = new double[parts]();
    for (int pass = 0; pass < 3; pass++)
        parallel(parts, n >= PAR_MIN ? nt : 1, 1, [&](int64_t a, int64_t b) {
            for (int64_t k = a; k < b; k++) {
                const int64_t lo = k * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
                double acc = 0.0;
                if (pass == 2) {
                    #pragma omp simd
                    for (int64_t i = lo; i < hi; i++)
                        store(out, i, store_master(master, i, load(master, i) + load(grad, i), sr));
                } else {
                    #pragma omp simd reduction(+:acc)
                    for (int64_t i = lo; i < hi; i++)
                        acc += (double)load(grad, i) + (pass == 0 ? (double)load(master, i) : 0.0);
                }
                part[k] += acc;
            }
        }, 2);
    double total = 0.0;
    for (int64_t k = 0; k < parts; k++) total += part[k];
    delete[] part;
    return total;
}

}  // namespace

extern "C" double tm_adafactor_floor(int64_t n, void* master, int mdt, const void* grad, int gdt, void* out, int odt,
                                     const uint32_t* sr, int nt) {
    TM_ALL(mdt, gdt, odt, return (floor_t<M, G, O>(n, (M*)master, (const G*)grad, (O*)out, sr, nt)))
    return 0.0;
}

extern "C" void tm_adafactor_stats(int64_t B, int64_t R, int64_t C, const void* master, int mdt, const void* grad,
                                   int gdt, const float* s, double* row_sum, double* col_sum, double* p_sumsq,
                                   int nt) {
    TM_MASTER(mdt, TM_GRAD(gdt, stats_t(B, R, C, (const M*)master, (const G*)grad, s, row_sum, col_sum, p_sumsq, nt)))
}
extern "C" double tm_adafactor_rms(int64_t B, int64_t R, int64_t C, const void* grad, int gdt, const float* s,
                                   const float* f, int nt) {
    TM_GRAD(gdt, return rms_t(B, R, C, (const G*)grad, s, f, nt))
    return 0.0;
}
extern "C" void tm_adafactor_apply(int64_t B, int64_t R, int64_t C, void* master, int mdt, const void* grad, int gdt,
                                   void* out, int odt, const float* f, const float* s, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    const int64_t rows = B * R;
    TM_ALL(mdt, gdt, odt, parallel(rows, rows * C >= PAR_MIN ? nt : 1, 1, [&](int64_t a, int64_t b) {
        apply_rows<M, G, O>(a, b, R, C, (M*)master, (const G*)grad, (O*)out, f, B, s, sr); }, 2))
}
extern "C" void tm_adafactor_vec_stats(int64_t n, const void* master, int mdt, const void* grad, int gdt, float* var,
                                       const float* s, double* u_sumsq, double* p_sumsq, int nt) {
    const int64_t parts = (n + CHUNK - 1) / CHUNK;
    double* u = new double[parts]();
    double* p = new double[parts]();
    TM_MASTER(mdt, TM_GRAD(gdt, parallel(parts, n >= PAR_MIN ? nt : 1, 1, [&](int64_t a, int64_t b) {
        for (int64_t k = a; k < b; k++)
            vec_stats_range((int64_t)(k * CHUNK), (k + 1) * CHUNK < n ? (k + 1) * CHUNK : n, (const M*)master,
                            (const G*)grad, var, s, u[k], p[k]); }, 2)))
    double us = 0.0, ps = 0.0;
    for (int64_t k = 0; k < parts; k++) { us += u[k]; ps += p[k]; }
    *u_sumsq = us;
    *p_sumsq = ps;
    delete[] u;
    delete[] p;
}
extern "C" void tm_adafactor_vec_apply(int64_t n, void* master, int mdt, const void* grad, int gdt, void* out, int odt,
                                       const float* var, const float* s, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    TM_ALL(mdt, gdt, odt, parallel(n, nt, 64, [&](int64_t a, int64_t b) {
        vec_apply_range<M, G, O>(a, b, (M*)master, (const G*)grad, (O*)out, var, s, sr); }))
}
"""
