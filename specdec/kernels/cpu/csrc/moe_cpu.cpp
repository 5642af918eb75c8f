// Mixture-of-experts feed-forward of int8-activation experts (w4a8 / w8a8) in one call per layer:
//   out[t] = sum over j of w[t, j] * down(silu_mul(gate_up(x[t]))) of expert ids[t, j]
// with every expert's gate_up [2I, H] and down [H, I] stacked in woq_a8.cpp's layout ([E, N padded
// to 16, ...], woq_cpu.A8Weight per expert). At batch 1 a layer's experts otherwise cost a few
// ATen dispatches each (quantize, linear, activation, linear, scale, add): here the whole layer
// is four phases in one call, each over all touched experts at once.
//   1. pairs (row, choice) grouped by expert, stable (a counting sort); each touched expert's rows
//      gathered as quantized activations (woq_a8.cpp's quantize_row, once per row of x)
//   2. gate_up of every touched expert, in parallel over (expert, block of 16 outputs)
//   3. silu_mul, then the down projection's activation quantization, in parallel over pairs
//   4. down of every touched expert, in parallel over (expert, block); each output scaled by its
//      pair's routing weight, then summed into out[t] in increasing expert id (one thread)
// Every product and sum is the one layers.moe.grouped_experts makes through the per-expert ops
// (a8_linear's tiles, cpu_ops' silu_mul arithmetic, one rounded multiply, then the adds in expert
// order), so the result equals the Python path bit for bit, and a row's result does not depend on
// the rows beside it (the kernel's row-consistency). AMX tiles (where built with -mamx-int8) run an
// expert whose row count reaches the caller's threshold, as WeightOnlyLinear picks per call: both
// paths give the same values bit for bit.
//
// The int8-activation kernel is compiled into this extension from its own source (the include
// below; its ops register under this extension's namespace too), so the tiles are that kernel's
// code, not a copy.
#include "woq_a8.cpp"

#include <ATen/ops/zeros.h>

#include <tuple>
#include <vector>

namespace {

// One of the layer's stacked linears: expert 0's kernel arguments (activations and outputs unset)
// and the strides to expert e's.
struct Stacked {
  Args base;
  bool int4;
  int sf;
  int64_t amx_min_rows;  // 0: never AMX
  int64_t w_bytes, s_bytes, sup_floats;

  bool amx(int64_t rows) const { return amx_min_rows > 0 && rows >= amx_min_rows; }
  bool s8(int64_t rows) const { return int4 || amx(rows); }  // activations as s8 (else VNNI int8's u8)

  Args expert(int64_t e, const uint8_t* xq, const float* xs, const float* xsx, float* y) const {
    Args a = base;
    a.w += e * w_bytes;
    a.ws = static_cast<const char*>(a.ws) + e * s_bytes;
    if (a.wo != nullptr) a.wo = static_cast<const char*>(a.wo) + e * s_bytes;
    if (a.ws_sup != nullptr) a.ws_sup += e * sup_floats;
    if (a.wo_sup != nullptr) a.wo_sup += e * sup_floats;
    a.xq = xq;
    a.xs = xs;
    a.xsx = xsx;
    a.y = y;
    return a;
  }
};

Stacked stack_of(const at::Tensor& w, const at::Tensor& s, const at::Tensor& o, const at::Tensor& s_sup,
                 const at::Tensor& o_sup, int64_t K, int64_t N, int64_t amx_min_rows) {
  TORCH_CHECK(w.dim() == 3 && s.dim() == 3 && w.size(0) == s.size(0), "moe a8: stacked [E, ...] weights and scales");
  const bool int4 = w.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || w.scalar_type() == at::kChar, "moe a8: int8 or packed uint8 int4 weights");
  const int sf = scale_format(s);
  const bool two = sf == kTwoLevel;
  const at::Tensor none;
  check_shapes(w[0], s[0], int4 ? o[0] : none, two ? s_sup[0] : none, two && int4 ? o_sup[0] : none, K, N, int4);
  TORCH_CHECK(w.is_contiguous() && s.is_contiguous() && (!int4 || (o.is_contiguous() && o.sizes() == s.sizes())) &&
              (!two || (s_sup.is_contiguous() && s_sup.size(0) == w.size(0))),
              "moe a8: contiguous stacked tensors, one [E] entry per expert");
#if !defined(__AMX_INT8__)
  amx_min_rows = 0;
#endif
  const int64_t G = K / s.size(2);
  Stacked st{Args{nullptr, nullptr, nullptr, static_cast<const uint8_t*>(w.data_ptr()), s.data_ptr(),
                  int4 ? o.data_ptr() : nullptr, two ? s_sup.data_ptr<float>() : nullptr,
                  two && int4 ? o_sup.data_ptr<float>() : nullptr, K, G, two ? K / s_sup.size(2) : K, N,
                  std::min<int64_t>(G, kABlock), K / G, two ? s_sup.size(2) : 0, K / kABlock,
                  kBlock * (int4 ? K / 2 : K), nullptr},
             int4, sf, amx_min_rows, w.stride(0), s.stride(0) * s.element_size(), two ? s_sup.stride(0) : 0};
  return st;
}

// rows 0 .. M - 1 of block blk of one expert, in passes of kMaxRows (the VNNI / AVX2 tiles)
template <bool INT4, int SF>
void rows_tile(const Args& a, int64_t blk, int64_t M) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    Args p = a;
    p.xq += m0 * a.K;
    p.xs += m0 * a.nab;
    p.xsx += m0 * a.nab;
    p.y += m0 * a.N;
    switch (std::min<int64_t>(kMaxRows, M - m0)) {
      case 1: tile<INT4, SF, 1>(p, blk); break;
      case 2: tile<INT4, SF, 2>(p, blk); break;
      case 3: tile<INT4, SF, 3>(p, blk); break;
      case 4: tile<INT4, SF, 4>(p, blk); break;
      case 5: tile<INT4, SF, 5>(p, blk); break;
      case 6: tile<INT4, SF, 6>(p, blk); break;
      case 7: tile<INT4, SF, 7>(p, blk); break;
      case 8: tile<INT4, SF, 8>(p, blk); break;
      case 9: tile<INT4, SF, 9>(p, blk); break;
      default: break;
    }
  }
}

using RowsTile = void (*)(const Args&, int64_t, int64_t);

template <bool INT4>
RowsTile rows_tile_for(int sf) {
  return sf == kF32 ? &rows_tile<INT4, kF32> : sf == kF16 ? &rows_tile<INT4, kF16> : &rows_tile<INT4, kTwoLevel>;
}

#if defined(__AMX_INT8__)
// rows 0 .. M - 1 of block blk through AMX tiles: run_amx_format's per-block steps (inputs in chunks
// whose B operands stay in L1, 16-row passes, the last one ending at row M); `configured`: the row
// count this thread's tiles are configured for (-1: none yet)
template <bool INT4, int SF>
void rows_tile_amx(const Args& a, int64_t blk, int64_t M, int& configured) {
  const int64_t chunks = (16 * a.K + kAmxChunkBytes - 1) / kAmxChunkBytes;
  const int64_t chunk = ((a.K + chunks - 1) / chunks + 63) / 64 * 64;
  thread_local std::vector<uint8_t> unpacked;
  thread_local std::vector<float> acc;
  if (INT4 && static_cast<int64_t>(unpacked.size()) < 16 * chunk) unpacked.resize(16 * chunk);
  if (static_cast<int64_t>(acc.size()) < 16 * M) acc.resize(16 * M);
  const int rows = static_cast<int>(std::min(M, kAmxRows));
  if (rows != configured) {
    configure_a8(rows, static_cast<int>(a.E));
    configured = rows;
  }
  const uint8_t* wp = a.w + blk * a.blk_bytes;
  for (int64_t kb = 0; kb < a.K; kb += chunk) {
    const int64_t ke = std::min(a.K, kb + chunk);
    const uint8_t* b = wp + 16 * kb;
    if (INT4) {
      unpack_int4(wp, kb, ke, unpacked.data());
      b = unpacked.data();
    }
    if (M < kAmxRows) {
      tile_amx<INT4, SF, false>(a, blk, 0, rows, kb, ke, b, acc.data(), 0);
      continue;
    }
    for (int64_t r = 0; r < M; r += kAmxRows) {
      const int64_t r0 = std::min(r, M - kAmxRows);
      tile_amx<INT4, SF, true>(a, blk, r0, kAmxRows, kb, ke, b, acc.data() + 16 * r0, static_cast<int>(r - r0));
    }
  }
}

using RowsTileAmx = void (*)(const Args&, int64_t, int64_t, int&);

template <bool INT4>
RowsTileAmx rows_tile_amx_for(int sf) {
  return sf == kF32 ? &rows_tile_amx<INT4, kF32> : sf == kF16 ? &rows_tile_amx<INT4, kF16>
                                                              : &rows_tile_amx<INT4, kTwoLevel>;
}
#endif

// The step's pairs grouped by expert: pairs of touched expert i (in increasing id) are
// order[start[i] .. start[i] + count[i]), each in its row-major (row, choice) order.
struct Groups {
  std::vector<int64_t> order, expert, start, count;
};

Groups group_pairs(const at::Tensor& ids, int64_t num_experts) {
  const int64_t P = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> per(num_experts, 0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "moe a8: expert id ", id[p], " outside [0, ", num_experts, ")");
    ++per[id[p]];
  }
  Groups g;
  std::vector<int64_t> next(num_experts, 0);
  int64_t at = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (per[e] == 0) continue;
    g.expert.push_back(e);
    g.start.push_back(at);
    g.count.push_back(per[e]);
    next[e] = at;
    at += per[e];
  }
  g.order.resize(P);
  for (int64_t p = 0; p < P; ++p) g.order[next[id[p]]++] = p;
  return g;
}

// Quantized activations of P gathered rows: [P, K] bytes, [P, K / 32] block scales and xs * sums.
struct Gathered {
  at::Tensor q, xs, xsx;
  Gathered(int64_t P, int64_t K, const at::TensorOptions& f)
      : q(at::empty({P, K}, f.dtype(at::kByte))), xs(at::empty({P, K / kABlock}, f)),
        xsx(at::empty({P, K / kABlock}, f)) {}
  uint8_t* q_row(int64_t i) { return q.data_ptr<uint8_t>() + i * q.size(1); }
  float* xs_row(int64_t i) { return xs.data_ptr<float>() + i * xs.size(1); }
  float* xsx_row(int64_t i) { return xsx.data_ptr<float>() + i * xsx.size(1); }
};

// one linear over every touched expert: expert i's rows are rows start[i] .. of `in` and `out`
// (`out` row stride N); `scale`: each output row times its pair's routing weight after the tile
void run_experts(const Stacked& st, const Groups& g, Gathered& in, float* out, const float* scale) {
  const int64_t blocks = (st.base.N + kBlock - 1) / kBlock, N = st.base.N;
  const int64_t units = static_cast<int64_t>(g.expert.size()) * blocks;
  const RowsTile vnni = st.int4 ? rows_tile_for<true>(st.sf) : rows_tile_for<false>(st.sf);
#if defined(__AMX_INT8__)
  const RowsTileAmx amx = st.int4 ? rows_tile_amx_for<true>(st.sf) : rows_tile_amx_for<false>(st.sf);
#endif
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    int configured = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t i = u / blocks, blk = u % blocks, s = g.start[i], M = g.count[i];
      const Args a = st.expert(g.expert[i], in.q_row(s), in.xs_row(s), in.xsx_row(s), out + s * N);
#if defined(__AMX_INT8__)
      if (st.amx(M)) amx(a, blk, M, configured);
      else vnni(a, blk, M);
#else
      vnni(a, blk, M);
#endif
      if (scale == nullptr) continue;
      const int64_t n0 = blk * kBlock, n1 = std::min(N, n0 + kBlock);
      for (int64_t m = 0; m < M; ++m) {
        const float w = scale[g.order[s + m]];
        float* y = out + (s + m) * N;
        for (int64_t n = n0; n < n1; ++n) y[n] *= w;
      }
    }
#if defined(__AMX_INT8__)
    if (configured >= 0) _tile_release();
#endif
  });
}

}  // namespace

// x [T, H] float32, expert_ids [T, k] int64, weights [T, k] float32; gate_up (w13 ...) [E, 2I padded,
// ...], down (w2 ...) [E, H padded, ...] stacked A8Weight tensors (unused offsets / factors: empty).
// -> (out [T, H] float32, the number of distinct experts read)
std::tuple<at::Tensor, int64_t> moe_a8(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                                       const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& o13,
                                       const at::Tensor& s13_sup, const at::Tensor& o13_sup, const at::Tensor& w2,
                                       const at::Tensor& s2, const at::Tensor& o2, const at::Tensor& s2_sup,
                                       const at::Tensor& o2_sup, int64_t intermediate, int64_t amx13_min_rows,
                                       int64_t amx2_min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "moe a8: x [T, H] float32");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0) && expert_ids.scalar_type() == at::kLong &&
              expert_ids.is_contiguous(), "moe a8: expert_ids [T, k] int64");
  TORCH_CHECK(weights.sizes() == expert_ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moe a8: routing weights [T, k] float32");
  const int64_t T = x.size(0), H = x.size(1), k = expert_ids.size(1), P = T * k, I = intermediate;
  TORCH_CHECK(w13.size(0) == w2.size(0), "moe a8: as many gate_up as down experts");
  const Stacked up = stack_of(w13, s13, o13, s13_sup, o13_sup, H, 2 * I, amx13_min_rows);
  const Stacked down = stack_of(w2, s2, o2, s2_sup, o2_sup, I, H, amx2_min_rows);
  const Groups g = group_pairs(expert_ids, w13.size(0));
  const int64_t touched = static_cast<int64_t>(g.expert.size());

  // 1. x's rows quantized once in each form an expert needs, gathered per pair
  bool need_s8 = false, need_u8 = false;
  for (int64_t i = 0; i < touched; ++i) (up.s8(g.count[i]) ? need_s8 : need_u8) = true;
  const Quantized x_s8 = need_s8 ? quantize(x, true) : Quantized{}, x_u8 = need_u8 ? quantize(x, false) : Quantized{};
  Gathered xg(P, H, x.options());
  const int64_t nab_h = H / kABlock;
  for (int64_t i = 0; i < touched; ++i) {
    const Quantized& q = up.s8(g.count[i]) ? x_s8 : x_u8;
    for (int64_t r = g.start[i]; r < g.start[i] + g.count[i]; ++r) {
      const int64_t t = g.order[r] / k;
      std::memcpy(xg.q_row(r), q.xq.data_ptr<uint8_t>() + t * H, H);
      std::memcpy(xg.xs_row(r), q.xs.data_ptr<float>() + t * nab_h, sizeof(float) * nab_h);
      if (q.xsx.size(0) > 0) std::memcpy(xg.xsx_row(r), q.xsx.data_ptr<float>() + t * nab_h, sizeof(float) * nab_h);
    }
  }

  // 2. gate_up
  at::Tensor h = at::empty({P, 2 * I}, x.options());
  run_experts(up, g, xg, h.data_ptr<float>(), nullptr);

  // 3. the activation, quantized for down in its expert's form
  std::vector<uint8_t> pair_s8(P);
  for (int64_t i = 0; i < touched; ++i)
    for (int64_t r = g.start[i]; r < g.start[i] + g.count[i]; ++r) pair_s8[r] = down.s8(g.count[i]);
  at::Tensor act = at::empty({P, I}, x.options());
  Gathered ag(P, I, x.options());
  const float* hp = h.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  at::parallel_for(0, P, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      specdec_cpu_common::silu_mul_row(hp + r * 2 * I, hp + r * 2 * I + I, actp + r * I, I);
      quantize_row(actp + r * I, I, pair_s8[r], ag.q_row(r), ag.xs_row(r), ag.xsx_row(r));
    }
  });

  // 4. down, scaled by the routing weights, summed per row in increasing expert id
  at::Tensor y = at::empty({P, H}, x.options());
  run_experts(down, g, ag, y.data_ptr<float>(), weights.data_ptr<float>());
  at::Tensor out = at::zeros({T, H}, x.options());
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < P; ++r) {
    float* o = op + (g.order[r] / k) * H;
    const float* v = yp + r * H;
#pragma omp simd
    for (int64_t n = 0; n < H; ++n) o[n] += v[n];
  }
  return {out, touched};
}

TORCH_LIBRARY_FRAGMENT(SPECDEC_LIB, m) {
  m.def("moe_a8(Tensor x, Tensor expert_ids, Tensor weights, Tensor w13, Tensor s13, Tensor o13, Tensor s13_sup, "
        "Tensor o13_sup, Tensor w2, Tensor s2, Tensor o2, Tensor s2_sup, Tensor o2_sup, int intermediate, "
        "int amx13_min_rows, int amx2_min_rows) -> (Tensor, int)", &moe_a8);
}
