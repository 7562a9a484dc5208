// Fused exact attention in bf16 on Intel AMX, forward and backward, as XLA CPU FFI custom calls.
//
// Why: XLA CPU runs attention as separate passes over [Lq, Lk] float32 tiles (q k^T, row max,
// exp, convert to bf16, row sum, p v), each a round trip through memory: one Wan S head
// (1024 x 1024, d 64) took ~1.4 ms, here ~0.45 ms (2 cores). One block of 32 queries goes
// through both products and its softmax while its scores (32 x Lk float32) stay in the core's
// cache; k and v are repacked once per work item into the tiles' layout. The backward (see
// "backward" below) does the same for its five products: 8 heads 23 -> 6.8 ms.
//
// Semantics: those of jaxcore/kernels/blockwise.py's forward for one tile covering all keys:
// scores = (q k^T) * scale in float32 (bf16 products, float32 accumulation; scale > 0), masked
// keys left out; m = row max (0 where every key is masked); p = exp(scores - m) in float32;
// l = sum(p) in float32; out = (bf16(p) v) / l, rounded to bf16 (zeros where l == 0);
// lse = m + log(l) (+inf where l == 0). Within float32 rounding of XLA's exp, not bit for bit.
// jaxcore/kernels/native.py builds and registers it; tests/jaxcore/test_native_attention.py
// compares it with the XLA path.
//
// Layout: attention_common.h's Shape (q [B, Lq, H, D], k and v [B, Lk, H, D] in bf16, mask
// [B, Lk], lse [B, H, Lq]), D a multiple of 32 (one AMX tile row holds 32 bf16). Work items are
// (pair, query range) claimed from a shared counter by the calling thread and helpers on XLA's
// intra-op pool; the caller works too, so the call completes even when no helper runs.

#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "attention_common.h"

namespace {

constexpr int64_t kRows = 16;   // rows of an AMX tile
constexpr int64_t kDepth = 32;  // bf16 values along the contraction in one tile row (64 bytes)

struct TileConfig {  // the layout _tile_loadconfig reads (palette 1)
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: an accumulator holds 16 x 16 float32, a left operand 16 x 32
// bf16, a right operand 16 pair rows x 16 columns of bf16 pairs (see ScoreTiles for who is who).
void ConfigureTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kRows;
  }
  _tile_loadconfig(&config);
}

// Linux grants AMX's tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
bool RequestAmx() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// bf16 (round to nearest even, as XLA's convert) of 16 float32 values, stored at `to`.
inline void StoreBf16(uint16_t* to, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), (__m256i)_mm512_cvtneps_pbh(x));
}

// A thread's buffers, reused across calls.
struct Scratch {
  // Operands in whole tiles, each 16 rows x 64 bytes contiguous (a tile load's stride is 64
  // bytes: rows a multiple of 4 KiB apart share one L1 set, and a 16-row load thrashed it):
  std::vector<uint32_t> keys_t;  // k^T as bf16 pairs (k[n][2r], k[n][2r+1]): tile (n / 16, r / 16)
  std::vector<uint32_t> values;  // v as bf16 pairs (v[2r][c], v[2r+1][c]): tile (r / 16, c / 16)
  std::vector<uint16_t> probs;   // bf16 probabilities: row tile i / 16, then tile n / 32
  std::vector<__mmask16> live;   // [lk_tiles / 16]: bit n % 16 set: attend to key n
  // the block's scores row by row, rows a cache line further apart than their length (for the
  // same reason; the softmax reads them along rows)
  std::vector<float> scores;     // [32, lk_tiles + 16]
  std::vector<float> sums;       // [32, d] unnormalised output
  std::vector<uint16_t> q_block;  // [32, d]: BlockRows
};

// AMX's right operand holds pairs of consecutive contraction rows side by side. For q k^T
// (and do v^T) the contraction runs along d: x^T as pairs (x[n][2r], x[n][2r+1]), tile
// (n / 16, r / 16). For p v (and ds k) it runs along the keys: x as pairs (x[2r][c],
// x[2r+1][c]), tile (r / 16, c / 16). Keys padded to whole tiles with zeros.
// x's rows are `ld` apart. Both in vector loads and stores: written element by element they
// took ~14% of the forward (Flux.1 at 1024^2, 4,608 keys x 24 heads x 128: 293-305 -> 267-268
// ms, torch SDPA 242-255; 1,536 x 4 x 128: 5.5-5.7 -> 4.7-5.0 ms).
void RepackTransposed(const uint16_t* x, int64_t lk, int64_t d, int64_t ld, int64_t lk_tiles,
                      std::vector<uint32_t>& to) {
  const int64_t half_d = d / 2, r_tiles = half_d / 16;
  to.assign(half_d * lk_tiles, 0);
  const int* pairs = reinterpret_cast<const int*>(x);
  // a tile's row r % 16 holds keys n0 .. n0 + 15 of pair column r: one gather down x's rows
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                           5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(ld / 2)));
  for (int64_t n0 = 0; n0 < lk; n0 += 16) {
    const __mmask16 real = lk - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (lk - n0)) - 1);
    uint32_t* tiles = to.data() + (n0 / 16) * r_tiles * 256;
    const int* from = pairs + n0 * (ld / 2);
    for (int64_t r = 0; r < half_d; ++r)
      _mm512_storeu_si512(tiles + (r / 16) * 256 + (r % 16) * 16,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, rows,
                                                      from + r, 4));
  }
}

void RepackRows(const uint16_t* x, int64_t lk, int64_t d, int64_t ld, int64_t lk_tiles,
                std::vector<uint32_t>& to) {
  const int64_t c_tiles = d / 16;
  to.assign(lk_tiles / 2 * d, 0);
  for (int64_t n = 0; n < lk; n += 2) {  // rows n, n + 1 side by side as bf16 pairs
    uint32_t* tiles = to.data() + (n / 32) * c_tiles * 256 + ((n % 32) / 2) * 16;
    const bool odd = n + 1 < lk;
    for (int64_t c = 0; c < d; c += 16) {
      const __m512i even = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + n * ld + c)));
      const __m512i next = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(x + (n + 1) * ld + c)))
                               : _mm512_setzero_si512();
      _mm512_storeu_si512(tiles + (c / 16) * 256,
                          _mm512_or_si512(even, _mm512_slli_epi32(next, 16)));
    }
  }
}

// Where row i, key n of a block's bf16 [32, lk_tiles] left operand lives in whole tiles.
inline int64_t BlockTiles(int64_t i, int64_t n, int64_t lk_tiles) {
  return (i / kRows) * kRows * lk_tiles + (n / 32) * 512 + (i % kRows) * 32 + n % 32;
}

// Softmax of one block's rows: bf16 probabilities into `probs`, each row's shift (its scaled
// max, 0 when every key is masked) and sum into the arrays. exp(scale * (s - max)) is computed
// as 2^(c s - c max), c = scale log2(e), one multiply-add per score (scale > 0, so the max of
// the scaled scores is the scaled max).
void Softmax(int64_t lk_tiles, float scale, Scratch& w, float* shifts, float* sums) {
  const float c = scale * kLog2e;
  const __m512 vc = _mm512_set1_ps(c);
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < kBlock; ++i) {
    const float* row = w.scores.data() + i * ScoresStride(lk_tiles);
    uint16_t* probs = w.probs.data() + BlockTiles(i, 0, lk_tiles);
    __m512 vmax = vneg_inf;
    for (int64_t n = 0; n < lk_tiles; n += 16)
      vmax = _mm512_mask_max_ps(vmax, w.live[n / 16], vmax, _mm512_loadu_ps(row + n));
    const float m = _mm512_reduce_max_ps(vmax);
    if (!std::isfinite(m)) {  // every key masked: no probabilities, zero output
      for (int64_t n = 0; n < lk_tiles; n += 32) std::memset(probs + n * 16, 0, 64);
      shifts[i] = 0.0f;
      sums[i] = 0.0f;
      continue;
    }
    const __m512 vshift = _mm512_set1_ps(c * m);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t n = 0; n < lk_tiles; n += 16) {
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(row + n), vc, vshift);
      const __m512 p = Exp2(x, w.live[n / 16]);
      vsum = _mm512_add_ps(vsum, p);
      StoreBf16(probs + (n / 32) * 512 + n % 32, p);
    }
    shifts[i] = scale * m;
    sums[i] = _mm512_reduce_add_ps(vsum);
  }
}

// The products, for a block of 32 queries: its two row tiles (tmm4, tmm5) share each right
// operand tile (tmm6, tmm7), which halves the traffic of k and v through the cache (what bound
// the products at 16 queries per block), and four C tiles (tmm0-3) accumulate independently.

// out[32, n0 .. n0 + 31] (float32, row stride `stride`) = a[32, d] (bf16, row stride d) . b,
// b in RepackTransposed's tiles: the scores q k^T, and the backward's do v^T
void ScoreTiles(const uint16_t* a, int64_t d, const uint32_t* b, int64_t n0, float* out,
                int64_t stride) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t per_key_tile = (d / 32) * 256;  // uint32 per 16 keys of b
  const uint32_t* keys = b + (n0 / 16) * per_key_tile;
  for (int64_t c = 0; c < d; c += kDepth) {
    _tile_loadd(4, a + c, d * 2);
    _tile_loadd(5, a + kRows * d + c, d * 2);
    _tile_loadd(6, keys + (c / 32) * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, keys + per_key_tile + (c / 32) * 256, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  float* top = out + n0;
  float* bottom = top + kRows * stride;
  _tile_stored(0, top, stride * 4);
  _tile_stored(1, top + 16, stride * 4);
  _tile_stored(2, bottom, stride * 4);
  _tile_stored(3, bottom + 16, stride * 4);
}

// out[32, c0 .. c0 + 31] (float32, row stride d) = a[32, lk_tiles] . b, a in whole tiles (row
// tile i / 16, then tile n / 32: BlockTiles), b in RepackRows' tiles: p v, and the backward's
// ds k
void OutputTiles(const uint16_t* a, int64_t lk_tiles, const uint32_t* b, int64_t d, int64_t c0,
                 float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* top = a;
  const uint16_t* bottom = a + kRows * lk_tiles;
  for (int64_t n = 0; n < lk_tiles; n += kDepth) {
    _tile_loadd(4, top + n * 16, 64);
    _tile_loadd(5, bottom + n * 16, 64);
    const uint32_t* tile = b + ((n / 32) * (d / 16) + c0 / 16) * 256;
    _tile_loadd(6, tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, tile + 256, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  float* sums = out + c0;
  _tile_stored(0, sums, d * 4);
  _tile_stored(1, sums + 16, d * 4);
  _tile_stored(2, sums + kRows * d, d * 4);
  _tile_stored(3, sums + kRows * d + 16, d * 4);
}

// The kBlock rows a block's tile loads read, [32, d] bf16 contiguous: x's `rows` rows (`ld`
// apart) gathered into `block`, zero rows after the last (zero queries get no probabilities).
const uint16_t* BlockRows(const uint16_t* x, int64_t rows, int64_t d, int64_t ld,
                          std::vector<uint16_t>& block) {
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(block.data() + i * d, x + i * ld, d * sizeof(uint16_t));
  std::fill(block.begin() + rows * d, block.end(), 0);
  return block.data();
}

// Queries [r0, r1) of one pair: their bf16 output and lse.
void AttendRows(const Shape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                const bool* mask, float scale, uint16_t* out, float* lse, int64_t r0, int64_t r1,
                Scratch& w) {
  const int64_t d = s.d, ld = s.row();
  const int64_t lk_tiles = (s.lk + kDepth - 1) / kDepth * kDepth;
  RepackTransposed(k, s.lk, d, ld, lk_tiles, w.keys_t);
  RepackRows(v, s.lk, d, ld, lk_tiles, w.values);
  LiveKeys(mask, s.lk, lk_tiles, w.live);
  w.scores.resize(kBlock * ScoresStride(lk_tiles));
  w.probs.resize(kBlock * lk_tiles);
  w.sums.resize(kBlock * d);
  w.q_block.resize(kBlock * d);
  float shifts[kBlock], row_sums[kBlock];
  ConfigureTiles();
  for (int64_t row0 = r0; row0 < r1; row0 += kBlock) {
    const int64_t rows = std::min(kBlock, r1 - row0);
    const uint16_t* q_block = BlockRows(q + row0 * ld, rows, d, ld, w.q_block);
    for (int64_t n0 = 0; n0 < lk_tiles; n0 += 32)
      ScoreTiles(q_block, d, w.keys_t.data(), n0, w.scores.data(), ScoresStride(lk_tiles));
    Softmax(lk_tiles, scale, w, shifts, row_sums);
    for (int64_t c0 = 0; c0 < d; c0 += 32)
      OutputTiles(w.probs.data(), lk_tiles, w.values.data(), d, c0, w.sums.data());
    for (int64_t i = 0; i < rows; ++i) {
      const bool seen = row_sums[i] > 0;
      const __m512 inverse = _mm512_set1_ps(seen ? 1.0f / row_sums[i] : 0.0f);
      for (int64_t c = 0; c < d; c += 16)
        StoreBf16(out + (row0 + i) * ld + c,
                  _mm512_mul_ps(_mm512_loadu_ps(w.sums.data() + i * d + c), inverse));
      lse[row0 + i] = seen ? shifts[i] + std::log(row_sums[i])
                           : std::numeric_limits<float>::infinity();
    }
  }
  _tile_release();
}

constexpr KernelSpec kSpec{"amx attention", "bf16", ffi::DataType::BF16, kDepth, RequestAmx,
                           "amx attention: the kernel refused AMX tile state"};

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale) {
  return ForwardHandler<uint16_t, Scratch>(kSpec, pool, q, k, v, mask, out, lse, scale,
                                           AttendRows);
}

// --- backward -------------------------------------------------------------------------------
//
// FlashAttention-2's backward (blockwise.py's _tile_grads, all keys in one tile) for one pair,
// 32 queries at a time: s = q k^T, p = exp(scale s - lse) (float32, masked keys 0), dp = do v^T,
// ds = bf16(scale p (dp - delta)) with delta = rowsum(do * out); then dq = ds k for the block,
// and dv^T += do^T bf16(p), dk^T += q^T ds, accumulated in float32 over the blocks (their left
// operands are the block's do^T and q^T, [d, 32 queries]; their right ones p and ds as pairs of
// queries side by side).

struct BackwardScratch {
  std::vector<uint32_t> keys_t, values_t, keys_rows;  // for q k^T, do v^T, ds k
  std::vector<__mmask16> live;
  std::vector<float> scores, dprobs;   // [32, ScoresStride(lk_tiles)]
  std::vector<uint16_t> ds_tiles;      // ds as a left operand (BlockTiles)
  std::vector<uint32_t> p_pairs, ds_pairs;  // tile n / 16: [16 query pairs, 16 keys]
  std::vector<uint16_t> do_t, q_t;     // [d, 32]
  std::vector<float> dv_t, dk_t;       // tile (c / 16, n / 16): [16 columns, 16 keys]
  std::vector<float> dq_sums;          // [32, d]
  std::vector<uint16_t> q_block, do_block;  // [32, d]: BlockRows
};

inline uint16_t ToBf16(float x) {  // round to nearest even, as the vector conversion
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float FromBf16(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// 32 bf16 from two rows' 16 float32 each, interleaved (a0, b0, a1, b1, ...): one row of a
// right operand over query pairs
inline void StorePairs(uint32_t* to, __m512 a, __m512 b) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in the low half
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  _mm512_storeu_si512(to, _mm512_permutexvar_epi16(order, both));
}

// ds and p of the block's rows (see above) into their operand layouts.
void ScoreGradients(int64_t lk_tiles, float scale, const float* lse, const float* delta,
                    BackwardScratch& w) {
  const float c = scale * kLog2e;
  const int64_t stride = ScoresStride(lk_tiles);
  const __m512 vc = _mm512_set1_ps(c), vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kBlock / 2; ++r) {  // rows 2r and 2r + 1
    const int64_t a = 2 * r, b = 2 * r + 1;
    // a row that saw no key in the forward (lse +inf) has no probabilities and no gradient
    const __mmask16 row_a = std::isfinite(lse[a]) ? 0xffff : 0, row_b = std::isfinite(lse[b]) ? 0xffff : 0;
    const __m512 shift_a = _mm512_set1_ps(row_a ? lse[a] * kLog2e : 0.0f);
    const __m512 shift_b = _mm512_set1_ps(row_b ? lse[b] * kLog2e : 0.0f);
    const __m512 delta_a = _mm512_set1_ps(delta[a]), delta_b = _mm512_set1_ps(delta[b]);
    const float *s_a = w.scores.data() + a * stride, *s_b = w.scores.data() + b * stride;
    const float *dp_a = w.dprobs.data() + a * stride, *dp_b = w.dprobs.data() + b * stride;
    for (int64_t n = 0; n < lk_tiles; n += 16) {
      const __mmask16 live = w.live[n / 16];
      const __m512 p_a = Exp2(_mm512_fmsub_ps(_mm512_loadu_ps(s_a + n), vc, shift_a), live & row_a);
      const __m512 p_b = Exp2(_mm512_fmsub_ps(_mm512_loadu_ps(s_b + n), vc, shift_b), live & row_b);
      const __m512 ds_a = _mm512_mul_ps(_mm512_mul_ps(p_a, _mm512_sub_ps(_mm512_loadu_ps(dp_a + n), delta_a)), vscale);
      const __m512 ds_b = _mm512_mul_ps(_mm512_mul_ps(p_b, _mm512_sub_ps(_mm512_loadu_ps(dp_b + n), delta_b)), vscale);
      StoreBf16(w.ds_tiles.data() + BlockTiles(a, n, lk_tiles), ds_a);
      StoreBf16(w.ds_tiles.data() + BlockTiles(b, n, lk_tiles), ds_b);
      StorePairs(w.p_pairs.data() + (n / 16) * 256 + r * 16, p_a, p_b);
      StorePairs(w.ds_pairs.data() + (n / 16) * 256 + r * 16, ds_a, ds_b);
    }
  }
}

// acc^T tiles (c / 16, n / 16) += a_t [d, 32] (bf16, 64-byte rows) . pairs (tile n / 16);
// up to four column tiles' left operands stay loaded (tmm4-7) while the keys go by.
void AccumulateTransposed(const uint16_t* a_t, const uint32_t* pairs, int64_t d, int64_t lk_tiles,
                          float* acc) {
  const int64_t key_tiles = lk_tiles / 16;
  for (int64_t g = 0; g < d; g += 64) {
    const int64_t tiles = std::min<int64_t>(4, (d - g) / 16);
    _tile_loadd(4, a_t + g * 32, 64);
    if (tiles > 1) _tile_loadd(5, a_t + (g + 16) * 32, 64);
    if (tiles > 2) _tile_loadd(6, a_t + (g + 32) * 32, 64);
    if (tiles > 3) _tile_loadd(7, a_t + (g + 48) * 32, 64);
    for (int64_t n = 0; n < key_tiles; ++n) {
      _tile_loadd(3, pairs + n * 256, 64);
      float* c0 = acc + ((g / 16) * key_tiles + n) * 256;
      const int64_t next = key_tiles * 256;  // the next column tile's accumulator
      _tile_loadd(0, c0, 64);
      _tile_dpbf16ps(0, 4, 3);
      if (tiles > 1) {
        _tile_loadd(1, c0 + next, 64);
        _tile_dpbf16ps(1, 5, 3);
      }
      if (tiles > 2) {
        _tile_loadd(2, c0 + 2 * next, 64);
        _tile_dpbf16ps(2, 6, 3);
      }
      _tile_stored(0, c0, 64);
      if (tiles > 3) {
        _tile_loadd(0, c0 + 3 * next, 64);
        _tile_dpbf16ps(0, 7, 3);
        _tile_stored(0, c0 + 3 * next, 64);
      }
      if (tiles > 1) _tile_stored(1, c0 + next, 64);
      if (tiles > 2) _tile_stored(2, c0 + 2 * next, 64);
    }
  }
}

void Transpose(const uint16_t* block, int64_t d, uint16_t* to) {  // [32, d] -> [d, 32]
  for (int64_t i = 0; i < kBlock; ++i)
    for (int64_t c = 0; c < d; ++c) to[c * kBlock + i] = block[i * d + c];
}

void BackwardPair(const Shape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                  const bool* mask, const uint16_t* out, const uint16_t* d_out, const float* lse,
                  float scale, uint16_t* dq, uint16_t* dk, uint16_t* dv, BackwardScratch& w) {
  const int64_t d = s.d, ld = s.row();
  const int64_t lk_tiles = (s.lk + kDepth - 1) / kDepth * kDepth, key_tiles = lk_tiles / 16;
  RepackTransposed(k, s.lk, d, ld, lk_tiles, w.keys_t);
  RepackTransposed(v, s.lk, d, ld, lk_tiles, w.values_t);
  RepackRows(k, s.lk, d, ld, lk_tiles, w.keys_rows);
  LiveKeys(mask, s.lk, lk_tiles, w.live);
  w.scores.resize(kBlock * ScoresStride(lk_tiles));
  w.dprobs.resize(kBlock * ScoresStride(lk_tiles));
  w.ds_tiles.resize(kBlock * lk_tiles);
  w.p_pairs.resize(kBlock / 2 * lk_tiles);
  w.ds_pairs.resize(kBlock / 2 * lk_tiles);
  w.do_t.resize(d * kBlock);
  w.q_t.resize(d * kBlock);
  w.dv_t.assign(d * lk_tiles, 0.0f);
  w.dk_t.assign(d * lk_tiles, 0.0f);
  w.dq_sums.resize(kBlock * d);
  w.q_block.resize(kBlock * d);
  w.do_block.resize(kBlock * d);
  ConfigureTiles();
  float lse_block[kBlock], delta[kBlock];
  for (int64_t row0 = 0; row0 < s.lq; row0 += kBlock) {
    const int64_t rows = std::min(kBlock, s.lq - row0);
    const uint16_t* q_block = BlockRows(q + row0 * ld, rows, d, ld, w.q_block);
    const uint16_t* do_block = BlockRows(d_out + row0 * ld, rows, d, ld, w.do_block);
    for (int64_t i = 0; i < kBlock; ++i) {
      lse_block[i] = i < rows ? lse[row0 + i] : std::numeric_limits<float>::infinity();
      float sum = 0.0f;
      for (int64_t c = 0; i < rows && c < d; ++c)
        sum += FromBf16(do_block[i * d + c]) * FromBf16(out[(row0 + i) * ld + c]);
      delta[i] = sum;
    }
    for (int64_t n0 = 0; n0 < lk_tiles; n0 += 32) {
      ScoreTiles(q_block, d, w.keys_t.data(), n0, w.scores.data(), ScoresStride(lk_tiles));
      ScoreTiles(do_block, d, w.values_t.data(), n0, w.dprobs.data(), ScoresStride(lk_tiles));
    }
    ScoreGradients(lk_tiles, scale, lse_block, delta, w);
    for (int64_t c0 = 0; c0 < d; c0 += 32)
      OutputTiles(w.ds_tiles.data(), lk_tiles, w.keys_rows.data(), d, c0, w.dq_sums.data());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < d; c += 16)
        StoreBf16(dq + (row0 + i) * ld + c, _mm512_loadu_ps(w.dq_sums.data() + i * d + c));
    Transpose(do_block, d, w.do_t.data());
    Transpose(q_block, d, w.q_t.data());
    AccumulateTransposed(w.do_t.data(), w.p_pairs.data(), d, lk_tiles, w.dv_t.data());
    AccumulateTransposed(w.q_t.data(), w.ds_pairs.data(), d, lk_tiles, w.dk_t.data());
  }
  _tile_release();
  for (int64_t n = 0; n < s.lk; ++n)
    for (int64_t c = 0; c < d; ++c) {
      const int64_t at = ((c / 16) * key_tiles + n / 16) * 256 + (c % 16) * 16 + n % 16;
      dv[n * ld + c] = ToBf16(w.dv_t[at]);
      dk[n * ld + c] = ToBf16(w.dk_t[at]);
    }
}

ffi::Error AttentionBackward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::Buffer<ffi::PRED> mask, ffi::AnyBuffer out,
                             ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out,
                             ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                             ffi::Result<ffi::AnyBuffer> dv, float scale) {
  return BackwardHandler<uint16_t, BackwardScratch>(kSpec, pool, q, k, v, mask, out, lse, d_out,
                                                    dq, dk, dv, scale, BackwardPair);
}

}  // namespace

// 1 when this process may use AMX (asks the kernel once); the Python side checks it before it
// emits the custom call.
extern "C" int difforge_amx_ready() { return RequestAmx() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(DifforgeAmxAttentionBackward, AttentionBackward,
                              BindBackward());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DifforgeAmxAttention, Attention,
                              BindForward());
