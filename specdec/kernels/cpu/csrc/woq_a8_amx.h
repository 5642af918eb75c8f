// The AMX path of woq_a8.cpp's int8-activation linear (built with -mamx-int8; included there, inside its
// anonymous namespace, after tile() and quantize_row()): a8_linear_amx, and moe_cpu.cpp's experts
// from a measured row count on.
//
// A unit (E = 32 inputs, 16 for int8 groups of 16) of up to 16 rows and one block of 16 outputs is one
// tile product: tile A the rows' s8 activations of the unit (natural order), tile B the unit's
// weights, 4 inputs of 16 outputs per 64-byte row, which is the int8 layout's vector as it is (int4:
// each vector's low nibbles, then its high ones, unpacked: inputs 8j .. 8j + 3, then 8j + 4 .. 8j + 7);
// int8 by tdpbssd, int4 by tdpbsud (u8 weights). Its integer sums are exact, the VNNI path's, and the
// float scaling after them is tile()'s instructions in tile()'s order (y += xs . ws . I, int4:
// + xs . sum(q) . wo), so a8_linear_amx equals a8_linear bit for bit, whatever rows share a tile.
//
// Tile instructions and the vector scaling hardly overlap on Sapphire Rapids, so each is made cheap
// on its own:
//   - per block and chunk of inputs, the work every 16-row pass shares is done once: the int4
//     unpack into B rows and each unit's group values (scales, offsets; two-level: code x factor)
//     as float32 vectors, [units][2][16], both L1-resident across the passes;
//   - the activation scales of a pass are laid out per unit ([units][16 rows], RowScales), so the
//     scaling broadcasts them from fixed offsets of one pointer;
//   - a pass prefetches its activation rows into L1 two pairs of units ahead (tile loads that miss
//     L1 stall the tile unit: the activations of all rows do not stay in L1 between passes).
#if defined(__AMX_INT8__)
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0, 1: C (rows x 16 int32) of an even and an odd unit; 2, 3: their A (rows x E bytes); 4, 5: B
// (E / 4 rows of 64 bytes). Two units in flight: tile registers are not renamed, so one unit's
// product would otherwise wait for the previous unit's store.
void configure_a8(int rows, int E) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 2; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
    cfg.rows[2 + t] = static_cast<uint8_t>(rows);
    cfg.colsb[2 + t] = static_cast<uint16_t>(E);
    cfg.rows[4 + t] = static_cast<uint8_t>(E / 4);
    cfg.colsb[4 + t] = 64;
  }
  // not _tile_loadconfig: gcc 12 declares it to read 8 bytes, so the stores of rows and colsb
  // above may be dropped as dead (then the first tile instruction faults)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

constexpr int64_t kAmxRows = 16;              // rows per tile pass
constexpr int64_t kAmxChunkBytes = 32 << 10;  // B operand bytes of a block's inputs kept in L1 across passes

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

// group_values for group g whose super-block is sb (two-level), without its division
template <int SF>
__attribute__((always_inline)) inline __m512 amx_group_values(const Args& a, const void* v, const float* sup,
                                                             int64_t blk, int64_t g, int64_t sb) {
  const int64_t at = (blk * a.ng + g) * kBlock;
  if (SF == kF32) return _mm512_loadu_ps(static_cast<const float*>(v) + at);
  if (SF == kF16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(v) + at)));
  const __m512 codes = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(v) + at))));
  return _mm512_mul_ps(codes, _mm512_loadu_ps(sup + (blk * a.nsb + sb) * kBlock));
}

// The group values of each unit of inputs [k_begin, k_end) of block blk: out[unit][0] the scales,
// out[unit][1] (int4) the offsets, 16 floats each (a group of G > E inputs repeats per unit)
template <bool INT4, int SF>
void unit_values(const Args& a, int64_t blk, int64_t k_begin, int64_t k_end, float* out) {
  const int64_t groups_per_super = a.S / a.G;  // S is a multiple of G (two-level); else S = K
  int64_t g = k_begin / a.G, sb = g / groups_per_super, in_super = g % groups_per_super;
  for (int64_t k = k_begin; k < k_end; ++g) {
    const __m512 sv = amx_group_values<SF>(a, a.ws, a.ws_sup, blk, g, sb);
    const __m512 ov = INT4 ? amx_group_values<SF>(a, a.wo, a.wo_sup, blk, g, sb) : sv;
    for (const int64_t end = std::min(k_end, (g + 1) * a.G); k < end; k += a.E, out += 2 * kBlock) {
      _mm512_store_ps(out, sv);
      _mm512_store_ps(out + kBlock, ov);
    }
    if (++in_super == groups_per_super) {
      in_super = 0;
      ++sb;
    }
  }
}

// The shared operands of a pass over a block's chunk of inputs [k_begin, k_end): B rows (the unit at
// input k at b + 16 * (k - k_begin)) and unit_values.
struct AmxChunk {
  int64_t k_begin, k_end;
  const uint8_t* b;
  const float* values;
};

// The activation scales of the 16-row passes of an M-row call, per unit: pass p (rows r0 .. r0 + 15,
// r0 = min(16 p, M - 16); M < 16: one pass of M rows, the others zero) at [p][nab][16], xs and (int4)
// xs * sums.
struct RowScales {
  std::vector<float> xs, xsx;
  int64_t nab = 0;

  static int64_t passes(int64_t M) { return M < kAmxRows ? 1 : (M + kAmxRows - 1) / kAmxRows; }
  void fill(const Args& a, int64_t M, bool int4) {
    nab = a.nab;
    const int64_t P = passes(M), rows = std::min(M, kAmxRows);
    xs.assign(P * nab * kAmxRows, 0.0f);
    xsx.assign(int4 ? P * nab * kAmxRows : 0, 0.0f);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t r0 = std::min(p * kAmxRows, M - rows);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t b = 0; b < nab; ++b) {
          xs[(p * nab + b) * kAmxRows + m] = a.xs[(r0 + m) * nab + b];
          if (int4) xsx[(p * nab + b) * kAmxRows + m] = a.xsx[(r0 + m) * nab + b];
        }
    }
  }
  const float* xs_of(int64_t pass) const { return xs.data() + pass * nab * kAmxRows; }
  const float* xsx_of(int64_t pass) const { return xsx.empty() ? nullptr : xsx.data() + pass * nab * kAmxRows; }
};

// One pass: rows r0 .. r0 + rows - 1 of block blk over the chunk c, tiles configured for these rows
// and E; xs, xsx: the pass's RowScales. acc [rows][16] holds the rows' float sums between chunks
// (read unless the chunk starts at input 0); at the last chunk they go to y instead. Rows below
// `kept` are computed but neither stored nor written (another pass owns them). FULL: rows is 16.
// Per pair of units, the integer sums by tiles, stored; then the float scaling of tile(), unit by
// unit, row by row, on the pair stored one step earlier (a load right after the tile store would
// wait for it), with the rows' float sums in registers across the inputs.
template <bool INT4, bool FULL>
void tile_amx(const Args& a, int64_t blk, int64_t r0, int rows, const AmxChunk& c, const float* xs,
              const float* xsx, float* acc, int kept) {
  constexpr int64_t kAhead = 128;  // bytes of each activation row prefetched ahead of the tile loads
  alignas(64) int32_t isum[2][2][16 * 16];  // [pair parity][unit of the pair][row][output]
  __m512 f[16];
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m)
    f[m] = (FULL || m < rows) && c.k_begin > 0 ? _mm512_loadu_ps(acc + 16 * m) : _mm512_setzero_ps();
  const uint8_t* xq = a.xq + r0 * a.K;
  const int64_t E = a.E, step = 2 * E;
  for (int64_t k0 = c.k_begin, i = 0; k0 < c.k_end + step; k0 += step, ++i) {
    if (k0 < c.k_end) {
      const int64_t k1 = k0 + E;
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m)
        if (FULL || m < rows) _mm_prefetch(reinterpret_cast<const char*>(xq + m * a.K + k0 + kAhead), _MM_HINT_T0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, xq + k0, a.K);
      _tile_loadd(3, xq + k1, a.K);
      _tile_loadd(4, c.b + 16 * (k0 - c.k_begin), 64);
      _tile_loadd(5, c.b + 16 * (k1 - c.k_begin), 64);
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
    if (k0 == c.k_begin) continue;
    for (int u = 0; u < 2; ++u) {
      const int64_t k = k0 - step + u * E, unit = 2 * (i - 1) + u, ab = k / kABlock;
      const __m512 sv = _mm512_load_ps(c.values + 2 * kBlock * unit);
      const __m512 ov = _mm512_load_ps(c.values + 2 * kBlock * unit + kBlock);
      const float* xs_u = xs + ab * kAmxRows;
      const float* xsx_u = INT4 ? xsx + ab * kAmxRows : nullptr;
      const int32_t* s = isum[(i - 1) & 1][u];
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m) {
        if (!FULL && m >= rows) continue;
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * m));
        f[m] = _mm512_fmadd_ps(sum, _mm512_mul_ps(sv, _mm512_set1_ps(xs_u[m])), f[m]);
        if (INT4) f[m] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsx_u[m]), f[m]);
      }
    }
  }
  const int64_t n0 = blk * kBlock;
  const __mmask16 outputs = static_cast<__mmask16>((1u << std::min<int64_t>(kBlock, a.N - n0)) - 1);
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) {
    if ((!FULL && m >= rows) || m < kept) continue;
    if (c.k_end == a.K)
      _mm512_mask_storeu_ps(a.y + (r0 + m) * a.N + n0, outputs, f[m]);
    else
      _mm512_storeu_ps(acc + 16 * m, f[m]);
  }
}

// A thread's buffers for amx_block: B rows and unit values of one chunk, the rows' float sums.
struct AmxScratch {
  int64_t chunk;  // inputs per chunk, a multiple of 64
  std::vector<uint8_t> unpacked;
  std::vector<float> values, acc;

  // chunks of a K-input weight whose int4 B rows fit kAmxChunkBytes
  static int64_t chunk_for(int64_t K) {
    const int64_t chunks = (16 * K + kAmxChunkBytes - 1) / kAmxChunkBytes;
    return ((K + chunks - 1) / chunks + 63) / 64 * 64;
  }
  void reserve(int64_t K, int64_t M, bool int4) {
    chunk = chunk_for(K);
    if (int4 && static_cast<int64_t>(unpacked.size()) < 16 * chunk) unpacked.resize(16 * chunk);
    if (static_cast<int64_t>(values.size()) < 2 * chunk + 16) values.resize(2 * chunk + 16);  // 32 per unit of 16
    if (static_cast<int64_t>(acc.size()) < 16 * M) acc.resize(16 * M);
  }
  const float* aligned_values() const {  // 64-byte aligned start inside `values`
    return reinterpret_cast<const float*>((reinterpret_cast<uintptr_t>(values.data()) + 63) & ~uintptr_t{63});
  }
};

// Rows 0 .. M - 1 of block blk, tiles configured for min(M, 16) rows and E: per chunk of inputs, B
// rows and unit values once, then every 16-row pass over them. M >= 16: passes of 16 rows, the last
// one ending at row M (it recomputes rows the pass before it owns and keeps only its own), so one tile
// configuration serves the whole call.
template <bool INT4, int SF>
void amx_block(const Args& a, int64_t blk, int64_t M, const RowScales& rs, AmxScratch& s) {
  const uint8_t* wp = a.w + blk * a.blk_bytes;
  float* values = const_cast<float*>(s.aligned_values());
  for (int64_t kb = 0; kb < a.K; kb += s.chunk) {
    const int64_t ke = std::min(a.K, kb + s.chunk);
    const uint8_t* b = wp + 16 * kb;  // int8: the layout's vectors are the B rows
    if (INT4) {
      unpack_int4(wp, kb, ke, s.unpacked.data());
      b = s.unpacked.data();
    }
    unit_values<INT4, SF>(a, blk, kb, ke, values);
    const AmxChunk c{kb, ke, b, values};
    if (M < kAmxRows) {
      tile_amx<INT4, false>(a, blk, 0, static_cast<int>(M), c, rs.xs_of(0), rs.xsx_of(0), s.acc.data(), 0);
      continue;
    }
    for (int64_t r = 0, p = 0; r < M; r += kAmxRows, ++p) {
      const int64_t r0 = std::min(r, M - kAmxRows);
      tile_amx<INT4, true>(a, blk, r0, kAmxRows, c, rs.xs_of(p), rs.xsx_of(p), s.acc.data() + 16 * r0,
                           static_cast<int>(r - r0));
    }
  }
}

// Blocks in parallel (each thread its own range of output columns), each by amx_block.
template <bool INT4, int SF>
void run_amx_format(const Args& a, int64_t M) {
  if (M == 0) return;
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  RowScales rs;
  rs.fill(a, M, INT4);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    AmxScratch scratch;
    scratch.reserve(a.K, M, INT4);
    configure_a8(static_cast<int>(std::min(M, kAmxRows)), static_cast<int>(a.E));
    for (int64_t blk = begin; blk < end; ++blk) amx_block<INT4, SF>(a, blk, M, rs, scratch);
    _tile_release();
  });
}

template <bool INT4>
void run_amx(const Args& a, int64_t M, int sf) {
  sf == kF32 ? run_amx_format<INT4, kF32>(a, M) : sf == kF16 ? run_amx_format<INT4, kF16>(a, M)
                                                             : run_amx_format<INT4, kTwoLevel>(a, M);
}
#endif  // __AMX_INT8__
