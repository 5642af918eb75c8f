// Multi-adapter LoRA delta for x86 CPUs with avx512_bf16: out[m] += B[slot m] (A[slot m] x[m]) for the
// rows of a step, every row with its own adapter slot (-1: none), in one call per adapted linear.
//
// Each row is multiplied by its own slot's A and B only: rows are grouped by slot and a slot's
// weights are streamed once for all its rows, so a step reads the adapters present in it and
// nothing else (no other slot's columns, no block-diagonal zeros between the parts of a fused
// linear). Two phases:
//   shrink  xa[m, p, :] = A[p, slot m] x[m]        (every part p of the slot, R outputs each)
//   expand  out[m, part p] += B_p[slot m] bf16(xa[m, p, :])
// Weights are bf16 in woq_cpu.pack_bf16_pairs' pair layout ([N / 16][K / 2][16][2]: one 64-byte
// load holds 16 outputs' weights of 2 consecutive inputs), x and xa are rounded to bf16, and one
// vdpbf16ps adds a pair's products to 16 outputs' float32 sums. Shapes (R a multiple of 16):
//   a    [P * L * R, K]   part p's A of slot l in rows (p * L + l) * R ..
//   b    [L * N, R]       slot l's B of every part, parts' outputs concatenated (N = sum of the parts')
//
// Row consistency (speculative == plain decoding rests on it): each (row, output) sum starts at
// zero and runs over the pairs in order with the same instructions whatever the call's rows,
// their slots or the tile they share, and the delta is added to out once, so row m of an M-row
// call equals the one-row call bit for bit. Threads split slots' blocks of outputs, never a sum.
#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#ifndef SPECDEC_LIB
#define SPECDEC_LIB specdec_lora
#endif

namespace {

constexpr int64_t kBlock = 16;  // outputs per block of the pair layout
constexpr int kMaxRows = 4;     // rows per tile
constexpr int kMaxBlocks = 4;   // 16-output blocks per tile: kMaxRows x kMaxBlocks independent sums

// sum over pairs p < K2 of block w[n]'s pair p times row x[m]'s pair p, for 16 outputs each; the
// shrink stores it rounded to bf16 (uint16 y[m] + 16 n), the expand adds it to float32 y[m] + 16 n
template <bool kExpand, int NB, int MB>
void pairs_tile(const uint32_t* const* x, const uint16_t* const* w, int64_t K2, void* const* y) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    __m512i wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_loadu_si512(w[n] + p * 32);
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(x[m][p]));
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)wv[n], (__m512bh)xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      if constexpr (kExpand) {
        float* dst = static_cast<float*>(y[m]) + n * kBlock;
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[m][n]));
      } else {  // round to nearest even, as torch rounds float32 to bf16
        alignas(64) float sums[kBlock];
        _mm512_store_ps(sums, acc[m][n]);
        uint16_t* dst = static_cast<uint16_t*>(y[m]) + n * kBlock;
        for (int i = 0; i < kBlock; ++i) dst[i] = c10::BFloat16(sums[i]).x;
      }
    }
}

template <bool kExpand, int NB>
void tile_rows(int mb, const uint32_t* const* x, const uint16_t* const* w, int64_t K2, void* const* y) {
  switch (mb) {
    case 4: pairs_tile<kExpand, NB, 4>(x, w, K2, y); break;
    case 3: pairs_tile<kExpand, NB, 3>(x, w, K2, y); break;
    case 2: pairs_tile<kExpand, NB, 2>(x, w, K2, y); break;
    default: pairs_tile<kExpand, NB, 1>(x, w, K2, y); break;
  }
}

template <bool kExpand>
void tile(int nb, int mb, const uint32_t* const* x, const uint16_t* const* w, int64_t K2, void* const* y) {
  switch (nb) {
    case 4: tile_rows<kExpand, 4>(mb, x, w, K2, y); break;
    case 3: tile_rows<kExpand, 3>(mb, x, w, K2, y); break;
    case 2: tile_rows<kExpand, 2>(mb, x, w, K2, y); break;
    default: tile_rows<kExpand, 1>(mb, x, w, K2, y); break;
  }
}

// One work item: `nb` blocks of one slot's weights (w[n]) against all that slot's rows, a row's
// inputs at x + row * x_stride + x_offset (uint32 pairs) and outputs at y + row * y_stride +
// y_offset (elements of the phase's output), kMaxRows rows at a time.
struct Work {
  int64_t slot;
  int nb;
  const uint16_t* w[kMaxBlocks];
  int64_t x_offset, y_offset;
};

struct Phase {
  std::vector<Work> work;
  const uint32_t* x;
  int64_t x_stride;
  char* y;  // bytes
  int64_t y_stride;
  int64_t K2;  // pairs summed per output
};

template <bool kExpand>
void run_item(const Phase& phase, const Work& item, const std::vector<int64_t>& slot_rows) {
  constexpr int64_t kElement = kExpand ? sizeof(float) : sizeof(uint16_t);
  for (size_t r0 = 0; r0 < slot_rows.size(); r0 += kMaxRows) {
    const int mb = static_cast<int>(std::min<size_t>(kMaxRows, slot_rows.size() - r0));
    const uint32_t* x[kMaxRows];
    void* y[kMaxRows];
    for (int m = 0; m < mb; ++m) {
      const int64_t row = slot_rows[r0 + m];
      x[m] = phase.x + row * phase.x_stride + item.x_offset;
      y[m] = phase.y + (row * phase.y_stride + item.y_offset) * kElement;
    }
    tile<kExpand>(item.nb, mb, x, item.w, phase.K2, y);
  }
}

// Both phases in one parallel region: the expand starts when every shrink item is done (the
// barrier at the end of the first loop).
void run(const Phase& shrink, const Phase& expand, const std::vector<std::vector<int64_t>>& rows) {
  const int64_t n1 = static_cast<int64_t>(shrink.work.size()), n2 = static_cast<int64_t>(expand.work.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max(n1, n2)));
#pragma omp parallel num_threads(threads) if (threads > 1 && !at::in_parallel_region())
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n1; ++i) run_item<false>(shrink, shrink.work[i], rows[shrink.work[i].slot]);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n2; ++i) run_item<true>(expand, expand.work[i], rows[expand.work[i].slot]);
  }
}

}  // namespace

// out [M, N] float32 += each row's delta (see the top). row_slots [M] int64 (-1: no adapter);
// part_sizes: each part's outputs, in output order (each a multiple of 16).
void lora_bf16_add_(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& row_slots, int64_t num_slots, at::IntArrayRef part_sizes) {
  const int64_t P = static_cast<int64_t>(part_sizes.size());
  TORCH_CHECK(P > 0 && num_slots > 0, "lora bf16: at least one part and one slot");
  TORCH_CHECK(a.dtype() == at::kBFloat16 && b.dtype() == at::kBFloat16 && a.is_contiguous() && b.is_contiguous() &&
              a.dim() == 2 && b.dim() == 2, "lora bf16: contiguous bf16 [P * L * R, K] A and [L * N, R] B");
  const int64_t K = a.size(1), R = b.size(1);
  int64_t N = 0;
  for (int64_t size : part_sizes) {
    TORCH_CHECK(size % kBlock == 0, "lora bf16: every part's outputs must be a multiple of 16, got ", size);
    N += size;
  }
  TORCH_CHECK(R % kBlock == 0 && K > 0 && K % 2 == 0 && a.size(0) == P * num_slots * R && b.size(0) == num_slots * N,
              "lora bf16: A must be [", P * num_slots * R, ", K even] and B [", num_slots * N,
              ", R a multiple of 16] for ", P, " parts, ", num_slots, " slots and ", N, " outputs");
  TORCH_CHECK(x.size(-1) == K, "lora bf16: x has ", x.size(-1), " inputs, A ", K);
  const int64_t M = x.numel() / K;
  TORCH_CHECK(out.dtype() == at::kFloat && out.is_contiguous() && out.numel() == M * N,
              "lora bf16: out must be contiguous float32 [", M, ", ", N, "]");
  TORCH_CHECK(row_slots.dtype() == at::kLong && row_slots.is_contiguous() && row_slots.numel() == M,
              "lora bf16: row_slots must be contiguous int64 [", M, "]");
  if (M == 0) return;

  // rows of each slot, in row order
  std::vector<std::vector<int64_t>> rows(num_slots);
  const int64_t* slot_of = row_slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    const int64_t s = slot_of[m];
    TORCH_CHECK(s >= -1 && s < num_slots, "lora bf16: row ", m, " has slot ", s, ", not in -1 .. ", num_slots - 1);
    if (s >= 0) rows[s].push_back(m);
  }

  const at::Tensor xb = x.reshape({M, K}).to(at::kBFloat16).contiguous();
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(b.data_ptr());
  const int64_t width = P * R;  // xa columns of a row: its slot's parts, R each
  std::vector<uint16_t> xa(M * width);  // bf16

  // shrink: the slot's P * R / 16 blocks of A (part-major), up to kMaxBlocks per item
  Phase shrink{{}, reinterpret_cast<const uint32_t*>(xb.data_ptr()), K / 2, reinterpret_cast<char*>(xa.data()),
               width, K / 2};
  const int64_t blocks_per_part = R / kBlock, slot_blocks = P * blocks_per_part;
  for (int64_t s = 0; s < num_slots; ++s) {
    if (rows[s].empty()) continue;
    for (int64_t first = 0; first < slot_blocks; first += kMaxBlocks) {
      Work item{s, static_cast<int>(std::min<int64_t>(kMaxBlocks, slot_blocks - first)), {}, 0, first * kBlock};
      for (int n = 0; n < item.nb; ++n) {
        const int64_t part = (first + n) / blocks_per_part, j = (first + n) % blocks_per_part;
        item.w[n] = ap + ((part * num_slots + s) * R + j * kBlock) * K;
      }
      shrink.work.push_back(item);
    }
  }
  // expand: per part, its blocks of the slot's B, up to kMaxBlocks per item
  Phase expand{{}, reinterpret_cast<const uint32_t*>(xa.data()), width / 2, reinterpret_cast<char*>(out.data_ptr()),
               N, R / 2};
  for (int64_t s = 0; s < num_slots; ++s) {
    if (rows[s].empty()) continue;
    int64_t part_start = 0;
    for (int64_t part = 0; part < P; ++part) {
      const int64_t part_blocks = part_sizes[part] / kBlock;
      for (int64_t first = 0; first < part_blocks; first += kMaxBlocks) {
        const int64_t v0 = part_start / kBlock + first;  // first output block of the item
        Work item{s, static_cast<int>(std::min<int64_t>(kMaxBlocks, part_blocks - first)), {}, part * R / 2,
                  v0 * kBlock};
        for (int n = 0; n < item.nb; ++n) item.w[n] = bp + (s * N + (v0 + n) * kBlock) * R;
        expand.work.push_back(item);
      }
      part_start += part_sizes[part];
    }
  }
  run(shrink, expand, rows);
}

TORCH_LIBRARY(SPECDEC_LIB, m) {
  m.def("lora_bf16_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor row_slots, int num_slots, "
        "int[] part_sizes) -> ()", &lora_bf16_add_);
}
