// Fused float32 CPU ops for the decoder's small per-layer steps: at batch 1 each of them is a
// few hundred floats, so what costs is the number of ATen ops (F.rms_norm alone is six), not the
// arithmetic. Each row is computed by itself in a fixed order (the same whatever the number of
// rows), so a row's result never depends on its batch.
//   add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual) * weight, x + residual)
//   rms_norm(x, weight, eps)
//   rotate(x [T, H, D] (rows may be strided), cos [T, 1, D/2], sin) -> rotate-half rotary
//   silu_mul(x [..., 2I]) -> silu(x[..., :I]) * x[..., I:] (the gated MLP's activation)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <cmath>

namespace {

constexpr int64_t kGrainRows = 16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.device().is_cpu(), "cpu_ops: ", name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, "cpu_ops: ", name, " must be contiguous in its last dim");
}

inline float row_inv_rms(const float* v, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += v[i] * v[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

}  // namespace

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                     double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_rows(weight, "weight");
  const int64_t n = x.size(-1);
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.numel() == n, "cpu_ops.add_rms_norm: shapes differ");
  const at::Tensor xc = x.reshape({-1, n}).contiguous(), rc = residual.reshape({-1, n}).contiguous();
  const int64_t rows = xc.size(0);
  at::Tensor out = at::empty_like(xc), sum = at::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *rp = rc.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = sum.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = xp[r * n + i] + rp[r * n + i];
      const float inv = row_inv_rms(s, n, e);
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = wp[i] * (s[i] * inv);
    }
  });
  return {out.view(x.sizes()), sum.view(x.sizes())};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n, "cpu_ops.rms_norm: weight has ", weight.numel(), " elements, x rows ", n);
  const at::Tensor xc = x.reshape({-1, n}).contiguous();
  const int64_t rows = xc.size(0);
  at::Tensor out = at::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float inv = row_inv_rms(xp + r * n, n, e);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) op[r * n + i] = wp[i] * (xp[r * n + i] * inv);
    }
  });
  return out.view(x.sizes());
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 3 && x.stride(2) == 1, "cpu_ops.rotate: x [T, H, D] float32");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.dtype() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * half &&
              sin.numel() == T * half, "cpu_ops.rotate: cos / sin [T, 1, D/2] float32, contiguous");
  at::Tensor out = at::empty({T, H, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * half, *s = sp + t * half;
      for (int64_t h = 0; h < H; ++h) {
        const float* a = xp + t * st + h * sh;
        specdec_cpu_common::rotate_half(a, c, s, op + (t * H + h) * D, half);
      }
    }
  });
  return out;
}

// x [..., 2I] (gate, then up) -> silu(gate) * up [..., I]
at::Tensor silu_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t n = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * n, "cpu_ops.silu_mul: an even last dim (gate, up)");
  const at::Tensor xc = x.reshape({-1, 2 * n}).contiguous();
  const int64_t rows = xc.size(0);
  at::Tensor out = at::empty({rows, n}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * 2 * n;
      specdec_cpu_common::silu_mul_row(g, g + n, op + r * n, n);
    }
  });
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

TORCH_LIBRARY(specdec_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor[]", &add_rms_norm);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("rotate(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rotate);
  m.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
}
