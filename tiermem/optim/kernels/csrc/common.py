"""C++ shared by every native kernel (tiermem/optim/kernels/native.py builds it): element loads and stores for
each dtype, the counter-based hash behind stochastic rounding, the finite check, and the dispatch
macros that turn run-time dtype codes into template instances.

Numbers are computed exactly as the torch reference kernels compute them: every rounding is an
explicit operation (the library is built with ``-ffp-contract=off``; a fused multiply-add is written
``fmaf`` where torch's CPU kernel fuses one, see NOTE [FMA parity] in _compiled.py), the square root
is correctly rounded (NOTE [sqrt rounding] in _kernels.py), and conversions round to nearest even as
torch's do.
"""

from __future__ import annotations

SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512CD__) && !defined(TM_PORTABLE)
#include <immintrin.h>
#define TM_AVX512 1
#elif defined(__AVX2__) && !defined(TM_PORTABLE)
#include <immintrin.h>
#define TM_AVX2 1
#endif

// Every helper is forced inline: GCC leaves some out of line across the many template instances, and
// a call in a loop stops it from being vectorised.
#define TM_INLINE inline __attribute__((always_inline))

namespace {

typedef _Float16 f16;
enum class bf16 : uint16_t {};  // a distinct scalar type: loads and stores vectorize
struct none { };  // "no out tensor"

// Below this many elements a call runs on one thread: a fork/join costs more than it saves.
const int64_t PAR_MIN = 1 << 15;

TM_INLINE float as_float(uint32_t u) { return __builtin_bit_cast(float, u); }
TM_INLINE uint32_t as_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

TM_INLINE float load(const float* p, int64_t i) { return p[i]; }
TM_INLINE float load(const bf16* p, int64_t i) { return as_float((uint32_t)(uint16_t)p[i] << 16); }
TM_INLINE float load(const f16* p, int64_t i) { return (float)p[i]; }

TM_INLINE uint16_t bf16_rne(float v) {  // as c10::BFloat16(float): round to nearest even, NaN -> 0x7FC0
    uint32_t u = as_bits(v);
    return v != v ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
TM_INLINE void store(float* p, int64_t i, float v) { p[i] = v; }
TM_INLINE void store(bf16* p, int64_t i, float v) { p[i] = (bf16)bf16_rne(v); }
TM_INLINE void store(f16* p, int64_t i, float v) { p[i] = (f16)v; }
TM_INLINE void store(none*, int64_t, float) { }

// NOTE [Stochastic rounding bits] (tiermem/optim/kernels/sr.py): 16 random bits per element, the top half of
// mix32(index ^ k1) ^ k2, where index is the element's index in its parameter (mod 2^32) and k1, k2
// are drawn from (seed, parameter, step) by the caller; so they do not depend on how the parameter
// is cut into calls. The rounding adds them below the bf16 mantissa and truncates.
TM_INLINE uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x21f0aaadu; x ^= x >> 15; x *= 0x735a2d97u; x ^= x >> 15;
    return x;
}
struct SR {
    uint32_t k1 = 0, k2 = 0, offset = 0;  // offset: the index of the call's element 0 (mod 2^32)
    explicit SR(const uint32_t* a) { if (a) { k1 = a[0]; k2 = a[1]; offset = a[2]; } }
};
TM_INLINE uint16_t bf16_stochastic(float v, uint32_t idx, const SR& sr) {
    const uint32_t r = (mix32(idx ^ sr.k1) ^ sr.k2) >> 16, u = as_bits(v);
    return v != v ? (uint16_t)0x7FC0 : (uint16_t)((u + r) >> 16);
}

// The master weights: fp32 (rounded by the arithmetic) or bf16, rounded stochastically. Returns the
// value stored, which is what `out` receives.
TM_INLINE float store_master(float* p, int64_t i, float v, const SR&) { p[i] = v; return v; }
TM_INLINE float store_master(bf16* p, int64_t i, float v, const SR& sr) {
    const uint16_t b = bf16_stochastic(v, sr.offset + (uint32_t)i, sr);
    p[i] = (bf16)b;
    return as_float((uint32_t)b << 16);
}

// NOTE [Selects, not branches]
// A loop-invariant flag picks between two values both computed, never between computing one or not. Without AVX-512's masks GCC may not run a floating-point operation that
// the source runs conditionally (it could raise an exception the program would not have raised; GCC
// assumes -ftrapping-math), so `if (flag) g = fmaf(...)` keeps the whole loop scalar on AVX2 CPUs
// (SGD with momentum ran at 0.28x its floor on a Zen 3). Computing both and picking gives the same
// bits, vectorises everywhere, and the extra lanes of arithmetic are free next to the memory traffic.
// The pick is a mask of bits, not `flag ? a : b`: GCC turns that back into a branch and sinks the
// arithmetic of the side not taken into it (code sinking), and the loop is scalar again.
TM_INLINE float pick(bool flag, float if_true, float if_false) {
    const uint32_t mask = 0u - (uint32_t)flag;
    return as_float((as_bits(if_true) & mask) | (as_bits(if_false) & ~mask));
}

TM_INLINE int threads(int64_t n, int nt) { return n >= PAR_MIN && nt > 1 ? nt : 1; }

// Runs f(a, b) on [0, n) split into one contiguous range per thread, each a multiple of `align`
// elements long (but the last). The kernels' loops live in functions of their own that take
// __restrict__ pointers: written inline in an OpenMP loop, GCC does not vectorise them.
template <class F> void parallel(int64_t n, int nt, int64_t align, F f, int64_t min_parallel = PAR_MIN) {
    int t_max = n >= min_parallel && nt > 1 ? nt : 1;
    if (t_max == 1) { f((int64_t)0, n); return; }
    #pragma omp parallel num_threads(t_max)
    {
        int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        int64_t per = ((n + count - 1) / count + align - 1) / align * align;
        int64_t a = t * per < n ? t * per : n, b = a + per < n ? a + per : n;
        if (a < b) f(a, b);
    }
}

// A value is inf or NaN when its exponent bits are all ones: the largest exponent field in the range
// tells (a max reduction vectorises where an "or" of comparisons did not).
template <class U> TM_INLINE int exponent_all_ones(const U* __restrict__ u, int64_t a, int64_t b, U mask) {
    U top = 0;
    #pragma omp simd reduction(max:top)
    for (int64_t i = a; i < b; i++) {
        const U e = (U)(u[i] & mask);
        top = e > top ? e : top;
    }
    return top == mask;
}
TM_INLINE int any_nonfinite_range(const float* g, int64_t a, int64_t b) {
    return exponent_all_ones((const uint32_t*)g, a, b, (uint32_t)0x7F800000u);
}
TM_INLINE int any_nonfinite_range(const bf16* g, int64_t a, int64_t b) {
    return exponent_all_ones((const uint16_t*)g, a, b, (uint16_t)0x7F80u);
}
TM_INLINE int any_nonfinite_range(const f16* g, int64_t a, int64_t b) {
    return exponent_all_ones((const uint16_t*)g, a, b, (uint16_t)0x7C00u);
}
template <class G> int any_nonfinite_t(const G* g, int64_t n, int nt) {
    int bad[64] = {0};
    parallel(n, nt < 64 ? nt : 64, 64, [&](int64_t a, int64_t b) {
        bad[omp_get_thread_num()] = any_nonfinite_range(g, a, b);
    });
    int any = 0;
    for (int i = 0; i < 64; i++) any |= bad[i];
    return any;
}

}  // namespace

// dtype codes (tiermem/optim/kernels/native.py DTYPE_CODES): 0 fp32, 1 bf16, 2 fp16, -1 no tensor
#define TM_GRAD(gdt, BODY) switch (gdt) { \
    case 0: { typedef float G; BODY; } break; \
    case 1: { typedef bf16 G; BODY; } break; \
    case 2: { typedef f16 G; BODY; } break; }
#define TM_OUT(odt, BODY) switch (odt) { \
    case -1: { typedef none O; BODY; } break; \
    case 0: { typedef float O; BODY; } break; \
    case 1: { typedef bf16 O; BODY; } break; \
    case 2: { typedef f16 O; BODY; } break; }
#define TM_MASTER(mdt, BODY) switch (mdt) { \
    case 0: { typedef float M; BODY; } break; \
    case 1: { typedef bf16 M; BODY; } break; }
#define TM_ALL(mdt, gdt, odt, BODY) TM_MASTER(mdt, TM_GRAD(gdt, TM_OUT(odt, BODY)))

extern "C" int tm_any_nonfinite(const void* g, int gdt, int64_t n, int nt) {
    TM_GRAD(gdt, return any_nonfinite_t((const G*)g, n, nt))
    return 1;
}
extern "C" int tm_abi_version() { return 1; }
"""
