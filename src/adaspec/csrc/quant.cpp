// adaspec's quantized weight-only linear kernels (adaspec.quant compiles this file on first use).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]), where w is a GGUF tensor kept in its file's blocks
// (one row of blocks per output n). The kernel dequantizes a weight block once, in registers or
// into a per-thread scratch panel, and applies it to every input row.
//
// Numerics (the contract the Python side documents):
// - a weight is dequantized to float32 exactly as the gguf package's numpy dequantizer does it
//   (d * q, d * q + m or (d * sc) * q - dmin * m, each rounded once, which for these types is the
//   exact value or one rounding of it);
// - each output is reduced in a fixed order whatever the row count M, the row tile and the thread
//   count: 16 float32 lanes, lane l accumulating w[k] * x[k] for k = l (mod 16) by fused multiply-add
//   in increasing k, then the lanes summed as a fixed tree ((l, l+8), then (l, l+4), (l, l+2),
//   (0, 1)); the bias is added last. Threads split the outputs (columns), never a reduction. So a
//   row's outputs are bit-identical alone, in a block and in a batch, and the AVX-512, AVX2 and
//   plain C++ builds give the same bits.
//
// Build: -O3 -march=native -ffp-contract=off (no implicit contraction: every FMA is explicit).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define ADASPEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ADASPEC_AVX2 1
#endif
#if defined(__SSSE3__) && defined(__SSE4_1__)
#define ADASPEC_SSE 1
#endif

namespace {

// GGML type ids (gguf.GGMLQuantizationType)
enum QType : int {
  T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
  T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

// how far ahead (bytes) the int8 products prefetch their weights (prefetch_ahead; 0: not, and the
// float32 products do not prefetch their next panel either)
int64_t g_prefetch_bytes = 3072;

// the rb weight bytes pf ahead of the record p that a tile's product computes, asked of the cache: the
// hardware's own prefetchers stop at each 4 KiB page, and a one-token step reads every weight
// once, from memory. Measured on a 2-core Xeon (SmolLM2 Q4_1, one token at 128 cached tokens):
// 6.3 ms with none, 5.0 at 2 KiB, 4.6 at 3-8 KiB (Qwen2.5-Coder-1.5B: 62.6, 49.3 at 2 KiB, 51.1 at
// 3 KiB); an hour later on the same VM, its memory faster, it gained nothing (4.11 against 4.12 ms).
// A prefetch changes no value, and one past the weights' end faults nowhere.
inline void prefetch_ahead(const uint8_t* p, int64_t rb, int64_t pf) {
  if (pf > 0)
    for (int64_t o = 0; o < rb; o += 64) __builtin_prefetch(p + pf + o, 0, 3);
}

// ---- scalar helpers -------------------------------------------------------------------------
inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400) == 0);
      bits = sign | (uint32_t(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline float half_at(const uint8_t* p) { return f16_to_f32(rd16(p)); }

// ---- 16 float lanes: the reduction unit ---------------------------------------------------------
#if defined(ADASPEC_AVX512)
struct V16 { __m512 v; };
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vset1(float s) { return {_mm512_set1_ps(s)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline float vhsum(V16 a) {
  __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
#elif defined(ADASPEC_AVX2)
struct V16 { __m256 lo, hi; };
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vset1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline float vhsum(V16 a) {
  __m256 t8 = _mm256_add_ps(a.lo, a.hi);
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
#else
struct V16 { float v[16]; };
inline V16 vzero() { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = 0.f; return r; }
inline V16 vload(const float* p) { V16 r; std::memcpy(r.v, p, 64); return r; }
inline void vstore(float* p, V16 a) { std::memcpy(p, a.v, 64); }
inline V16 vfma(V16 a, V16 b, V16 c) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
inline V16 vset1(float s) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = s; return r; }
inline V16 vmul(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
inline float vhsum(V16 a) {
  float t8[8], t4[4], t2[2];
  for (int i = 0; i < 8; ++i) t8[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  for (int i = 0; i < 2; ++i) t2[i] = t4[i] + t4[i + 2];
  return t2[0] + t2[1];
}
#endif

// ---- 16 bytes of quantized values: the unpacking unit ------------------------------------------
#if defined(ADASPEC_SSE)
struct B16 { __m128i v; };
inline B16 bload(const uint8_t* p) { return {_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))}; }
// (v >> s) & mask per byte; mask <= 0xff >> s, so the 16-bit shift's carry-in is masked off
inline B16 bshr_and(B16 a, int s, uint8_t mask) {
  return {_mm_and_si128(_mm_srli_epi16(a.v, s), _mm_set1_epi8(char(mask)))};
}
inline B16 bshl4(B16 a) { return {_mm_slli_epi16(a.v, 4)}; }  // bytes <= 0x0f
inline B16 bor(B16 a, B16 b) { return {_mm_or_si128(a.v, b.v)}; }
inline B16 bsub(B16 a, uint8_t c) { return {_mm_sub_epi8(a.v, _mm_set1_epi8(char(c)))}; }
// byte i = bit i of h ? val : 0
inline B16 bbits16(uint32_t h, uint8_t val) {
#if defined(ADASPEC_AVX512)
  return {_mm_maskz_mov_epi8(__mmask16(h & 0xffff), _mm_set1_epi8(char(val)))};
#else
  const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi16(short(h & 0xffff)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, char(128), 1, 2, 4, 8, 16, 32, 64, char(128));
  return {_mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(char(val)))};
#endif
}
// byte i = (a_i & bit) ? val : 0
inline B16 bbittest(B16 a, uint8_t bit, uint8_t val) {
  const __m128i b = _mm_set1_epi8(char(bit));
  return {_mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(a.v, b), b), _mm_set1_epi8(char(val)))};
}
#else
struct B16 { uint8_t v[16]; };
inline B16 bload(const uint8_t* p) { B16 r; std::memcpy(r.v, p, 16); return r; }
inline B16 bshr_and(B16 a, int s, uint8_t mask) { B16 r; for (int i = 0; i < 16; ++i) r.v[i] = uint8_t((a.v[i] >> s) & mask); return r; }
inline B16 bshl4(B16 a) { B16 r; for (int i = 0; i < 16; ++i) r.v[i] = uint8_t(a.v[i] << 4); return r; }
inline B16 bor(B16 a, B16 b) { B16 r; for (int i = 0; i < 16; ++i) r.v[i] = uint8_t(a.v[i] | b.v[i]); return r; }
inline B16 bsub(B16 a, uint8_t c) { B16 r; for (int i = 0; i < 16; ++i) r.v[i] = uint8_t(a.v[i] - c); return r; }
inline B16 bbits16(uint32_t h, uint8_t val) { B16 r; for (int i = 0; i < 16; ++i) r.v[i] = ((h >> i) & 1) ? val : 0; return r; }
inline B16 bbittest(B16 a, uint8_t bit, uint8_t val) { B16 r; for (int i = 0; i < 16; ++i) r.v[i] = (a.v[i] & bit) ? val : 0; return r; }
#endif

// 16 signed bytes -> 16 floats (exact)
inline V16 bto_f32(B16 q) {
#if defined(ADASPEC_AVX512)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q.v))};
#elif defined(ADASPEC_AVX2)
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q.v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q.v, 8)))};
#else
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = float(int8_t(q.v[i]));
  return r;
#endif
}

// ---- the block types ------------------------------------------------------------------------------
// Each type decodes the 32 weights w[32 b .. 32 b + 31] of one row as two V16 (each 16 of them).
// Integer types: the 16 values as signed bytes q, a scale d and (for affine types) an offset m:
// w = d * q (one multiplication) or fma(d, q, m) (one rounding of the exact d * q + m).

struct Half { B16 q; float d, m; };

inline V16 affine(const Half& h) { return vfma(vset1(h.d), bto_f32(h.q), vset1(h.m)); }
inline V16 scaled(const Half& h) { return vmul(vset1(h.d), bto_f32(h.q)); }


#if defined(ADASPEC_AVX512)
// 16 bytes of nibble pairs -> the low nibbles (w[0..15]) and high nibbles (w[16..31]) as int32 lanes
inline void nibbles_i32(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0f));
  hi = _mm512_srli_epi32(v, 4);
}
// the same for the 32 bytes of a K-quant sub-block pair: nibble `shift` (0 or 4) of each byte
inline void nibble_i32(const uint8_t* p, int shift, __m512i& a, __m512i& b) {
  const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  const __m512i mask = _mm512_set1_epi32(0x0f);
  a = _mm512_and_si512(_mm512_srli_epi32(v0, unsigned(shift)), mask);
  b = _mm512_and_si512(_mm512_srli_epi32(v1, unsigned(shift)), mask);
}
inline V16 i32f(__m512i q) { return {_mm512_cvtepi32_ps(q)}; }
#endif

struct Q4_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 18;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + b * BYTES;
    const float d = half_at(p);
#if defined(ADASPEC_AVX512)
    __m512i lo, hi;
    nibbles_i32(p + 2, lo, hi);
    const __m512i eight = _mm512_set1_epi32(8);
    const V16 dv = vset1(d);
    w0 = vmul(dv, i32f(_mm512_sub_epi32(lo, eight)));
    w1 = vmul(dv, i32f(_mm512_sub_epi32(hi, eight)));
    return;
#endif
    const B16 raw = bload(p + 2);
    w0 = scaled({bsub(bshr_and(raw, 0, 0x0f), 8), d, 0.f});
    w1 = scaled({bsub(bshr_and(raw, 4, 0x0f), 8), d, 0.f});
  }
};

struct Q4_1 {
  static constexpr int64_t BLOCK = 32, BYTES = 20;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + b * BYTES;
    const float d = half_at(p), m = half_at(p + 2);
#if defined(ADASPEC_AVX512)
    __m512i lo, hi;
    nibbles_i32(p + 4, lo, hi);
    const V16 dv = vset1(d), mv = vset1(m);
    w0 = vfma(dv, i32f(lo), mv);
    w1 = vfma(dv, i32f(hi), mv);
    return;
#endif
    const B16 raw = bload(p + 4);
    w0 = affine({bshr_and(raw, 0, 0x0f), d, m});
    w1 = affine({bshr_and(raw, 4, 0x0f), d, m});
  }
};

struct Q5_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 22;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + b * BYTES;
    const float d = half_at(p);
    const uint32_t qh = rd32(p + 2);
    const B16 raw = bload(p + 6);
    w0 = scaled({bsub(bor(bshr_and(raw, 0, 0x0f), bbits16(qh, 0x10)), 16), d, 0.f});
    w1 = scaled({bsub(bor(bshr_and(raw, 4, 0x0f), bbits16(qh >> 16, 0x10)), 16), d, 0.f});
  }
};

struct Q5_1 {
  static constexpr int64_t BLOCK = 32, BYTES = 24;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + b * BYTES;
    const float d = half_at(p), m = half_at(p + 2);
    const uint32_t qh = rd32(p + 4);
    const B16 raw = bload(p + 8);
    w0 = affine({bor(bshr_and(raw, 0, 0x0f), bbits16(qh, 0x10)), d, m});
    w1 = affine({bor(bshr_and(raw, 4, 0x0f), bbits16(qh >> 16, 0x10)), d, m});
  }
};

struct Q8_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 34;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + b * BYTES;
    const float d = half_at(p);
    w0 = scaled({bload(p + 2), d, 0.f});
    w1 = scaled({bload(p + 18), d, 0.f});
  }
};

// the 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// sub-block j's scale d * sc and offset -(dmin * mn) (both exact in float32) of a Q4_K / Q5_K super-block p
inline void k_affine(const uint8_t* p, int j, float& d, float& m) {
  int sc, mn;
  k_scale_min(p + 4, j, sc, mn);
  d = half_at(p) * float(sc);
  m = -(half_at(p + 2) * float(mn));
}

struct Q4_K {
  static constexpr int64_t BLOCK = 256, BYTES = 144;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + (b >> 3) * BYTES;
    const int j = int(b & 7);
    float d, m;
    k_affine(p, j, d, m);
    const uint8_t* qs = p + 16 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
#if defined(ADASPEC_AVX512)
    __m512i a, c;
    nibble_i32(qs, shift, a, c);
    const V16 dv = vset1(d), mv = vset1(m);
    w0 = vfma(dv, i32f(a), mv);
    w1 = vfma(dv, i32f(c), mv);
    return;
#endif
    w0 = affine({bshr_and(bload(qs), shift, 0x0f), d, m});
    w1 = affine({bshr_and(bload(qs + 16), shift, 0x0f), d, m});
  }
};

struct Q5_K {
  static constexpr int64_t BLOCK = 256, BYTES = 176;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + (b >> 3) * BYTES;
    const int j = int(b & 7);
    float d, m;
    k_affine(p, j, d, m);
    const uint8_t* qh = p + 16;
    const uint8_t* qs = p + 48 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    const uint8_t bit = uint8_t(1u << j);
    w0 = affine({bor(bshr_and(bload(qs), shift, 0x0f), bbittest(bload(qh), bit, 0x10)), d, m});
    w1 = affine({bor(bshr_and(bload(qs + 16), shift, 0x0f), bbittest(bload(qh + 16), bit, 0x10)), d, m});
  }
};

struct Q6_K {
  static constexpr int64_t BLOCK = 256, BYTES = 210;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + (b >> 3) * BYTES;
    const int s = int(b & 7), n = s >> 2, r = s & 3;
    const uint8_t* ql = p + 64 * n + 32 * (r & 1);
    const uint8_t* qh = p + 128 + 32 * n;
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    const float d = half_at(p + 208);
    const int lshift = 4 * (r >> 1), hshift = 2 * r;
    // (d * sc) * q: d * sc is exact (11 x 8 bits) and so is the product (d x sc * q: 11 x 12 bits)
    w0 = scaled({bsub(bor(bshr_and(bload(ql), lshift, 0x0f), bshl4(bshr_and(bload(qh), hshift, 0x03))), 32),
                 d * float(scales[2 * s]), 0.f});
    w1 = scaled({bsub(bor(bshr_and(bload(ql + 16), lshift, 0x0f), bshl4(bshr_and(bload(qh + 16), hshift, 0x03))), 32),
                 d * float(scales[2 * s + 1]), 0.f});
  }
};

struct F32 {
  static constexpr int64_t BLOCK = 32, BYTES = 128;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const float* p = reinterpret_cast<const float*>(row + b * BYTES);
    w0 = vload(p);
    w1 = vload(p + 16);
  }
};

struct F16 {
  static constexpr int64_t BLOCK = 32, BYTES = 64;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + b * BYTES;
#if defined(ADASPEC_AVX512)
    w0 = {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
    w1 = {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))};
#else
    float f[32];
    for (int i = 0; i < 32; ++i) f[i] = half_at(p + 2 * i);
    w0 = vload(f);
    w1 = vload(f + 16);
#endif
  }
};

struct BF16 {
  static constexpr int64_t BLOCK = 32, BYTES = 64;
  static inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
    const uint8_t* p = row + b * BYTES;
    float f[32];
    for (int i = 0; i < 32; ++i) {
      const uint32_t bits = uint32_t(rd16(p + 2 * i)) << 16;
      std::memcpy(f + i, &bits, 4);
    }
    w0 = vload(f);
    w1 = vload(f + 16);
  }
};

// ---- the products ---------------------------------------------------------------------------------
// One output column group: NC rows of blocks (outputs n0 .. n0 + NC - 1) against M input rows.

struct Out {
  float* y;          // [M, ldy], this segment's outputs at column 0
  int64_t ldy;
  const float* bias;  // [N] or null
};

inline void finish(const Out& o, int64_t m, int64_t n, V16 acc) {
  float v = vhsum(acc);
  if (o.bias != nullptr) v += o.bias[n];
  o.y[m * o.ldy + n] = v;
}

// Few rows: the group's weights are decoded in registers, block by block (NC columns at a time), and
// applied to each row; NC is as large as the registers allow (accumulators M x NC, weights 2 NC).
#if defined(ADASPEC_AVX512)
constexpr int small_nc(int M) { return M == 1 ? 8 : M == 2 ? 6 : M <= 4 ? 4 : M <= 6 ? 3 : 2; }
constexpr int64_t SMALL_M = 12;
#elif defined(ADASPEC_AVX2)
constexpr int small_nc(int M) { return M == 1 ? 2 : 1; }
constexpr int64_t SMALL_M = 4;
#else
constexpr int small_nc(int M) { return M > 0 ? 1 : 1; }
constexpr int64_t SMALL_M = 4;
#endif

template <class T, int M, int NC>
void small_rows(const float* x, int64_t ldx, int64_t nblk, const uint8_t* w, int64_t row_bytes, int64_t n0,
                const Out& o) {
  V16 acc[M][NC];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = vzero();
  const uint8_t* rows[NC];
  for (int c = 0; c < NC; ++c) rows[c] = w + (n0 + c) * row_bytes;
  // the next NC rows (contiguous) asked for across this panel's blocks (as prefetch_ahead)
  const uint8_t* next = w + (n0 + NC) * row_bytes;
  const int64_t span = g_prefetch_bytes > 0 ? NC * row_bytes : 0;
  int64_t asked = 0;
  for (int64_t b = 0; b < nblk; ++b) {
    for (const int64_t upto = span * (b + 1) / nblk; asked < upto; asked += 64) __builtin_prefetch(next + asked, 0, 3);
    V16 w0[NC], w1[NC];
    for (int c = 0; c < NC; ++c) T::decode(rows[c], b, w0[c], w1[c]);
    const float* xb = x + 32 * b;
    for (int m = 0; m < M; ++m) {
      const V16 x0 = vload(xb + m * ldx), x1 = vload(xb + m * ldx + 16);
      for (int c = 0; c < NC; ++c) {
        acc[m][c] = vfma(w0[c], x0, acc[m][c]);
        acc[m][c] = vfma(w1[c], x1, acc[m][c]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < NC; ++c) finish(o, m, n0 + c, acc[m][c]);
}

template <class T, int M>
void small_rows_cols(const float* x, int64_t ldx, int64_t nblk, const uint8_t* w, int64_t row_bytes,
                     int64_t n0, int64_t n1, const Out& o) {
  constexpr int NC = small_nc(M);
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) small_rows<T, M, NC>(x, ldx, nblk, w, row_bytes, n, o);
  for (; n < n1; ++n) small_rows<T, M, 1>(x, ldx, nblk, w, row_bytes, n, o);
}

// MR rows x NC columns of decoded weights (a panel in scratch: column c at wp + c * K)
template <int MR, int NC>
void micro(const float* x, int64_t ldx, const float* wp, int64_t K, const Out& o, int64_t m0, int64_t n0) {
  V16 acc[MR][NC];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = vzero();
  for (int64_t k = 0; k < K; k += 16) {
    V16 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = vload(wp + c * K + k);
    for (int m = 0; m < MR; ++m) {
      const V16 xv = vload(x + m * ldx + k);
      for (int c = 0; c < NC; ++c) acc[m][c] = vfma(wv[c], xv, acc[m][c]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) finish(o, m0 + m, n0 + c, acc[m][c]);
}

#if defined(ADASPEC_AVX512)
constexpr int MR_MAX = 6, NC_PANEL = 4;
#else
constexpr int MR_MAX = 2, NC_PANEL = 2;
#endif

template <int MR>
void micro_cols(const float* x, int64_t ldx, const float* panel, int64_t K, int64_t np, const Out& o,
                int64_t m0, int64_t n0) {
  int64_t c = 0;
  for (; c + NC_PANEL <= np; c += NC_PANEL) micro<MR, NC_PANEL>(x, ldx, panel + c * K, K, o, m0, n0 + c);
  for (; c < np; ++c) micro<MR, 1>(x, ldx, panel + c * K, K, o, m0, n0 + c);
}

template <class T>
void decode_rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, float* dst, int64_t ldd) {
  const int64_t nblk = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float* out = dst + (n - n0) * ldd;
    for (int64_t b = 0; b < nblk; ++b) {
      V16 w0, w1;
      T::decode(row, b, w0, w1);
      vstore(out + 32 * b, w0);
      vstore(out + 32 * b + 16, w1);
    }
  }
}

// more rows: decode a panel of columns once into scratch, then run every row tile over it
template <class T>
void many_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
               int64_t n0, int64_t n1, const Out& o, std::vector<float>& scratch) {
  // a panel of up to 256 KiB of float32 weights (L2), at least one column tile
  const int64_t per = std::max<int64_t>(NC_PANEL, (int64_t(65536) / K) / NC_PANEL * NC_PANEL);
  scratch.resize(size_t(per * K));
  for (int64_t p0 = n0; p0 < n1; p0 += per) {
    const int64_t np = std::min(per, n1 - p0);
    decode_rows<T>(w, row_bytes, K, p0, p0 + np, scratch.data(), K);
    int64_t m = 0;
    for (; m + MR_MAX <= M; m += MR_MAX)
      micro_cols<MR_MAX>(x + m * ldx, ldx, scratch.data(), K, np, o, m, p0);
    const int64_t left = M - m;
    const float* xr = x + m * ldx;
#if defined(ADASPEC_AVX512)
    switch (left) {
      case 5: micro_cols<5>(xr, ldx, scratch.data(), K, np, o, m, p0); break;
      case 4: micro_cols<4>(xr, ldx, scratch.data(), K, np, o, m, p0); break;
      case 3: micro_cols<3>(xr, ldx, scratch.data(), K, np, o, m, p0); break;
      case 2: micro_cols<2>(xr, ldx, scratch.data(), K, np, o, m, p0); break;
      case 1: micro_cols<1>(xr, ldx, scratch.data(), K, np, o, m, p0); break;
      default: break;
    }
#else
    if (left == 1) micro_cols<1>(xr, ldx, scratch.data(), K, np, o, m, p0);
#endif
  }
}

template <class T, int M>
void small_cols(const float* x, int64_t ldx, int64_t M_, int64_t nblk, const uint8_t* w, int64_t row_bytes,
                int64_t n0, int64_t n1, const Out& o) {
  if constexpr (M > 1) {
    if (M_ < M) return small_cols<T, M - 1>(x, ldx, M_, nblk, w, row_bytes, n0, n1, o);
  }
  small_rows_cols<T, M>(x, ldx, nblk, w, row_bytes, n0, n1, o);
}

template <class T>
void columns(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
             int64_t n0, int64_t n1, const Out& o, std::vector<float>& scratch) {
  if (M <= SMALL_M) return small_cols<T, int(SMALL_M)>(x, ldx, M, K / 32, w, row_bytes, n0, n1, o);
  many_rows<T>(x, ldx, M, K, w, row_bytes, n0, n1, o, scratch);
}

template <class F>
bool dispatch(int qtype, F&& f) {
  switch (qtype) {
    case T_F32: f(F32{}); return true;
    case T_F16: f(F16{}); return true;
    case T_BF16: f(BF16{}); return true;
    case T_Q4_0: f(Q4_0{}); return true;
    case T_Q4_1: f(Q4_1{}); return true;
    case T_Q5_0: f(Q5_0{}); return true;
    case T_Q5_1: f(Q5_1{}); return true;
    case T_Q8_0: f(Q8_0{}); return true;
    case T_Q4_K: f(Q4_K{}); return true;
    case T_Q5_K: f(Q5_K{}); return true;
    case T_Q6_K: f(Q6_K{}); return true;
    default: return false;
  }
}

int64_t block_elems(int qtype) {
  int64_t e = 0;
  dispatch(qtype, [&](auto t) { e = decltype(t)::BLOCK; });
  return e;
}

int64_t block_bytes(int qtype) {
  int64_t e = 0;
  dispatch(qtype, [&](auto t) { e = decltype(t)::BYTES; });
  return e;
}

void check_matrix(const torch::Tensor& w, int qtype, int64_t K) {
  TORCH_CHECK(block_elems(qtype) > 0, "adaspec quant: unsupported GGML type id ", qtype);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "adaspec quant: weights must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(K > 0 && K % 32 == 0 && K % block_elems(qtype) == 0,
              "adaspec quant: the input width ", K, " is not a multiple of the block size");
  TORCH_CHECK(w.size(1) == K / block_elems(qtype) * block_bytes(qtype),
              "adaspec quant: ", w.size(1), " bytes a row do not hold ", K, " weights of type ", qtype);
}


// ---- int8 activations: integer dot products (AVX-512 VNNI where the CPU has it) ------------------------
// The input rows are quantized per row and 32-value block, as llama.cpp's q8_0 does it:
// dx = max|x| / 127, xq = round_half_even(x * (127 / max|x|)) (0 where max|x| = 0). A weight block is
// (unsigned integers u, a scale A, an offset coefficient B) with w = A * u + B (per 16 for Q6_K), so
// sum_k w x ~= dx * (A * sum u xq + B * sum xq): the integer sums are exact; per output the float
// steps t = A * I, t = fma(B, S, t), acc = fma(dx, t, acc) run block by block in increasing k.
// Weights are repacked once into tiles of 16 outputs (lanes) so one instruction takes a 4-byte group
// of 16 outputs: the same bits (nibbles, high-bit planes, fp16 scales) in another order.

inline bool int8_type(int t) {
  return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K ||
         t == T_Q6_K;
}
inline bool k_type(int t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }
inline bool has_qh(int t) { return t == T_Q5_0 || t == T_Q5_1 || t == T_Q5_K; }
inline bool has_m16(int t) { return t == T_Q4_1 || t == T_Q5_1; }

// bytes of one 32-weight record of a tile, and (K types) of a super-block's header
inline int64_t rec_bytes(int t) {
  switch (t) {
    case T_Q4_0: return 256 + 32;
    case T_Q4_1: return 256 + 64;
    case T_Q5_0: return 256 + 64 + 32;
    case T_Q5_1: return 256 + 64 + 64;
    case T_Q8_0: return 512 + 32;
    case T_Q4_K: return 256 + 32;
    case T_Q5_K: return 256 + 64 + 32;
    case T_Q6_K: return 256 + 128 + 32;
    default: return 0;
  }
}
inline int64_t head_bytes(int t) { return t == T_Q6_K ? 32 : k_type(t) ? 64 : 0; }

// the unsigned integers of block b (32 weights) of a row in the file's layout; the fp16 bits of its
// scale and offset (32-weight types), or its 6-bit / 8-bit sub-block scale and min (K types)
struct Unpacked {
  uint8_t u[32];
  uint16_t d = 0, m = 0;  // fp16 bits (32-weight types; K types: the super-block's d, dmin)
  int sc0 = 0, sc1 = 0, mn = 0;
};

inline Unpacked unpack(int t, const uint8_t* row, int64_t b) {
  Unpacked r;
  switch (t) {
    case T_Q4_0: case T_Q4_1: {
      const uint8_t* p = row + b * (t == T_Q4_0 ? 18 : 20);
      r.d = rd16(p);
      if (t == T_Q4_1) r.m = rd16(p + 2);
      const uint8_t* qs = p + (t == T_Q4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) { r.u[i] = qs[i] & 0x0f; r.u[i + 16] = qs[i] >> 4; }
      break;
    }
    case T_Q5_0: case T_Q5_1: {
      const uint8_t* p = row + b * (t == T_Q5_0 ? 22 : 24);
      r.d = rd16(p);
      if (t == T_Q5_1) r.m = rd16(p + 2);
      const uint32_t qh = rd32(p + (t == T_Q5_0 ? 2 : 4));
      const uint8_t* qs = p + (t == T_Q5_0 ? 6 : 8);
      for (int i = 0; i < 16; ++i) {
        r.u[i] = uint8_t((qs[i] & 0x0f) | (((qh >> i) & 1) << 4));
        r.u[i + 16] = uint8_t((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
      }
      break;
    }
    case T_Q8_0: {
      const uint8_t* p = row + b * 34;
      r.d = rd16(p);
      for (int i = 0; i < 32; ++i) r.u[i] = uint8_t(int(int8_t(p[2 + i])) + 128);
      break;
    }
    case T_Q4_K: case T_Q5_K: {
      const int64_t bytes = t == T_Q4_K ? 144 : 176;
      const uint8_t* p = row + (b >> 3) * bytes;
      const int j = int(b & 7);
      r.d = rd16(p);
      r.m = rd16(p + 2);
      k_scale_min(p + 4, j, r.sc0, r.mn);
      const uint8_t* qs = p + (t == T_Q4_K ? 16 : 48) + 32 * (j >> 1);
      for (int i = 0; i < 32; ++i) {
        r.u[i] = uint8_t((qs[i] >> (4 * (j & 1))) & 0x0f);
        if (t == T_Q5_K) r.u[i] |= uint8_t(((p[16 + i] >> j) & 1) << 4);
      }
      break;
    }
    case T_Q6_K: {
      const uint8_t* p = row + (b >> 3) * 210;
      const int sb = int(b & 7), n = sb >> 2, q = sb & 3;
      const uint8_t* ql = p + 64 * n + 32 * (q & 1);
      const uint8_t* qh = p + 128 + 32 * n;
      for (int i = 0; i < 32; ++i)
        r.u[i] = uint8_t(((ql[i] >> (4 * (q >> 1))) & 0x0f) | (((qh[i] >> (2 * q)) & 3) << 4));
      r.sc0 = int8_t(p[192 + 2 * sb]);
      r.sc1 = int8_t(p[192 + 2 * sb + 1]);
      r.d = rd16(p + 208);
      break;
    }
    default: break;
  }
  return r;
}

// repack a [N, row_bytes] matrix into tiles of 16 outputs (zero lanes past N)
torch::Tensor repack_int8(const torch::Tensor& w, int t, int64_t K) {
  const int64_t N = w.size(0), row_bytes = w.size(1), nb = K / 32, tiles = (N + 15) / 16;
  const int64_t tile_bytes = nb * rec_bytes(t) + (k_type(t) ? nb / 8 * head_bytes(t) : 0);
  auto out = torch::zeros({tiles, tile_bytes}, torch::TensorOptions().dtype(torch::kUInt8));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile) {
      uint8_t* dst = op + tile * tile_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        if (k_type(t) && (b & 7) == 0) {  // the super-block header: d (and dmin) of each lane
          for (int l = 0; l < 16; ++l) {
            const int64_t n = tile * 16 + l;
            if (n >= N) continue;
            const Unpacked u = unpack(t, wp + n * row_bytes, b);
            std::memcpy(dst + 2 * l, &u.d, 2);
            if (t != T_Q6_K) std::memcpy(dst + 32 + 2 * l, &u.m, 2);
          }
          dst += head_bytes(t);
        }
        uint8_t* nib = dst;
        uint8_t* extra = dst + (t == T_Q8_0 ? 512 : 256);
        for (int l = 0; l < 16; ++l) {
          const int64_t n = tile * 16 + l;
          if (n >= N) continue;
          const Unpacked u = unpack(t, wp + n * row_bytes, b);
          for (int j = 0; j < 8; ++j)
            for (int i = 0; i < 4; ++i) {
              const uint8_t v = u.u[4 * j + i];
              const int byte = 4 * l + i;
              if (t == T_Q8_0) {
                nib[64 * j + byte] = v;
                continue;
              }
              nib[64 * (j & 3) + byte] |= uint8_t((v & 0x0f) << (j >= 4 ? 4 : 0));
              if (has_qh(t) && (v & 0x10)) extra[8 * j + byte / 8] |= uint8_t(1u << (byte % 8));
              if (t == T_Q6_K) extra[64 * (j >> 2) + byte] |= uint8_t(((v >> 4) & 3) << (2 * (j & 3)));
            }
          uint8_t* sc = extra + (has_qh(t) ? 64 : t == T_Q6_K ? 128 : 0);
          switch (t) {
            case T_Q4_0: case T_Q5_0: case T_Q8_0: std::memcpy(sc + 2 * l, &u.d, 2); break;
            case T_Q4_1: case T_Q5_1: std::memcpy(sc + 2 * l, &u.d, 2); std::memcpy(sc + 32 + 2 * l, &u.m, 2); break;
            case T_Q4_K: case T_Q5_K: sc[l] = uint8_t(u.sc0); sc[16 + l] = uint8_t(u.mn); break;
            case T_Q6_K: sc[l] = uint8_t(int8_t(u.sc0)); sc[16 + l] = uint8_t(int8_t(u.sc1)); break;
            default: break;
          }
        }
        dst += rec_bytes(t);
      }
    }
  });
  return out;
}

struct XQ {  // the input rows, quantized per row and 32-value block
  std::vector<int8_t> q;          // [M, K]
  std::vector<float> d;           // [M, nb]
  std::vector<float> s, s0, s1;   // [M, nb]: sums of the block's 32 values, first 16, last 16 (exact)
};

XQ quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  XQ r;
  r.q.resize(size_t(M * K));
  r.d.resize(size_t(M * nb));
  r.s.resize(size_t(M * nb));
  r.s0.resize(size_t(M * nb));
  r.s1.resize(size_t(M * nb));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + 32 * b;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* q = r.q.data() + m * K + 32 * b;
      int32_t s = 0, s0 = 0;
      for (int i = 0; i < 32; ++i) {
        const float v = std::nearbyint(xb[i] * id);
        q[i] = int8_t(std::max(-127.f, std::min(127.f, v)));
        s += q[i];
        if (i < 16) s0 += q[i];
      }
      r.d[size_t(m * nb + b)] = d;
      r.s[size_t(m * nb + b)] = float(s);
      r.s0[size_t(m * nb + b)] = float(s0);
      r.s1[size_t(m * nb + b)] = float(s - s0);
    }
  return r;
}

// 16 float lanes for one tile: A, B (and A1, B1 for the second half of a Q6_K block)
struct Scales { float a[16], b[16], a1[16], b1[16]; };

inline void tile_scales(int t, const uint8_t* head, const uint8_t* rec, Scales& s) {
  const uint8_t* sc = rec + (t == T_Q8_0 ? 512 : 256) + (has_qh(t) ? 64 : t == T_Q6_K ? 128 : 0);
  for (int l = 0; l < 16; ++l) {
    switch (t) {
      case T_Q4_0: case T_Q5_0: case T_Q8_0: {
        const float d = half_at(sc + 2 * l);
        s.a[l] = d;
        s.b[l] = d * (t == T_Q4_0 ? -8.f : t == T_Q5_0 ? -16.f : -128.f);
        break;
      }
      case T_Q4_1: case T_Q5_1: s.a[l] = half_at(sc + 2 * l); s.b[l] = half_at(sc + 32 + 2 * l); break;
      case T_Q4_K: case T_Q5_K:
        s.a[l] = half_at(head + 2 * l) * float(sc[l]);
        s.b[l] = -(half_at(head + 32 + 2 * l) * float(sc[16 + l]));
        break;
      case T_Q6_K: {
        const float d = half_at(head + 2 * l);
        s.a[l] = d * float(int8_t(sc[l]));
        s.a1[l] = d * float(int8_t(sc[16 + l]));
        s.b[l] = s.a[l] * -32.f;
        s.b1[l] = s.a1[l] * -32.f;
        break;
      }
      default: break;
    }
  }
}

// the 8 groups of 64 bytes (lane l, value i at byte 4 l + i) of one record, as unsigned bytes
inline void tile_groups(int t, const uint8_t* rec, uint8_t g[8][64]) {
  if (t == T_Q8_0) {
    std::memcpy(g, rec, 512);
    return;
  }
  for (int c = 0; c < 4; ++c)
    for (int byte = 0; byte < 64; ++byte) {
      g[c][byte] = rec[64 * c + byte] & 0x0f;
      g[c + 4][byte] = rec[64 * c + byte] >> 4;
    }
  const uint8_t* extra = rec + 256;
  if (has_qh(t))
    for (int j = 0; j < 8; ++j)
      for (int byte = 0; byte < 64; ++byte) g[j][byte] |= uint8_t(((extra[8 * j + byte / 8] >> (byte % 8)) & 1) << 4);
  if (t == T_Q6_K)
    for (int j = 0; j < 8; ++j)
      for (int byte = 0; byte < 64; ++byte) g[j][byte] |= uint8_t(((extra[64 * (j >> 2) + byte] >> (2 * (j & 3))) & 3) << 4);
}

#if defined(ADASPEC_AVX512) && defined(__AVX512VNNI__)
#define ADASPEC_VNNI 1
inline __m512i dot4(__m512i acc, __m512i u, const int8_t* x4) {
  int32_t v;
  std::memcpy(&v, x4, 4);
  return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(v));
}

// the 8 groups of 64 bytes of record p (lane l, value i of group j at byte 4 l + i: the 4-byte groups
// of 16 outputs one vpdpbusd takes), unpacked from the tile's nibbles and high-bit planes
__attribute__((always_inline)) inline void vnni_groups(int t, const uint8_t* p, __m512i g[8]) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  if (t == T_Q8_0) {
    for (int j = 0; j < 8; ++j) g[j] = _mm512_loadu_si512(p + 64 * j);
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(p + 64 * c);
      g[c] = _mm512_and_si512(v, lo4);
      g[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
    }
    if (has_qh(t)) {
      const __m512i bit = _mm512_set1_epi8(0x10);
      for (int j = 0; j < 8; ++j) {
        uint64_t mk;
        std::memcpy(&mk, p + 256 + 8 * j, 8);
        g[j] = _mm512_or_si512(g[j], _mm512_maskz_mov_epi8(__mmask64(mk), bit));
      }
    }
    if (t == T_Q6_K) {
      const __m512i three = _mm512_set1_epi8(0x03);
      for (int h = 0; h < 2; ++h) {
        const __m512i pl = _mm512_loadu_si512(p + 256 + 64 * h);
        for (int q = 0; q < 4; ++q)
          g[4 * h + q] = _mm512_or_si512(g[4 * h + q],
                                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(pl, 2 * q), three), 4));
      }
    }
  }
}

// the 16 lanes' scale A and offset coefficient B of record p (and A1, B1: a Q6_K block's second half)
__attribute__((always_inline)) inline void vnni_scales(int t, const uint8_t* p, const uint8_t* head, __m512& A, __m512& B, __m512& A1, __m512& B1) {
  const uint8_t* sc = p + (t == T_Q8_0 ? 512 : 256) + (has_qh(t) ? 64 : t == T_Q6_K ? 128 : 0);
  A1 = _mm512_setzero_ps(), B1 = _mm512_setzero_ps();
  switch (t) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0:
      A = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      B = _mm512_mul_ps(A, _mm512_set1_ps(t == T_Q4_0 ? -8.f : t == T_Q5_0 ? -16.f : -128.f));
      break;
    case T_Q4_1: case T_Q5_1:
      A = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      B = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)));
      break;
    case T_Q4_K: case T_Q5_K: {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head)));
      const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head + 32)));
      A = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
      B = _mm512_xor_ps(_mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16))))),
                        _mm512_set1_ps(-0.f));
      break;
    }
    default: {  // Q6_K
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head)));
      A = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
      A1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)))));
      B = _mm512_mul_ps(A, _mm512_set1_ps(-32.f));
      B1 = _mm512_mul_ps(A1, _mm512_set1_ps(-32.f));
      break;
    }
  }
}

// one row's float steps over one block from its integer sums (i0: the block's, or a Q6_K block's first
// half, i1 its second half): t = A I (+ A1 I1), t = fma(B, S, t) (+ fma(B1, S1, t)), acc = fma(dx, t, acc)
__attribute__((always_inline)) inline __m512 int8_step(int t, __m512 A, __m512 B, __m512 A1, __m512 B1, __m512i i0, __m512i i1, const XQ& xq,
                        size_t at, __m512 acc) {
  __m512 tv = _mm512_mul_ps(A, _mm512_cvtepi32_ps(i0));
  if (t == T_Q6_K) {
    tv = _mm512_fmadd_ps(A1, _mm512_cvtepi32_ps(i1), tv);
    tv = _mm512_fmadd_ps(B, _mm512_set1_ps(xq.s0[at]), tv);
    tv = _mm512_fmadd_ps(B1, _mm512_set1_ps(xq.s1[at]), tv);
  } else {
    tv = _mm512_fmadd_ps(B, _mm512_set1_ps(xq.s[at]), tv);
  }
  return _mm512_fmadd_ps(_mm512_set1_ps(xq.d[at]), tv, acc);
}

// rows m0 .. m0 + MT - 1 of 16 (ncols) outputs from n0, the bias added last
template <int MT>
inline void store_rows(const __m512* acc, float* y, int64_t ldy, int64_t m0, int64_t n0, int64_t ncols,
                       const float* bias) {
  const __mmask16 k = __mmask16((1u << ncols) - 1);
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    const __m512 v = bias != nullptr ? _mm512_add_ps(acc[m], _mm512_maskz_loadu_ps(k, bias + n0)) : acc[m];
    _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n0, k, v);
  }
}

template <int MT>
void int8_tile(int t, const uint8_t* tile, int64_t nb, const XQ& xq, int64_t m0, int64_t K, float* y, int64_t ldy,
               int64_t n0, int64_t ncols, const float* bias) {
  const int64_t NB = nb;
  __m512 acc[MT];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* p = tile;
  const uint8_t* head = nullptr;
  const int64_t pf = g_prefetch_bytes;
  for (int64_t b = 0; b < NB; ++b) {
    if (k_type(t) && (b & 7) == 0) {
      head = p;
      p += head_bytes(t);
    }
    prefetch_ahead(p, rec_bytes(t), pf);
    __m512i g[8];
    vnni_groups(t, p, g);
    __m512 A, B, A1, B1;
    vnni_scales(t, p, head, A, B, A1, B1);
    // the rows unrolled (their accumulators stay in registers); each row's integer sum in two
    // independent chains of four products, then added (integer sums: the same value in any order)
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const int8_t* xb = xq.q.data() + (m0 + m) * K + 32 * b;
      const size_t at = size_t((m0 + m) * NB + b);
      if (t == T_Q6_K) {
        __m512i i0 = dot4(_mm512_setzero_si512(), g[0], xb), i0b = dot4(_mm512_setzero_si512(), g[1], xb + 4);
        __m512i i1 = dot4(_mm512_setzero_si512(), g[4], xb + 16), i1b = dot4(_mm512_setzero_si512(), g[5], xb + 20);
        i0 = dot4(i0, g[2], xb + 8), i0b = dot4(i0b, g[3], xb + 12);
        i1 = dot4(i1, g[6], xb + 24), i1b = dot4(i1b, g[7], xb + 28);
        acc[m] = int8_step(t, A, B, A1, B1, _mm512_add_epi32(i0, i0b), _mm512_add_epi32(i1, i1b), xq, at, acc[m]);
      } else {
        __m512i iv = dot4(_mm512_setzero_si512(), g[0], xb), iw = dot4(_mm512_setzero_si512(), g[1], xb + 4);
#pragma GCC unroll 4
        for (int j = 2; j < 8; j += 2) iv = dot4(iv, g[j], xb + 4 * j), iw = dot4(iw, g[j + 1], xb + 4 * j + 4);
        acc[m] = int8_step(t, A, B, A1, B1, _mm512_add_epi32(iv, iw), iv, xq, at, acc[m]);
      }
    }
    p += rec_bytes(t);
  }
  store_rows<MT>(acc, y, ldy, m0, n0, ncols, bias);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define ADASPEC_AMX 1
// AMX (Intel's tile unit, Sapphire Rapids and later): one TDPBSUD gives the integer sums of up to 16
// input rows x the tile's 16 outputs over a block (signed input bytes times unsigned weight bytes, in
// int32): the very integers vpdpbusd gives, so the same float steps (int8_step) give the same bits.
// Linux lends a process the tile state once it asks (ARCH_REQ_XCOMP_PERM); where it refuses, the
// VNNI code runs. A thread loads the tile shapes (amx_begin) before its products, releases after.
bool amx_ready() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileShapes {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: integer sums (rows x 16 int32); tmm2, tmm3: a block's input rows (32 bytes each); tmm4,
// tmm5: its weights (8 groups of 64 bytes); tmm6, tmm7: a half block's (16 bytes; 4 groups), for Q6_K.
// The shapes a thread loaded last (rows; 0: none since amx_begin), kept so they load once a row count.
thread_local int tl_amx_rows = 0;

void amx_shapes(int rows) {
  if (tl_amx_rows == rows) return;
  TileShapes c;
  const uint8_t r = uint8_t(rows);
  c.colsb[0] = c.colsb[1] = 64, c.rows[0] = c.rows[1] = r;
  c.colsb[2] = c.colsb[3] = 32, c.rows[2] = c.rows[3] = r;
  c.colsb[4] = c.colsb[5] = 64, c.rows[4] = c.rows[5] = 8;
  c.colsb[6] = 16, c.rows[6] = r;
  c.colsb[7] = 64, c.rows[7] = 4;
  asm volatile("" : : "r"(&c) : "memory");  // GCC 12 drops the stores the tile instruction reads otherwise
  _tile_loadconfig(&c);
  tl_amx_rows = rows;
}

// a thread's products begin: the tile shapes are loaded afresh (other code may have loaded its own)
void amx_begin() { tl_amx_rows = 0; }

// MT (<= 16) rows against one tile, in chunks of AMX_CHUNK blocks and three passes a chunk, so that
// no pass waits on the one before: the blocks' weight bytes unpacked to scratch; their integer sums
// on the tile unit (two sets of tiles in turn, MT rows), stored to scratch; the float steps of every row.
constexpr int AMX_CHUNK = 8;

template <int MT>
void int8_tile_amx(int t, const uint8_t* tile, int64_t nb, const XQ& xq, int64_t m0, int64_t K, float* y,
                   int64_t ldy, int64_t n0, int64_t ncols, const float* bias) {
  alignas(64) uint8_t wb[AMX_CHUNK][512];
  alignas(64) int32_t cs[AMX_CHUNK][2][16][16];
  const uint8_t* recs[AMX_CHUNK];
  const uint8_t* heads[AMX_CHUNK];
  __m512 acc[MT];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  amx_shapes(MT);
  const int8_t* x0 = xq.q.data() + m0 * K;
  const uint8_t* p = tile;
  const uint8_t* head = nullptr;
  const int64_t pf = g_prefetch_bytes;
  for (int64_t c0 = 0; c0 < nb; c0 += AMX_CHUNK) {
    const int n = int(std::min<int64_t>(AMX_CHUNK, nb - c0));
    for (int i = 0; i < n; ++i) {
      if (k_type(t) && ((c0 + i) & 7) == 0) {
        head = p;
        p += head_bytes(t);
      }
      recs[i] = p, heads[i] = head;
      prefetch_ahead(p, rec_bytes(t), pf);
      __m512i g[8];
      vnni_groups(t, p, g);
      for (int j = 0; j < 8; ++j) _mm512_store_si512(wb[i] + 64 * j, g[j]);
      p += rec_bytes(t);
    }
    if (t == T_Q6_K) {  // a block's halves apart: i0 over values 0-15, i1 over 16-31
      for (int i = 0; i < n; ++i) {
        const int8_t* xb = x0 + 32 * (c0 + i);
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(6, xb, K);
        _tile_loadd(7, wb[i], 64);
        _tile_dpbsud(0, 6, 7);
        _tile_loadd(6, xb + 16, K);
        _tile_loadd(7, wb[i] + 256, 64);
        _tile_dpbsud(1, 6, 7);
        _tile_stored(0, cs[i][0], 64);
        _tile_stored(1, cs[i][1], 64);
      }
    } else {
      for (int i = 0; i < n; i += 2) {
        _tile_zero(0);
        _tile_loadd(2, x0 + 32 * (c0 + i), K);
        _tile_loadd(4, wb[i], 64);
        _tile_dpbsud(0, 2, 4);
        if (i + 1 < n) {
          _tile_zero(1);
          _tile_loadd(3, x0 + 32 * (c0 + i + 1), K);
          _tile_loadd(5, wb[i + 1], 64);
          _tile_dpbsud(1, 3, 5);
        }
        _tile_stored(0, cs[i][0], 64);
        if (i + 1 < n) _tile_stored(1, cs[i + 1][0], 64);
      }
    }
    for (int i = 0; i < n; ++i) {
      __m512 A, B, A1, B1;
      vnni_scales(t, recs[i], heads[i], A, B, A1, B1);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const size_t at = size_t((m0 + m) * nb + c0 + i);
        const __m512i i0 = _mm512_load_si512(cs[i][0][m]);
        const __m512i i1 = t == T_Q6_K ? _mm512_load_si512(cs[i][1][m]) : i0;
        acc[m] = int8_step(t, A, B, A1, B1, i0, i1, xq, at, acc[m]);
      }
    }
  }
  store_rows<MT>(acc, y, ldy, m0, n0, ncols, bias);
}

// rows m .. m + rows - 1 (1 to 16) against one tile
void int8_rows_amx(int t, const uint8_t* tile, int64_t nb, const XQ& xq, int64_t m, int64_t rows, int64_t K,
                   float* y, int64_t ldy, int64_t n0, int64_t ncols, const float* bias) {
  switch (rows) {
#define ADASPEC_AMX_CASE(R) \
    case R: int8_tile_amx<R>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    ADASPEC_AMX_CASE(16) ADASPEC_AMX_CASE(15) ADASPEC_AMX_CASE(14) ADASPEC_AMX_CASE(13)
    ADASPEC_AMX_CASE(12) ADASPEC_AMX_CASE(11) ADASPEC_AMX_CASE(10) ADASPEC_AMX_CASE(9)
    ADASPEC_AMX_CASE(8) ADASPEC_AMX_CASE(7) ADASPEC_AMX_CASE(6) ADASPEC_AMX_CASE(5)
    ADASPEC_AMX_CASE(4) ADASPEC_AMX_CASE(3) ADASPEC_AMX_CASE(2) ADASPEC_AMX_CASE(1)
#undef ADASPEC_AMX_CASE
    default: break;
  }
}
#endif
#endif

// the same arithmetic in plain C++ (other CPUs): integer sums, then the same float steps per lane
void int8_tile_generic(int t, const uint8_t* tile, int64_t nb, const XQ& xq, int64_t m0, int64_t rows, int64_t K,
                       float* y, int64_t ldy, int64_t n0, int64_t ncols, const float* bias) {
  std::vector<float> acc(size_t(rows * 16), 0.f);
  const uint8_t* p = tile;
  const uint8_t* head = nullptr;
  uint8_t g[8][64];
  Scales s;
  for (int64_t b = 0; b < nb; ++b) {
    if (k_type(t) && (b & 7) == 0) {
      head = p;
      p += head_bytes(t);
    }
    tile_groups(t, p, g);
    tile_scales(t, head, p, s);
    for (int64_t m = 0; m < rows; ++m) {
      const int8_t* xb = xq.q.data() + (m0 + m) * K + 32 * b;
      const size_t at = size_t((m0 + m) * nb + b);
      for (int l = 0; l < 16; ++l) {
        int32_t i0 = 0, i1 = 0;
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) (j < 4 ? i0 : i1) += int32_t(g[j][4 * l + i]) * int32_t(xb[4 * j + i]);
        float tv;
        if (t == T_Q6_K) {
          tv = s.a[l] * float(i0);
          tv = std::fma(s.a1[l], float(i1), tv);
          tv = std::fma(s.b[l], xq.s0[at], tv);
          tv = std::fma(s.b1[l], xq.s1[at], tv);
        } else {
          tv = s.a[l] * float(i0 + i1);
          tv = std::fma(s.b[l], xq.s[at], tv);
        }
        float& a = acc[size_t(m * 16 + l)];
        a = std::fma(xq.d[at], tv, a);
      }
    }
    p += rec_bytes(t);
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t l = 0; l < ncols; ++l)
      y[(m0 + m) * ldy + n0 + l] = acc[size_t(m * 16 + l)] + (bias != nullptr ? bias[n0 + l] : 0.f);
}

#if defined(ADASPEC_VNNI)
// rows m .. m + rows - 1 (1 to 12) against one tile
void int8_rows(int t, const uint8_t* tile, int64_t nb, const XQ& xq, int64_t m, int64_t rows, int64_t K, float* y,
               int64_t ldy, int64_t n0, int64_t ncols, const float* bias) {
  switch (rows) {
    case 12: int8_tile<12>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 11: int8_tile<11>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 10: int8_tile<10>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 9: int8_tile<9>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 8: int8_tile<8>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 7: int8_tile<7>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 6: int8_tile<6>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 5: int8_tile<5>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 4: int8_tile<4>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 3: int8_tile<3>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 2: int8_tile<2>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    case 1: int8_tile<1>(t, tile, nb, xq, m, K, y, ldy, n0, ncols, bias); break;
    default: break;
  }
}
#endif

// inputs of at least this many rows take the tile unit where it runs (amx_rows(M)); fewer, VNNI. On a
// Sapphire Rapids core, 10-16 rows run 1.1-1.45x faster on it (Q4_1, Q4_K); fewer, no faster than VNNI
int64_t g_amx_min_rows = 10;

// whether this build and process can run the int8 products on the tile unit
bool has_amx() {
#if defined(ADASPEC_AMX)
  return amx_ready();
#else
  return false;
#endif
}

bool amx_rows(int64_t M) { return g_amx_min_rows > 0 && M >= g_amx_min_rows && has_amx(); }

// one tile (16 outputs) against all M rows, in row tiles of near-equal size: at most 16 on the tile unit
// (amx: the caller's thread has run amx_begin), else at most 12 (12 accumulators and the 8 weight
// groups in registers)
void int8_columns(int t, const uint8_t* tile, int64_t nb, const XQ& xq, int64_t M, int64_t K, float* y, int64_t ldy,
                  int64_t n0, int64_t ncols, const float* bias, bool amx) {
#if defined(ADASPEC_VNNI)
  // the tile unit's groups (at most 16 rows) where they hold at least g_amx_min_rows rows each (Q6_K,
  // two tile products a block: 16, unless a test asked for every row count)
  const int64_t need = t == T_Q6_K && g_amx_min_rows > 1 ? 16 : g_amx_min_rows;
  amx = amx && M / ((M + 15) / 16) >= need;
  const int64_t most = amx ? 16 : 12;
  int64_t m = 0;
  const int64_t tiles = (M + most - 1) / most;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t rows = (M - m) / (tiles - i);
#if defined(ADASPEC_AMX)
    if (amx) {
      int8_rows_amx(t, tile, nb, xq, m, rows, K, y, ldy, n0, ncols, bias);
      m += rows;
      continue;
    }
#endif
    int8_rows(t, tile, nb, xq, m, rows, K, y, ldy, n0, ncols, bias);
    m += rows;
  }
#else
  (void)amx;
  int8_tile_generic(t, tile, nb, xq, 0, M, K, y, ldy, n0, ncols, bias);
#endif
}

bool has_vnni() {
#if defined(ADASPEC_VNNI)
  return true;
#else
  return false;
#endif
}

// ---- a set of matrices sharing an input (q/k/v, gate/up, or one) ---------------------------------------
struct Segment {
  torch::Tensor w;       // [N, row_bytes] uint8
  torch::Tensor bias;    // [N] float32 or undefined
  torch::Tensor packed;  // int8 mode: the tiles of 16 outputs (repack_int8), else undefined
  int qtype;
  int64_t N, row_bytes;
};

struct Group {  // NC-column units of work: (segment, first column, last column)
  int seg;
  int64_t n0, n1;
};

class QuantMatrices {
 public:
  QuantMatrices(std::vector<torch::Tensor> weights, std::vector<int64_t> qtypes,
                std::vector<c10::optional<torch::Tensor>> biases, int64_t K, bool int8)
      : K_(K), int8_(int8) {
    TORCH_CHECK(!weights.empty() && weights.size() == qtypes.size() && weights.size() == biases.size(),
                "adaspec quant: one type and one bias (or None) per matrix");
    for (size_t i = 0; i < weights.size(); ++i) {
      check_matrix(weights[i], int(qtypes[i]), K);
      Segment s;
      s.w = weights[i];
      s.qtype = int(qtypes[i]);
      s.N = weights[i].size(0);
      s.row_bytes = weights[i].size(1);
      if (biases[i].has_value() && biases[i]->defined()) {
        const torch::Tensor& b = *biases[i];
        TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == torch::kFloat32 && b.dim() == 1 && b.size(0) == s.N &&
                        b.is_contiguous(), "adaspec quant: a bias must be a contiguous float32 CPU vector of N values");
        s.bias = b;
      }
      if (int8 && int8_type(s.qtype)) s.packed = repack_int8(s.w, s.qtype, K);
      segs_.push_back(s);
    }
    // units of work: 16 columns (a few cache lines of output, several column tiles); a thread takes
    // whole units, so it owns whole columns and each column's reduction is its own
    for (size_t i = 0; i < segs_.size(); ++i)
      for (int64_t n = 0; n < segs_[i].N; n += 16) units_.push_back({int(i), n, std::min(segs_[i].N, n + 16)});
    for (const auto& s : segs_) work_ += s.N * K;
  }

  std::vector<torch::Tensor> forward(const torch::Tensor& x_in) const {
    TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32,
                "adaspec quant: the input must be float32 on the CPU");
    TORCH_CHECK(x_in.size(-1) == K_, "adaspec quant: input width ", x_in.size(-1), ", the weights take ", K_);
    const torch::Tensor x = x_in.reshape({-1, K_}).contiguous();
    const int64_t M = x.size(0);
    auto lead = x_in.sizes().vec();
    std::vector<torch::Tensor> outs;
    std::vector<Out> os;
    for (const auto& s : segs_) {
      lead.back() = s.N;
      outs.push_back(torch::empty(lead, x.options()));
      os.push_back({outs.back().data_ptr<float>(), s.N, s.bias.defined() ? s.bias.data_ptr<float>() : nullptr});
    }
    if (M == 0) return outs;
    const float* xp = x.data_ptr<float>();
    bool any_int8 = false;
    for (const auto& s : segs_) any_int8 = any_int8 || s.packed.defined();
    const XQ xq = any_int8 ? quantize_rows(xp, M, K_) : XQ{};
    const int64_t units = int64_t(units_.size());
    // below ~256 K multiply-adds a call, one thread (the pool's wake-up costs more than it saves)
    const int64_t grain = (work_ * M < (int64_t(1) << 18)) ? units : 1;
    const bool amx = any_int8 && amx_rows(M);
    at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
      std::vector<float> scratch;
#if defined(ADASPEC_AMX)
      if (amx) amx_begin();
#endif
      // consecutive units of one segment run as one range (fewer, longer column loops)
      int64_t u = u0;
      while (u < u1) {
        const Group& g = units_[size_t(u)];
        const Segment& seg = segs_[size_t(g.seg)];
        if (seg.packed.defined()) {  // int8 mode: one tile of 16 outputs
          const int64_t tile = g.n0 / 16;
          const Out& o = os[size_t(g.seg)];
          int8_columns(seg.qtype, seg.packed.data_ptr<uint8_t>() + tile * seg.packed.size(1), K_ / 32, xq, M, K_,
                       o.y, o.ldy, g.n0, g.n1 - g.n0, o.bias, amx);
          ++u;
          continue;
        }
        int64_t v = u + 1;
        while (v < u1 && units_[size_t(v)].seg == g.seg) ++v;
        const Segment& s = segs_[size_t(g.seg)];
        const int64_t n0 = g.n0, n1 = units_[size_t(v - 1)].n1;
        dispatch(s.qtype, [&](auto t) {
          columns<decltype(t)>(xp, K_, M, K_, s.w.data_ptr<uint8_t>(), s.row_bytes, n0, n1, os[size_t(g.seg)], scratch);
        });
        u = v;
      }
#if defined(ADASPEC_AMX)
      if (amx && tl_amx_rows != 0) _tile_release();
#endif
    });
    return outs;
  }

  int64_t in_features() const { return K_; }
  bool int8() const { return int8_; }

 private:
  int64_t K_;
  bool int8_ = false;
  int64_t work_ = 0;
  std::vector<Segment> segs_;
  std::vector<Group> units_;
};

// the whole matrix [N, K], or the rows `rows` of it, as float32 (the same decoding as the products)
torch::Tensor dequantize(const torch::Tensor& w, int64_t qtype, int64_t K, const c10::optional<torch::Tensor>& rows) {
  check_matrix(w, int(qtype), K);
  torch::Tensor idx;
  if (rows.has_value() && rows->defined()) {
    idx = rows->to(torch::kLong).contiguous();
    TORCH_CHECK(idx.device().is_cpu(), "adaspec quant: row indices must be on the CPU");
  }
  const int64_t n = idx.defined() ? idx.numel() : w.size(0);
  auto out = torch::empty({n, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const int64_t* ip = idx.defined() ? idx.data_ptr<int64_t>() : nullptr;
  const int64_t N = w.size(0), row_bytes = w.size(1);
  if (ip != nullptr)
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "adaspec quant: row ", ip[i], " out of range");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / K);
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    dispatch(int(qtype), [&](auto t) {
      using T = decltype(t);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = ip != nullptr ? ip[i] : i;
        decode_rows<T>(wp + r * row_bytes, row_bytes, K, 0, 1, op + i * K, K);
      }
    });
  });
  return out;
}


// ---- attention in a fixed order ---------------------------------------------------------------------
// out[b, i, h] = sum_j p_j v[b, h / g, j] / sum_j p_j, p_j = exp(s_j - max_j s_j),
// s_j = scale * (q[b, h, i] . k[b, h / g, j]) + mask[b, i, j] (or causal: keys 0 .. L - Q + i).
// The dot product is 16 lanes over the head dimension and the fixed tree. The weighted sum over values
// runs in increasing j, so a key a row cannot see (p = exp(-inf) = 0 exactly) leaves it as it is. The
// softmax denominator sums the nonzero p_j in increasing j, the n-th of them in lane n mod 16, then the
// fixed tree: its order depends on which keys a row sees, never on the columns they sit at. A row's
// output is therefore the same alone (L keys), in a block or batch (more keys, masked), and in a padded
// batch cache, where its keys sit behind left padding and between masked holes.

inline V16 vsub(V16 a, V16 b);
inline V16 vmax(V16 a, V16 b);
#if defined(ADASPEC_AVX512)
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vhmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline V16 vround(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V16 vscale2(V16 a, V16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a * 2^n (n integral)
#elif defined(ADASPEC_AVX2)
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float vhmax(V16 a) {
  float f[16];
  vstore(f, a);
  float m = f[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, f[i]);
  return m;
}
inline V16 vround(V16 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline __m256 scale2_8(__m256 a, __m256 n) {  // n in [-126, 127] after the clamp in vexp
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
}
inline V16 vscale2(V16 a, V16 n) { return {scale2_8(a.lo, n.lo), scale2_8(a.hi, n.hi)}; }
#else
inline V16 vsub(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
inline V16 vadd(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
inline V16 vmax(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::max(a.v[i], b.v[i]); return r; }
inline float vhmax(V16 a) { float m = a.v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, a.v[i]); return m; }
inline V16 vround(V16 a) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::nearbyint(a.v[i]); return r; }
inline V16 vscale2(V16 a, V16 n) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::ldexp(a.v[i], int(n.v[i])); return r; }
#endif

// exp(x) for x <= 0 (softmax arguments): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial (relative error ~2e-7); below -87.3 the result is 0 (exp(-inf) = 0 exactly)
inline V16 vexp(V16 x) {
  const V16 lo = vset1(-87.3f);
  const V16 xc = vmax(x, lo);
  const V16 n = vround(vmul(xc, vset1(1.44269504088896341f)));
  V16 r = vfma(n, vset1(-0.693359375f), xc);  // Cody-Waite: ln2 = 0.693359375 - 2.12194440e-4
  r = vfma(n, vset1(2.12194440e-4f), r);
  V16 p = vset1(1.f / 720.f);
  p = vfma(p, r, vset1(1.f / 120.f));
  p = vfma(p, r, vset1(1.f / 24.f));
  p = vfma(p, r, vset1(1.f / 6.f));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
  V16 e = vscale2(p, n);
  // x below the clamp (masked keys): exactly 0
#if defined(ADASPEC_AVX512)
  e.v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, lo.v, _CMP_GE_OQ), e.v);
#elif defined(ADASPEC_AVX2)
  e.lo = _mm256_and_ps(e.lo, _mm256_cmp_ps(x.lo, lo.lo, _CMP_GE_OQ));
  e.hi = _mm256_and_ps(e.hi, _mm256_cmp_ps(x.hi, lo.hi, _CMP_GE_OQ));
#else
  for (int i = 0; i < 16; ++i) if (!(x.v[i] >= lo.v[i])) e.v[i] = 0.f;
#endif
  return e;
}

// 16 floats from p, of which the first n are real (the rest zero: they add nothing to a sum)
inline V16 vload_part(const float* p, int64_t n) {
  if (n >= 16) return vload(p);
  float buf[16] = {0.f};
  std::memcpy(buf, p, size_t(n) * 4);
  return vload(buf);
}

// vhsum of R rows at once: the same pairings as vhsum ((l, l+8), (l, l+4), (l, l+2), (0, 1)), four rows
// sharing each shuffle and addition on AVX-512
template <int R>
inline void vhsum_rows(const V16* a, float* out) {
#if defined(ADASPEC_AVX512)
  if constexpr (R == 4) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a[0].v, a[1].v, 0x44), _mm512_shuffle_f32x4(a[0].v, a[1].v, 0xee));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(a[2].v, a[3].v, 0x44), _mm512_shuffle_f32x4(a[2].v, a[3].v, 0xee));
    // ab = [t8(a) | t8(b)], cd = [t8(c) | t8(d)] (128-bit quarters: a0-3, a4-7, b0-3, b4-7)
    __m512 t4 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    // t4 = [t4(a), t4(b), t4(c), t4(d)]
    const __m512 t2 = _mm512_add_ps(t4, _mm512_shuffle_ps(t4, t4, 0xee));
    const __m512 t1 = _mm512_add_ps(t2, _mm512_shuffle_ps(t2, t2, 0x55));
    alignas(64) float buf[16];
    _mm512_store_ps(buf, t1);
    out[0] = buf[0], out[1] = buf[4], out[2] = buf[8], out[3] = buf[12];
    return;
  }
#endif
  for (int r = 0; r < R; ++r) out[r] = vhsum(a[r]);
}

#if defined(ADASPEC_AVX512)
// chunk c of a key row: 16 floats, those past D zero (as vload_part)
inline __m512 kchunk(const float* k, int c, int64_t D) {
  const int64_t n = D - 16 * c;
  if (n >= 16) return _mm512_loadu_ps(k + 16 * c);
  return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), k + 16 * c);
}

// The dot products of one query row (C chunks qv) with 16 keys (rows of ldk floats from k): per key the
// lane products in chunk order (vmul, then vfma), then its 16 lanes summed with vhsum's pairings ((l,
// l+8), (l, l+4), (l, l+2), (0, 1)) by a transposing tree that sums the 16 keys at once: the same
// additions of the same values as vhsum per key, so the same bits as the key-by-key path.
template <int C>
inline __m512 dots16(const V16* qv, const float* k, int64_t ldk, int64_t D) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const float* kj = k + j * ldk;
    __m512 acc = _mm512_mul_ps(qv[0].v, kchunk(kj, 0, D));
#pragma GCC unroll 16
    for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c].v, kchunk(kj, c, D), acc);
    a[j] = acc;
  }
  // (l, l+8): b[j] = [t8(a[j]) | t8(a[j+8])] in 128-bit quarters [a_j 0-3, a_j 4-7, a_j+8 0-3, a_j+8 4-7]
  __m512 b[8];
#pragma GCC unroll 16
  for (int j = 0; j < 8; ++j)
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xee));
  // (l, l+4): c[j] = quarters [t4(a_j), t4(a_j+8), t4(a_j+4), t4(a_j+12)]
  __m512 c4[4];
#pragma GCC unroll 16
  for (int j = 0; j < 4; ++j)
    c4[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 4], 0x88), _mm512_shuffle_f32x4(b[j], b[j + 4], 0xdd));
  // (l, l+2) within each quarter: d[j] quarter q = [t2(X), t2(Y)], X of c[j], Y of c[j+2]
  __m512 d2[2];
#pragma GCC unroll 16
  for (int j = 0; j < 2; ++j)
    d2[j] = _mm512_add_ps(_mm512_shuffle_ps(c4[j], c4[j + 2], 0x44), _mm512_shuffle_ps(c4[j], c4[j + 2], 0xee));
  // (0, 1): quarter q (keys offset o = 0, 8, 4, 12) holds keys o, o+2, o+1, o+3
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d2[0], d2[1], 0x88), _mm512_shuffle_ps(d2[0], d2[1], 0xdd));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), e);
}
#endif

#if defined(ADASPEC_AVX512)
// out[r] = inv[r] * sum_j p[r][j] v[j] for R rows (p in s, rows Lp apart), keys j in increasing order per
// lane: the same steps as the generic loop below, its accumulators held in registers
template <int R, int C>
inline void weigh_values(const float* s, int64_t Lp, const float* vb, int64_t ldv, int64_t D, int64_t lmax,
                         const float* inv, float* const* out) {
  __m512 acc[R * C];
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < lmax; ++j) {
    const float* vj = vb + j * ldv;
    __m512 vc[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) vc[c] = kchunk(vj, c, D);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(s[r * Lp + j]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_fmadd_ps(p, vc[c], acc[r * C + c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m512 o = _mm512_mul_ps(acc[r * C + c], _mm512_set1_ps(inv[r]));
      const int64_t n = D - 16 * c;
      _mm512_mask_storeu_ps(out[r] + 16 * c, n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), o);
    }
}
#endif

// R query rows of one head against its keys and values (rows' causal limits `last`, in keys), C = the
// head size in 16-lane chunks. Per row and key the dot product is lanes d mod 16, chunks in order,
// then the fixed tree; per row and output lane the weighted sum runs over keys in increasing order.
template <int R, int C>
void attention_rows(const float* const* qr, const float* kb, const float* vb, int64_t ldk, int64_t ldv, int64_t D,
                    const int64_t* last, const float* const* mrow, float scale, float* s, int64_t Lp,
                    float* packed, float* const* out) {
  int64_t lmax = 0;
  for (int r = 0; r < R; ++r) lmax = std::max(lmax, last[r]);
  V16 qv[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) qv[r][c] = vload_part(qr[r] + 16 * c, D - 16 * c);
  int64_t j0 = 0;
#if defined(ADASPEC_AVX512)
  // whole blocks of 16 keys, one row at a time (the block stays in L1 across the rows)
  for (; j0 + 16 <= lmax; j0 += 16) {
    const __m512 keys = _mm512_add_ps(_mm512_set1_ps(float(j0)), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                                 12, 13, 14, 15));
    for (int r = 0; r < R; ++r) {
      __m512 x = _mm512_mul_ps(_mm512_set1_ps(scale), dots16<C>(qv[r], kb + j0 * ldk, ldk, D));
      if (mrow[r] != nullptr) x = _mm512_add_ps(x, _mm512_loadu_ps(mrow[r] + j0));
      const __mmask16 seen = _mm512_cmp_ps_mask(keys, _mm512_set1_ps(float(last[r])), _CMP_LT_OQ);
      _mm512_storeu_ps(s + r * Lp + j0, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, x));
    }
  }
#endif
  for (int64_t j = j0; j < lmax; ++j) {
    V16 kc[C];
    for (int c = 0; c < C; ++c) kc[c] = vload_part(kb + j * ldk + 16 * c, D - 16 * c);
    V16 acc[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = vmul(qv[r][0], kc[0]);
      for (int c = 1; c < C; ++c) acc[r] = vfma(qv[r][c], kc[c], acc[r]);
    }
    float dots[R];
    vhsum_rows<R>(acc, dots);
    for (int r = 0; r < R; ++r) {
      float x = scale * dots[r];
      if (mrow[r] != nullptr) x += mrow[r][j];
      s[r * Lp + j] = j < last[r] ? x : -INFINITY;
    }
  }
  float inv[R];
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * Lp;
    for (int64_t j = lmax; j < Lp; ++j) sr[j] = -INFINITY;
    V16 mx = vset1(-INFINITY);
    for (int64_t j = 0; j < Lp; j += 16) mx = vmax(mx, vload(sr + j));
    float m = vhmax(mx);
    if (!(m > -INFINITY)) m = 0.f;  // a row that sees no key: zeros
    const V16 mv = vset1(m);
    int64_t n = 0;  // the nonzero p_j, packed in increasing j (the denominator's order: see above)
    for (int64_t j = 0; j < Lp; j += 16) {
      const V16 e = vexp(vsub(vload(sr + j), mv));
      vstore(sr + j, e);
#if defined(ADASPEC_AVX512)
      const __mmask16 nz = _mm512_cmp_ps_mask(e.v, _mm512_setzero_ps(), _CMP_NEQ_OQ);
      // compressed in a register, then stored whole (the buffer has 16 floats to spare): a compressing
      // store to memory is microcoded on some cores (Zen 4: most of the attention's time)
      _mm512_storeu_ps(packed + n, _mm512_maskz_compress_ps(nz, e.v));
      n += __builtin_popcount(static_cast<unsigned>(nz));
#else
      for (int64_t i = j; i < j + 16; ++i)
        if (sr[i] != 0.f) packed[n++] = sr[i];
#endif
    }
    V16 sum = vzero();
    for (int64_t j = 0; j < n; j += 16) sum = vadd(sum, vload_part(packed + j, n - j));
    const float total = vhsum(sum);
    inv[r] = total > 0.f ? 1.f / total : 0.f;
  }
#if defined(ADASPEC_AVX512)
  if constexpr (R * C <= 24) {
    weigh_values<R, C>(s, Lp, vb, ldv, D, lmax, inv, out);
    return;
  }
#endif
  V16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  for (int64_t j = 0; j < lmax; ++j) {
    V16 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = vload_part(vb + j * ldv + 16 * c, D - 16 * c);
    for (int r = 0; r < R; ++r) {
      const V16 p = vset1(s[r * Lp + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(p, vc[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const V16 o = vmul(acc[r][c], vset1(inv[r]));
      if (16 * c + 16 <= D) {
        vstore(out[r] + 16 * c, o);
      } else {
        float buf[16];
        vstore(buf, o);
        std::memcpy(out[r] + 16 * c, buf, size_t(D - 16 * c) * 4);
      }
    }
}

template <int C>
void attention_head(const float* qh, int64_t ldq, int64_t Q, const float* kb, const float* vb, int64_t ldk,
                    int64_t ldv, int64_t D, int64_t L, const float* mh, float scale, float* s, int64_t Lp,
                    float* packed, float* oh, int64_t ldo) {
  constexpr int R = C <= 4 ? 4 : 2;
  int64_t i = 0;
  auto tile = [&](auto rows) {
    constexpr int n = decltype(rows)::value;
    const float* qr[n];
    const float* mr[n];
    float* orow[n];
    int64_t last[n];
    for (int r = 0; r < n; ++r) {
      qr[r] = qh + (i + r) * ldq;
      mr[r] = mh != nullptr ? mh + (i + r) * L : nullptr;
      orow[r] = oh + (i + r) * ldo;
      last[r] = mh != nullptr ? L : L - Q + i + r + 1;  // keys a causal row sees
    }
    attention_rows<n, C>(qr, kb, vb, ldk, ldv, D, last, mr, scale, s, Lp, packed, orow);
    i += n;
  };
  for (; i + R <= Q;) tile(std::integral_constant<int, R>{});
  for (; i < Q;) tile(std::integral_constant<int, 1>{});
}

torch::Tensor attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                        const c10::optional<torch::Tensor>& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, "adaspec attention: q, k, v are [B, H, T, D]");
  TORCH_CHECK(q_in.scalar_type() == torch::kFloat32 && k_in.scalar_type() == torch::kFloat32 &&
                  v_in.scalar_type() == torch::kFloat32 && q_in.device().is_cpu(),
              "adaspec attention: float32 CPU tensors");
  // keys and values may be views of a longer cache (rows of D floats, any head and batch strides)
  const torch::Tensor q = q_in.contiguous();
  const torch::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const torch::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && H % Hk == 0 && v.size(1) == Hk && v.size(2) == L &&
                  k.size(3) == D && v.size(3) == D && L >= Q, "adaspec attention: shapes do not match");
  TORCH_CHECK(D <= 256, "adaspec attention: head size ", D, " over 256");
  torch::Tensor mask;
  int64_t mb = 0, mhs = 0;
  if (mask_in.has_value() && mask_in->defined()) {
    mask = mask_in->to(torch::kFloat32).contiguous();
    TORCH_CHECK(mask.dim() == 4 && mask.size(2) == Q && mask.size(3) == L &&
                    (mask.size(0) == B || mask.size(0) == 1) && (mask.size(1) == H || mask.size(1) == 1),
                "adaspec attention: the mask is [B or 1, H or 1, Q, L]");
    mb = mask.size(0) == 1 ? 0 : mask.size(1) * Q * L;
    mhs = mask.size(1) == 1 ? 0 : Q * L;
  }
  auto out = torch::empty({B, Q, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = mask.defined() ? mask.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t group = H / Hk, Lp = (L + 15) / 16 * 16;
  const float fscale = float(scale);
  const int64_t C = (D + 15) / 16;
  at::parallel_for(0, B * H, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> s(static_cast<size_t>(5 * Lp + 16));  // 4 rows' scores, then the packed p_j of one
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / H, h = u % H, hk = h / group;
      const float* kb = kp + b * k.stride(0) + hk * k.stride(1);
      const float* vb = vp + b * v.stride(0) + hk * v.stride(1);
      const float* qh = qp + (b * H + h) * Q * D;
      const float* mh = mp != nullptr ? mp + b * mb + h * mhs : nullptr;
      float* oh = op + (b * Q * H + h) * D;
      const int64_t ldk = k.stride(2), ldv = v.stride(2), ldo = H * D;
      switch (C) {
#define ADASPEC_HEAD(n) case n: attention_head<n>(qh, D, Q, kb, vb, ldk, ldv, D, L, mh, fscale, s.data(), Lp, s.data() + 4 * Lp, oh, ldo); break;
        ADASPEC_HEAD(1) ADASPEC_HEAD(2) ADASPEC_HEAD(3) ADASPEC_HEAD(4) ADASPEC_HEAD(5) ADASPEC_HEAD(6)
        ADASPEC_HEAD(7) ADASPEC_HEAD(8) ADASPEC_HEAD(9) ADASPEC_HEAD(10) ADASPEC_HEAD(11) ADASPEC_HEAD(12)
        ADASPEC_HEAD(13) ADASPEC_HEAD(14) ADASPEC_HEAD(15) ADASPEC_HEAD(16)
#undef ADASPEC_HEAD
        default: break;
      }
    }
  });
  return out;
}


// ---- the elementwise steps of a decoder layer --------------------------------------------------------
// RMSNorm: y = w * (x * (1 / sqrt(mean(x^2) + eps))), the mean over each row in a fixed order.
torch::Tensor rmsnorm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && w_in.scalar_type() == torch::kFloat32 && x_in.device().is_cpu(),
              "adaspec rmsnorm: float32 CPU tensors");
  const int64_t H = x_in.size(-1);
  TORCH_CHECK(w_in.numel() == H, "adaspec rmsnorm: the weight has ", w_in.numel(), " values for rows of ", H);
  const torch::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  auto y = torch::empty_like(x);
  const int64_t rows = x.numel() / std::max<int64_t>(H, 1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float* yr = yp + r * H;
      V16 acc = vzero();
      int64_t i = 0;
      for (; i + 16 <= H; i += 16) { const V16 a = vload(xr + i); acc = vfma(a, a, acc); }
      if (i < H) { const V16 a = vload_part(xr + i, H - i); acc = vfma(a, a, acc); }
      const float inv = 1.f / std::sqrt(vhsum(acc) / float(H) + float(eps));
      for (int64_t j = 0; j < H; ++j) yr[j] = wp[j] * (xr[j] * inv);
    }
  });
  return y;
}

// Rotary embedding of q [B, T, H * D] with cos, sin [B or 1, T, D] (rotate-half convention), laid out
// [B, H, T, D]: out = q * cos + rotate_half(q) * sin, each product and the sum rounded once (as
// transformers' apply_rotary_pos_emb computes it).
torch::Tensor rope(const torch::Tensor& q_in, const torch::Tensor& cos_in, const torch::Tensor& sin_in, int64_t D) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == torch::kFloat32 && q_in.device().is_cpu(),
              "adaspec rope: q is a float32 CPU tensor [B, T, H * D]");
  const torch::Tensor q = q_in.contiguous();
  const torch::Tensor c = cos_in.to(torch::kFloat32).contiguous(), sn = sin_in.to(torch::kFloat32).contiguous();
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2) / D, half = D / 2;
  TORCH_CHECK(D % 2 == 0 && q.size(2) == H * D, "adaspec rope: rows of ", q.size(2), " are not heads of ", D);
  TORCH_CHECK(c.dim() == 3 && c.size(1) == T && c.size(2) == D && (c.size(0) == B || c.size(0) == 1) &&
                  sn.sizes() == c.sizes(), "adaspec rope: cos and sin are [B or 1, T, D]");
  const int64_t cb = c.size(0) == 1 ? 0 : T * D;
  auto out = torch::empty({B, H, T, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, std::max<int64_t>(1, 8192 / std::max<int64_t>(T * D, 1)), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / H, h = u % H;
      for (int64_t t = 0; t < T; ++t) {
        const float* x = qp + (b * T + t) * H * D + h * D;
        const float* cr = cp + b * cb + t * D;
        const float* sr = sp + b * cb + t * D;
        float* o = op + ((b * H + h) * T + t) * D;
        for (int64_t d = 0; d < half; ++d) o[d] = x[d] * cr[d] + (-x[d + half]) * sr[d];
        for (int64_t d = half; d < D; ++d) o[d] = x[d] * cr[d] + x[d - half] * sr[d];
      }
    }
  });
  return out;
}


// ---- a whole decoder layer (Llama / Qwen2 / Mistral) ------------------------------------------------
// x + attn(norm1(x)) = x2; x2 + mlp(norm2(x2)): the same steps, in the same order and with the same
// kernels, as the layer's modules run one by one (rmsnorm, q/k/v, rope, attention, o, gate/up, silu,
// down), with the new keys and values written into the cache's buffers at position L.
class DecoderLayer {
 public:
  DecoderLayer(const QuantMatrices& qkv, const QuantMatrices& o, const QuantMatrices& gate_up, const QuantMatrices& down,
               torch::Tensor norm1, double eps1, torch::Tensor norm2, double eps2, int64_t heads, int64_t kv_heads,
               int64_t head_dim, double scale)
      : qkv_(qkv), o_(o), gate_up_(gate_up), down_(down), norm1_(std::move(norm1)), norm2_(std::move(norm2)),
        eps1_(eps1), eps2_(eps2), H_(heads), Hk_(kv_heads), D_(head_dim), scale_(scale) {}

  torch::Tensor forward(const torch::Tensor& x, const c10::optional<torch::Tensor>& mask, const torch::Tensor& cos,
                        const torch::Tensor& sin, torch::Tensor kbuf, torch::Tensor vbuf, int64_t L) const {
    const int64_t B = x.size(0), T = x.size(1);
    TORCH_CHECK(kbuf.dim() == 4 && kbuf.size(0) == B && kbuf.size(1) == Hk_ && kbuf.size(2) >= L + T &&
                    kbuf.size(3) == D_ && vbuf.sizes() == kbuf.sizes(), "adaspec layer: the cache buffers do not fit");
    const torch::Tensor h = rmsnorm(x, norm1_, eps1_);
    const std::vector<torch::Tensor> qkv = qkv_.forward(h);
    const torch::Tensor q = rope(qkv[0], cos, sin, D_);
    kbuf.narrow(2, L, T).copy_(rope(qkv[1], cos, sin, D_));
    vbuf.narrow(2, L, T).copy_(qkv[2].view({B, T, Hk_, D_}).transpose(1, 2));
    const torch::Tensor att = attention(q, kbuf.narrow(2, 0, L + T), vbuf.narrow(2, 0, L + T), mask, scale_);
    torch::Tensor x2 = x + o_.forward(att.view({B, T, H_ * D_}))[0];
    std::vector<torch::Tensor> gu = gate_up_.forward(rmsnorm(x2, norm2_, eps2_));
    at::silu_(gu[0]);
    gu[0].mul_(gu[1]);
    return x2 + down_.forward(gu[0])[0];
  }

 private:
  QuantMatrices qkv_, o_, gate_up_, down_;
  torch::Tensor norm1_, norm2_;
  double eps1_, eps2_;
  int64_t H_, Hk_, D_;
  double scale_;
};

// how many of torch's threads one parallel_for over n units runs on (1 where the build has no OpenMP)
int64_t threads_used(int64_t n) {
  std::vector<int> seen(size_t(std::max(1, at::get_num_threads())), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[size_t(at::get_thread_num()) % seen.size()] = 1; });
  int64_t k = 0;
  for (int v : seen) k += v;
  return k;
}

std::string isa() {
#if defined(ADASPEC_AVX512)
  return g_amx_min_rows > 0 && has_amx() ? "avx512-amx" : "avx512";
#elif defined(ADASPEC_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "adaspec's quantized weight-only linear kernels (adaspec.quant)";
  pybind11::class_<QuantMatrices>(m, "QuantMatrices")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<c10::optional<torch::Tensor>>,
                          int64_t, bool>(), pybind11::arg("weights"), pybind11::arg("qtypes"), pybind11::arg("biases"),
           pybind11::arg("in_features"), pybind11::arg("int8") = false)
      .def("forward", &QuantMatrices::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("in_features", &QuantMatrices::in_features)
      .def_property_readonly("int8", &QuantMatrices::int8);
  pybind11::class_<DecoderLayer>(m, "DecoderLayer")
      .def(pybind11::init<const QuantMatrices&, const QuantMatrices&, const QuantMatrices&, const QuantMatrices&,
                          torch::Tensor, double, torch::Tensor, double, int64_t, int64_t, int64_t, double>())
      .def("forward", &DecoderLayer::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize", &dequantize, "the float32 weights of a quantized matrix (rows: a subset)",
        pybind11::arg("weights"), pybind11::arg("qtype"), pybind11::arg("in_features"),
        pybind11::arg("rows") = pybind11::none());
  m.def("attention", &attention, "attention in a fixed order (q, k, v: [B, H, T, D]) -> [B, Q, H, D]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask") = pybind11::none(),
        pybind11::arg("scale"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rmsnorm", &rmsnorm, "RMSNorm of the last dimension", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope", &rope, "rotary embedding, [B, T, H * D] -> [B, H, T, D]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("block_elems", &block_elems);
  m.def("block_bytes", &block_bytes);
  m.def("isa", &isa);
  m.def("threads_used", &threads_used, "how many threads one parallel_for over n units runs on");
  m.def("has_vnni", &has_vnni, "whether the int8 products run AVX-512 VNNI (else plain C++)");
  m.def("has_amx", &has_amx, "whether this build and process can run the int8 products on AMX tiles");
  m.def("prefetch_bytes", [] { return g_prefetch_bytes; }, "how far ahead (bytes) the int8 products prefetch their weights (0: not, nor the float32 products their next panel)");
  m.def("set_prefetch_bytes", [](int64_t n) { g_prefetch_bytes = n; }, "prefetch the int8 products' weights n bytes ahead (0: not, nor the float32 products their next panel)");
  m.def("amx_min_rows", [] { return g_amx_min_rows; }, "inputs of at least this many rows run on AMX (0: never)");
  m.def("set_amx_min_rows", [](int64_t n) { g_amx_min_rows = n; }, "inputs of at least n rows run on AMX (0: never)");
}
