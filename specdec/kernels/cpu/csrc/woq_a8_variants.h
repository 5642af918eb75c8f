// Other instruction sequences for woq_a8.cpp's tile (AVX-512 VNNI build only; included there, inside its
// anonymous namespace, after tile() and quantize_row()). Which one runs at a row count is measured at
// load time (layers/cpu_kernel_choice.py): what a CPU charges for an instruction differs by kind (Zen 4
// issues a 512-bit operation as two 256-bit halves; Intel cores issue it whole), and a 7-row
// verification is compute-bound where the dot products are dear.
//
//   tile_vnni512_bcast  int4: tile() with each row's activation word broadcast by vpdpbusd's own
//                       memory operand ({1to16}) instead of one vpbroadcastd per row and vector
//   tile_vnni256        int4 and int8: 256-bit vpdpbusd (AVX-512 VL), each block of 16 outputs as
//                       two halves of 8; int4 with the {1to8} broadcast operand
//   tile_bf16           int4: nibbles made bf16 with vpternlogd (128 + n: exponent 2^7, the nibble in
//                       the mantissa) and multiplied by the bf16 activations with vdpbf16ps; each
//                       unit's accumulator starts at -128 * (the row's sum of q over the unit)
//
// All give every unit the same exact integer sums as tile() (bf16: |partial sums| < 2^21, so the
// float32 sums are the integers themselves), then run tile()'s float scaling (scale_unit,
// woq_a8_scaling.h), one lane per output, in the same order: every variant equals a8_linear bit for
// bit, at every row count, so a caller may pick one per call by its row count and a row's result
// stays independent of the call's rows.

enum A8Variant { kVnni512 = 0, kVnni512Bcast = 1, kVnni256 = 2, kBf16 = 3 };

// acc += u8 a . s8 (the 4 bytes at p, broadcast) per 32-bit lane
__attribute__((always_inline)) inline void dpbusd_bcast(__m512i& acc, __m512i a, const uint8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const int32_t*>(p)));
}

__attribute__((always_inline)) inline void dpbusd_bcast(__m256i& acc, __m256i a, const uint8_t* p) {
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const int32_t*>(p)));
}

__attribute__((always_inline)) inline void dpbusd(__m256i& acc, __m256i a, __m256i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// acc += bf16 pairs a . (the bf16 pair at p, broadcast) per float32 lane (the asm needs no
// -mavx512bf16: callers check the CPU flag)
__attribute__((always_inline)) inline void dpbf16_bcast(__m512& acc, __m512i a, const uint16_t* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const int32_t*>(p)));
}

template <int SF, int MB>
void tile_vnni512_bcast(const Args& a, int64_t blk) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 facc[MB];
  for (int m = 0; m < MB; ++m) facc[m] = _mm512_setzero_ps();
  __m512 sv = _mm512_setzero_ps(), ov = _mm512_setzero_ps();
  const uint8_t* wp = a.w + blk * a.blk_bytes;
  for (int64_t k0 = 0; k0 < a.K; k0 += a.E) {
    enter_group<true, SF>(a, blk, k0, sv, ov);
    __m512i iacc[MB];
    for (int m = 0; m < MB; ++m) iacc[m] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + a.E; k += 8) {
      const uint8_t* p = wp + (k / 8) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p) + specdec_cpu_common::kStreamAhead, _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(p);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int m = 0; m < MB; ++m) {
        dpbusd_bcast(iacc[m], lo, a.xq + m * a.K + k);
        dpbusd_bcast(iacc[m], hi, a.xq + m * a.K + k + 4);
      }
    }
    const int64_t b = k0 / kABlock;
    for (int m = 0; m < MB; ++m)
      facc[m] = scale_unit<true>(facc[m], _mm512_cvtepi32_ps(iacc[m]), sv, ov, a.xs, a.xsx, m * a.nab + b);
  }
  store_rows<MB>(a, blk, facc);
}

// Outputs 8h .. 8h + 7 of group g of block blk (group_values' lanes)
template <int SF>
__attribute__((always_inline)) inline __m256 group_values_half(const Args& a, const void* v, const float* sup,
                                                              int64_t blk, int64_t g, int h) {
  const __m512 all = group_values<SF>(a, v, sup, blk, g);
  return h == 0 ? _mm512_castps512_ps256(all) : _mm512_extractf32x8_ps(all, 1);
}

// Block blk as two halves of 8 outputs, one after the other over all of K: a half's accumulators
// (2 MB registers) stay in registers; the second half reads the block again from cache (the first
// half's pass prefetches the stream).
template <bool INT4, int SF, int MB>
void tile_vnni256(const Args& a, int64_t blk) {
  constexpr int64_t kStep = INT4 ? 8 : 4;  // inputs per 64-byte vector
  const __m256i ones = _mm256_set1_epi8(1);
  const uint8_t* wp = a.w + blk * a.blk_bytes;
  alignas(64) float out[MB][16];
  for (int h = 0; h < 2; ++h) {
    __m256 facc[MB];
    for (int m = 0; m < MB; ++m) facc[m] = _mm256_setzero_ps();
    __m256 sv = _mm256_setzero_ps(), ov = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < a.K; k0 += a.E) {
      if (k0 % a.G == 0) {
        sv = group_values_half<SF>(a, a.ws, a.ws_sup, blk, k0 / a.G, h);
        if (INT4) ov = group_values_half<SF>(a, a.wo, a.wo_sup, blk, k0 / a.G, h);
      }
      __m256i iacc[MB], wsum = _mm256_setzero_si256();
      for (int m = 0; m < MB; ++m) iacc[m] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + a.E; k += kStep) {
        const __m256i v = load_half(wp + (k / kStep) * 64, h);
        if (INT4) {
          __m256i lo, hi;
          split_nibbles(v, lo, hi);
          for (int m = 0; m < MB; ++m) {
            dpbusd_bcast(iacc[m], lo, a.xq + m * a.K + k);
            dpbusd_bcast(iacc[m], hi, a.xq + m * a.K + k + 4);
          }
        } else {
          dpbusd(wsum, ones, v);
          for (int m = 0; m < MB; ++m) dpbusd(iacc[m], _mm256_set1_epi32(load_word(a.xq + m * a.K + k)), v);
        }
      }
      const int64_t b = k0 / kABlock;
      for (int m = 0; m < MB; ++m) {
        const __m256i isum = INT4 ? iacc[m] : _mm256_sub_epi32(iacc[m], _mm256_slli_epi32(wsum, 7));
        facc[m] = scale_unit<INT4>(facc[m], _mm256_cvtepi32_ps(isum), sv, ov, a.xs, a.xsx, m * a.nab + b);
      }
    }
    for (int m = 0; m < MB; ++m) _mm256_store_ps(out[m] + 8 * h, facc[m]);
  }
  for (int m = 0; m < MB; ++m) store_outputs(a, m, blk, out[m]);
}


// Rows 0 .. M - 1 of the s8 activations -> bf16 [M, K] (exact: |q| <= 127), each 8 inputs 8j .. 8j + 7
// in the order tile_bf16's weight words pair them, (0, 2), (4, 6), (1, 3), (5, 7), one pair per 4
// bytes; and per unit of 32 inputs -128 * (the sum of q), the accumulator's start [M, K / 32].
void bf16_activations(const Args& a, int64_t M, uint16_t* xb, float* start) {
  const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* q = reinterpret_cast<const int8_t*>(a.xq + m * a.K);
    for (int64_t k = 0; k < a.K; k += 16) {
      const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k)));
      // the float's top 16 bits are its bf16 value: the low 16 are zero for integers below 2^8
      const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(v)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + m * a.K + k),
                          _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(order, bits)));
    }
    for (int64_t b = 0; b < a.nab; ++b) {
      const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * b)));
      const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * b + 16)));
      start[m * a.nab + b] = -128.0f * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi)));
    }
  }
}

// int4, units of 32 inputs (a.E): the unit's 4 vectors give 16 words per output, 4 weight vectors of
// bf16 pairs each: (v >> s) & 15 | 0x4300 per 16-bit word, s = 0, 4, 8, 12, holds inputs (0, 2),
// (4, 6), (1, 3), (5, 7) of the vector's 8 as 128 + n.
template <int SF, int MB>
void tile_bf16(const Args& a, int64_t blk) {
  const __m512i low4 = _mm512_set1_epi16(0x000F), exp128 = _mm512_set1_epi16(0x4300);
  constexpr int kOr = 0xEA;  // vpternlogd: (A & B) | C
  __m512 facc[MB];
  for (int m = 0; m < MB; ++m) facc[m] = _mm512_setzero_ps();
  __m512 sv = _mm512_setzero_ps(), ov = _mm512_setzero_ps();
  const uint8_t* wp = a.w + blk * a.blk_bytes;
  for (int64_t k0 = 0; k0 < a.K; k0 += a.E) {
    enter_group<true, SF>(a, blk, k0, sv, ov);
    const int64_t b = k0 / kABlock;
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_set1_ps(a.xstart[m * a.nab + b]);
    for (int64_t k = k0; k < k0 + a.E; k += 8) {
      const uint8_t* p = wp + (k / 8) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p) + specdec_cpu_common::kStreamAhead, _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(p);
      const __m512i w02 = _mm512_ternarylogic_epi32(v, low4, exp128, kOr);
      const __m512i w46 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, exp128, kOr);
      const __m512i w13 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low4, exp128, kOr);
      const __m512i w57 = _mm512_or_si512(_mm512_srli_epi16(v, 12), exp128);
      for (int m = 0; m < MB; ++m) {
        const uint16_t* x = a.xb + m * a.K + k;
        dpbf16_bcast(acc[m], w02, x);
        dpbf16_bcast(acc[m], w46, x + 2);
        dpbf16_bcast(acc[m], w13, x + 4);
        dpbf16_bcast(acc[m], w57, x + 6);
      }
    }
    for (int m = 0; m < MB; ++m) facc[m] = scale_unit<true>(facc[m], acc[m], sv, ov, a.xs, a.xsx, m * a.nab + b);
  }
  store_rows<MB>(a, blk, facc);
}

// tile() or one of the variants above for block blk (a variant a format does not take runs tile())
template <bool INT4, int SF, int MB, int V>
__attribute__((always_inline)) inline void tile_variant(const Args& a, int64_t blk) {
  if constexpr (V == kVnni256) tile_vnni256<INT4, SF, MB>(a, blk);
  else if constexpr (V == kVnni512Bcast && INT4) tile_vnni512_bcast<SF, MB>(a, blk);
  else if constexpr (V == kBf16 && INT4) tile_bf16<SF, MB>(a, blk);
  else tile<INT4, SF, MB>(a, blk);
}
