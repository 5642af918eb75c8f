// AMX linears for x86 CPUs with tile registers (Sapphire Rapids and later: amx_tile, amx_bf16).
//
// bf16 weights in pair layout (woq_cpu.pack_bf16_pairs: [N / 16][K / 2][16][2]) are already the
// layout a tdpbf16ps B operand wants: for one block of 16 outputs, 16 consecutive pairs (32 inputs)
// are 16 rows of 64 bytes, one contiguous KB, row r holding inputs 2r, 2r + 1 of each output. So a
// block's weights stream straight from memory into tile B, the rows of x (rounded to bf16) form
// tile A (up to 16 rows, 32 inputs each) and tile C holds the rows' 16 float32 sums, kept in the
// tile over the whole K. Up to 16 rows cost one pass over the weight: verification rows ride along
// with the first.
//
// Each (row, output) sum is the same tile instruction sequence over the same 32-input chunks
// whatever M is and whichever rows share the tile (AMX computes every element of C from its own
// row of A and column of B), so row i of an M-row call equals the 1-row call bit for bit. The
// float32 sums are ordered as AMX orders them, not as the AVX-512 pair kernel does: the two agree
// to float32 rounding, not bit for bit, so a layer runs one of them for every row count.
//
// Linux hands out AMX state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); amx_init asks once and says whether it was granted.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

namespace {

#ifndef SPECDEC_LIB
#define SPECDEC_LIB specdec_amx
#endif

constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
constexpr int64_t kRows = 16;   // rows of x per tile
constexpr int64_t kChunk = 32;  // bf16 inputs per tile step (64 bytes)

bool request_amx() {
  static const bool granted = [] {
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) == 0 && (mask >> kXfeatureXtiledata & 1)) return true;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    mask = 0;
    return syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) == 0 && (mask >> kXfeatureXtiledata & 1);
  }();
  return granted;
}

// tiles 0, 1: C of two blocks (rows x 16 float32), 2: A (rows x 32 bf16), 3, 4: B of the two blocks
// (16 pairs x 16 outputs). Two blocks share each A load and keep two product chains in flight (tile
// registers are not renamed: one block's products would wait on each other).
void configure_bf16(int rows) {
  specdec_cpu_common::TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.set(t, rows, 64);
  cfg.set(3, 16, 64);
  cfg.set(4, 16, 64);
  cfg.load();
}

inline void prefetch_chunk(const uint16_t* w) {
  const char* next = reinterpret_cast<const char*>(w) + specdec_cpu_common::kStreamAhead;
  for (int line = 0; line < 16; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T1);
}

// y[rows, 16 outputs of each of two blocks] for x rows (bf16, row stride K), the blocks' weights at w0, w1
inline void bf16_two_blocks(const uint16_t* x, const uint16_t* w0, const uint16_t* w1, int64_t K, float* y0,
                            float* y1, int64_t ldy) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    prefetch_chunk(w0 + k0 * 16);
    prefetch_chunk(w1 + k0 * 16);
    _tile_loadd(2, x + k0, K * 2);
    _tile_loadd(3, w0 + k0 * 16, 64);
    _tile_loadd(4, w1 + k0 * 16, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, y0, ldy * 4);
  _tile_stored(1, y1, ldy * 4);
}

// one block: its C chain alone (the odd block of an odd count)
inline void bf16_block(const uint16_t* x, const uint16_t* w, int64_t K, float* y, int64_t ldy) {
  _tile_zero(0);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    prefetch_chunk(w + k0 * 16);
    _tile_loadd(2, x + k0, K * 2);
    _tile_loadd(3, w + k0 * 16, 64);
    _tile_dpbf16ps(0, 2, 3);
  }
  _tile_stored(0, y, ldy * 4);
}

at::Tensor finish(at::Tensor y, const at::Tensor& x, int64_t M, int64_t N, const c10::optional<at::Tensor>& bias) {
  y = y.narrow(0, 0, M);
  if (!y.is_contiguous()) y = y.contiguous();
  specdec_cpu_common::add_bias(y, bias);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes).to(x.scalar_type());
}

}  // namespace

bool amx_init() { return request_amx(); }

// y = x @ W^T (+ bias) for a bf16 weight in pair layout [N, K] (N % 16 == 0, K % 32 == 0): x rounded to
// bf16, float32 sums in AMX tiles; the result in x's dtype. More than 16 rows run as 16-row tiles
// (x padded with zero rows to a multiple of 16), each block's weights read once per call from
// memory and from cache by the later tiles.
at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(request_amx(), "amx bf16 linear: the OS did not grant AMX tile state to this process");
  TORCH_CHECK(weight.dtype() == at::kBFloat16 && weight.is_contiguous() && weight.dim() == 2,
              "amx bf16 linear: contiguous bf16 [N, K] weight in pair layout");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0 && K % kChunk == 0, "amx bf16 linear: N must be a multiple of 16 and K of 32");
  TORCH_CHECK(x.size(-1) == K, "amx bf16 linear: x has ", x.size(-1), " inputs, the weight ", K);
  at::Tensor xb = x.reshape({-1, K}).to(at::kBFloat16).contiguous();
  const int64_t M = xb.size(0);
  const int64_t rows = std::min<int64_t>(M, kRows);
  const int64_t padded = M <= kRows ? M : (M + kRows - 1) / kRows * kRows;
  if (padded != M) xb = at::cat({xb, xb.new_zeros({padded - M, K})});
  at::Tensor y = at::empty({padded, N}, xb.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / 16;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    configure_bf16(static_cast<int>(rows));
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t v = 2 * pair;
      for (int64_t m0 = 0; m0 < padded; m0 += rows) {
        if (v + 1 < blocks)
          bf16_two_blocks(xp + m0 * K, wp + v * 16 * K, wp + (v + 1) * 16 * K, K, yp + m0 * N + v * 16,
                          yp + m0 * N + (v + 1) * 16, N);
        else
          bf16_block(xp + m0 * K, wp + v * 16 * K, K, yp + m0 * N + v * 16, N);
      }
    }
    _tile_release();
  });
  return finish(y, x, M, N, bias);
}

TORCH_LIBRARY(SPECDEC_LIB, m) {
  m.def("amx_init() -> bool", &amx_init);
  m.def("amx_bf16_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", &amx_bf16_linear);
}
