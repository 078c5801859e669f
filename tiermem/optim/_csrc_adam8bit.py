"""C++ of the 8-bit Adam kernel: block-wise quantized moments dequantized, updated and requantized in
one pass (NOTE [8-bit state] in tiermem/optim/_quant.py has the layout and the maps).

A block of 256 elements is dequantized into two L1-resident fp32 arrays, updated with Adam's
arithmetic (the fp32 kernel's but for one division: _csrc_elementwise.adam_math8), its new absmax
taken, and quantized back; master, grad and ``out`` stream through once, so the memory traffic is
16 bytes per parameter (bf16 grad and out) against the fp32 kernel's 28. No memory gathers (they cost
more than the whole update here): dequantizing computes the value from the code (AVX-512: the decade
from the code's leading zeros; a byte-permute lookup in the map's byte planes, AVX-512 VBMI, was
measured slower on AMD Zen 4, bench/RESULTS.md 2026-12-02, and removed); quantizing finds the decade
from the value's fp32 exponent (an octave holds at most one decade start) and the cell by a
multiply-add with the decade's constants, taken from registers by permutes. The portable scalar path
(other CPUs, and the tails) computes the same bits. bench/RESULTS.md (2026-12-01) has what it costs.
"""

from __future__ import annotations

SOURCE = r"""
namespace {

const int64_t QBLOCK = 256;

// The maps' constants (tiermem/optim/_quant.py CONSTANTS, the one definition): per map 16 slots of
// IW, C, HI, B, W (decade d in slot d, 1.0 in slot 7, "below 1e-7" in slot 15), then the 8 decade
// starts, then per fp32 exponent (mod 32) the decade at the octave's start and the start inside it.
struct Map { const float *iw, *c, *hi, *b, *w; };
TM_INLINE Map map_of(const float* k, bool is_signed) {
    const float* t = k + (is_signed ? 0 : 80);
    return {t, t + 16, t + 32, t + 48, t + 64};
}
TM_INLINE int decade_slot(float a, const float* k) {
    const float* starts = k + 160;
    int d = -1;
    for (int i = 0; i < 8; i++) d += a >= starts[i];
    return d & 15;
}
TM_INLINE uint8_t quant1(float y, const Map& m, const float* k, bool is_signed) {
    const float a = fabsf(y);
    const int d = decade_slot(a, k);
    const int q = (int)(a * m.iw[d] + m.c[d]);
    return (uint8_t)(is_signed && std::signbit(y) ? q + 128 : q);
}
// The value of a code in a block with this absmax: the map's value (CONSTANTS from float 256: the signed
// map, then the unsigned one) times absmax.
TM_INLINE const float* map_values(const float* k, bool is_signed) { return k + (is_signed ? 256 : 512); }
TM_INLINE float dequant1(uint32_t code, const float* k, float absmax, bool is_signed) {
    return map_values(k, is_signed)[code] * absmax;
}

#ifdef TM_AVX512
struct MapVec {  // one map's slots in registers
    __m512 iw, c, b, w;
    TM_INLINE MapVec(const Map& m)
        : iw(_mm512_loadu_ps(m.iw)), c(_mm512_loadu_ps(m.c)), b(_mm512_loadu_ps(m.b)), w(_mm512_loadu_ps(m.w)) {}
};
struct Octaves {
    __m512i first_lo, first_hi;
    __m512 edge_lo, edge_hi;
    TM_INLINE explicit Octaves(const float* k)
        : first_lo(_mm512_cvttps_epi32(_mm512_loadu_ps(k + 168))),
          first_hi(_mm512_cvttps_epi32(_mm512_loadu_ps(k + 184))),
          edge_lo(_mm512_loadu_ps(k + 200)), edge_hi(_mm512_loadu_ps(k + 216)) {}
};
// 16 codes of y (as 32-bit lanes): the decade from y's exponent (an octave holds at most one decade
// start), then the cell.
TM_INLINE __m512i quant16(__m512 y, const MapVec& m, const Octaves& o, bool is_signed) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 a = _mm512_castsi512_ps(mag);
    const __m512i e = _mm512_max_epi32(_mm512_srli_epi32(mag, 23), _mm512_set1_epi32(103));
    __m512i d = _mm512_permutex2var_epi32(o.first_lo, e, o.first_hi);
    const __m512 edge = _mm512_permutex2var_ps(o.edge_lo, e, o.edge_hi);
    d = _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(a, edge, _CMP_GE_OQ), d, _mm512_set1_epi32(1));
    const __m512 x = _mm512_add_ps(_mm512_mul_ps(a, _mm512_permutexvar_ps(d, m.iw)), _mm512_permutexvar_ps(d, m.c));
    __m512i q = _mm512_cvttps_epi32(x);
    if (is_signed) q = _mm512_or_si512(q, _mm512_srli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN)), 24));
    return q;
}
// 16 values (at absmax 1) computed from their codes: B[d] + q * W[d], as the map was made.
TM_INLINE __m512 dequant16(const uint8_t* codes, const MapVec& m, bool is_signed) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)codes));
    if (!is_signed) {
        const __m512i t = _mm512_add_epi32(c, _mm512_set1_epi32(1));
        const __m512i d = _mm512_sub_epi32(_mm512_set1_epi32(30), _mm512_lzcnt_epi32(t));
        return _mm512_add_ps(_mm512_permutexvar_ps(d, m.b),
                             _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_permutexvar_ps(d, m.w)));
    }
    const __m512i q = _mm512_and_si512(c, _mm512_set1_epi32(127));
    const __m512i d = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(q));  // q = 0 -> slot 15
    __m512 v = _mm512_add_ps(_mm512_permutexvar_ps(d, m.b),
                             _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_permutexvar_ps(d, m.w)));
    v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(q, _mm512_set1_epi32(127)), v, _mm512_set1_ps(1.f));
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v),
                                                _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(128)), 24)));
}
#endif

// codes -> values, for len (<= QBLOCK) elements of a block.
TM_INLINE void dequant_block(const uint8_t* codes, float absmax, bool is_signed, float* out, int64_t len,
                             const float* k) {
    int64_t i = 0;
#ifdef TM_AVX512
    const MapVec mv(map_of(k, is_signed));
    for (; i + 16 <= len; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(dequant16(codes + i, mv, is_signed), _mm512_set1_ps(absmax)));
#endif
    for (; i < len; i++) out[i] = dequant1(codes[i], k, absmax, is_signed);
}
// x * inv -> codes
TM_INLINE void quant_block(const float* x, float inv, bool is_signed, uint8_t* codes, int64_t len, const float* k) {
    const Map m = map_of(k, is_signed);
    int64_t i = 0;
#ifdef TM_AVX512
    const MapVec mv(m);
    const Octaves o(k);
    const __m512 scale = _mm512_set1_ps(inv);
    for (; i + 16 <= len; i += 16)
        _mm_storeu_si128((__m128i*)(codes + i),
                         _mm512_cvtepi32_epi8(quant16(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale), mv, o, is_signed)));
#endif
    for (; i < len; i++) codes[i] = quant1(x[i] * inv, m, k, is_signed);
}

// Forced inline (as every helper): out of line, GCC 12 leaves this loop scalar (its max reductions),
// measured 5x slower.
template <class M, class G, class O>
TM_INLINE void adam8_update(int64_t o, int64_t len, M* __restrict__ master, const G* __restrict__ grad, O* __restrict__ out,
                  float* __restrict__ m, float* __restrict__ v, const AdamScalars& c_, const SR& sr_,
                  float& m_max, float& v_max) {
    const AdamScalars c = c_;  // locals: members read through a reference stop the loop vectorising
    const SR sr = sr_;
    float mm = 0.f, vm = 0.f;
    #pragma omp simd reduction(max:mm, vm)
    for (int64_t i = 0; i < len; i++) {
        AdamOut r = adam_math8(c, load(master, o + i), load(grad, o + i), m[i], v[i]);
        m[i] = r.m;
        v[i] = r.v;
        store(out, o + i, store_master(master, o + i, r.p, sr));
        const float am = fabsf(r.m);
        mm = am > mm ? am : mm;
        vm = r.v > vm ? r.v : vm;
    }
    m_max = mm;
    v_max = vm;
}

template <class M, class G, class O>
void adam8_range(int64_t a, int64_t b, M* master, uint8_t* mq, float* mabs, uint8_t* vq, float* vabs, const G* grad,
                 O* out, const float* s, const float* q, const SR& sr) {
    const AdamScalars c(s);
    alignas(64) float m[QBLOCK], v[QBLOCK];
    for (int64_t o = a; o < b; o += QBLOCK) {
        const int64_t len = b - o < QBLOCK ? b - o : QBLOCK, blk = o / QBLOCK;
        dequant_block(mq + o, mabs[blk], true, m, len, q);
        dequant_block(vq + o, vabs[blk], false, v, len, q);
        float m_max, v_max;
        adam8_update(o, len, master, grad, out, m, v, c, sr, m_max, v_max);
        quant_block(m, m_max > 0.f ? 1.f / m_max : 0.f, true, mq + o, len, q);
        quant_block(v, v_max > 0.f ? 1.f / v_max : 0.f, false, vq + o, len, q);
        mabs[blk] = m_max;
        vabs[blk] = v_max;
    }
}

// The floor of the 8-bit kernel: its streams (master, grad, out, two code arrays, two absmax arrays).
template <class M, class G, class O>
void streams8_range(int64_t a, int64_t b, M* __restrict__ master, uint8_t* __restrict__ mq,
                    float* __restrict__ mabs, uint8_t* __restrict__ vq, float* __restrict__ vabs,
                    const G* __restrict__ grad, O* __restrict__ out, const SR& sr_) {
    const SR sr = sr_;
    #pragma omp simd
    for (int64_t i = a; i < b; i++) {
        float g = load(grad, i);
        mq[i] = (uint8_t)(mq[i] + 1);
        vq[i] = (uint8_t)(vq[i] + 3);
        store(out, i, store_master(master, i, load(master, i) + g, sr));
    }
    for (int64_t k = a / QBLOCK; k < (b + QBLOCK - 1) / QBLOCK; k++) { mabs[k] += 1.f; vabs[k] += 1.f; }
}

}  // namespace

extern "C" void tm_adam8bit(int64_t n, void* master, int mdt, uint8_t* mq, float* mabs, uint8_t* vq, float* vabs,
                            const void* grad, int gdt, void* out, int odt, const float* s, const float* qc,
                            const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    TM_ALL(mdt, gdt, odt, parallel(n, nt, QBLOCK, [&](int64_t a, int64_t b) {
        adam8_range<M, G, O>(a, b, (M*)master, mq, mabs, vq, vabs, (const G*)grad, (O*)out, s, qc, sr); }))
}
extern "C" void tm_streams8(int64_t n, void* master, int mdt, uint8_t* mq, float* mabs, uint8_t* vq, float* vabs,
                            const void* grad, int gdt, void* out, int odt, const uint32_t* sr_, int nt) {
    const SR sr(sr_);
    TM_ALL(mdt, gdt, odt, parallel(n, nt, QBLOCK, [&](int64_t a, int64_t b) {
        streams8_range<M, G, O>(a, b, (M*)master, mq, mabs, vq, vabs, (const G*)grad, (O*)out, sr); }))
}
// codes <-> values, for tiermem.optim.quantize_blockwise / dequantize_blockwise and the tests.
extern "C" void tm_dequantize(int64_t n, const uint8_t* codes, const float* absmax, int is_signed, float* out,
                              const float* qc, int nt) {
    parallel(n, nt, QBLOCK, [&](int64_t a, int64_t b) {
        for (int64_t o = a; o < b; o += QBLOCK)
            dequant_block(codes + o, absmax[o / QBLOCK], is_signed, out + o, b - o < QBLOCK ? b - o : QBLOCK, qc);
    });
}
extern "C" void tm_quantize(int64_t n, const float* x, int is_signed, uint8_t* codes, float* absmax,
                            const float* qc, int nt) {
    parallel(n, nt, QBLOCK, [&](int64_t a, int64_t b) {
        for (int64_t o = a; o < b; o += QBLOCK) {
            const int64_t len = b - o < QBLOCK ? b - o : QBLOCK;
            float mx = 0.f;
            #pragma omp simd reduction(max:mx)
            for (int64_t i = 0; i < len; i++) { float t = fabsf(x[o + i]); mx = t > mx ? t : mx; }
            quant_block(x + o, mx > 0.f ? 1.f / mx : 0.f, is_signed, codes + o, len, qc);
            absmax[o / QBLOCK] = mx;
        }
    });
}
"""
