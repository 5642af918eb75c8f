// Paged attention for x86 CPUs with AVX-512 or AVX2, float32, in which every (query row, head) is computed on
// its own: the same instruction sequence over the keys it may see, in key order, whatever the
// other rows of the call, the padding of the batch or the number of keys it may not see. So a
// token's row is the same number in a one-row decode step, in row j of a K+1-row verification and
// next to any other requests (``specdec.layers.attention_rows.ROWS_BACKEND``).
//
// Per (row, head): s_n = (q * scale) . k_n (D / kW FMAs in one chain, then a fixed horizontal sum)
// for each visible key n; m = max s_n; p_n = exp(s_n - m) (a polynomial exp, the same
// instructions for every element); l = sum p_n and o = sum p_n v_n in key order; out = o / l.
// Visible: n <= seq_len - q_len + j (bottom-right causal) and, for a token-tree request, n < base
// or bit (n - base) of the row's mask. Per-layer options: a sliding window w also hides keys
// n < base with n <= pos - w (pos: the row's slot, or base - 1 + depth for a tree node, depth =
// the bits set in its mask row); soft-capping replaces s_n by c * tanh(s_n / c); a sink logit z
// per head joins the max and adds exp(z - m) to l (gpt-oss), with no value.
//
// ``qkv_attention_rows`` runs a layer's rotary, KV-cache write and attention in one call from the
// fused QKV projection's output (at batch 1 the separate ops cost more than their arithmetic).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#ifndef SPECDEC_LIB
#define SPECDEC_LIB specdec_attention_rows
#endif

#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace specdec_cpu_common;  // exp_ps: x <= 0 here

struct Args {
  const float* q;  // [T, H, D]
  const float* k;  // [num_blocks, block_size, Hkv, D]
  const float* v;
  const int64_t* block_tables;  // [R, W]
  const int64_t* seq_lens;      // [R]
  const int64_t* qsl;           // [R + 1]
  const int64_t* tree_base;     // [R] or null
  const uint8_t* tree_mask;     // [T, tree_width] or null
  int64_t tree_width, W, bs, H, Hkv, D;
  float scale;
  float* out;  // [T, H, D]
  int64_t window;      // 0: full attention
  const float* sinks;  // [H] or null
  float softcap;       // 0: none
};

// Query heads h0 .. h0 + G - 1 of row t (request r), all reading kv head kvh: each key and value
// row is loaded once for them; each head's arithmetic is as described above, whatever G is.
template <int G>
void one_group(const Args& a, int64_t r, int64_t t, int64_t kvh, int64_t h0, std::vector<float>& s,
               std::vector<int32_t>& keys) {
  const int64_t seq_len = a.seq_lens[r], q_len = a.qsl[r + 1] - a.qsl[r];
  const int64_t j = t - a.qsl[r], limit = seq_len - q_len + j;  // last visible key
  const int64_t base = a.tree_base != nullptr ? a.tree_base[r] : seq_len;
  const uint8_t* mask = a.tree_mask != nullptr ? a.tree_mask + t * a.tree_width : nullptr;
  int64_t first = 0;  // the first key the sliding window lets this row see (before base)
  if (a.window > 0) {
    int64_t pos = limit, depth = 0;
    if (mask != nullptr)
      for (int64_t i = 0; i < a.tree_width; ++i) depth += mask[i] != 0;
    if (depth > 0) pos = base - 1 + depth;
    first = std::max<int64_t>(0, pos - a.window + 1);
  }
  const int64_t D = a.D, chunks = D / kW, rem = D % kW, nc = chunks + (rem ? 1 : 0);
  const vmask tail = vtail(rem);
  auto load = [&](const float* p, int64_t c) { return c < chunks ? vload(p + kW * c) : vload_mask(tail, p + kW * c); };
  vf qv[G][256 / kW];  // D <= 256
  for (int g = 0; g < G; ++g) {
    const float* qrow = a.q + (t * a.H + h0 + g) * D;
    for (int64_t c = 0; c < nc; ++c) qv[g][c] = vmul(load(qrow, c), vset1(a.scale));
  }
  const int64_t* table = a.block_tables + r * a.W;
  keys.clear();
  for (int64_t n = std::min(first, base); n <= limit; ++n)
    if (n < base ? n >= first : mask[n - base] != 0) keys.push_back(static_cast<int32_t>(n));
  const int64_t nk = static_cast<int64_t>(keys.size()), stride = nk + kW;
  s.resize(G * stride);
  float m[G];
  for (int g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int64_t i = 0; i < nk; ++i) {
    const int64_t n = keys[i];
    const float* kr = a.k + ((table[n / a.bs] * a.bs + n % a.bs) * a.Hkv + kvh) * D;
    vf acc[G];
    for (int g = 0; g < G; ++g) acc[g] = vzero();
    for (int64_t c = 0; c < nc; ++c) {
      const vf kv = load(kr, c);
      for (int g = 0; g < G; ++g) acc[g] = vfmadd(qv[g][c], kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      float x = vreduce_add(acc[g]);
      if (a.softcap > 0.0f) x = a.softcap * std::tanh(x / a.softcap);
      s[g * stride + i] = x;
      m[g] = std::max(m[g], x);
    }
  }
  float l[G];
  for (int g = 0; g < G; ++g) {
    if (a.sinks != nullptr) m[g] = std::max(m[g], a.sinks[h0 + g]);
    const vf mv = vset1(m[g]);
    float* sg = s.data() + g * stride;
    for (int64_t i = 0; i < nk; i += kW)  // padding lanes are computed and never read
      vstore(sg + i, exp_ps(vsub(vload(sg + i), mv)));
    l[g] = a.sinks != nullptr ? std::exp(a.sinks[h0 + g] - m[g]) : 0.0f;
  }
  vf o[G][256 / kW];
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < nc; ++c) o[g][c] = vzero();
  for (int64_t i = 0; i < nk; ++i) {
    const int64_t n = keys[i];
    const float* vr = a.v + ((table[n / a.bs] * a.bs + n % a.bs) * a.Hkv + kvh) * D;
    for (int g = 0; g < G; ++g) l[g] += s[g * stride + i];
    for (int64_t c = 0; c < nc; ++c) {
      const vf vv = load(vr, c);
      for (int g = 0; g < G; ++g) o[g][c] = vfmadd(vset1(s[g * stride + i]), vv, o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const vf inv = vset1(1.0f / l[g]);
    float* orow = a.out + (t * a.H + h0 + g) * D;
    for (int64_t c = 0; c < chunks; ++c) vstore(orow + kW * c, vmul(o[g][c], inv));
    if (rem) vstore_mask(tail, orow + kW * chunks, vmul(o[g][chunks], inv));
  }
}

// The query heads of kv head kvh for row t, up to 4 at a time.
void row_heads(const Args& a, int64_t r, int64_t t, int64_t kvh, std::vector<float>& s, std::vector<int32_t>& keys) {
  const int64_t group = a.H / a.Hkv;
  for (int64_t h0 = kvh * group; h0 < (kvh + 1) * group; h0 += 4) {
    switch (std::min<int64_t>(4, (kvh + 1) * group - h0)) {
      case 1: one_group<1>(a, r, t, kvh, h0, s, keys); break;
      case 2: one_group<2>(a, r, t, kvh, h0, s, keys); break;
      case 3: one_group<3>(a, r, t, kvh, h0, s, keys); break;
      default: one_group<4>(a, r, t, kvh, h0, s, keys); break;
    }
  }
}

}  // namespace

at::Tensor attention_rows(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                          const c10::optional<at::Tensor>& tree_base, const c10::optional<at::Tensor>& tree_mask,
                          int64_t window, const c10::optional<at::Tensor>& sinks, double softcap) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat, "attention_rows: float32");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous(), "contiguous inputs");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % Hkv == 0 && D <= 256, "attention_rows: shapes");
  const at::Tensor sl = seq_lens.to(at::kLong).contiguous(), qsl = query_start_loc.to(at::kLong).contiguous();
  const at::Tensor bt = block_tables.to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(query);
  const int64_t R = sl.size(0);
  const bool tree = tree_base.has_value() && tree_base->defined();
  const at::Tensor tb = tree ? tree_base->to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor tm = tree ? tree_mask->to(at::kByte).contiguous() : at::Tensor();
  const bool has_sinks = sinks.has_value() && sinks->defined();
  const at::Tensor sk = has_sinks ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!has_sinks || sk.numel() == H, "attention_rows: one sink per query head");
  const int64_t layer = kv_cache.size(1) * bs * Hkv * D;  // floats of one of K / V
  const float* cache = kv_cache.data_ptr<float>();
  const Args a{query.data_ptr<float>(), cache, cache + layer,
               bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), qsl.data_ptr<int64_t>(),
               tree ? tb.data_ptr<int64_t>() : nullptr, tree ? tm.data_ptr<uint8_t>() : nullptr,
               tree ? tm.size(1) : 0, bt.size(1), bs, H, Hkv, D, static_cast<float>(scale), out.data_ptr<float>(),
               window, has_sinks ? sk.data_ptr<float>() : nullptr, static_cast<float>(softcap)};
  std::vector<int64_t> row_req(T, -1);
  const int64_t* q = qsl.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = q[r]; t < q[r + 1]; ++t) row_req[t] = r;
  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    std::vector<int32_t> keys;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / Hkv, kvh = i % Hkv;
      if (row_req[t] >= 0) row_heads(a, row_req[t], t, kvh, s, keys);
    }
  });
  return out;
}

// One attention layer's work between its QKV and output projections, in one call: the fused qkv
// rows [T, (H + 2 Hkv) * D] (queries, keys, values), rotated (rotate-half rotary with the step's
// cos / sin [T, 1, D/2] rows) for queries and keys, keys and values written to the cache at
// slot_mapping [T], then ``attention_rows`` over the cache. -> [T, H, D].
at::Tensor qkv_attention_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, double scale, int64_t num_heads,
                              const c10::optional<at::Tensor>& tree_base, const c10::optional<at::Tensor>& tree_mask,
                              int64_t window, const c10::optional<at::Tensor>& sinks, double softcap) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat && qkv.dim() == 2 &&
              qkv.stride(1) == 1, "qkv_attention_rows: float32 qkv [T, (H + 2 Hkv) * D], rows contiguous");
  TORCH_CHECK(kv_cache.is_contiguous(), "qkv_attention_rows: contiguous kv_cache");
  const int64_t T = qkv.size(0), H = num_heads, Hkv = kv_cache.size(3), D = kv_cache.size(4), half = D / 2;
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D && D % 2 == 0, "qkv_attention_rows: qkv width ", qkv.size(1),
              " is not (", H, " + 2 * ", Hkv, ") * ", D);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == T * half && sin.numel() == T * half,
              "qkv_attention_rows: cos / sin [T, 1, D/2] float32, contiguous");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "qkv_attention_rows: one slot per row");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  at::Tensor query = at::empty({T, H, D}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  float* qp = query.data_ptr<float>();
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + num_slots * Hkv * D;
  const int64_t row_stride = qkv.stride(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "qkv_attention_rows: slot ", sl[t], " outside the cache");
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * half, *s = sp + t * half, *row = src + t * row_stride;
      const int64_t slot = sl[t];
      for (int64_t h = 0; h < H + Hkv; ++h) {  // queries, then keys (straight into the cache)
        specdec_cpu_common::rotate_half(row + h * D, c, s, h < H ? qp + (t * H + h) * D : kc + (slot * Hkv + h - H) * D,
                                        half);
      }
      std::memcpy(vc + slot * Hkv * D, row + (H + Hkv) * D, sizeof(float) * Hkv * D);
    }
  });
  return attention_rows(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, tree_base, tree_mask,
                        window, sinks, softcap);
}

TORCH_LIBRARY(SPECDEC_LIB, m) {
  m.def("attention_rows(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, Tensor? tree_base, Tensor? tree_mask, int window, Tensor? sinks, "
        "float softcap) -> Tensor", &attention_rows);
  m.def("qkv_attention_rows(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int num_heads, "
        "Tensor? tree_base, Tensor? tree_mask, int window, Tensor? sinks, float softcap) -> Tensor", &qkv_attention_rows);
}
