"""C++ of the single-pass elementwise kernels: SGD (momentum, Nesterov, dampening), Adagrad, Lion, and
Adam/AdamW for bf16 master weights (stochastic rounding; fp32 masters run the compiled kernel of
_compiled.py, whose numbers these equal), plus the floor kernel that moves the same bytes.

Each kernel reads the gradient, the master weights and its state once and writes the master, the
state and ``out`` once; the scalars come in one fp32 array laid out by tiermem/optim/hypers.py, every
flag among them data, so one instance serves every hyperparameter. The arithmetic is the reference
kernels' (tiermem/optim/kernels/reference.py), op for op.
"""

from __future__ import annotations

ADAM_MATH = r"""
namespace {

// Adam's arithmetic, shared with the 8-bit kernel: torch.optim.adam._single_tensor_adam op for op
// (tiermem/optim/kernels/eager.py _single_tensor_adam), on the scalars of AdamHyper.kernel_scalars() plus
// two flags (and, for the 8-bit kernel, 1 / bias_correction2_sqrt): the new weight and moments.
struct AdamScalars {
    float inv, clip, decay_mul, l2, lerp, b2, omb2, bc2, eps, neg_step, inv_bc2, inv_k, inv_rk;
    bool use_l2, from_grad;
    explicit AdamScalars(const float* s)
        : inv(s[0]), clip(s[1]), decay_mul(s[3]), l2(s[4]), lerp(s[5]), b2(s[6]), omb2(s[7]), bc2(s[8]),
          eps(s[9]), neg_step(s[10]), inv_bc2(s[13]), inv_k(s[14]), inv_rk(s[15]), use_l2(s[11] != 0.f), from_grad(s[12] != 0.f) {}
};
struct AdamOut { float p, m, v; };
TM_INLINE AdamOut adam_math(const AdamScalars& c, float p, float g, float m, float v) {
    g = g * c.inv * c.clip;
    g = pick(c.use_l2, fmaf(p, c.l2, g), g);                   // grad.add(param, alpha=wd)
    p = p * c.decay_mul;                                       // AdamW: param.mul_(1 - lr*wd)
    m = fmaf(c.lerp, g - m, pick(c.from_grad, g, m));          // exp_avg.lerp_(grad, 1-beta1)
    v = fmaf(c.omb2 * g, g, v * c.b2);                         // exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
    float denom = sqrtf(v) / c.bc2 + c.eps;
    return {p + (c.neg_step * m) / denom, m, v};               // param.addcdiv_(exp_avg, denom, -step_size)
}
// The 8-bit kernel's: the same but for one division fewer, sqrt(v) * (1 / bias_correction2_sqrt) (a
// division costs as much as the rest of the update on some CPUs; the moments' quantization error is
// ~10^5 times this rounding difference).
TM_INLINE AdamOut adam_math8(const AdamScalars& c, float p, float g, float m, float v) {
    g = g * c.inv * c.clip;
    if (c.use_l2) g = fmaf(p, c.l2, g);
    p = p * c.decay_mul;
    m = fmaf(c.lerp, g - m, c.from_grad ? g : m);
    v = fmaf(c.omb2 * g, g, v * c.b2);
    float denom = sqrtf(v) * c.inv_bc2 + c.eps;
    return {p + (c.neg_step * m) / denom, m, v};
}

}  // namespace
"""

SOURCE = r"""
namespace {

template <class M, class G, class O, bool MOMENTUM>
void sgd_range(int64_t a, int64_t b, M* __restrict__ master, float* __restrict__ buf, const G* __restrict__ grad,
               O* __restrict__ out, const float* s, const SR& sr_) {
    const SR sr = sr_;  // a local: members read through a reference stop the loop vectorising
    const float inv = s[0], clip = s[1], wd = s[2], mom = s[4], omd = s[5], neg_lr = s[8];
    const bool decay = s[3] != 0.f, first = s[6] != 0.f, nesterov = s[7] != 0.f;
    #pragma omp simd
    for (int64_t i = a; i < b; i++) {
        float p = load(master, i);
        float g = load(grad, i) * inv * clip;
        g = pick(decay, fmaf(p, wd, g), g);                   // grad.add(param, alpha=wd)
        if (MOMENTUM) {  // NOTE [Selects, not branches]: buf is read on the first step too (then unused)
            float m = pick(first, g, fmaf(g, omd, buf[i] * mom));  // buf.mul_(mom).add_(grad, alpha=1-damp)
            buf[i] = m;
            g = pick(nesterov, fmaf(m, mom, g), m);           // grad.add(buf, alpha=mom)
        }
        store(out, i, store_master(master, i, fmaf(g, neg_lr, p), sr));  // param.add_(grad, alpha=-lr)
    }
}

template <class M, class G, class O>
void adagrad_range(int64_t a, int64_t b, M* __restrict__ master, float* __restrict__ sum,
                   const G* __restrict__ grad, O* __restrict__ out, const float* s, const SR& sr_) {
    const SR sr = sr_;  // a local: members read through a reference stop the loop vectorising
    const float inv = s[0], clip = s[1], wd = s[2], neg_clr = s[4], eps = s[5];
    const bool decay = s[3] != 0.f;
    #pragma omp simd
    for (int64_t i = a; i < b; i++) {
        float p = load(master, i);
        float g = load(grad, i) * inv * clip;
        g = pick(decay, fmaf(p, wd, g), g);                    // NOTE [Selects, not branches]
        float acc = fmaf(g, g, sum[i]);                        // state_sum.addcmul_(grad, grad, value=1)
        sum[i] = acc;
        float std_ = sqrtf(acc) + eps;                         // state_sum.sqrt().add_(eps)
        store(out, i, store_master(master, i, p + (neg_clr * g) / std_, sr));  // addcdiv_(grad, std, -clr)
    }
}

template <class M, class G, class O>
void lion_range(int64_t a, int64_t b, M* __restrict__ master, float* __restrict__ exp_avg,
                const G* __restrict__ grad, O* __restrict__ out, const float* s, const SR& sr_) {
    const SR sr = sr_;  // a local: members read through a reference stop the loop vectorising
    const float inv = s[0], clip = s[1], decay_mul = s[2], b1 = s[3], omb1 = s[4], b2 = s[5], omb2 = s[6],
                neg_lr = s[7];
    #pragma omp simd
    for (int64_t i = a; i < b; i++) {
        float p = load(master, i) * decay_mul;                 // param.mul_(1 - lr*wd)
        float g = load(grad, i) * inv * clip;
        float m = exp_avg[i];
        float c = fmaf(g, omb1, m * b1);                       // exp_avg.mul(b1).add(grad, alpha=1-b1)
        float sign = (float)((c > 0.f) - (c < 0.f));           // torch.sign (NaN -> 0)
        exp_avg[i] = fmaf(g, omb2, m * b2);                    // exp_avg.mul_(b2).add_(grad, alpha=1-b2)
        store(out, i, store_master(master, i, fmaf(sign, neg_lr, p), sr));  // param.add_(sign, alpha=-lr)
    }
}

template <class M, class G, class O>
void adam_range(int64_t a, int64_t b, M* __restrict__ master, float* __restrict__ exp_avg,
                float* __restrict__ exp_avg_sq, const G* __restrict__ grad, O* __restrict__ out, const float* s,
                const SR& sr_) {
    const SR sr = sr_;
    const AdamScalars c(s);
    #pragma omp simd
    for (int64_t i = a; i < b; i++) {
        AdamOut r = adam_math(c, load(master, i), load(grad, i), exp_avg[i], exp_avg_sq[i]);
        exp_avg[i] = r.m;
        exp_avg_sq[i] = r.v;
        store(out, i, store_master(master, i, r.p, sr));
    }
}

// The floor: the streams of a kernel with one or two fp32 state tensors, and next to no arithmetic.
template <class M, class G, class O, bool TWO>
void streams_range(int64_t a, int64_t b, M* __restrict__ master, float* __restrict__ s0, float* __restrict__ s1,
                   const G* __restrict__ grad, O* __restrict__ out, const SR& sr_) {
    const SR sr = sr_;
    #pragma omp simd
    for (int64_t i = a; i < b; i++) {
        float g = load(grad, i);
        s0[i] += g;
        if (TWO) s1[i] += g;
        store(out, i, store_master(master, i, load(master, i) + g, sr));
    }
}

}  // namespace

#define TM_RUN(CALL) parallel(n, nt, 64, [&](int64_t a, int64_t b) { CALL; })

extern "C" void tm_sgd(int64_t n, void* master, int mdt, float* buf, const void* grad, int gdt, void* out, int odt,
                       const float* s, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    if (buf) {
        TM_ALL(mdt, gdt, odt,
               TM_RUN((sgd_range<M, G, O, true>(a, b, (M*)master, buf, (const G*)grad, (O*)out, s, sr))))
    } else {
        TM_ALL(mdt, gdt, odt,
               TM_RUN((sgd_range<M, G, O, false>(a, b, (M*)master, buf, (const G*)grad, (O*)out, s, sr))))
    }
}
extern "C" void tm_adagrad(int64_t n, void* master, int mdt, float* sum, const void* grad, int gdt, void* out,
                           int odt, const float* s, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    TM_ALL(mdt, gdt, odt, TM_RUN((adagrad_range<M, G, O>(a, b, (M*)master, sum, (const G*)grad, (O*)out, s, sr))))
}
extern "C" void tm_lion(int64_t n, void* master, int mdt, float* exp_avg, const void* grad, int gdt, void* out,
                        int odt, const float* s, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    TM_ALL(mdt, gdt, odt, TM_RUN((lion_range<M, G, O>(a, b, (M*)master, exp_avg, (const G*)grad, (O*)out, s, sr))))
}
extern "C" void tm_adam(int64_t n, void* master, int mdt, float* exp_avg, float* exp_avg_sq, const void* grad,
                        int gdt, void* out, int odt, const float* s, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    TM_ALL(mdt, gdt, odt, TM_RUN((adam_range<M, G, O>(a, b, (M*)master, exp_avg, exp_avg_sq, (const G*)grad,
                                                       (O*)out, s, sr))))
}
extern "C" void tm_streams(int64_t n, void* master, int mdt, float* s0, float* s1, const void* grad, int gdt,
                           void* out, int odt, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    if (s1) {
        TM_ALL(mdt, gdt, odt, TM_RUN((streams_range<M, G, O, true>(a, b, (M*)master, s0, s1, (const G*)grad,
                                                                    (O*)out, sr))))
    } else {
        TM_ALL(mdt, gdt, odt, TM_RUN((streams_range<M, G, O, false>(a, b, (M*)master, s0, s1, (const G*)grad,
                                                                     (O*)out, sr))))
    }
}
"""
