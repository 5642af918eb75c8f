// The float scaling of one unit's integer sums, the same instructions in the same order in every tile
// of the int8-activation kernel (woq_a8.cpp, woq_a8_variants.h): that order is what makes the tiles
// equal bit for bit. Included inside woq_a8.cpp's namespace.
//
//   int8: f + sum * (ws * xs)
//   int4: f + sum * (ws * xs) + wo * xsx
//
// sum: the unit's integer sums of one row as floats (exact); sv, ov: the group's scales and (int4)
// offsets of the tile's outputs; xs[i], xsx[i]: the row's scale and (int4) xs * its sum of q at the
// unit's activation block (xsx is read for int4 only: int8 activations have none).
#pragma once

#if defined(__AVX512F__)
template <bool INT4>
__attribute__((always_inline)) inline __m512 scale_unit(__m512 f, __m512 sum, __m512 sv, __m512 ov, const float* xs,
                                                       const float* xsx, int64_t i) {
  f = _mm512_fmadd_ps(sum, _mm512_mul_ps(sv, _mm512_set1_ps(xs[i])), f);
  return INT4 ? _mm512_fmadd_ps(ov, _mm512_set1_ps(xsx[i]), f) : f;
}
#endif

template <bool INT4>
__attribute__((always_inline)) inline __m256 scale_unit(__m256 f, __m256 sum, __m256 sv, __m256 ov, const float* xs,
                                                       const float* xsx, int64_t i) {
  f = _mm256_fmadd_ps(sum, _mm256_mul_ps(sv, _mm256_set1_ps(xs[i])), f);
  return INT4 ? _mm256_fmadd_ps(ov, _mm256_set1_ps(xsx[i]), f) : f;
}
