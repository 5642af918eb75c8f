// Weight-only int8 / int4 linear for x86 CPUs with AVX-512 or AVX2 + FMA (common.h's vf, kW lanes):
// y[M, N] = x[M, K] @ dequant(W)[N, K]^T.
//
// The weight is dequantised in registers (int -> fp32, times the group scale, plus the int4 offset
// term) and multiplied with float32 FMAs; activations stay float32 (bf16 input is widened once),
// so the result is float32 math on the dequantised weight, as woq_format.reference_linear.
// Quantising the activations too (VNNI) was faster past one row but made the layer a step
// function of its input: the last-ulp differences other operators show between a K+1-row
// verification and a one-row decode then flip int8 roundings and greedy speculation drifts.
// Each (row, output) dot product runs the same instruction sequence whatever M is and whichever
// rows share its tile, so row i of an M-row call equals the 1-row call bit for bit. Parallel over
// blocks of outputs (at::parallel_for); software prefetch (common.h's prefetch_stream) keeps the
// weight stream ahead of the tile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#ifndef SPECDEC_LIB
#define SPECDEC_LIB specdec_woq
#endif

namespace {

using namespace specdec_cpu_common;

// int8, one scale per group of G inputs (G % 16 == 0). Per-channel (G == K) scales once at the end.
template <int NB, int MB>
void int8_tile(const float* x, int64_t ldx, const int8_t* w, const float* scales, int64_t K, int64_t G,
               float* y, int64_t ldy) {
  vf acc[NB][MB];
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = vzero();
  const int64_t num_groups = K / G;
  const bool per_channel = num_groups == 1;
  for (int64_t g = 0; g < num_groups; ++g) {
    vf s[NB];
    for (int n = 0; n < NB; ++n) s[n] = vset1(per_channel ? 1.0f : scales[n * num_groups + g]);
    for (int64_t k = g * G; k < (g + 1) * G; k += kW) {
      prefetch_stream(w, k * NB, NB * kW);
      vf wv[NB];
      for (int n = 0; n < NB; ++n) {
        wv[n] = vload_i8(w + n * K + k);
        if (!per_channel) wv[n] = vmul(wv[n], s[n]);
      }
      for (int m = 0; m < MB; ++m) {
        const vf xv = vload(x + m * ldx + k);
        for (int n = 0; n < NB; ++n) acc[n][m] = vfmadd(wv[n], xv, acc[n][m]);
      }
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) {
      const float dot = vreduce_add(acc[n][m]);
      y[m * ldy + n] = per_channel ? dot * scales[n] : dot;
    }
}

// int4 in Q4_0 nibble order: per 32 inputs, 16 bytes, low nibble = input j, high = input j + 16.
// w = q * s + o: one FMA dequantises kW weights for all rows of the tile.
template <int NB, int MB>
void int4_tile(const float* x, int64_t ldx, const uint8_t* w, const float* scales, const float* offsets, int64_t K,
               int64_t G, float* y, int64_t ldy) {
  vf acc[NB][MB], acc_hi[NB][MB];  // two chains per dot product: inputs j and j + 16 of each block
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = acc_hi[n][m] = vzero();
  const int64_t num_groups = K / G;
  for (int64_t g = 0; g < num_groups; ++g) {
    vf s[NB], zs[NB];
    for (int n = 0; n < NB; ++n) {
      s[n] = vset1(scales[n * num_groups + g]);
      zs[n] = vset1(offsets[n * num_groups + g]);
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
      for (int h = 0; h < 16; h += kW) {  // bytes h .. h + kW - 1 of the block
        vf lo[NB], hi[NB];
        for (int n = 0; n < NB; ++n) {
          // here rather than above the n loop: gcc schedules the many-row tiles worse with it there
          if (k % 128 == 0 && h == 0 && n == 0) prefetch_stream(w, k / 2 * NB, NB * 64);
          const auto b = vload_u8_i32(w + n * (K / 2) + k / 2 + h);
          lo[n] = vfmadd(vcvt_i32(vand_i32(b, 0xF)), s[n], zs[n]);
          hi[n] = vfmadd(vcvt_i32(vsrl_i32(b, 4)), s[n], zs[n]);
        }
        for (int m = 0; m < MB; ++m) {
          const vf x0 = vload(x + m * ldx + k + h);
          const vf x1 = vload(x + m * ldx + k + 16 + h);
          for (int n = 0; n < NB; ++n) {
            acc[n][m] = vfmadd(lo[n], x0, acc[n][m]);
            acc_hi[n][m] = vfmadd(hi[n], x1, acc_hi[n][m]);
          }
        }
      }
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) y[m * ldy + n] = vreduce_add(vadd(acc[n][m], acc_hi[n][m]));
}

// bf16 weights, float32 activations and arithmetic (CPUs without bf16 dot products): a bf16 is
// the top half of a float32, so per 2 kW inputs one load gives the even inputs as floats by a
// 16-bit shift and the odd ones by a mask. The activations are reordered to match once per call
// (bf16_order_x: per 2 kW inputs, the kW even then the kW odd).
template <int NB, int MB>
void bf16_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t K, float* y, int64_t ldy) {
  vf acc[NB][MB];
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = vzero();
  for (int64_t k = 0; k < K; k += 2 * kW) {
    prefetch_stream(w, k * NB * 2, NB * 2 * kW * 2);
    vf we[NB], wo[NB];
    for (int n = 0; n < NB; ++n) {
      const auto v = vload_i32(w + n * K + k);
      we[n] = vas_float(vsll_i32(v, 16));
      wo[n] = vas_float(vand_i32(v, static_cast<int32_t>(0xFFFF0000u)));
    }
    for (int m = 0; m < MB; ++m) {
      const vf xe = vload(x + m * ldx + k), xo = vload(x + m * ldx + k + kW);
      for (int n = 0; n < NB; ++n) acc[n][m] = vfmadd(wo[n], xo, vfmadd(we[n], xe, acc[n][m]));
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) y[m * ldy + n] = vreduce_add(acc[n][m]);
}

#if defined(__AVX512F__)
// bf16 weights in pair layout, bf16 activations, bf16 dot products with float32 accumulation, for
// CPUs with avx512_bf16 (compiled for it here, called only where the CPU has it). Pair layout
// (woq_cpu.pack_bf16_pairs): [N / 16][K / 2][16][2], so one 64-byte load holds 16 outputs' weights
// for 2 consecutive inputs, and one vdpbf16ps adds both inputs' products to 16 outputs' float32
// sums, the pair's activations broadcast. Each output's sum runs over the pairs in order whatever
// M is and whichever rows share a tile, so row i of an M-row call equals the 1-row call bit for
// bit. No horizontal sums; each 16-output block is one sequential stream.
//
// Prefetch: with many rows a tile of outputs is compute-bound once its weights are in L2, but its
// first row tile waits on memory. So each row tile also prefetches its share of the next tile's
// weights (lines [pf_lo, pf_hi) from pf, one or more per step), and the memory streams while the
// arithmetic runs.
template <int NB, int MB>
__attribute__((target("avx512bf16,avx512f,avx512bw")))
void bf16_pairs_tile(const uint32_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* y, int64_t ldy,
                     const char* pf = nullptr, int64_t pf_lo = 0, int64_t pf_hi = 0) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t block = 16 * K;  // one 16-output block of the pair layout, in bf16 elements
  const int64_t pf_step = (pf_hi - pf_lo + K / 2 - 1) / (K / 2);  // lines per step
  for (int64_t p = 0; p < K / 2; ++p) {
    for (int64_t i = 0; i < pf_step && pf_lo < pf_hi; ++i, pf_lo += 1) _mm_prefetch(pf + 64 * pf_lo, _MM_HINT_T1);
    __m512i wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_loadu_si512(w + n * block + p * 32);
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(x[m * ldx + p]));
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)wv[n], (__m512bh)xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) _mm512_storeu_ps(y + m * ldy + n * 16, acc[m][n]);
}
#endif

// The last `rest` rows (rest <= R) in one tile of exactly that many rows.
template <int NB, int R, typename F>
void rest_rows(int64_t rest, int64_t m, F&& tile) {
  if constexpr (R > 0) {
    if (rest == R) tile(std::integral_constant<int, NB>{}, std::integral_constant<int, R>{}, m);
    else rest_rows<NB, R - 1>(rest, m, tile);
  }
}

// Dispatch a runtime (nb, mb) to the template instance; tiles are at most MaxNB x MaxMB.
template <int NB, int MaxMB, typename F>
void rows_loop(int64_t M, F&& tile) {
  int64_t m = 0;
  for (; m + MaxMB <= M; m += MaxMB) tile(std::integral_constant<int, NB>{}, std::integral_constant<int, MaxMB>{}, m);
  rest_rows<NB, MaxMB - 1>(M - m, m, tile);
}

template <int MaxNB, int MaxMB, typename F>
void blocks_loop(int64_t M, int64_t N, F&& tile) {
  const int64_t num_blocks = (N + MaxNB - 1) / MaxNB;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * MaxNB;
      auto at_n0 = [&](auto nb, auto mb, int64_t m0) { tile(nb, mb, n0, m0); };
      switch (std::min<int64_t>(MaxNB, N - n0)) {
        case 4: rows_loop<4, MaxMB>(M, at_n0); break;
        case 3: rows_loop<3, MaxMB>(M, at_n0); break;
        case 2: rows_loop<2, MaxMB>(M, at_n0); break;
        default: rows_loop<1, MaxMB>(M, at_n0); break;
      }
    }
  });
}

// The tile shapes: 4 outputs (independent FMA chains at one row) x 4 rows on AVX-512 (32
// registers), x 2 rows on AVX2 (16)
template <typename F>
void float_blocks(int64_t M, int64_t N, F&& tile) {
  blocks_loop<4, kW == 16 ? 4 : 2>(M, N, tile);
}

at::Tensor as_float_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.size(-1) == K, "woq linear: x has ", x.size(-1), " inputs, the weight ", K);
  return x.reshape({-1, K}).to(at::kFloat).contiguous();
}

at::Tensor finish(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes).to(x.scalar_type());
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dtype() == at::kChar && qweight.is_contiguous() && scales.dtype() == at::kFloat &&
              scales.is_contiguous(), "woq int8: int8 [N, K] weight and float32 [N, K / G] scales, contiguous");
  const int64_t N = qweight.size(0), K = qweight.size(1), G = K / scales.size(1);
  TORCH_CHECK(K % 16 == 0 && G % 16 == 0 && scales.size(1) * G == K, "woq int8: K and G must be multiples of 16");
  const at::Tensor xf = as_float_rows(x, K);
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ng = K / G;
  float_blocks(M, N, [&](auto nb, auto mb, int64_t n0, int64_t m0) {
    int8_tile<decltype(nb)::value, decltype(mb)::value>(xp + m0 * K, K, wp + n0 * K, sp + n0 * ng, K, G,
                                                       yp + m0 * N + n0, N);
  });
  return finish(y, x, N);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& offsets) {
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && scales.dtype() == at::kFloat &&
              scales.is_contiguous() && offsets.dtype() == at::kFloat && offsets.is_contiguous(),
              "woq int4: uint8 [N, K / 2] weight, float32 [N, K / G] scales and offsets, contiguous");
  const int64_t N = packed.size(0), K = 2 * packed.size(1), G = K / scales.size(1);
  TORCH_CHECK(G % 32 == 0 && scales.size(1) * G == K, "woq int4: the group size must be a multiple of 32");
  const at::Tensor xf = as_float_rows(x, K);
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ng = K / G;
  blocks_loop<2, kW == 16 ? 4 : 2>(M, N, [&](auto nb, auto mb, int64_t n0, int64_t m0) {  // 2 x 2 x MB accumulators
    int4_tile<decltype(nb)::value, decltype(mb)::value>(xp + m0 * K, K, wp + n0 * (K / 2), sp + n0 * ng,
                                                       zp + n0 * ng, K, G, yp + m0 * N + n0, N);
  });
  return finish(y, x, N);
}

// x [M, K] float32 -> per 2 kW inputs the kW even then the kW odd (bf16_tile's order)
at::Tensor bf16_order_x(const at::Tensor& xf, int64_t K) {
  return xf.view({xf.size(0), K / (2 * kW), kW, 2}).transpose(2, 3).contiguous().view({xf.size(0), K});
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dtype() == at::kBFloat16 && weight.is_contiguous(), "bf16 linear: contiguous bf16 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 32 == 0, "bf16 linear: K must be a multiple of 32");
  const at::Tensor xf = bf16_order_x(as_float_rows(x, K), K);
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  float* yp = y.data_ptr<float>();
  float_blocks(M, N, [&](auto nb, auto mb, int64_t n0, int64_t m0) {
    bf16_tile<decltype(nb)::value, decltype(mb)::value>(xp + m0 * K, K, wp + n0 * K, K, yp + m0 * N + n0, N);
  });
  specdec_cpu_common::add_bias(y, bias);
  return finish(y, x, N);
}

#if defined(__AVX512F__)
// y = x @ W^T (+ bias) for a bf16 weight in pair layout [N, K] (N % 16 == 0, K % 32 == 0): x rounded to
// bf16, float32 sums; the result in x's dtype.
at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dtype() == at::kBFloat16 && weight.is_contiguous() && weight.dim() == 2,
              "bf16 pairs linear: contiguous bf16 [N, K] weight in pair layout");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "bf16 pairs linear: N must be a multiple of 16 and K of 32");
  TORCH_CHECK(x.size(-1) == K, "bf16 pairs linear: x has ", x.size(-1), " inputs, the weight ", K);
  const at::Tensor xb = x.reshape({-1, K}).to(at::kBFloat16).contiguous();
  const int64_t M = xb.size(0);
  at::Tensor y = at::empty({M, N}, xb.options().dtype(at::kFloat));
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  float* yp = y.data_ptr<float>();
  // blocks of outputs counted in 16-output vectors: 4 vectors x 6 rows per tile (24 sums); from
  // kPrefetchRows rows on, each row tile prefetches its share (m0 / M ..) of the next block's weights
  constexpr int64_t kPrefetchRows = 20;
  const int64_t nv = N / 16, block_lines = 16 * K * 2 / 64;  // 64-byte lines of one 16-output vector
  blocks_loop<4, 6>(M, nv, [&](auto nb, auto mb, int64_t v0, int64_t m0) {
    const int64_t next = v0 + 4, lines = M >= kPrefetchRows ? std::min<int64_t>(4, nv - next) * block_lines : 0;
    const char* pf = lines > 0 ? reinterpret_cast<const char*>(wp + next * 16 * K) : nullptr;
    bf16_pairs_tile<decltype(nb)::value, decltype(mb)::value>(xp + m0 * (K / 2), K / 2, wp + v0 * 16 * K, K,
                                                              yp + m0 * N + v0 * 16, N, pf, lines * m0 / M,
                                                              lines * (m0 + decltype(mb)::value) / M);
  });
  specdec_cpu_common::add_bias(y, bias);
  return finish(y, x, N);
}
#endif

TORCH_LIBRARY(SPECDEC_LIB, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor", &int8_linear);
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets) -> Tensor", &int4_linear);
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", &bf16_linear);
#if defined(__AVX512F__)
  m.def("bf16_pairs_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", &bf16_pairs_linear);
#endif
}
