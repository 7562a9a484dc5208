// Fused exact attention forward in bf16 on Intel AMX, as an XLA CPU FFI custom call.
//
// Why: XLA CPU runs attention as separate passes over [Lq, Lk] float32 tiles (q k^T, row max,
// exp, convert to bf16, row sum, p v), each a round trip through memory: one Wan S head
// (1024 x 1024, d 64) took ~1.4 ms, here ~0.45 ms (2 cores). One block of 32 queries goes
// through both products and its softmax while its scores (32 x Lk float32) stay in the core's
// cache; k and v are repacked once per work item into the tiles' layout.
//
// Semantics: those of jaxcore/kernels/blockwise.py's forward for one tile covering all keys:
// scores = (q k^T) * scale in float32 (bf16 products, float32 accumulation; scale > 0), masked
// keys left out; m = row max (0 where every key is masked); p = exp(scores - m) in float32;
// l = sum(p) in float32; out = (bf16(p) v) / l, rounded to bf16 (zeros where l == 0);
// lse = m + log(l) (+inf where l == 0). Within float32 rounding of XLA's exp, not bit for bit. jaxcore/kernels/native.py builds and registers it;
// tests/jaxcore/test_native_attention.py compares it with the XLA path.
//
// Layout: q [P, Lq, D], k and v [P, Lk, D] (bf16, row-major, P = batch x heads pairs), mask
// [P, Lk] (pred). D a multiple of 32 (one AMX tile row holds 32 bf16). Work items are
// (pair, query range) claimed from a shared counter by the calling thread and helpers on XLA's
// intra-op pool; the caller works too, so the call completes even when no helper runs.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRows = 16;   // rows of an AMX tile
constexpr int64_t kBlock = 32;  // queries per block: two row tiles share each right operand
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

// 2^x, zero where `live` is clear. Rounding to the nearest integer n leaves r = x - n in
// [-0.5, 0.5], where Cephes' exp2f polynomial is within ~1 ulp; scalef applies 2^n and goes
// to 0 for very negative x.
inline __m512 Exp2(__m512 x, __mmask16 live) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// bf16 (round to nearest even, as XLA's convert) of 16 float32 values, stored at `to`.
inline void StoreBf16(uint16_t* to, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), (__m256i)_mm512_cvtneps_pbh(x));
}

inline int64_t ScoresStride(int64_t lk_tiles) { return lk_tiles + 16; }

struct Shape {
  int64_t pairs, lq, lk, d;
};

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
  std::vector<uint16_t> q_tail;  // [32, d]: the last block's queries, zero-padded
};

// AMX's right operand holds pairs of consecutive contraction rows side by side: repack one
// pair's k (transposed) and v that way, keys padded to whole tiles with masked zeros.
void Repack(const Shape& s, const uint16_t* k, const uint16_t* v, const bool* mask,
            int64_t lk_tiles, Scratch& w) {
  const int64_t d = s.d, lk = s.lk, half_d = d / 2;
  w.keys_t.assign(half_d * lk_tiles, 0);
  w.values.assign(lk_tiles / 2 * d, 0);
  w.live.assign(lk_tiles / 16, 0);
  const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(k);
  const int64_t r_tiles = half_d / 16, c_tiles = d / 16;
  for (int64_t n = 0; n < lk; ++n) {
    uint32_t* tiles = w.keys_t.data() + (n / 16) * r_tiles * 256 + n % 16;
    for (int64_t r = 0; r < half_d; ++r) tiles[(r / 16) * 256 + (r % 16) * 16] = k_pairs[n * half_d + r];
  }
  for (int64_t n = 0; n < lk; ++n) {
    uint32_t* tiles = w.values.data() + (n / 32) * c_tiles * 256 + ((n % 32) / 2) * 16;
    const int shift = (n % 2) * 16;
    for (int64_t c = 0; c < d; ++c) tiles[(c / 16) * 256 + c % 16] |= uint32_t(v[n * d + c]) << shift;
    if (mask[n]) w.live[n / 16] |= static_cast<__mmask16>(1u << (n % 16));
  }
}

// Softmax of one block's rows: bf16 probabilities into `probs`, each row's shift (its scaled
// max, 0 when every key is masked) and sum into the arrays. exp(scale * (s - max)) is computed
// as 2^(c s - c max), c = scale log2(e), one multiply-add per score (scale > 0, so the max of
// the scaled scores is the scaled max).
void Softmax(int64_t lk_tiles, float scale, Scratch& w, float* shifts, float* sums) {
  const float c = scale * 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(c);
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < kBlock; ++i) {
    const float* row = w.scores.data() + i * ScoresStride(lk_tiles);
    uint16_t* probs = w.probs.data() + (i / kRows) * kRows * lk_tiles + (i % kRows) * 32;
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

// scores of the block for keys n0 .. n0 + 31
void ScoreTiles(const uint16_t* q_block, int64_t d, int64_t lk_tiles, int64_t n0, Scratch& w) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t per_key_tile = (d / 32) * 256;  // uint32 per 16 keys of k^T
  const uint32_t* keys = w.keys_t.data() + (n0 / 16) * per_key_tile;
  for (int64_t c = 0; c < d; c += kDepth) {
    _tile_loadd(4, q_block + c, d * 2);
    _tile_loadd(5, q_block + kRows * d + c, d * 2);
    _tile_loadd(6, keys + (c / 32) * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, keys + per_key_tile + (c / 32) * 256, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t stride = ScoresStride(lk_tiles);
  float* top = w.scores.data() + n0;
  float* bottom = top + kRows * stride;
  _tile_stored(0, top, stride * 4);
  _tile_stored(1, top + 16, stride * 4);
  _tile_stored(2, bottom, stride * 4);
  _tile_stored(3, bottom + 16, stride * 4);
}

// unnormalised output columns c0 .. c0 + 31 of the block
void OutputTiles(int64_t d, int64_t lk_tiles, int64_t c0, Scratch& w) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* top = w.probs.data();
  const uint16_t* bottom = top + kRows * lk_tiles;
  for (int64_t n = 0; n < lk_tiles; n += kDepth) {
    _tile_loadd(4, top + n * 16, 64);
    _tile_loadd(5, bottom + n * 16, 64);
    const uint32_t* tile = w.values.data() + ((n / 32) * (d / 16) + c0 / 16) * 256;
    _tile_loadd(6, tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, tile + 256, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  float* sums = w.sums.data() + c0;
  _tile_stored(0, sums, d * 4);
  _tile_stored(1, sums + 16, d * 4);
  _tile_stored(2, sums + kRows * d, d * 4);
  _tile_stored(3, sums + kRows * d + 16, d * 4);
}

// Queries [r0, r1) of one pair: their bf16 output and lse.
void AttendRows(const Shape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                const bool* mask, float scale, uint16_t* out, float* lse, int64_t r0, int64_t r1,
                Scratch& w) {
  const int64_t d = s.d;
  const int64_t lk_tiles = (s.lk + kDepth - 1) / kDepth * kDepth;
  Repack(s, k, v, mask, lk_tiles, w);
  w.scores.resize(kBlock * ScoresStride(lk_tiles));
  w.probs.resize(kBlock * lk_tiles);
  w.sums.resize(kBlock * d);
  w.q_tail.resize(kBlock * d);
  float shifts[kBlock], row_sums[kBlock];
  ConfigureTiles();
  for (int64_t row0 = r0; row0 < r1; row0 += kBlock) {
    const int64_t rows = std::min(kBlock, r1 - row0);
    const uint16_t* q_block = q + row0 * d;
    if (rows < kBlock) {  // the block's tile loads read 32 rows
      std::fill(w.q_tail.begin(), w.q_tail.end(), 0);
      std::memcpy(w.q_tail.data(), q_block, rows * d * sizeof(uint16_t));
      q_block = w.q_tail.data();
    }
    for (int64_t n0 = 0; n0 < lk_tiles; n0 += 32) ScoreTiles(q_block, d, lk_tiles, n0, w);
    Softmax(lk_tiles, scale, w, shifts, row_sums);
    for (int64_t c0 = 0; c0 < d; c0 += 32) OutputTiles(d, lk_tiles, c0, w);
    for (int64_t i = 0; i < rows; ++i) {
      const bool seen = row_sums[i] > 0;
      const __m512 inverse = _mm512_set1_ps(seen ? 1.0f / row_sums[i] : 0.0f);
      for (int64_t c = 0; c < d; c += 16)
        StoreBf16(out + (row0 + i) * d + c,
                  _mm512_mul_ps(_mm512_loadu_ps(w.sums.data() + i * d + c), inverse));
      lse[row0 + i] = seen ? shifts[i] + std::log(row_sums[i])
                           : std::numeric_limits<float>::infinity();
    }
  }
  _tile_release();
}

struct Job {
  Shape s;
  const uint16_t *q, *k, *v;
  const bool* mask;
  float scale;
  uint16_t* out;
  float* lse;
  int64_t rows_per_item, items_per_pair, items;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable finished;

  void Work() {
    thread_local Scratch scratch;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      const int64_t pair = i / items_per_pair, part = i % items_per_pair;
      const int64_t r0 = part * rows_per_item, r1 = std::min(s.lq, r0 + rows_per_item);
      const int64_t q_off = pair * s.lq * s.d, kv_off = pair * s.lk * s.d;
      AttendRows(s, q + q_off, k + kv_off, v + kv_off, mask + pair * s.lk, scale, out + q_off,
                 lse + pair * s.lq, r0, r1, scratch);
      if (done.fetch_add(1) + 1 == items) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || q.element_type() != ffi::DataType::BF16 ||
      k.element_type() != ffi::DataType::BF16 || v.element_type() != ffi::DataType::BF16 ||
      qd[2] % kDepth != 0 || kd[2] != qd[2] || kd[0] != qd[0])
    return ffi::Error::InvalidArgument("amx attention: q [P, Lq, D], k/v [P, Lk, D] in bf16, D % 32 == 0");
  if (!RequestAmx()) return ffi::Error::Internal("amx attention: the kernel refused AMX tile state");
  auto job = std::make_shared<Job>();
  job->s = {qd[0], qd[1], kd[1], qd[2]};
  job->q = static_cast<const uint16_t*>(q.untyped_data());
  job->k = static_cast<const uint16_t*>(k.untyped_data());
  job->v = static_cast<const uint16_t*>(v.untyped_data());
  job->mask = mask.typed_data();
  job->scale = scale;
  job->out = static_cast<uint16_t*>(out->untyped_data());
  job->lse = lse->typed_data();
  if (job->s.pairs == 0 || job->s.lq == 0) return ffi::Error::Success();
  // about four items per thread, none under 4 blocks (128 queries): an item repacks its
  // pair's k and v, which must stay small next to its products
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t blocks = (job->s.lq + kBlock - 1) / kBlock;
  int64_t parts = (4 * threads + job->s.pairs - 1) / job->s.pairs;
  parts = std::max<int64_t>(1, std::min(parts, blocks / 4));
  job->rows_per_item = (blocks + parts - 1) / parts * kBlock;
  job->items_per_pair = (job->s.lq + job->rows_per_item - 1) / job->rows_per_item;
  job->items = job->s.pairs * job->items_per_pair;
  for (int64_t i = 1; i < std::min(threads, job->items); ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  std::unique_lock<std::mutex> lock(job->mu);
  job->finished.wait(lock, [&] { return job->done.load() == job->items; });
  return ffi::Error::Success();
}

}  // namespace

// 1 when this process may use AMX (asks the kernel once); the Python side checks it before it
// emits the custom call.
extern "C" int difforge_amx_ready() { return RequestAmx() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(DifforgeAmxAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
