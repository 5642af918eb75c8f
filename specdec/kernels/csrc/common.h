// Small pieces more than one of specdec's CPU kernels use (each kernel is its own extension, built
// from its .cpp; this header is included, not built).
//   exp_ps(x)           AVX-512 exp, x clamped to [-87, 88] (where __AVX512F__ is on)
//   rotate_half(...)    one head's rotate-half rotary
//   add_bias(y, bias)   y [M, N] += bias [N], row by row
#pragma once

#include <torch/extension.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace specdec_cpu_common {

#ifdef __AVX512F__
// 2^k * P(r), x = k ln2 + r, |r| <= ln2 / 2 (Cephes expf coefficients): the same instructions for
// every element
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
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
