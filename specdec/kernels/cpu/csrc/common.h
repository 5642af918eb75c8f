// Small pieces more than one of specdec's CPU kernels use (each kernel is its own extension, built
// from its .cpp; this header is included, not built).
//   vf, kW, v*(...)     one float32 SIMD register of kW lanes and its operations: AVX-512 (kW 16)
//                       where __AVX512F__ is on, else AVX2 + FMA (kW 8); the kernels written on
//                       them compile for either
//   exp_ps(x)           exp, x clamped to [-87, 88]: the same instructions for every element
//   rotate_half(...)    one head's rotate-half rotary
//   silu_mul_row(...)   silu(gate) * up over one row
//   add_bias(y, bias)   y [M, N] += bias [N], row by row
//   prefetch_stream(...) a weight tile's rows read as one sequential stream, prefetched ahead
//   TileConfig          an AMX tile configuration (palette 1), filled by set() and loaded by load()
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace specdec_cpu_common {

#if defined(__AVX512F__)
constexpr int kW = 16;
using vf = __m512;
using vmask = __mmask16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float v) { return _mm512_set1_ps(v); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vmask vtail(int64_t n) { return static_cast<vmask>((1u << n) - 1); }  // the first n lanes, n < kW
inline vf vload_mask(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore_mask(vmask m, float* p, vf v) { _mm512_mask_storeu_ps(p, m, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vreduce_add(vf v) { return _mm512_reduce_add_ps(v); }
// kW int8 / uint8 values widened to floats
inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512i vload_u8_i32(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vf vcvt_i32(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512i vand_i32(__m512i v, int32_t m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
inline __m512i vsrl_i32(__m512i v, int n) { return _mm512_srli_epi32(v, n); }
inline __m512i vsll_i32(__m512i v, int n) { return _mm512_slli_epi32(v, n); }
inline __m512i vload_i32(const void* p) { return _mm512_loadu_si512(p); }
inline vf vas_float(__m512i v) { return _mm512_castsi512_ps(v); }
#elif defined(__AVX2__)
constexpr int kW = 8;
using vf = __m256;
using vmask = __m256i;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float v) { return _mm256_set1_ps(v); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vmask vtail(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vload_mask(vmask m, const float* p) { return _mm256_maskload_ps(p, m); }
inline void vstore_mask(vmask m, float* p, vf v) { _mm256_maskstore_ps(p, m, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
// a fixed order: the halves, then pairs, then the last two
inline float vreduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256i vload_u8_i32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vf vcvt_i32(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i vand_i32(__m256i v, int32_t m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
inline __m256i vsrl_i32(__m256i v, int n) { return _mm256_srli_epi32(v, n); }
inline __m256i vsll_i32(__m256i v, int n) { return _mm256_slli_epi32(v, n); }
inline __m256i vload_i32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline vf vas_float(__m256i v) { return _mm256_castsi256_ps(v); }
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// 2^k * P(r), x = k ln2 + r, |r| <= ln2 / 2 (Cephes expf coefficients): the same instructions for
// every element
inline vf exp_ps(vf x) {
#if defined(__AVX512F__)
  x = _mm512_min_ps(_mm512_max_ps(x, vset1(-87.0f)), vset1(88.0f));
  const vf k = _mm512_roundscale_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  x = _mm256_min_ps(_mm256_max_ps(x, vset1(-87.0f)), vset1(88.0f));
  const vf k = _mm256_round_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  vf r = vfmadd(k, vset1(-0.693359375f), x);
  r = vfmadd(k, vset1(2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  p = vfmadd(vmul(p, r), r, vadd(r, vset1(1.0f)));
#if defined(__AVX512F__)
  return _mm512_scalef_ps(p, k);
#else
  // 2^k as a float (k in [-126, 127] after the clamp), then one exact multiply: as scalef
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return vmul(p, _mm256_castsi256_ps(e));
#endif
}
#endif

// o = x rotated by one position's cos / sin [D/2] (rotate-half layout: pairs (i, i + D/2))
inline void rotate_half(const float* x, const float* c, const float* s, float* o, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    o[i] = x[i] * c[i] - x[half + i] * s[i];
    o[half + i] = x[half + i] * c[i] + x[i] * s[i];
  }
}

// o[i] = silu(g[i]) * u[i]; the same per-element arithmetic whatever n or the element's place
// (cpu_ops' silu_mul and the MoE kernel's activation, which must agree bit for bit)
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
#if defined(__AVX512F__) || defined(__AVX2__)
  auto silu_mul = [](vf gv, vf uv) { return vmul(vdiv(gv, vadd(vset1(1.0f), exp_ps(vsub(vzero(), gv)))), uv); };
  int64_t i = 0;
  for (; i + kW <= n; i += kW) vstore(o + i, silu_mul(vload(g + i), vload(u + i)));
  if (i < n) {
    const vmask m = vtail(n - i);
    vstore_mask(m, o + i, silu_mul(vload_mask(m, g + i), vload_mask(m, u + i)));
  }
#else
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#endif
}

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int64_t kStreamAhead = 16384;  // bytes

// A tile of a row-major weight reads its NB adjacent rows together, `bytes` of them per step, the
// step starting `offset` bytes into the tile's block of rows (its first row at `tile`): prefetch
// as many bytes kStreamAhead further, into L2, so the memory sees one sequential stream per
// thread (each row's own stream, a few hundred bytes to a few KB, is too short for the hardware
// prefetcher to follow). Prefetches past the end of the weight are harmless hints.
inline void prefetch_stream(const void* tile, int64_t offset, int64_t bytes) {
  const char* p = static_cast<const char*>(tile) + kStreamAhead + offset;
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
}
#endif

#if defined(__AMX_TILE__)
// The 64-byte operand of ldtilecfg: palette 1, then each tile's bytes per row and rows (unset tiles
// are zero: unused).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int num_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(num_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }

  // Not _tile_loadconfig: gcc 12 declares its operand an 8-byte read, so the stores of rows and
  // colsb before it may be dropped as dead (the first tile instruction then faults); the asm's
  // operand is the whole struct.
  void load() const { asm volatile("ldtilecfg %0" : : "m"(*this)); }
};
#endif

inline void add_bias(at::Tensor& y, const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return;
  const int64_t M = y.size(0), N = y.size(1);
  TORCH_CHECK(bias->numel() == N, "linear: bias has ", bias->numel(), " elements, the output ", N);
  const at::Tensor b = bias->to(at::kFloat).contiguous();
  const float* bp = b.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) yp[m * N + n] += bp[n];
}

}  // namespace specdec_cpu_common
