// int8-activation linear for x86 CPUs with AVX-512 VNNI or AVX2: y[M, N] = A8(x)[M, K] . W[N, K]^T, the
// function woq_format.reference_linear_a8 defines (int8 / int4 weights; x quantized per row per
// block of 32 inputs, symmetric, round half to even; integer block sums; float scaling).
//
// Layout. K is cut into chunks of 512, 256, 128 or 64 inputs (greedy, largest first). In a chunk
// of C inputs, 32-bit lane l of a 512-bit register owns the W = C / 16 consecutive inputs
// l*W .. l*W + W - 1, and step s of the chunk's C / 64 steps holds inputs l*W + 4s .. l*W + 4s + 3
// of every lane in bytes 4l .. 4l + 3. So one vpdpbusd per step adds 4 products to each lane, a
// lane never leaves one 32-input activation block (nor one weight group), and after the chunk one
// conversion and two or three float operations per (row, output) apply the 16 lanes' activation
// and weight scales at once. Activations are written in this order when quantized; weights are
// stored in it once (woq_cpu.A8Weight): int8 as is, int4 as 32 bytes per step with byte b holding
// position b in its low nibble and position b + 32 in its high nibble. Weight rows are stored in
// groups of kRowGroup (the last group holds the N % kRowGroup rest): a group's rows step by step
// (step 0 of each row, then step 1 of each row, ...), so a tile of a group's rows reads one
// sequential stream where row-major storage gives it one short stream per row.
//
// int4: vpdpbusd(u8 weights 0..15, s8 activations); the offset term is offset * (sum of the lane's
// activations). int8: vpdpbusd(u8 = activations + 128, s8 weights) minus 128 * (sum of the lane's
// weights), that sum taken by one more vpdpbusd per step against ones, shared by the tile's rows.
//
// AVX2 (no VNNI; built where AVX-512 VNNI is missing): the same layout, each 64-byte step as two
// 256-bit halves (lanes 0-7, 8-15). Products by vpmaddubsw (u8 . s8 pairs into int16) and vpmaddwd
// against ones. int4: the u8 weights 0..15 times the s8 activations, pairs summed in int16 over a
// chunk's at most 8 steps (|sum| <= 8 * 2 * 15 * 127 < 2^15), widened once per chunk. int8: |w|
// times the activation with w's sign (|w| <= 128 and |x| <= 127: a pair fits int16), widened each
// step. The integer sums are exact, the same as the VNNI path's.
//
// Every (row, output) result is the same instruction sequence whatever M is and whichever rows
// share its tile, so row i of an M-row call equals the 1-row call bit for bit.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#ifndef SPECDEC_LIB
#define SPECDEC_LIB specdec_woq_a8
#endif

struct Chunk {
  int64_t c0, C, g0;
  alignas(64) int32_t group_of_lane[16];   // lane -> its weight group, relative to g0
  int32_t num_groups;                      // the groups the chunk touches, from g0
  int64_t sb0;                             // two-level scales: the chunk's first super-block of S inputs
  alignas(64) int32_t super_of_group[16];  // group (relative to g0) -> its super-block, relative to sb0
  int32_t num_supers;                      // the super-blocks the chunk touches, from sb0
  bool identity;                           // lane l is group l (a lane's inputs are one whole group)
  // AVX2, per half h of the lanes: the super-block of its first group (relative to sb0) and, for
  // the 8 groups from that first one, each one's super-block relative to it
  int32_t half_super[2];
  alignas(32) int32_t half_super_of_group[2][8];
};

// S: inputs per super-block of two-level scales (0: none)
std::vector<Chunk> make_chunks(int64_t K, int64_t G, int64_t S = 0) {
  std::vector<Chunk> out;
  int64_t c0 = 0;
  while (c0 < K) {
    int64_t C = 512;
    while (C > K - c0 || C / 16 > G) C /= 2;  // a lane's inputs within one weight group
    Chunk c{};
    c.c0 = c0;
    c.C = C;
    c.g0 = c0 / G;
    for (int l = 0; l < 16; ++l) c.group_of_lane[l] = static_cast<int32_t>((c0 + l * (C / 16)) / G - c.g0);
    c.num_groups = c.group_of_lane[15] + 1;
    c.sb0 = S > 0 ? c0 / S : 0;
    for (int j = 0; j < c.num_groups && S > 0; ++j) c.super_of_group[j] = static_cast<int32_t>((c0 + j * G) / S - c.sb0);
    c.num_supers = c.super_of_group[c.num_groups - 1] + 1;
    c.identity = c.num_groups == 16;
    for (int h = 0; h < 2; ++h) {
      const int32_t first = c.group_of_lane[8 * h];
      c.half_super[h] = c.super_of_group[first];
      for (int j = 0; j < 8; ++j)
        c.half_super_of_group[h][j] = first + j < c.num_groups ? c.super_of_group[first + j] - c.half_super[h] : 0;
    }
    out.push_back(c);
    c0 += C;
  }
  return out;
}

struct Args {
  const uint8_t* xq;    // [M, K] activations in chunk order (int4: s8 bit patterns; int8: + 128)
  const float* xs;      // [M, L] the activation scale of each lane (L = 16 * chunks)
  const float* xsum;    // [M, L] int4: the sum of each lane's quantized activations
  const uint8_t* w;     // int8 [N, K] or int4 [N, K / 2], chunk order
  const void* ws;       // [N, K / G] group scales: float32, float16 or (two-level) int8
  const void* wo;       // [N, K / G] int4 offsets, as the scales
  const float* ws_sup;  // two-level: [N, K / S] float32 super-block factors of the scales
  const float* wo_sup;  // two-level, int4: of the offsets
  const Chunk* chunks;
  int64_t num_chunks, K, G, L, N, nsb;
  float* y;
  int64_t ng;  // K / G, the groups of a row (one division per call, not one per chunk and output)
};

// Scale formats (the scales' dtype): float32 as is; float16 widened; int8 times the float32
// factor of its super-block. Each gives the same float32 values a float32 copy would hold (the
// Python side stores a compact form only where it is exact), so the result does not depend on it.
enum ScaleFormat { kF32 = 0, kF16 = 1, kTwoLevel = 2 };

constexpr int kMaxRows = 9;  // rows per kernel pass; more rows run as passes of these
constexpr int64_t kRowGroup = 4;  // weight rows stored step-interleaved (see the layout above)

// Where output n's weights start and how far apart its steps are, step_bytes per row and step.
struct RowStream {
  const uint8_t* p;
  int64_t stride;
};
inline RowStream row_stream(const Args& a, int64_t n, int64_t step_bytes) {
  const int64_t g = n - n % kRowGroup, rows = std::min<int64_t>(kRowGroup, a.N - g);
  return {a.w + g * step_bytes * (a.K / 64) + (n - g) * step_bytes, rows * step_bytes};
}

#if defined(__AVX512VNNI__)

// The chunk's group values (lane j = group g0 + j) of output n.
template <int SF>
__attribute__((always_inline)) inline __m512 group_values(const Args& a, const Chunk& ch, const void* v,
                                                         const float* sup, int64_t n) {
  const int64_t base = n * a.ng + ch.g0;
  const __mmask16 groups = static_cast<__mmask16>((1u << ch.num_groups) - 1);
  if (SF == kF32) return _mm512_maskz_loadu_ps(groups, static_cast<const float*>(v) + base);
  if (SF == kF16)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(groups, static_cast<const uint16_t*>(v) + base));
  const __m512 mult = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(groups, static_cast<const int8_t*>(v) + base)));
  const __mmask16 supers = static_cast<__mmask16>((1u << ch.num_supers) - 1);
  const __m512 factor = _mm512_permutexvar_ps(_mm512_loadu_si512(ch.super_of_group),
                                              _mm512_maskz_loadu_ps(supers, sup + n * a.nsb + ch.sb0));
  return _mm512_mul_ps(mult, factor);
}

// acc += u8 a . s8 b per 32-bit lane (vpdpbusd), accumulating in place: written with the
// intrinsic, gcc 12 copies every accumulator of a large tile through another register (and the
// stack) on each step, which costs more than the dot products.
__attribute__((always_inline)) inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

template <bool INT4>
__attribute__((always_inline)) inline __m512i load_weights(const uint8_t* p) {
  if (!INT4) return _mm512_loadu_si512(p);
  // the 32 bytes in both halves; the upper half's 16-bit words shifted right by 4: after the
  // mask, low nibbles (positions 0-31) below, high nibbles (positions 32-63) above
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), _mm512_set1_epi8(0x0F));
}

// Outputs n0 .. n0 + NB - 1 (within one row group) for rows m0 .. m0 + MB - 1.
template <bool INT4, int SF, int NB, int MB>
void tile(const Args& a, int64_t n0, int64_t m0) {
  const __m512i ones = _mm512_set1_epi8(1);
  // float accumulators live in memory (L1): touched once per chunk, they leave the registers to
  // the integer accumulators of the inner loop
  alignas(64) float facc_mem[NB][MB][16] = {};
  constexpr int64_t step_bytes = INT4 ? 32 : 64;  // one row's weights per step of 64 inputs
  RowStream rs[NB];
  for (int n = 0; n < NB; ++n) rs[n] = row_stream(a, n0 + n, step_bytes);
  for (int64_t c = 0; c < a.num_chunks; ++c) {
    const Chunk& ch = a.chunks[c];
    __m512i iacc[NB][MB], wsum[NB];
    for (int n = 0; n < NB; ++n) {
      wsum[n] = _mm512_setzero_si512();
      for (int m = 0; m < MB; ++m) iacc[n][m] = _mm512_setzero_si512();
    }
    for (int64_t k = ch.c0; k < ch.c0 + ch.C; k += 64) {
      specdec_cpu_common::prefetch_stream(rs[0].p, (k / 64) * rs[0].stride, NB * step_bytes);
      __m512i w[NB];
      for (int n = 0; n < NB; ++n) {
        w[n] = load_weights<INT4>(rs[n].p + (k / 64) * rs[n].stride);
        if (!INT4) dpbusd(wsum[n], ones, w[n]);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512i x = _mm512_loadu_si512(a.xq + (m0 + m) * a.K + k);
        for (int n = 0; n < NB; ++n)
          INT4 ? dpbusd(iacc[n][m], w[n], x) : dpbusd(iacc[n][m], x, w[n]);
      }
    }
    __m512 sv[NB], ov[NB];
    const __m512i lane_group = _mm512_loadu_si512(ch.group_of_lane);
    for (int n = 0; n < NB; ++n) {
      sv[n] = group_values<SF>(a, ch, a.ws, a.ws_sup, n0 + n);
      if (!ch.identity) sv[n] = _mm512_permutexvar_ps(lane_group, sv[n]);
      if (INT4) {
        ov[n] = group_values<SF>(a, ch, a.wo, a.wo_sup, n0 + n);
        if (!ch.identity) ov[n] = _mm512_permutexvar_ps(lane_group, ov[n]);
      } else {
        wsum[n] = _mm512_slli_epi32(wsum[n], 7);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xs = _mm512_loadu_ps(a.xs + (m0 + m) * a.L + 16 * c);
      if (INT4) {
        const __m512 xsum = _mm512_loadu_ps(a.xsum + (m0 + m) * a.L + 16 * c);
        for (int n = 0; n < NB; ++n) {
          const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[n][m]), sv[n], _mm512_mul_ps(ov[n], xsum));
          _mm512_store_ps(facc_mem[n][m], _mm512_fmadd_ps(t, xs, _mm512_load_ps(facc_mem[n][m])));
        }
      } else {
        for (int n = 0; n < NB; ++n) {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[n][m], wsum[n])), sv[n]);
          _mm512_store_ps(facc_mem[n][m], _mm512_fmadd_ps(t, xs, _mm512_load_ps(facc_mem[n][m])));
        }
      }
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) a.y[(m0 + m) * a.N + n0 + n] = _mm512_reduce_add_ps(_mm512_load_ps(facc_mem[n][m]));
}

// Tiles of NB outputs within the row groups (NB divides kRowGroup); the last group's
// N % kRowGroup outputs one by one.
template <bool INT4, int SF, int NB, int MB>
void run(const Args& a) {
  static_assert(kRowGroup % NB == 0, "a tile stays in one row group");
  const int64_t full = a.N / kRowGroup * (kRowGroup / NB);
  at::parallel_for(0, full, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) tile<INT4, SF, NB, MB>(a, b * NB, 0);
  });
  for (int64_t n = full * NB; n < a.N; ++n) tile<INT4, SF, 1, MB>(a, n, 0);
}

// One tile holds all M <= 9 rows, so each weight is loaded (and int4 unpacked) once per call;
// outputs per tile shrink as rows grow to keep the integer accumulators in registers.
template <bool INT4, int SF>
void run_rows(const Args& a, int64_t M) {
  switch (M) {
    case 1: run<INT4, SF, 4, 1>(a); break;
    case 2: run<INT4, SF, 4, 2>(a); break;
    case 3: run<INT4, SF, 4, 3>(a); break;
    case 4: run<INT4, SF, 4, 4>(a); break;
    case 5: run<INT4, SF, 2, 5>(a); break;
    case 6: run<INT4, SF, 2, 6>(a); break;
    case 7: run<INT4, SF, 2, 7>(a); break;
    case 8: run<INT4, SF, 2, 8>(a); break;
    case 9: run<INT4, SF, 2, 9>(a); break;
    default: break;
  }
}

template <bool INT4>
void run_format(const Args& a, int64_t M, int sf) {
  sf == kF32 ? run_rows<INT4, kF32>(a, M) : sf == kF16 ? run_rows<INT4, kF16>(a, M) : run_rows<INT4, kTwoLevel>(a, M);
}

// Rows of x -> activations in chunk order, per-lane scales and (int4) per-lane sums.
void quantize_rows(const float* x, int64_t M, int64_t K, const std::vector<Chunk>& chunks, bool int4, uint8_t* xq,
                   float* xs, float* xsum) {
  const int64_t L = 16 * static_cast<int64_t>(chunks.size());
  std::vector<int8_t> q(K);
  std::vector<float> bs(K / 32);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i ones = _mm512_set1_epi8(1), bias = _mm512_set1_epi8(static_cast<char>(0x80));  // + 128 (mod 256)
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    for (int64_t b = 0; b < K / 32; ++b) {
      const __m512 v0 = _mm512_loadu_ps(row + 32 * b), v1 = _mm512_loadu_ps(row + 32 * b + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      bs[b] = amax / 127.0f;
      const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), lo), hi);
      const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + 32 * b), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
    }
    uint8_t* out = xq + m * K;
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (size_t c = 0; c < chunks.size(); ++c) {
      const int64_t c0 = chunks[c].c0, W = chunks[c].C / 16;
      // lane l's first input c0 + l W: its 4-byte words, step by step, and its block's scale
      const __m512i first = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c0)),
                                             _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(W))));
      _mm512_storeu_ps(xs + m * L + 16 * c, _mm512_i32gather_ps(_mm512_srli_epi32(first, 5), bs.data(), 4));
      __m512i sum = _mm512_setzero_si512();
      for (int64_t s = 0; s < W / 4; ++s) {
        const __m512i word = _mm512_add_epi32(_mm512_srli_epi32(first, 2), _mm512_set1_epi32(static_cast<int32_t>(s)));
        const __m512i v = _mm512_i32gather_epi32(word, q.data(), 4);
        sum = _mm512_dpbusd_epi32(sum, ones, v);  // 1 * each signed byte: the lane's sum
        _mm512_storeu_si512(out + c0 + 64 * s, int4 ? v : _mm512_xor_si512(v, bias));
      }
      if (xsum != nullptr) _mm512_storeu_ps(xsum + m * L + 16 * c, _mm512_cvtepi32_ps(sum));
    }
  }
}

#else  // AVX2

// 8 consecutive values from p[pos] as floats (values past `total` read as 0)
template <typename T>
inline __m256 load8(const T* p, int64_t pos, int64_t total) {
  if (__builtin_expect(pos + 8 > total, 0)) {  // the last rows' values: copied out first
    alignas(32) T tmp[8] = {};
    for (int64_t i = 0; pos + i < total && i < 8; ++i) tmp[i] = p[pos + i];
    return load8(tmp, 0, 8);
  }
  if constexpr (std::is_same<T, float>::value) return _mm256_loadu_ps(p + pos);
  else if constexpr (std::is_same<T, uint16_t>::value)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + pos)));
  else return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + pos))));
}

// Lanes 8h .. 8h + 7 of the chunk's group values of output n (lane -> its group's value). The
// half's lanes touch at most 8 consecutive groups (a lane never spans two), loaded at once and
// moved to their lanes by one permutation; two-level: codes times their super-blocks' factors,
// moved likewise.
template <int SF>
__attribute__((always_inline)) inline __m256 half_values(const Args& a, const Chunk& ch, const void* v,
                                                        const float* sup, int64_t n, int h) {
  const int64_t ng = a.ng, first = ch.group_of_lane[8 * h];
  const int64_t pos = n * ng + ch.g0 + first, total = a.N * ng;
  __m256 vals;
  if (SF == kF32) vals = load8(static_cast<const float*>(v), pos, total);
  else if (SF == kF16) vals = load8(static_cast<const uint16_t*>(v), pos, total);
  else {
    const __m256 factors = _mm256_permutevar8x32_ps(
        load8(sup, n * a.nsb + ch.sb0 + ch.half_super[h], a.N * a.nsb),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(ch.half_super_of_group[h])));
    vals = _mm256_mul_ps(load8(static_cast<const int8_t*>(v), pos, total), factors);
  }
  if (ch.identity) return vals;
  const __m256i lanes = _mm256_sub_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(ch.group_of_lane + 8 * h)),
                                         _mm256_set1_epi32(static_cast<int32_t>(first)));
  return _mm256_permutevar8x32_ps(vals, lanes);
}

// One chunk, outputs n0 .. n0 + NB - 1, rows m0 .. m0 + RB - 1: integer dot products per lane,
// then facc[n][m] += xs * (ws * I (+ wo * xsum)) per lane. The activations are s8 (int8 too).
template <bool INT4, int NB, int RB>
__attribute__((always_inline)) inline void chunk_rows(const Args& a, const Chunk& ch, int64_t c, int64_t n0,
                                                     int64_t m0, const float (*sv)[16], const float (*ov)[16],
                                                     float (*facc)[kMaxRows][16]) {
  const __m256i ones16 = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  __m256i acc[NB][RB][2];
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < RB; ++m) acc[n][m][0] = acc[n][m][1] = _mm256_setzero_si256();
  constexpr int64_t step_bytes = INT4 ? 32 : 64;  // one row's weights per step of 64 inputs
  RowStream rs[NB];
  for (int n = 0; n < NB; ++n) rs[n] = row_stream(a, n0 + n, step_bytes);
  for (int64_t k = ch.c0; k < ch.c0 + ch.C; k += 64) {
    specdec_cpu_common::prefetch_stream(rs[0].p, (k / 64) * rs[0].stride, NB * step_bytes);
    for (int n = 0; n < NB; ++n) {
      const uint8_t* row = rs[n].p + (k / 64) * rs[n].stride;
      if (INT4) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        const __m256i w0 = _mm256_and_si256(v, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int m = 0; m < RB; ++m) {
          const uint8_t* x = a.xq + (m0 + m) * a.K + k;
          acc[n][m][0] = _mm256_add_epi16(acc[n][m][0], _mm256_maddubs_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
          acc[n][m][1] = _mm256_add_epi16(acc[n][m][1], _mm256_maddubs_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
        }
      } else {
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32));
        const __m256i w0 = _mm256_abs_epi8(r0), w1 = _mm256_abs_epi8(r1);
        for (int m = 0; m < RB; ++m) {
          const uint8_t* x = a.xq + (m0 + m) * a.K + k;
          const __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), r0);
          const __m256i x1 = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)), r1);
          acc[n][m][0] = _mm256_add_epi32(acc[n][m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones16));
          acc[n][m][1] = _mm256_add_epi32(acc[n][m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones16));
        }
      }
    }
  }
  for (int m = 0; m < RB; ++m)
    for (int h = 0; h < 2; ++h) {
      const __m256 xs = _mm256_loadu_ps(a.xs + (m0 + m) * a.L + 16 * c + 8 * h);
      const __m256 xsum = INT4 ? _mm256_loadu_ps(a.xsum + (m0 + m) * a.L + 16 * c + 8 * h) : _mm256_setzero_ps();
      for (int n = 0; n < NB; ++n) {
        const __m256i isum = INT4 ? _mm256_madd_epi16(acc[n][m][h], ones16) : acc[n][m][h];
        const __m256 s = _mm256_load_ps(sv[n] + 8 * h);
        const __m256 t = INT4 ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, _mm256_mul_ps(_mm256_load_ps(ov[n] + 8 * h), xsum))
                              : _mm256_mul_ps(_mm256_cvtepi32_ps(isum), s);
        float* f = facc[n][m0 + m] + 8 * h;
        _mm256_store_ps(f, _mm256_fmadd_ps(t, xs, _mm256_load_ps(f)));
      }
    }
}

// outputs n0 .. n0 + NB - 1 (within one row group) for all M <= kMaxRows rows, RB rows at a time
// per chunk (the chunk's weights stay in L1 between the row blocks)
template <bool INT4, int SF, int NB, int RB>
void tile(const Args& a, int64_t n0, int64_t M) {
  alignas(32) float facc[NB][kMaxRows][16];
  for (int n = 0; n < NB; ++n) std::memset(facc[n], 0, sizeof(float) * 16 * M);
  alignas(32) float sv[NB][16], ov[NB][16];
  for (int64_t c = 0; c < a.num_chunks; ++c) {
    const Chunk& ch = a.chunks[c];
    for (int n = 0; n < NB; ++n)
      for (int h = 0; h < 2; ++h) {
        _mm256_store_ps(sv[n] + 8 * h, half_values<SF>(a, ch, a.ws, a.ws_sup, n0 + n, h));
        if (INT4) _mm256_store_ps(ov[n] + 8 * h, half_values<SF>(a, ch, a.wo, a.wo_sup, n0 + n, h));
      }
    int64_t m0 = 0;
    for (; m0 + RB <= M; m0 += RB) chunk_rows<INT4, NB, RB>(a, ch, c, n0, m0, sv, ov, facc);
    switch (M - m0) {
      case 1: chunk_rows<INT4, NB, 1>(a, ch, c, n0, m0, sv, ov, facc); break;
      case 2: chunk_rows<INT4, NB, (RB > 2 ? 2 : 1)>(a, ch, c, n0, m0, sv, ov, facc); break;
      default: break;
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int64_t m = 0; m < M; ++m)
      a.y[m * a.N + n0 + n] = specdec_cpu_common::vreduce_add(
          _mm256_add_ps(_mm256_load_ps(facc[n][m]), _mm256_load_ps(facc[n][m] + 8)));
}

// Tiles of NB outputs within the row groups (NB divides kRowGroup); the last group's
// N % kRowGroup outputs one by one.
template <bool INT4, int SF, int NB, int RB>
void run(const Args& a, int64_t M) {
  static_assert(kRowGroup % NB == 0, "a tile stays in one row group");
  const int64_t full = a.N / kRowGroup * (kRowGroup / NB);
  at::parallel_for(0, full, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) tile<INT4, SF, NB, RB>(a, b * NB, M);
  });
  for (int64_t n = full * NB; n < a.N; ++n) tile<INT4, SF, 1, RB>(a, n, M);
}

template <bool INT4, int SF>
void run_rows(const Args& a, int64_t M) {
  if (M == 1) run<INT4, SF, 4, 1>(a, M);
  else if (M == 2 || M == 4) run<INT4, SF, 2, 2>(a, M);
  else run<INT4, SF, 2, 3>(a, M);
}

template <bool INT4>
void run_format(const Args& a, int64_t M, int sf) {
  sf == kF32 ? run_rows<INT4, kF32>(a, M) : sf == kF16 ? run_rows<INT4, kF16>(a, M) : run_rows<INT4, kTwoLevel>(a, M);
}

// Rows of x -> s8 activations in chunk order (int8 too: the AVX2 products take them signed),
// per-lane scales and (int4) per-lane sums.
void quantize_rows(const float* x, int64_t M, int64_t K, const std::vector<Chunk>& chunks, bool /*int4*/,
                   uint8_t* xq, float* xs, float* xsum) {
  const int64_t L = 16 * static_cast<int64_t>(chunks.size());
  std::vector<int8_t> q(K);
  std::vector<float> bs(K / 32);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    for (int64_t b = 0; b < K / 32; ++b) {
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
      bs[b] = am / 127.0f;
      __m256i qi[4];
      for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lo), hi);
      // packs work per 128-bit half: 0-3 4-7 | ... ; the permutation puts the 32 bytes back in order
      const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + 32 * b), p8);
    }
    uint8_t* out = xq + m * K;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const int64_t c0 = chunks[c].c0, W = chunks[c].C / 16;
      for (int l = 0; l < 16; ++l) {
        const int64_t first = c0 + l * W;
        xs[m * L + 16 * c + l] = bs[first / 32];
        int32_t sum = 0;
        for (int64_t s = 0; s < W / 4; ++s) {
          std::memcpy(out + c0 + 64 * s + 4 * l, q.data() + first + 4 * s, 4);
          for (int t = 0; t < 4; ++t) sum += q[first + 4 * s + t];
        }
        if (xsum != nullptr) xsum[m * L + 16 * c + l] = static_cast<float>(sum);
      }
    }
  }
}

#endif

// more rows: passes of kMaxRows with their own Args offsets, the remainder last
template <bool INT4>
void run_all(const Args& a, int64_t M, int sf) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    Args part = a;
    part.xq += m0 * a.K;
    part.xs += m0 * a.L;
    if (INT4) part.xsum += m0 * a.L;
    part.y += m0 * a.N;
    run_format<INT4>(part, std::min<int64_t>(kMaxRows, M - m0), sf);
  }
}

int scale_format(const at::Tensor& scales) {
  return scales.scalar_type() == at::kFloat ? kF32 : scales.scalar_type() == at::kHalf ? kF16 : kTwoLevel;
}

void check_shapes(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& offsets,
                  const at::Tensor& scales_sup, const at::Tensor& offsets_sup, int64_t K, bool int4) {
  TORCH_CHECK(weight.is_contiguous() && weight.size(1) == (int4 ? K / 2 : K), "woq a8: weight [N, K] / [N, K / 2]");
  const auto st = scales.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kHalf || st == at::kChar) && scales.is_contiguous() &&
              scales.size(0) == weight.size(0), "woq a8: float32, float16 or int8 [N, K / G] scales");
  const int64_t G = K / scales.size(1);
  TORCH_CHECK(K % 64 == 0 && G % (int4 ? 32 : 16) == 0 && G * scales.size(1) == K,
              "woq a8: K a multiple of 64, G of 32 (int4) or 16 (int8)");
  TORCH_CHECK(!int4 || (offsets.scalar_type() == st && offsets.sizes() == scales.sizes() && offsets.is_contiguous()),
              "woq a8: int4 offsets shaped and typed as the scales");
  if (st == at::kChar) {
    const int64_t nsb = scales_sup.size(1), S = K / nsb;
    TORCH_CHECK(scales_sup.scalar_type() == at::kFloat && scales_sup.is_contiguous() &&
                scales_sup.size(0) == weight.size(0) && S * nsb == K && S % G == 0 && S >= 32,
                "woq a8: int8 scales need float32 [N, K / S] super-block factors, S a multiple of G and >= 32");
    TORCH_CHECK(!int4 || (offsets_sup.sizes() == scales_sup.sizes() && offsets_sup.scalar_type() == at::kFloat &&
                          offsets_sup.is_contiguous()), "woq a8: int4 offset factors shaped as the scale factors");
  }
}

}  // namespace

at::Tensor a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const at::Tensor& offsets, const at::Tensor& scales_sup, const at::Tensor& offsets_sup,
                     int64_t K, const c10::optional<at::Tensor>& bias) {
  const bool int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || weight.scalar_type() == at::kChar, "woq a8: int8 or packed uint8 int4 weight");
  check_shapes(weight, scales, offsets, scales_sup, offsets_sup, K, int4);
  const int sf = scale_format(scales);
  const int64_t S = sf == kTwoLevel ? K / scales_sup.size(1) : 0;
  TORCH_CHECK(x.size(-1) == K, "woq a8: x has ", x.size(-1), " inputs, the weight ", K);
  const int64_t N = weight.size(0), G = K / scales.size(1);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  const std::vector<Chunk> chunks = make_chunks(K, G, S);
  const int64_t L = 16 * static_cast<int64_t>(chunks.size());
  at::Tensor xq = at::empty({M, K}, xf.options().dtype(at::kByte));
  at::Tensor xs = at::empty({M, L}, xf.options());
  at::Tensor xsum = int4 ? at::empty({M, L}, xf.options()) : at::Tensor();
  quantize_rows(xf.data_ptr<float>(), M, K, chunks, int4, xq.data_ptr<uint8_t>(), xs.data_ptr<float>(),
                int4 ? xsum.data_ptr<float>() : nullptr);
  at::Tensor y = at::empty({M, N}, xf.options());
  const bool two = sf == kTwoLevel;
  const Args a{xq.data_ptr<uint8_t>(), xs.data_ptr<float>(), int4 ? xsum.data_ptr<float>() : nullptr,
               static_cast<const uint8_t*>(weight.data_ptr()), scales.data_ptr(), int4 ? offsets.data_ptr() : nullptr,
               two ? scales_sup.data_ptr<float>() : nullptr, two && int4 ? offsets_sup.data_ptr<float>() : nullptr,
               chunks.data(), static_cast<int64_t>(chunks.size()), K, G, L, N, two ? scales_sup.size(1) : 0,
               y.data_ptr<float>(), K / G};
  int4 ? run_all<true>(a, M, sf) : run_all<false>(a, M, sf);
  specdec_cpu_common::add_bias(y, bias);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes).to(x.scalar_type());
}

// The quantized activations as the kernel lays them out: (q [M, K] in chunk order, as int8 for
// int4 and + 128 as uint8 for int8; per-lane scales [M, L]; int4: per-lane sums [M, L]).
std::vector<at::Tensor> a8_quantize(const at::Tensor& x, int64_t G, bool int4) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  TORCH_CHECK(K % 64 == 0 && G % (int4 ? 32 : 16) == 0 && K % G == 0,
              "woq a8: K a multiple of 64, G of 32 (int4) or 16 (int8)");
  const std::vector<Chunk> chunks = make_chunks(K, G);
  const int64_t L = 16 * static_cast<int64_t>(chunks.size());
  at::Tensor xq = at::empty({M, K}, xf.options().dtype(at::kByte));
  at::Tensor xs = at::empty({M, L}, xf.options());
  at::Tensor xsum = at::zeros({M, L}, xf.options());
  quantize_rows(xf.data_ptr<float>(), M, K, chunks, int4, xq.data_ptr<uint8_t>(), xs.data_ptr<float>(),
                int4 ? xsum.data_ptr<float>() : nullptr);
#if !defined(__AVX512VNNI__)
  if (!int4) xq.bitwise_xor_(0x80);  // the AVX2 path keeps int8's activations signed: + 128 as documented
#endif
  return {xq, xs, xsum};
}

TORCH_LIBRARY(SPECDEC_LIB, m) {
  m.def("a8_linear(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor scales_sup, Tensor offsets_sup, "
        "int K, Tensor? bias=None) -> Tensor", &a8_linear);
  m.def("a8_quantize(Tensor x, int G, bool int4) -> Tensor[]", &a8_quantize);
}
