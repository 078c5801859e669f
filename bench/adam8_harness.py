"""Where the 8-bit Adam kernel's time goes, and what candidate changes would buy: a harness outside the
library (issue 22, the kernel's speed).

    python bench/adam8_harness.py [--params 16M] [--cache 8192] [--repeat 9]

It compiles, with the library's flags, the library's own C++ (tiermem/optim/kernels/csrc/*.py SOURCE) beside
candidate versions of the kernel written here, and times each on one thread in CPU time of the
calling thread (CLOCK_THREAD_CPUTIME_ID, so descheduling on a loaded machine does not count), in
interleaved rounds, fastest of ``--repeat``; fp32 master, bf16 grad and out (TieredModel's call):

* ``library``: tm_adam8bit as the library builds it on this CPU (its codes: AVX-512, AVX2 or scalar);
* ``hand update (exact)``: the library's codes with the update written with 256-bit intrinsics (fp32
  master, bf16 grad and out only): the same bits as the library, checked here before timing;
* ``hand update, rcp``: the division by ``rcp`` + one Newton step (not the same bits);
* ``hand update, rsqrt + rcp``: and the square root by ``rsqrt`` + one Newton step (not the same bits);
* ``pow2 map``: a format whose cells are fp8-like (sign, exponent, 3 mantissa bits for exp_avg; 5 and
  3 for exp_avg_sq) against a per-block scale, so that (de)quantizing is bit arithmetic on the fp32
  exponent (timed only: a format change; the exact hand update);
* the fp32 Adam kernel (tm_adam's loop, 28 B) and the floors (16 B and 28 B, the same streams
  with next to no arithmetic); in cache also the stages alone (both moments).

``--params`` runs from memory, ``--cache`` (L2-resident) the arithmetic alone. Ratios come last.
Needs an x86 CPU with AVX2 and FMA (the candidates are written with their intrinsics).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tiermem.optim.kernels import native as _native
from tiermem.optim.kernels.csrc import (
    adam8bit as _csrc_adam8bit,
    common as _csrc_common,
    elementwise as _csrc_elementwise,
)

CANDIDATES = r"""
#include <immintrin.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
namespace cand {

TM_INLINE void pack_codes32(uint8_t* p, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {  // 32 codes, in order
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(q0, q1), _mm256_packus_epi32(q2, q3));
    _mm256_storeu_si256((__m256i*)p, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// -- the update, by hand for fp32 master / bf16 grad / bf16 out: exact, or with approximations ----------
TM_INLINE __m256 load_bf16x8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
TM_INLINE void store_bf16x8(bf16* p, __m256 v) {  // round to nearest even (finite values)
    __m256i u = _mm256_castps_si256(v);
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    u = _mm256_srli_epi32(u, 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128((__m128i*)p, h);
}
template <int APPROX>  // 0 exact (sqrt, div), 1 rcp + Newton for the division, 2 rsqrt + Newton too
TM_INLINE void update8(int64_t o, int64_t len, float* __restrict__ master, const bf16* __restrict__ grad,
                       bf16* __restrict__ out, float* __restrict__ m, float* __restrict__ v, const AdamScalars& c,
                       float& m_max, float& v_max) {
    const __m256 inv = _mm256_set1_ps(c.inv), clip = _mm256_set1_ps(c.clip), dm = _mm256_set1_ps(c.decay_mul),
                 lerp = _mm256_set1_ps(c.lerp), b2 = _mm256_set1_ps(c.b2), omb2 = _mm256_set1_ps(c.omb2),
                 ibc2 = _mm256_set1_ps(c.inv_bc2), eps = _mm256_set1_ps(c.eps), ns = _mm256_set1_ps(c.neg_step),
                 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), two = _mm256_set1_ps(2.f),
                 half = _mm256_set1_ps(0.5f), three = _mm256_set1_ps(3.f);
    __m256 mm = _mm256_setzero_ps(), vm = _mm256_setzero_ps();
    for (int64_t i = 0; i < len; i += 8) {
        __m256 p = _mm256_loadu_ps(master + o + i), g = load_bf16x8(grad + o + i);
        __m256 mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
        g = _mm256_mul_ps(_mm256_mul_ps(g, inv), clip);
        p = _mm256_mul_ps(p, dm);
        mi = _mm256_fmadd_ps(lerp, _mm256_sub_ps(g, mi), mi);
        vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(vi, b2));
        __m256 s;
        if (APPROX == 2) {  // sqrt(v) = v * rsqrt(v), one Newton step; v = 0 -> 0
            const __m256 r0 = _mm256_rsqrt_ps(vi);
            const __m256 r = _mm256_mul_ps(_mm256_mul_ps(half, r0), _mm256_sub_ps(three, _mm256_mul_ps(_mm256_mul_ps(vi, r0), r0)));
            s = _mm256_and_ps(_mm256_mul_ps(vi, r), _mm256_cmp_ps(vi, _mm256_setzero_ps(), _CMP_GT_OQ));
        } else {
            s = _mm256_sqrt_ps(vi);
        }
        const __m256 den = _mm256_add_ps(_mm256_mul_ps(s, ibc2), eps);
        __m256 step;
        if (APPROX >= 1) {
            const __m256 r0 = _mm256_rcp_ps(den);
            const __m256 r = _mm256_mul_ps(r0, _mm256_sub_ps(two, _mm256_mul_ps(den, r0)));
            step = _mm256_mul_ps(_mm256_mul_ps(ns, mi), r);
        } else {
            step = _mm256_div_ps(_mm256_mul_ps(ns, mi), den);
        }
        p = _mm256_add_ps(p, step);
        _mm256_storeu_ps(master + o + i, p);
        store_bf16x8(out + o + i, p);
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        mm = _mm256_max_ps(mm, _mm256_and_ps(mi, absmask));
        vm = _mm256_max_ps(vm, vi);
    }
    alignas(32) float a[8], b[8];
    _mm256_store_ps(a, mm);
    _mm256_store_ps(b, vm);
    m_max = v_max = 0.f;
    for (int j = 0; j < 8; j++) { m_max = a[j] > m_max ? a[j] : m_max; v_max = b[j] > v_max ? b[j] : v_max; }
}

// The library's adam8_range (its codes, whichever path this CPU builds) with a hand-written update.
template <int APPROX>
void adam8_approx(int64_t a, int64_t b, float* master, uint8_t* mq, float* mabs, uint8_t* vq, float* vabs,
                const bf16* grad, bf16* out, const float* s, const float* q) {
    const AdamScalars c(s);
    alignas(64) float m[QBLOCK], v[QBLOCK];
    for (int64_t o = a; o < b; o += QBLOCK) {
        const int64_t len = b - o < QBLOCK ? b - o : QBLOCK, blk = o / QBLOCK;
        dequant_block(mq + o, mabs[blk], true, m, len, q);
        dequant_block(vq + o, vabs[blk], false, v, len, q);
        float m_max, v_max;
        update8<APPROX>(o, len, master, grad, out, m, v, c, m_max, v_max);
        quant_block(m, m_max > 0.f ? 1.f / m_max : 0.f, true, mq + o, len, q);
        quant_block(v, v_max > 0.f ? 1.f / v_max : 0.f, false, vq + o, len, q);
        mabs[blk] = m_max;
        vabs[blk] = v_max;
    }
}

// -- a map of fp8-like cells: (de)quantizing is bit arithmetic on the fp32 exponent (timing only) ----
// exp_avg: sign, 4 exponent bits (2^-15 .. 1), 3 mantissa bits; exp_avg_sq: 5 and 3 (2^-31 .. 1).
TM_INLINE __m256i pow2_quant8(__m256 y, bool is_signed) {
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i u = _mm256_srli_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(1 << 19)), 20);  // nearest
    u = _mm256_sub_epi32(u, _mm256_set1_epi32(is_signed ? (127 - 15) << 3 : (127 - 31) << 3));
    u = _mm256_min_epi32(_mm256_max_epi32(u, _mm256_setzero_si256()), _mm256_set1_epi32(is_signed ? 127 : 255));
    if (is_signed) u = _mm256_or_si256(u, _mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN)), 24));
    return u;
}
TM_INLINE __m256 pow2_dequant8(const uint8_t* codes, bool is_signed) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)codes));
    const __m256i q = is_signed ? _mm256_and_si256(c, _mm256_set1_epi32(127)) : c;
    __m256i u = _mm256_slli_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(is_signed ? (127 - 15) << 3 : (127 - 31) << 3)), 20);
    u = _mm256_andnot_si256(_mm256_cmpeq_epi32(q, _mm256_setzero_si256()), u);
    if (is_signed) u = _mm256_or_si256(u, _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(128)), 24));
    return _mm256_castsi256_ps(u);
}
void adam8_pow2(int64_t a, int64_t b, float* master, uint8_t* mq, float* mabs, uint8_t* vq, float* vabs,
                const bf16* grad, bf16* out, const float* s) {
    const AdamScalars c(s);
    alignas(64) float m[QBLOCK], v[QBLOCK];
    for (int64_t o = a; o < b; o += QBLOCK) {
        const int64_t blk = o / QBLOCK;  // whole blocks only (timing)
        const __m256 ms = _mm256_set1_ps(mabs[blk]), vs = _mm256_set1_ps(vabs[blk]);
        for (int64_t i = 0; i < QBLOCK; i += 8) {
            _mm256_storeu_ps(m + i, _mm256_mul_ps(pow2_dequant8(mq + o + i, true), ms));
            _mm256_storeu_ps(v + i, _mm256_mul_ps(pow2_dequant8(vq + o + i, false), vs));
        }
        float m_max, v_max;
        update8<0>(o, QBLOCK, master, grad, out, m, v, c, m_max, v_max);
        const __m256 mi = _mm256_set1_ps(m_max > 0.f ? 1.f / m_max : 0.f), vi = _mm256_set1_ps(v_max > 0.f ? 1.f / v_max : 0.f);
        for (int64_t i = 0; i < QBLOCK; i += 32) {
            __m256i qm[4], qv[4];
            for (int j = 0; j < 4; j++) {
                qm[j] = pow2_quant8(_mm256_mul_ps(_mm256_loadu_ps(m + i + 8 * j), mi), true);
                qv[j] = pow2_quant8(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * j), vi), false);
            }
            pack_codes32(mq + o + i, qm[0], qm[1], qm[2], qm[3]);
            pack_codes32(vq + o + i, qv[0], qv[1], qv[2], qv[3]);
        }
        mabs[blk] = m_max;
        vabs[blk] = v_max;
    }
}

}  // namespace cand

static double thread_seconds() {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

struct Bufs {
    int64_t n;
    float* master; uint8_t *mq, *vq; float *mabs, *vabs; bf16 *grad, *out; float *e, *s2;
};
static Bufs make(int64_t n, unsigned seed, const float* qc) {
    Bufs b{n};
    const int64_t nb = (n + 255) / 256;
    b.master = (float*)aligned_alloc(64, n * 4); b.e = (float*)aligned_alloc(64, n * 4); b.s2 = (float*)aligned_alloc(64, n * 4);
    b.mq = (uint8_t*)aligned_alloc(64, n); b.vq = (uint8_t*)aligned_alloc(64, n);
    b.mabs = (float*)aligned_alloc(64, nb * 4); b.vabs = (float*)aligned_alloc(64, nb * 4);
    b.grad = (bf16*)aligned_alloc(64, n * 2); b.out = (bf16*)aligned_alloc(64, n * 2);
    srand(seed);
    float* tmp = (float*)aligned_alloc(64, n * 4);
    for (int64_t i = 0; i < n; i++) {
        float r = (float)rand() / RAND_MAX - 0.5f, r2 = (float)rand() / RAND_MAX - 0.5f;
        b.master[i] = r; b.grad[i] = (bf16)bf16_rne(r2 * 1e-3f); b.e[i] = r2 * 1e-3f; b.s2[i] = r * r * 1e-6f;
        tmp[i] = r2 * 1e-3f;
    }
    tm_quantize(n, tmp, 1, b.mq, b.mabs, qc, 1);
    for (int64_t i = 0; i < n; i++) tmp[i] = tmp[i] * tmp[i];
    tm_quantize(n, tmp, 0, b.vq, b.vabs, qc, 1);
    free(tmp);
    return b;
}

int main(int argc, char** argv) {
    const int64_t big = atoll(argv[1]), small = atoll(argv[2]);
    const int repeat = atoi(argv[3]);
    const float* qc = (const float*)QCONST;
    // scalars: AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0.01, step 10
    float s[16] = {1.f, 1.f, 1.f, 1.f - 1e-5f, 0.f, 0.1f, 0.999f, 0.001f, 0.0998f, 1e-8f, -1.53e-3f, 0.f, 0.f, 10.02f, 0, 0};
    // the hand-written exact update against the library's, same bits (rcp / rsqrt are not)
    for (int64_t n : {(int64_t)4096, (int64_t)70144}) {
        Bufs x = make(n, 7, qc), y = make(n, 7, qc);
        for (int st = 0; st < 3; st++) {
            tm_adam8bit(n, x.master, 0, x.mq, x.mabs, x.vq, x.vabs, x.grad, 1, x.out, 1, s, qc, nullptr, 1);
            cand::adam8_approx<0>(0, n, y.master, y.mq, y.mabs, y.vq, y.vabs, y.grad, y.out, s, qc);
        }
        if (memcmp(x.mq, y.mq, n) || memcmp(x.vq, y.vq, n) || memcmp(x.master, y.master, 4 * n)) {
            printf("MISMATCH: the hand-written update against the library's at n=%lld\n", (long long)n);
            return 1;
        }
    }
    for (int64_t n : {big, small}) {
        Bufs b = make(n, 1, qc);
        const int64_t reps = n >= (1 << 20) ? 1 : (1 << 24) / n;  // in cache: many calls per timing
        const char* names[] = {"library", "hand update (exact)", "hand update, rcp", "hand update, rsqrt + rcp", "pow2 map",
                               "fp32 Adam kernel (28 B)", "floor 16 B (8-bit)", "floor 28 B (fp32)",
                               "stage: dequantize", "stage: quantize", "stage: update (hand, exact)",
                               "stage: pow2 (de)quantize"};
        const int K = 12;
        double best[K];
        for (int k = 0; k < K; k++) best[k] = 1e30;
        for (int r = -1; r < repeat; r++)
            for (int k = 0; k < (n == big ? 8 : K); k++) {
                const double t0 = thread_seconds();
                for (int64_t j = 0; j < reps; j++) {
                    switch (k) {
                    case 0: tm_adam8bit(n, b.master, 0, b.mq, b.mabs, b.vq, b.vabs, b.grad, 1, b.out, 1, s, qc, nullptr, 1); break;
                    case 1: cand::adam8_approx<0>(0, n, b.master, b.mq, b.mabs, b.vq, b.vabs, b.grad, b.out, s, qc); break;
                    case 2: cand::adam8_approx<1>(0, n, b.master, b.mq, b.mabs, b.vq, b.vabs, b.grad, b.out, s, qc); break;
                    case 3: cand::adam8_approx<2>(0, n, b.master, b.mq, b.mabs, b.vq, b.vabs, b.grad, b.out, s, qc); break;
                    case 4: cand::adam8_pow2(0, n, b.master, b.mq, b.mabs, b.vq, b.vabs, b.grad, b.out, s); break;
                    case 5: tm_adam(n, b.master, 0, b.e, b.s2, b.grad, 1, b.out, 1, s, nullptr, 1); break;
                    case 6: tm_streams8(n, b.master, 0, b.mq, b.mabs, b.vq, b.vabs, b.grad, 1, b.out, 1, nullptr, 1); break;
                    case 7: tm_streams(n, b.master, 0, b.e, b.s2, b.grad, 1, b.out, 1, nullptr, 1); break;
                    case 8: for (int64_t o = 0; o < n; o += QBLOCK) {
                                dequant_block(b.mq + o, b.mabs[o / QBLOCK], true, b.e + o, QBLOCK, qc);
                                dequant_block(b.vq + o, b.vabs[o / QBLOCK], false, b.s2 + o, QBLOCK, qc); } break;
                    case 9: for (int64_t o = 0; o < n; o += QBLOCK) {
                                quant_block(b.e + o, 1.f / b.mabs[o / QBLOCK], true, b.mq + o, QBLOCK, qc);
                                quant_block(b.s2 + o, 1.f / b.vabs[o / QBLOCK], false, b.vq + o, QBLOCK, qc); } break;
                    case 10: for (int64_t o = 0; o < n; o += QBLOCK) { float x, y; const AdamScalars c(s);
                                cand::update8<0>(o, QBLOCK, b.master, b.grad, b.out, b.e + o, b.s2 + o, c, x, y); } break;
                    case 11: for (int64_t o = 0; o < n; o += QBLOCK) for (int64_t i = 0; i < QBLOCK; i += 32) {
                                __m256i q[4];
                                for (int j = 0; j < 4; j++) q[j] = cand::pow2_quant8(_mm256_mul_ps(cand::pow2_dequant8(b.mq + o + i + 8 * j, true), _mm256_set1_ps(1.5f)), true);
                                cand::pack_codes32(b.mq + o + i, q[0], q[1], q[2], q[3]);
                                for (int j = 0; j < 4; j++) q[j] = cand::pow2_quant8(_mm256_mul_ps(cand::pow2_dequant8(b.vq + o + i + 8 * j, false), _mm256_set1_ps(1.5f)), false);
                                cand::pack_codes32(b.vq + o + i, q[0], q[1], q[2], q[3]); } break;
                    }
                }
                const double t = (thread_seconds() - t0) / reps;
                if (r >= 0 && t < best[k]) best[k] = t;
            }
        printf("\n%lld parameters (%s), ns/param, fastest of %d:\n", (long long)n, n == big ? "from memory" : "in cache", repeat);
        // the stages' own arrays are L2-resident only in cache: timed there only
        for (int k = 0; k < (n == big ? 8 : K); k++) printf("  %-28s %6.3f\n", names[k], best[k] / n * 1e9);
        printf("ratios (speed):\n");
        for (int k = 1; k < 5; k++) printf("  %-28s / library          %5.2fx\n", names[k], best[0] / best[k]);
        for (int k = 0; k < 5; k++) printf("  %-28s / floor 16 B       %5.2fx\n", names[k], best[6] / best[k]);
        for (int k = 0; k < 5; k++) printf("  %-28s / fp32 Adam kernel %5.2fx\n", names[k], best[5] / best[k]);
    }
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="16M", help="parameters from memory (default 16M)")
    ap.add_argument("--cache", type=int, default=8192, help="parameters in cache (default 8192)")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    t = args.params.strip().upper()
    big = int(float(t[:-1]) * {"K": 10**3, "M": 2**20}[t[-1]]) if t[-1] in "KM" else int(t)
    from tiermem.optim.kernels import quant as _quant

    qconst = ", ".join(
        f"{x!r}f" if x == x and abs(x) != float("inf") else "INFINITY" for x in _quant.CONSTANTS.tolist()
    )
    head = f"static const float QCONST[] = {{{qconst}}};\n"
    source = "\n".join(
        [
            _csrc_common.SOURCE,
            _csrc_elementwise.ADAM_MATH,
            _csrc_elementwise.SOURCE,
            _csrc_adam8bit.SOURCE,
            head,
            CANDIDATES,
        ]
    )
    flags = [f for f in _native.FLAGS if f not in ("-shared", "-fPIC")]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "h.cpp", Path(tmp) / "h"
        src.write_text(source)
        cc = subprocess.run(["g++", *flags, str(src), "-o", str(exe)], capture_output=True, text=True)
        if cc.returncode:
            sys.exit(cc.stderr[-6000:])
        print("g++", " ".join(flags))
        run = subprocess.run([str(exe), str(big), str(args.cache), str(args.repeat)], env={"OMP_NUM_THREADS": "1"})
        sys.exit(run.returncode)


if __name__ == "__main__":
    main()
