// int8-activation linear for x86 CPUs with AVX-512 VNNI or AVX2: y[M, N] = A8(x)[M, K] . W[N, K]^T, the
// function woq_format.reference_linear_a8 defines (int8 / int4 weights; x quantized per row per
// block of 32 inputs, symmetric, round half to even; integer sums per weight group and activation
// block; float scaling).
//
// Layout (woq_cpu.A8Weight). Outputs are stored in blocks of 16 (N padded with zero rows to a
// multiple of 16). A block's weights are a sequence of 64-byte vectors, each holding 4 bytes for
// each of the 16 outputs (output o in bytes 4o .. 4o + 3), so one vpdpbusd with a broadcast
// 4-byte activation word adds 4 products to each of 16 output sums: an outer product, with no
// horizontal sums. int8: vector j holds inputs 4j .. 4j + 3 (byte t: input 4j + t). int4: vector
// j holds inputs 8j .. 8j + 7, byte t of an output input 8j + t in its low nibble and 8j + 4 + t in
// its high nibble. Group scales and offsets are stored per block too, [N / 16][K / G][16] (and
// two-level factors [N / 16][K / S][16]), so a group's 16 values are one vector.
//
// Activations keep their natural order: q [M, K] (int4: s8; int8 on VNNI: q + 128 as u8), with
// per-row scales xs [M, K / 32] and, for int4, xs * (sum of the block's q) [M, K / 32].
//
// A unit of E = 32 inputs (16 for int8 groups of 16) lies in one weight group and one activation
// block: its integer sums, per row and output, are scaled once: y += xs . ws . I (int4:
// + xs . sum(q) . wo).
// int4: vpdpbusd(u8 weights 0..15, s8 activations). int8: vpdpbusd(u8 = activations + 128, s8
// weights) minus 128 * (the unit's weight sums, one more vpdpbusd against ones per vector,
// shared by the tile's rows).
//
// AVX2 (no VNNI; built where AVX-512 VNNI is missing): the same layout, each 64-byte vector as two
// 256-bit halves (outputs 0-7, 8-15). Products by vpmaddubsw (u8 . s8 pairs into int16) and
// vpmaddwd against ones. int4: u8 weights 0..15 times s8 activations, pairs summed in int16 over a
// unit (|sum| <= 8 * 2 * 15 * 127 < 2^15), widened once per unit. int8: |w| times the activation
// with w's sign (|w| <= 128, |x| <= 127: a pair fits int16), widened every vector. The integer sums
// are exact, the same as the VNNI path's.
//
// Every (row, output) result is the same instruction sequence whatever M is and whichever rows
// share its tile, so row i of an M-row call equals the 1-row call bit for bit.
//
// AMX (built with -mamx-int8 where the CPU has amx_int8; a8_linear_amx): the unit's integer sums
// of up to 16 rows come from one tile product instead of 8 vpdpbusd per row: tile A holds the rows'
// s8 activations of the unit (natural order), tile B the unit's weights, 4 inputs of 16 outputs per
// 64-byte row, which is the int8 layout's vector as it is (int4: each vector's low nibbles, then its
// high ones, unpacked into a buffer: inputs 8j .. 8j + 3, then 8j + 4 .. 8j + 7); int8 by tdpbssd,
// int4 by tdpbsud (u8 weights). The sums are exact integers, the same as the VNNI path's, and
// the float scaling after them is the same instructions in the same order, so a8_linear_amx
// equals a8_linear bit for bit and a caller may pick either per call by its row count.
//
// Variants (AVX-512 VNNI build; woq_a8_variants.h): a8_linear_vnni512_bcast, a8_linear_vnni256 and
// a8_linear_bf16 run other instruction sequences for the same sums and scaling, equal to a8_linear
// bit for bit; which runs at a row count is measured at load time.
#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

#ifndef SPECDEC_LIB
#define SPECDEC_LIB specdec_woq_a8
#endif

constexpr int64_t kBlock = 16;   // outputs per block
constexpr int64_t kABlock = 32;  // activation inputs per scale
constexpr int kMaxRows = 9;      // rows per kernel pass; more rows run as passes of these

struct Args {
  const uint8_t* xq;    // [M, K] activations (int4: s8 bit patterns; int8 on VNNI: + 128)
  const float* xs;      // [M, K / 32] block scales
  const float* xsx;     // [M, K / 32] int4: xs * the block's sum of q
  const uint8_t* w;     // [N / 16] blocks of 16 K (int8) or 8 K (int4) bytes
  const void* ws;       // [N / 16][K / G][16] group scales: float32, float16 or (two-level) int8
  const void* wo;       // int4 offsets, as the scales
  const float* ws_sup;  // two-level: [N / 16][K / S][16] float32 super-block factors of the scales
  const float* wo_sup;  // two-level, int4: of the offsets
  int64_t K, G, S, N, E;
  int64_t ng, nsb, nab;  // groups, super-blocks and activation blocks of a row
  int64_t blk_bytes;
  float* y;
  const uint16_t* xb = nullptr;   // the bf16 variant (woq_a8_variants.h): [M, K] bf16 activations
  const float* xstart = nullptr;  // and its accumulators' starts [M, K / 32]
};

// Scale formats (the scales' dtype): float32 as is; float16 widened; int8 times the float32
// factor of its super-block. Each gives the same float32 values a float32 copy would hold (the
// Python side stores a compact form only where it is exact), so the result does not depend on it.
enum ScaleFormat { kF32 = 0, kF16 = 1, kTwoLevel = 2 };

// y[m, blk * 16 + o] = v[o] for the outputs below N
inline void store_outputs(const Args& a, int64_t m, int64_t blk, const float* v) {
  const int64_t n0 = blk * kBlock, count = std::min<int64_t>(kBlock, a.N - n0);
  std::memcpy(a.y + m * a.N + n0, v, sizeof(float) * count);
}

// the 4 activation bytes at p as one word (each is broadcast to every output of a vector)
inline int32_t load_word(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#include "woq_a8_scaling.h"

// Half h (outputs 8h .. 8h + 7) of the 64-byte weight vector at p, for tiles that run a block as two
// halves of 8 outputs (the AVX2 build's, vnni256): the first half's read prefetches the stream, the
// second reads the vectors again from cache.
inline __m256i load_half(const uint8_t* p, int h) {
  if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + specdec_cpu_common::kStreamAhead, _MM_HINT_T1);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
}

// int4: the low and the high nibbles of each byte of v
inline void split_nibbles(__m256i v, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}

#if defined(__AVX512VNNI__)

// The 16 values of group g of block blk, whose super-block is sb (two-level scales).
template <int SF>
__attribute__((always_inline)) inline __m512 group_values(const Args& a, const void* v, const float* sup, int64_t blk,
                                                         int64_t g, int64_t sb) {
  const int64_t at = (blk * a.ng + g) * kBlock;
  if (SF == kF32) return _mm512_loadu_ps(static_cast<const float*>(v) + at);
  if (SF == kF16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(v) + at)));
  const __m512 codes = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(v) + at))));
  return _mm512_mul_ps(codes, _mm512_loadu_ps(sup + (blk * a.nsb + sb) * kBlock));
}

template <int SF>
__attribute__((always_inline)) inline __m512 group_values(const Args& a, const void* v, const float* sup, int64_t blk,
                                                         int64_t g) {
  return group_values<SF>(a, v, sup, blk, g, g * a.G / a.S);
}

// Where the unit at input k0 starts a group: that group's scales into sv and (int4) offsets into ov
template <bool INT4, int SF>
__attribute__((always_inline)) inline void enter_group(const Args& a, int64_t blk, int64_t k0, __m512& sv, __m512& ov) {
  if (k0 % a.G != 0) return;
  sv = group_values<SF>(a, a.ws, a.ws_sup, blk, k0 / a.G);
  if (INT4) ov = group_values<SF>(a, a.wo, a.wo_sup, blk, k0 / a.G);
}

// rows 0 .. MB - 1 of block blk's outputs from their float sums
template <int MB>
__attribute__((always_inline)) inline void store_rows(const Args& a, int64_t blk, const __m512* facc) {
  alignas(64) float out[16];
  for (int m = 0; m < MB; ++m) {
    _mm512_store_ps(out, facc[m]);
    store_outputs(a, m, blk, out);
  }
}

// acc += u8 a . s8 b per 32-bit lane (vpdpbusd), accumulating in place: written with the
// intrinsic, gcc 12 copies every accumulator of a large tile through another register (and the
// stack) on each step, which costs more than the dot products.
__attribute__((always_inline)) inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

inline __m512i broadcast_word(const uint8_t* p) { return _mm512_set1_epi32(load_word(p)); }

// Block blk (16 outputs) for rows 0 .. MB - 1. One block per tile: its weights are one sequential
// stream, which the software prefetch follows kStreamAhead bytes ahead.
template <bool INT4, int SF, int MB>
void tile(const Args& a, int64_t blk) {
  constexpr int64_t kStep = INT4 ? 8 : 4;  // inputs per 64-byte vector
  const __m512i ones = _mm512_set1_epi8(1), low4 = _mm512_set1_epi8(0x0F);
  __m512 facc[MB];
  for (int m = 0; m < MB; ++m) facc[m] = _mm512_setzero_ps();
  __m512 sv = _mm512_setzero_ps(), ov = _mm512_setzero_ps();
  const uint8_t* wp = a.w + blk * a.blk_bytes;
  for (int64_t k0 = 0; k0 < a.K; k0 += a.E) {
    enter_group<INT4, SF>(a, blk, k0, sv, ov);
    __m512i iacc[MB], wsum = _mm512_setzero_si512();
    for (int m = 0; m < MB; ++m) iacc[m] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + a.E; k += kStep) {
      const uint8_t* p = wp + (k / kStep) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p) + specdec_cpu_common::kStreamAhead, _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(p);
      if (INT4) {
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int m = 0; m < MB; ++m) {
          dpbusd(iacc[m], lo, broadcast_word(a.xq + m * a.K + k));
          dpbusd(iacc[m], hi, broadcast_word(a.xq + m * a.K + k + 4));
        }
      } else {
        dpbusd(wsum, ones, v);
        for (int m = 0; m < MB; ++m) dpbusd(iacc[m], broadcast_word(a.xq + m * a.K + k), v);
      }
    }
    const int64_t b = k0 / kABlock;
    for (int m = 0; m < MB; ++m) {
      const __m512i isum = INT4 ? iacc[m] : _mm512_sub_epi32(iacc[m], _mm512_slli_epi32(wsum, 7));
      facc[m] = scale_unit<INT4>(facc[m], _mm512_cvtepi32_ps(isum), sv, ov, a.xs, a.xsx, m * a.nab + b);
    }
  }
  store_rows<MB>(a, blk, facc);
}

// Row m of x -> its s8 activations (int8 on VNNI: + 128), block scales and (int4) xs * block sums.
void quantize_row(const float* row, int64_t K, bool int4, uint8_t* out, float* xs, float* xsx) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < K / kABlock; ++b) {
    const __m512 v0 = _mm512_loadu_ps(row + 32 * b), v1 = _mm512_loadu_ps(row + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), lo), hi);
    const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), lo), hi);
    xs[b] = amax / 127.0f;
    if (int4) xsx[b] = xs[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    const __m512i shift = _mm512_set1_epi32(int4 ? 0 : 128);  // int8: + 128 as u8
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * b), _mm512_cvtepi32_epi8(_mm512_add_epi32(q0, shift)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * b + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(q1, shift)));
  }
}

#include "woq_a8_variants.h"

#if defined(__AMX_INT8__)
// tiles 0, 1: C (rows x 16 int32) of an even and an odd unit; 2, 3: their A (rows x E bytes); 4, 5: B
// (E / 4 rows of 64 bytes). Two units in flight: tile registers are not renamed, so one unit's
// product would otherwise wait for the previous unit's store.
void configure_a8(int rows, int E) {
  specdec_cpu_common::TileConfig cfg;
  for (int t = 0; t < 2; ++t) {
    cfg.set(t, rows, 64);
    cfg.set(2 + t, rows, E);
    cfg.set(4 + t, E / 4, 64);
  }
  cfg.load();
}

// int4: the vectors of inputs [k_begin, k_end) of a block at wp as B rows, 64 bytes each (low nibbles
// of vector j: row 2j, high: row 2j + 1), so the unit at input k starts at rows + 16 * (k - k_begin)
inline void unpack_int4(const uint8_t* wp, int64_t k_begin, int64_t k_end, uint8_t* rows) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t j = k_begin / 8; j < k_end / 8; ++j) {
    const uint8_t* p = wp + 64 * j;
    _mm_prefetch(reinterpret_cast<const char*>(p) + specdec_cpu_common::kStreamAhead, _MM_HINT_T1);
    const __m512i v = _mm512_loadu_si512(p);
    uint8_t* out = rows + 128 * (j - k_begin / 8);
    _mm512_storeu_si512(out, _mm512_and_si512(v, low4));
    _mm512_storeu_si512(out + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  }
}

// One pass of a tile: rows r0 .. r0 + rows - 1 of block blk over inputs [k_begin, k_end), B operands
// at b (the unit at input k at b + 16 * (k - k_begin)), tiles configured for these rows and E.
// acc [rows][16] holds the rows' float sums between passes over a block's inputs (read unless
// k_begin is 0); at k_end = K they go to y instead. Rows below `kept` are computed but neither
// stored nor written (another pass owns them). FULL: rows is 16.
// Per pair of units, the integer sums by tiles, stored; then the float scaling of tile() above, unit
// by unit, row by row, on the pair stored one step earlier (a load right after the tile store
// would wait for it), with the rows' float sums in registers across the inputs.
template <bool INT4, int SF, bool FULL>
void tile_amx(const Args& a, int64_t blk, int64_t r0, int rows, int64_t k_begin, int64_t k_end, const uint8_t* b,
              float* acc, int kept) {
  alignas(64) int32_t isum[2][2][16 * 16];  // [pair parity][unit of the pair][row][output]
  __m512 f[16];
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m)
    f[m] = (FULL || m < rows) && k_begin > 0 ? _mm512_loadu_ps(acc + 16 * m) : _mm512_setzero_ps();
  __m512 sv = _mm512_setzero_ps(), ov = _mm512_setzero_ps();
  const uint8_t* xq = a.xq + r0 * a.K;
  const float* xs = a.xs + r0 * a.nab;
  const float* xsx = INT4 ? a.xsx + r0 * a.nab : nullptr;
  // the group of the next unit to scale, where the one after it starts, and (two-level) its super-block
  int64_t g = k_begin / a.G, next_group = k_begin, sb = g * a.G / a.S, next_super = (sb + 1) * a.S;
  const int64_t step = 2 * a.E;
  for (int64_t k0 = k_begin, i = 0; k0 < k_end + step; k0 += step, ++i) {
    if (k0 < k_end) {
      const int64_t k1 = k0 + a.E;
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, xq + k0, a.K);
      _tile_loadd(3, xq + k1, a.K);
      _tile_loadd(4, b + 16 * (k0 - k_begin), 64);
      _tile_loadd(5, b + 16 * (k1 - k_begin), 64);
      if (INT4) {
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 5);
      } else {
        _tile_dpbssd(0, 2, 4);
        _tile_dpbssd(1, 3, 5);
      }
      _tile_stored(0, isum[i & 1][0], 64);
      _tile_stored(1, isum[i & 1][1], 64);
    }
    if (k0 == k_begin) continue;
    for (int u = 0; u < 2; ++u) {
      const int64_t k = k0 - step + u * a.E;
      if (k == next_group) {
        if (k > k_begin) {
          ++g;
          if (k == next_super) {
            ++sb;
            next_super += a.S;
          }
        }
        next_group = (g + 1) * a.G;
        sv = group_values<SF>(a, a.ws, a.ws_sup, blk, g, sb);
        if (INT4) ov = group_values<SF>(a, a.wo, a.wo_sup, blk, g, sb);
      }
      const int64_t ab = k / kABlock;
      const int32_t* s = isum[(i - 1) & 1][u];
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m) {
        if (!FULL && m >= rows) continue;
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * m));
        f[m] = _mm512_fmadd_ps(sum, _mm512_mul_ps(sv, _mm512_set1_ps(xs[m * a.nab + ab])), f[m]);
        if (INT4) f[m] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsx[m * a.nab + ab]), f[m]);
      }
    }
  }
  const int64_t n0 = blk * kBlock;
  const __mmask16 outputs = static_cast<__mmask16>((1u << std::min<int64_t>(kBlock, a.N - n0)) - 1);
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) {
    if ((!FULL && m >= rows) || m < kept) continue;
    if (k_end == a.K)
      _mm512_mask_storeu_ps(a.y + (r0 + m) * a.N + n0, outputs, f[m]);
    else
      _mm512_storeu_ps(acc + 16 * m, f[m]);
  }
}
#endif  // __AMX_INT8__

#else  // AVX2

// The 16 values of group g of block blk, into out[16].
template <int SF>
inline void group_values(const Args& a, const void* v, const float* sup, int64_t blk, int64_t g, float* out) {
  const int64_t at = (blk * a.ng + g) * kBlock;
  for (int h = 0; h < 2; ++h) {
    __m256 vals;
    const int64_t i = at + 8 * h;
    if (SF == kF32) vals = _mm256_loadu_ps(static_cast<const float*>(v) + i);
    else if (SF == kF16)
      vals = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(v) + i)));
    else {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(v) + i));
      vals = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)),
                           _mm256_loadu_ps(sup + (blk * a.nsb + g * a.G / a.S) * kBlock + 8 * h));
    }
    _mm256_store_ps(out + 8 * h, vals);
  }
}

inline __m256i broadcast_word(const uint8_t* p) { return _mm256_set1_epi32(load_word(p)); }

// Block blk for rows 0 .. MB - 1; a unit's 256 bytes per half stay in L1 between the halves.
template <bool INT4, int SF, int MB>
void tile(const Args& a, int64_t blk) {
  constexpr int64_t kStep = INT4 ? 8 : 4;
  const __m256i ones16 = _mm256_set1_epi16(1);
  alignas(32) float facc[MB][16] = {};
  alignas(32) float sv[16], ov[16] = {};  // int8: no offsets
  const uint8_t* wp = a.w + blk * a.blk_bytes;
  for (int64_t k0 = 0; k0 < a.K; k0 += a.E) {
    if (k0 % a.G == 0) {
      group_values<SF>(a, a.ws, a.ws_sup, blk, k0 / a.G, sv);
      if (INT4) group_values<SF>(a, a.wo, a.wo_sup, blk, k0 / a.G, ov);
    }
    const int64_t b = k0 / kABlock;
    for (int h = 0; h < 2; ++h) {
      __m256i acc[MB];
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + a.E; k += kStep) {
        const __m256i v = load_half(wp + (k / kStep) * 64, h);
        if (INT4) {
          __m256i lo, hi;
          split_nibbles(v, lo, hi);
          for (int m = 0; m < MB; ++m) {
            const uint8_t* x = a.xq + m * a.K + k;
            acc[m] = _mm256_add_epi16(acc[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast_word(x)),
                                                               _mm256_maddubs_epi16(hi, broadcast_word(x + 4))));
          }
        } else {
          const __m256i aw = _mm256_abs_epi8(v);
          for (int m = 0; m < MB; ++m) {
            const __m256i x = _mm256_sign_epi8(broadcast_word(a.xq + m * a.K + k), v);
            acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones16));
          }
        }
      }
      const __m256 s = _mm256_load_ps(sv + 8 * h), o = _mm256_load_ps(ov + 8 * h);
      for (int m = 0; m < MB; ++m) {
        const __m256i isum = INT4 ? _mm256_madd_epi16(acc[m], ones16) : acc[m];
        _mm256_store_ps(facc[m] + 8 * h, scale_unit<INT4>(_mm256_load_ps(facc[m] + 8 * h), _mm256_cvtepi32_ps(isum), s,
                                                          o, a.xs, a.xsx, m * a.nab + b));
      }
    }
  }
  for (int m = 0; m < MB; ++m) store_outputs(a, m, blk, facc[m]);
}

// Row of x -> its s8 activations (int8 too: the AVX2 products take them signed), block scales
// and (int4) xs * block sums.
void quantize_row(const float* row, int64_t K, bool int4, uint8_t* out, float* xs, float* xsx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kABlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(row + 32 * b + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float am = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(am > 0.0f ? 127.0f / am : 0.0f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)
      qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lo), hi);
    // packs work per 128-bit half: 0-3 4-7 | ... ; the permutation puts the 32 bytes back in order
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * b), p8);
    xs[b] = am / 127.0f;
    if (int4) {
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) sum += static_cast<int8_t>(out[32 * b + i]);
      xsx[b] = xs[b] * static_cast<float>(sum);
    }
  }
}

#endif

#if !defined(__AVX512VNNI__)
enum A8Variant { kVnni512 = 0 };  // the AVX2 build has tile() alone

template <bool INT4, int SF, int MB, int V>
inline void tile_variant(const Args& a, int64_t blk) {
  tile<INT4, SF, MB>(a, blk);
}
#endif

// Blocks in parallel; one tile holds all M <= 9 rows, so each weight is loaded (and int4 unpacked)
// once per call. V: the tile's instruction sequence (A8Variant).
template <bool INT4, int SF, int MB, int V>
void run(const Args& a) {
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) tile_variant<INT4, SF, MB, V>(a, blk);
  });
}

template <bool INT4, int SF, int V>
void run_rows(const Args& a, int64_t M) {
  switch (M) {
    case 1: run<INT4, SF, 1, V>(a); break;
    case 2: run<INT4, SF, 2, V>(a); break;
    case 3: run<INT4, SF, 3, V>(a); break;
    case 4: run<INT4, SF, 4, V>(a); break;
    case 5: run<INT4, SF, 5, V>(a); break;
    case 6: run<INT4, SF, 6, V>(a); break;
    case 7: run<INT4, SF, 7, V>(a); break;
    case 8: run<INT4, SF, 8, V>(a); break;
    case 9: run<INT4, SF, 9, V>(a); break;
    default: break;
  }
}

// the variants a format takes (int8: vnni512 and vnni256); anything else runs tile()
template <bool INT4, int SF>
void run_variant(const Args& a, int64_t M, int variant) {
#if defined(__AVX512VNNI__)
  if (variant == kVnni256) return run_rows<INT4, SF, kVnni256>(a, M);
  if constexpr (INT4) {
    if (variant == kVnni512Bcast) return run_rows<INT4, SF, kVnni512Bcast>(a, M);
    if (variant == kBf16) return run_rows<INT4, SF, kBf16>(a, M);
  }
#endif
  run_rows<INT4, SF, kVnni512>(a, M);
}

template <bool INT4>
void run_format(const Args& a, int64_t M, int sf, int variant) {
  sf == kF32 ? run_variant<INT4, kF32>(a, M, variant)
             : sf == kF16 ? run_variant<INT4, kF16>(a, M, variant) : run_variant<INT4, kTwoLevel>(a, M, variant);
}

// more rows: passes of kMaxRows with their own Args offsets, the remainder last
template <bool INT4>
void run_all(const Args& a, int64_t M, int sf, int variant) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    Args part = a;
    part.xq += m0 * a.K;
    part.xs += m0 * a.nab;
    if (INT4) part.xsx += m0 * a.nab;
    if (part.xb != nullptr) {
      part.xb += m0 * a.K;
      part.xstart += m0 * a.nab;
    }
    part.y += m0 * a.N;
    run_format<INT4>(part, std::min<int64_t>(kMaxRows, M - m0), sf, variant);
  }
}

#if defined(__AMX_INT8__)
constexpr int64_t kAmxRows = 16;             // rows per tile pass
constexpr int64_t kAmxChunkBytes = 32 << 10;  // B operand bytes of a block's inputs kept in L1 across passes

// Blocks in parallel; per block, its inputs in chunks whose B operands (int4: unpacked once) stay in
// L1 while every 16-row pass reads them. M >= 16: passes of 16 rows, the last one ending at row M
// (it recomputes rows the pass before it owns and keeps only its own), so one tile configuration
// serves the whole call.
template <bool INT4, int SF>
void run_amx_format(const Args& a, int64_t M) {
  if (M == 0) return;
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  const int64_t chunks = (16 * a.K + kAmxChunkBytes - 1) / kAmxChunkBytes;
  const int64_t chunk = ((a.K + chunks - 1) / chunks + 63) / 64 * 64;  // a multiple of 2 E
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> unpacked(INT4 ? 16 * chunk : 0);
    std::vector<float> acc(16 * M);  // [M][16]
    configure_a8(static_cast<int>(std::min(M, kAmxRows)), static_cast<int>(a.E));
    for (int64_t blk = begin; blk < end; ++blk) {
      const uint8_t* wp = a.w + blk * a.blk_bytes;
      for (int64_t kb = 0; kb < a.K; kb += chunk) {
        const int64_t ke = std::min(a.K, kb + chunk);
        const uint8_t* b = wp + 16 * kb;  // int8: the layout's vectors are the B rows
        if (INT4) {
          unpack_int4(wp, kb, ke, unpacked.data());
          b = unpacked.data();
        }
        if (M < kAmxRows) {
          tile_amx<INT4, SF, false>(a, blk, 0, static_cast<int>(M), kb, ke, b, acc.data(), 0);
          continue;
        }
        for (int64_t r = 0; r < M; r += kAmxRows) {
          const int64_t r0 = std::min(r, M - kAmxRows);
          tile_amx<INT4, SF, true>(a, blk, r0, kAmxRows, kb, ke, b, acc.data() + 16 * r0, static_cast<int>(r - r0));
        }
      }
    }
    _tile_release();
  });
}

template <bool INT4>
void run_amx(const Args& a, int64_t M, int sf) {
  sf == kF32 ? run_amx_format<INT4, kF32>(a, M) : sf == kF16 ? run_amx_format<INT4, kF16>(a, M)
                                                             : run_amx_format<INT4, kTwoLevel>(a, M);
}
#endif

int scale_format(const at::Tensor& scales) {
  return scales.scalar_type() == at::kFloat ? kF32 : scales.scalar_type() == at::kHalf ? kF16 : kTwoLevel;
}

void check_shapes(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& offsets,
                  const at::Tensor& scales_sup, const at::Tensor& offsets_sup, int64_t K, int64_t N, bool int4) {
  const int64_t padded = (N + kBlock - 1) / kBlock * kBlock;
  TORCH_CHECK(weight.is_contiguous() && weight.size(0) == padded && weight.size(1) == (int4 ? K / 2 : K),
              "woq a8: weight [N padded to 16, K] / [N padded to 16, K / 2]");
  const auto st = scales.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kHalf || st == at::kChar) && scales.is_contiguous() &&
              scales.size(0) == padded, "woq a8: float32, float16 or int8 [N padded to 16, K / G] scales");
  const int64_t G = K / scales.size(1);
  TORCH_CHECK(K % 64 == 0 && G % (int4 ? 32 : 16) == 0 && G * scales.size(1) == K,
              "woq a8: K a multiple of 64, G of 32 (int4) or 16 (int8)");
  TORCH_CHECK(!int4 || (offsets.scalar_type() == st && offsets.sizes() == scales.sizes() && offsets.is_contiguous()),
              "woq a8: int4 offsets shaped and typed as the scales");
  if (st == at::kChar) {
    const int64_t nsb = scales_sup.size(1), S = K / nsb;
    TORCH_CHECK(scales_sup.scalar_type() == at::kFloat && scales_sup.is_contiguous() &&
                scales_sup.size(0) == padded && S * nsb == K && S % G == 0 && S >= 32,
                "woq a8: int8 scales need float32 [N, K / S] super-block factors, S a multiple of G and >= 32");
    TORCH_CHECK(!int4 || (offsets_sup.sizes() == scales_sup.sizes() && offsets_sup.scalar_type() == at::kFloat &&
                          offsets_sup.is_contiguous()), "woq a8: int4 offset factors shaped as the scale factors");
  }
}

struct Quantized {
  at::Tensor xq, xs, xsx;
};

Quantized quantize(const at::Tensor& xf, bool int4) {
  const int64_t M = xf.size(0), K = xf.size(1);
  Quantized q{at::empty({M, K}, xf.options().dtype(at::kByte)), at::empty({M, K / kABlock}, xf.options()),
              at::empty({int4 ? M : 0, K / kABlock}, xf.options())};  // int8 has no use for xs * sums
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xf.data_ptr<float>() + m * K, K, int4, q.xq.data_ptr<uint8_t>() + m * K,
                 q.xs.data_ptr<float>() + m * (K / kABlock),
                 int4 ? q.xsx.data_ptr<float>() + m * (K / kABlock) : nullptr);
  return q;
}

}  // namespace

namespace {

constexpr int kAmx = -1;  // a8_linear_impl's variant: the AMX path (built with -mamx-int8 only)

// variant: an A8Variant or kAmx (whose activations are s8 for both formats); every one gives the
// same values bit for bit
at::Tensor a8_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const at::Tensor& offsets, const at::Tensor& scales_sup, const at::Tensor& offsets_sup,
                          int64_t K, int64_t N, const c10::optional<at::Tensor>& bias, int variant) {
  const bool amx = variant == kAmx;
  const bool int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || weight.scalar_type() == at::kChar, "woq a8: int8 or packed uint8 int4 weight");
  check_shapes(weight, scales, offsets, scales_sup, offsets_sup, K, N, int4);
  const int sf = scale_format(scales);
  TORCH_CHECK(x.size(-1) == K, "woq a8: x has ", x.size(-1), " inputs, the weight ", K);
  const int64_t G = K / scales.size(1);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  const Quantized q = quantize(xf, int4 || amx);
  at::Tensor y = at::empty({M, N}, xf.options());
  const bool two = sf == kTwoLevel;
  Args a{q.xq.data_ptr<uint8_t>(), q.xs.data_ptr<float>(), q.xsx.data_ptr<float>(),
         static_cast<const uint8_t*>(weight.data_ptr()), scales.data_ptr(), int4 ? offsets.data_ptr() : nullptr,
         two ? scales_sup.data_ptr<float>() : nullptr, two && int4 ? offsets_sup.data_ptr<float>() : nullptr,
         K, G, two ? K / scales_sup.size(1) : K, N, std::min<int64_t>(G, kABlock),
         K / G, two ? scales_sup.size(1) : 0, K / kABlock, kBlock * (int4 ? K / 2 : K), y.data_ptr<float>()};
  at::Tensor xb, xstart;  // the bf16 variant's activations, alive until the kernel returns
#if defined(__AVX512VNNI__)
  if (int4 && variant == kBf16) {
    TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "woq a8: the bf16 variant needs a CPU with avx512_bf16");
    xb = at::empty({M, K}, xf.options().dtype(at::kShort));
    xstart = at::empty({M, K / kABlock}, xf.options());
    bf16_activations(a, M, reinterpret_cast<uint16_t*>(xb.data_ptr<int16_t>()), xstart.data_ptr<float>());
    a.xb = reinterpret_cast<const uint16_t*>(xb.data_ptr<int16_t>());
    a.xstart = xstart.data_ptr<float>();
  }
#endif
#if defined(__AMX_INT8__)
  if (amx) {
    int4 ? run_amx<true>(a, M, sf) : run_amx<false>(a, M, sf);
  } else {
    int4 ? run_all<true>(a, M, sf, variant) : run_all<false>(a, M, sf, variant);
  }
#else
  TORCH_CHECK(!amx, "woq a8: built without AMX");
  int4 ? run_all<true>(a, M, sf, variant) : run_all<false>(a, M, sf, variant);
#endif
  specdec_cpu_common::add_bias(y, bias);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes).to(x.scalar_type());
}

}  // namespace

at::Tensor a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const at::Tensor& offsets, const at::Tensor& scales_sup, const at::Tensor& offsets_sup,
                     int64_t K, int64_t N, const c10::optional<at::Tensor>& bias) {
  return a8_linear_impl(x, weight, scales, offsets, scales_sup, offsets_sup, K, N, bias, kVnni512);
}

#if defined(__AVX512VNNI__)
// a8_linear through one of woq_a8_variants.h's tiles, equal to it bit for bit (int8 weights take
// vnni256; the int4-only variants run a8_linear's tile on them)
#define SPECDEC_A8_VARIANT(name, variant)                                                                          \
  at::Tensor name(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& offsets, \
                  const at::Tensor& scales_sup, const at::Tensor& offsets_sup, int64_t K, int64_t N,                  \
                  const c10::optional<at::Tensor>& bias) {                                                           \
    return a8_linear_impl(x, weight, scales, offsets, scales_sup, offsets_sup, K, N, bias, variant);                \
  }
SPECDEC_A8_VARIANT(a8_linear_vnni512_bcast, kVnni512Bcast)
SPECDEC_A8_VARIANT(a8_linear_vnni256, kVnni256)
SPECDEC_A8_VARIANT(a8_linear_bf16, kBf16)
#undef SPECDEC_A8_VARIANT
#endif

#if defined(__AMX_INT8__)
// a8_linear through AMX tiles, equal to it bit for bit; the process must hold AMX state
// (amx_cpu.available() asks the OS for it)
at::Tensor a8_linear_amx(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                         const at::Tensor& offsets, const at::Tensor& scales_sup, const at::Tensor& offsets_sup,
                         int64_t K, int64_t N, const c10::optional<at::Tensor>& bias) {
  return a8_linear_impl(x, weight, scales, offsets, scales_sup, offsets_sup, K, N, bias, kAmx);
}
#endif

// The quantized activations as the kernel reads them: (q [M, K], as int8 bit patterns for int4 and
// for int8 on AVX2, + 128 as uint8 for int8 on VNNI; block scales [M, K / 32]; int4: xs * block
// sums [M, K / 32], int8: an empty [0, K / 32]).
std::vector<at::Tensor> a8_quantize(const at::Tensor& x, bool int4) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  TORCH_CHECK(xf.dim() == 2 && xf.size(1) % kABlock == 0, "woq a8: x [M, K], K a multiple of 32");
  const Quantized q = quantize(xf, int4);
  return {q.xq, q.xs, q.xsx};
}

TORCH_LIBRARY(SPECDEC_LIB, m) {
  m.def("a8_linear(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor scales_sup, Tensor offsets_sup, "
        "int K, int N, Tensor? bias=None) -> Tensor", &a8_linear);
  m.def("a8_quantize(Tensor x, bool int4) -> Tensor[]", &a8_quantize);
#if defined(__AVX512VNNI__)
#define SPECDEC_A8_ARGS \
  "(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor scales_sup, Tensor offsets_sup, int K, int N, " \
  "Tensor? bias=None) -> Tensor"
  m.def("a8_linear_vnni512_bcast" SPECDEC_A8_ARGS, &a8_linear_vnni512_bcast);
  m.def("a8_linear_vnni256" SPECDEC_A8_ARGS, &a8_linear_vnni256);
  m.def("a8_linear_bf16" SPECDEC_A8_ARGS, &a8_linear_bf16);
#undef SPECDEC_A8_ARGS
#endif
#if defined(__AMX_INT8__)
  m.def("a8_linear_amx(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor scales_sup, "
        "Tensor offsets_sup, int K, int N, Tensor? bias=None) -> Tensor", &a8_linear_amx);
#endif
}
