"""C++ of the 8-bit Adam kernel: block-wise quantized moments dequantized, updated and requantized in
one pass (NOTE [8-bit state] in tiermem/optim/kernels/quant.py has the layout and the maps).

A block of 256 elements is dequantized into two L1-resident fp32 arrays, updated with Adam's
arithmetic (the fp32 kernel's but for one division: _csrc_elementwise.adam_math8), its new absmax
taken, and quantized back; master, grad and ``out`` stream through once, so the memory traffic is
16 bytes per parameter (bf16 grad and out) against the fp32 kernel's 28. No memory gathers (they cost
more than the whole update here): dequantizing computes the value from the code (AVX-512: the decade
from the code's leading zeros; a byte-permute lookup in the map's byte planes, AVX-512 VBMI, was
measured slower on AMD Zen 4, bench/RESULTS.md 2026-12-02, and removed); quantizing finds the decade
from the value's fp32 exponent (an octave holds at most one decade start) and the cell by a
multiply-add with the decade's constants, taken from registers by permutes. CPUs with AVX2 but no
AVX-512 run the same steps 8 lanes at a time (8-entry permutes; the decade at an octave's start
computed from the exponent); the scalar path ran there before, 3.3x slower on the whole kernel (AMD
Zen 3, bench/adam8_harness.py). The portable scalar path (other CPUs, the tails, and ``-DTM_PORTABLE``
builds, which the tests compare with the vector paths) computes the same bits. bench/RESULTS.md
(2026-12-01, 2026-12-02) has what each costs.
"""

from __future__ import annotations

SOURCE = r"""
namespace {

const int64_t QBLOCK = 256;

// The maps' constants (tiermem/optim/kernels/quant.py CONSTANTS, the one definition): per map 16 slots of
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

#ifdef TM_AVX2
// AVX2 only (no AVX-512): the same numbers 8 lanes at a time, with 8-entry permutes (slots 0-7 of each
// table; the slot-15 cases, code 0 and |y| below 1e-7, are masked to 0). Measured 2.3-2.8x the scalar
// path on AMD Zen 3 (bench/adam8_harness.py, bench/RESULTS.md 2026-12-02).
struct MapVec8 {
    __m256 iw, c, b, w;
    TM_INLINE explicit MapVec8(const Map& m)
        : iw(_mm256_loadu_ps(m.iw)), c(_mm256_loadu_ps(m.c)), b(_mm256_loadu_ps(m.b)), w(_mm256_loadu_ps(m.w)) {}
};
TM_INLINE __m256i exponent_of(__m256i x) {  // floor(log2 x) + 127 of integers 1 <= x <= 2^24
    return _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(x)), 23);
}
TM_INLINE __m256 dequant8(const uint8_t* codes, const MapVec8& m, bool is_signed) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)codes)), zero = _mm256_setzero_si256();
    if (!is_signed) {  // decade floor(log2(c + 1)) - 1; code 255 is slot 7 (1.0)
        const __m256i d = _mm256_sub_epi32(exponent_of(_mm256_add_epi32(c, _mm256_set1_epi32(1))), _mm256_set1_epi32(128));
        const __m256 v = _mm256_add_ps(_mm256_permutevar8x32_ps(m.b, d),
                                       _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_permutevar8x32_ps(m.w, d)));
        return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c, zero)), v);
    }
    const __m256i q = _mm256_and_si256(c, _mm256_set1_epi32(127));
    const __m256i d = _mm256_sub_epi32(exponent_of(q), _mm256_set1_epi32(127));  // floor(log2 q)
    __m256 v = _mm256_add_ps(_mm256_permutevar8x32_ps(m.b, d),
                             _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_permutevar8x32_ps(m.w, d)));
    v = _mm256_blendv_ps(v, _mm256_set1_ps(1.f), _mm256_castsi256_ps(_mm256_cmpeq_epi32(q, _mm256_set1_epi32(127))));
    v = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(q, zero)), v);
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v),
                                                _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(128)), 24)));
}
// 8 codes of y: the decade at the start of y's octave is floor((e - 127) * log10 2) + 7, computed as
// ((e - 127) * 77) >> 8 + 7 (the same for every exponent e in [103, 127]: the octave table of
// NOTE [8-bit state], tests/test_optim_8bit.py checks), then the one decade start the octave may hold.
TM_INLINE __m256i quant8(__m256 y, const MapVec8& m, __m256 starts, bool is_signed) {
    const __m256i bits = _mm256_castps_si256(y), mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256 a = _mm256_castsi256_ps(mag);
    const __m256i k = _mm256_sub_epi32(_mm256_max_epi32(_mm256_srli_epi32(mag, 23), _mm256_set1_epi32(103)),
                                       _mm256_set1_epi32(127));
    __m256i d = _mm256_add_epi32(_mm256_srai_epi32(_mm256_mullo_epi32(k, _mm256_set1_epi32(77)), 8), _mm256_set1_epi32(7));
    const __m256 next = _mm256_permutevar8x32_ps(starts, _mm256_add_epi32(d, _mm256_set1_epi32(1)));
    d = _mm256_sub_epi32(d, _mm256_castps_si256(_mm256_cmp_ps(a, next, _CMP_GE_OQ)));
    d = _mm256_min_epi32(d, _mm256_set1_epi32(7));  // 1.0 and above (slot 8 would read starts[0])
    const __m256 x = _mm256_add_ps(_mm256_mul_ps(a, _mm256_permutevar8x32_ps(m.iw, d)), _mm256_permutevar8x32_ps(m.c, d));
    __m256i q = _mm256_and_si256(_mm256_cvttps_epi32(x), _mm256_cmpgt_epi32(d, _mm256_set1_epi32(-1)));
    if (is_signed) q = _mm256_or_si256(q, _mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN)), 24));
    return q;
}
TM_INLINE void store_codes32(uint8_t* p, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {  // 32 codes, in order
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(q0, q1), _mm256_packus_epi32(q2, q3));
    _mm256_storeu_si256((__m256i*)p, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
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
#elif defined(TM_AVX2)
    const MapVec8 mv(map_of(k, is_signed));
    for (; i + 8 <= len; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(dequant8(codes + i, mv, is_signed), _mm256_set1_ps(absmax)));
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
#elif defined(TM_AVX2)
    const MapVec8 mv(m);
    const __m256 scale = _mm256_set1_ps(inv), starts = _mm256_loadu_ps(k + 160);
    for (; i + 32 <= len; i += 32) {
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = quant8(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), scale), mv, starts, is_signed);
        store_codes32(codes + i, q[0], q[1], q[2], q[3]);
    }
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

// NOTE [8-bit moment bound] (tiermem/optim/kernels/quant.py): an element whose v was quantized to 0 while its m
// was not, and whose fp32 moments hold m^2 <= R K v, gets the smallest v code whose value is at least
// m_q^2 / K (m_q: m's stored value). Rare: one vectorised test per block, the scalar fix where it found one.
TM_INLINE void bound_block(const float* m, const float* v, const uint8_t* mq, uint8_t* vq, float m_max, float v_max,
                           int64_t len, const AdamScalars& c, const float* k) {
    int need = 0;
    for (int64_t i = 0; i < len; i++) need |= (vq[i] == 0) & ((mq[i] & 127) != 0);
    if (!need) return;
    const float* values = map_values(k, false);
    for (int64_t i = 0; i < len; i++) {
        if (vq[i] != 0 || (mq[i] & 127) == 0 || !((m[i] * c.inv_rk) * m[i] <= v[i])) continue;
        const float mv = dequant1(mq[i], k, m_max, true), target = (mv * c.inv_k) * mv;
        uint32_t code = 0;
        while (code < 255 && values[code] * v_max < target) code++;
        vq[i] = (uint8_t)code;
    }
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
        bound_block(m, v, mq + o, vq + o, m_max, v_max, len, c, q);
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
