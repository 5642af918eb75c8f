// int8 / int4 weight linear for x86 CPUs with AVX-512 VNNI: y[M, N] = x[M, K] @ W[N, K]^T.
//
// The function computed is specdec/kernels/woq_format.py's ``reference_linear``: each row of x is
// quantised to int8 on its own (symmetric, scale max|x| / 127, round half to even), the integer
// dot products of each weight group are exact (VNNI ``vpdpbusd``: u8 activations = q + 128 times
// s8 weights, the +128 taken back by a per-group weight sum folded into the accumulator's start
// value), and each group's integer sum is scaled in float32. A row's result never depends on the
// other rows of the call, so row i of an M-row call equals the 1-row call bit for bit.
//
// Layout per chunk of 64 inputs: int8 weights in input order; int4 weights in Q4_0 nibble order
// (16 bytes per block of 32: low nibble = input j, high = input j + 16), unpacked as
// [0-15, 32-47, 16-31, 48-63], so the int4 kernel reads its activations permuted the same way.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

#ifndef WOQ_NB
#define WOQ_NB 2
#define WOQ_MB 4
#define WOQ_PREFETCH 2048
#endif
constexpr int kNB = WOQ_NB;  // outputs per block
constexpr int kMB = WOQ_MB;  // rows per tile: kNB * kMB integer and float accumulators in registers

struct Args {
  const uint8_t* xq;  // [M, K] activations + 128 (int4: permuted per 64)
  const float* xs;    // [M] activation scales
  const void* w;      // int8 [N, K] or uint8 [N, K / 2]
  const float* ws;    // [N, K / G] weight scales
  const int32_t* init;  // [N, K / G] -128 * sum of the group's signed weights
  const uint8_t* wz;  // [N, K / G] int4 zero points (unused for int8)
  int64_t K, G;
  float* y;
  int64_t N;
};

// The 64 signed weights of output n at chunk k: int8 as stored; int4 unpacked minus zero points.
template <bool INT4, bool SPLIT>
inline __m512i load_weights(const Args& a, int64_t n, int64_t k, int64_t g) {
  if (!INT4) return _mm512_loadu_si512(static_cast<const int8_t*>(a.w) + n * a.K + k);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(a.w) + n * (a.K / 2) + k / 2));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
  const int64_t ng = a.K / a.G;
  const uint8_t* z = a.wz + n * ng + g;
  __m512i zv = _mm512_set1_epi8(static_cast<char>(z[0]));
  if (SPLIT) zv = _mm512_mask_blend_epi8(0xFFFF0000FFFF0000ULL, zv, _mm512_set1_epi8(static_cast<char>(z[1])));
  return _mm512_sub_epi8(q, zv);
}

// Group a of a split chunk (G == 32) owns int8 lanes 0-7 / int4 lanes 0-3 and 8-11.
template <bool INT4>
constexpr __mmask16 kGroupB = INT4 ? 0xF0F0 : 0xFF00;
template <bool INT4>
constexpr int kGroupBLane = INT4 ? 4 : 8;

template <bool INT4, bool SPLIT, int MB>
void tile(const Args& a, int64_t n0, int64_t m0) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  const int64_t chunks_per_group = SPLIT ? 1 : G / 64;
  __m512 facc[kNB][MB];
  for (int n = 0; n < kNB; ++n)
    for (int m = 0; m < MB; ++m) facc[n][m] = _mm512_setzero_ps();
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += 64 * chunks_per_group, g += SPLIT ? 2 : 1) {
    __m512i start[kNB];
    __m512 scale[kNB];
    for (int n = 0; n < kNB; ++n) {
      const int32_t* init = a.init + (n0 + n) * ng + g;
      const float* ws = a.ws + (n0 + n) * ng + g;
      start[n] = _mm512_maskz_set1_epi32(1, init[0]);
      scale[n] = _mm512_set1_ps(ws[0]);
      if (SPLIT) {
        start[n] = _mm512_mask_set1_epi32(start[n], 1 << kGroupBLane<INT4>, init[1]);
        scale[n] = _mm512_mask_blend_ps(kGroupB<INT4>, scale[n], _mm512_set1_ps(ws[1]));
      }
    }
    __m512i iacc[kNB][MB];
    for (int n = 0; n < kNB; ++n)
      for (int m = 0; m < MB; ++m) iacc[n][m] = start[n];
    for (int64_t c = 0; c < chunks_per_group; ++c) {
      const int64_t k = k0 + 64 * c;
      __m512i w[kNB];
      for (int n = 0; n < kNB; ++n) {
        // the hardware prefetcher alone leaves a memory-bound stream idle while the tile computes
        const uint8_t* row = static_cast<const uint8_t*>(a.w) + (n0 + n) * (INT4 ? K / 2 : K) + (INT4 ? k / 2 : k);
        _mm_prefetch(reinterpret_cast<const char*>(row + WOQ_PREFETCH), _MM_HINT_T0);
        w[n] = load_weights<INT4, SPLIT>(a, n0 + n, k, g);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512i x = _mm512_loadu_si512(a.xq + (m0 + m) * K + k);
        for (int n = 0; n < kNB; ++n) iacc[n][m] = _mm512_dpbusd_epi32(iacc[n][m], x, w[n]);
      }
    }
    for (int n = 0; n < kNB; ++n)
      for (int m = 0; m < MB; ++m) facc[n][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[n][m]), scale[n], facc[n][m]);
  }
  for (int n = 0; n < kNB; ++n)
    for (int m = 0; m < MB; ++m) a.y[(m0 + m) * a.N + n0 + n] = a.xs[m0 + m] * _mm512_reduce_add_ps(facc[n][m]);
}

// The remainder tile of `rem` < kMB rows, dispatched to its compile-time size.
template <bool INT4, bool SPLIT, int R>
void tail(const Args& a, int64_t n0, int64_t m0, int64_t rem) {
  if constexpr (R > 0) {
    if (rem == R) tile<INT4, SPLIT, R>(a, n0, m0);
    else tail<INT4, SPLIT, R - 1>(a, n0, m0, rem);
  }
}

template <bool INT4, bool SPLIT>
void run(const Args& a, int64_t M) {
  // N is a multiple of kNB (checked); rows go in tiles of kMB, then the remainder
  at::parallel_for(0, a.N / kNB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t m = 0;
      for (; m + kMB <= M; m += kMB) tile<INT4, SPLIT, kMB>(a, b * kNB, m);
      tail<INT4, SPLIT, kMB - 1>(a, b * kNB, m, M - m);
    }
  });
}

// Row-wise int8 quantisation, the same float operations as woq_format.quantize_activations
// (max is exact in any order; cvtps_epi32 rounds half to even, as torch.round). K % 64 == 0.
void quantize_rows(const float* x, int64_t M, int64_t K, bool permute, uint8_t* xq, float* xs) {
  static constexpr int kInt4Order[4] = {0, 2, 1, 3};  // where each 16 of a chunk of 64 goes
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    const float amax = _mm512_reduce_max_ps(vmax);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    xs[m] = amax / 127.0f;
    uint8_t* out = xq + m * K;
    for (int64_t k = 0; k < K; k += 16) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), inv));
      q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127)),
                           _mm512_set1_epi32(128));
      const int64_t dst = permute ? k - k % 64 + 16 * kInt4Order[(k % 64) / 16] : k;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + dst), _mm512_cvtepi32_epi8(q));
    }
  }
}

}  // namespace

at::Tensor woq_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const at::Tensor& init, const at::Tensor& zeros, int64_t K) {
  const bool int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK(weight.is_contiguous() && (int4 || weight.scalar_type() == at::kChar), "woq: int8 / uint8 weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && init.scalar_type() == at::kInt &&
              init.is_contiguous() && init.sizes() == scales.sizes(), "woq: float32 scales, int32 group sums");
  TORCH_CHECK(!int4 || (zeros.scalar_type() == at::kByte && zeros.sizes() == scales.sizes() && zeros.is_contiguous()),
              "woq: uint8 zero points for int4");
  const int64_t N = weight.size(0), G = K / scales.size(1);
  TORCH_CHECK(K % 64 == 0 && scales.size(1) * G == K && (G == 32 || G % 64 == 0) && N % kNB == 0,
              "woq: K a multiple of 64, group size 32 or a multiple of 64, N a multiple of ", kNB);
  TORCH_CHECK(x.size(-1) == K, "woq: x has ", x.size(-1), " inputs, the weight ", K);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor xq = at::empty({M, K}, xf.options().dtype(at::kByte));
  at::Tensor xs = at::empty({M}, xf.options());
  quantize_rows(xf.data_ptr<float>(), M, K, int4, xq.data_ptr<uint8_t>(), xs.data_ptr<float>());
  at::Tensor y = at::empty({M, N}, xf.options());
  const Args a{xq.data_ptr<uint8_t>(), xs.data_ptr<float>(), weight.data_ptr(), scales.data_ptr<float>(),
               init.data_ptr<int32_t>(), int4 ? zeros.data_ptr<uint8_t>() : nullptr, K, G, y.data_ptr<float>(), N};
  if (int4) {
    G == 32 ? run<true, true>(a, M) : run<true, false>(a, M);
  } else {
    G == 32 ? run<false, true>(a, M) : run<false, false>(a, M);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes).to(x.scalar_type());
}

at::Tensor quantize_activations(const at::Tensor& x, bool permute) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  TORCH_CHECK(K % 64 == 0, "woq: K a multiple of 64");
  at::Tensor xq = at::empty({M, K}, xf.options().dtype(at::kByte));
  at::Tensor xs = at::empty({M, 1}, xf.options());
  quantize_rows(xf.data_ptr<float>(), M, K, permute, xq.data_ptr<uint8_t>(), xs.data_ptr<float>());
  return at::cat({xs, xq.to(at::kFloat)}, 1);  // [M, 1 + K]: the scale, then q + 128 (for the tests)
}

TORCH_LIBRARY(specdec_woq, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor scales, Tensor init, Tensor zeros, int K) -> Tensor", &woq_linear);
  m.def("quantize_activations(Tensor x, bool permute) -> Tensor", &quantize_activations);
}
