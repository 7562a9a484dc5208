// Fused exact attention in float32 with AVX-512 FMA, forward and backward, as XLA CPU FFI
// custom calls: the float32 counterpart of amx_attention.cc (AMX has no float32 products).
//
// Why: XLA CPU runs float32 attention as separate passes over [Lq, Lk] float32 tiles (q k^T,
// row max, exp, row sum, p v), each a round trip through memory: the Wan S self-attention
// (1024 tokens, 8 x 64) took 13.7 ms forward and 49 ms forward + backward, PyTorch's flash
// kernel 8.2 and 29 ms (2 cores). Here a block of 32 queries goes through both products and its
// softmax while its scores stay in the core's cache, and every product is one register-blocked
// FMA kernel (TiledGemm below). Both passes take the keys in blocks (the forward with an
// online softmax, see kKeyBlock; the backward, kBackwardKeyBlock), so that long sequences stay
// in L2.
//
// Semantics: those of jaxcore/kernels/blockwise.py's forward and backward for one tile covering
// all keys (the key blocks change only the float32 rounding), in float32 throughout:
// scores = (q k^T) * scale (scale > 0), masked keys left out; m = row max (0 where every key
// is masked); p = exp(scores - m); l = sum(p); out = (p v) / l (zeros where l == 0);
// lse = m + log(l) (+inf where l == 0). The backward recomputes p = exp(scale s - lse) and
// forms dq = ds k, dk = ds^T q, dv = p^T do with ds = scale p (do v^T - delta),
// delta = rowsum(do * out). Within float32 rounding of XLA's (exp as 2^x, another summation
// order), not bit for bit. jaxcore/kernels/native.py builds and registers it;
// tests/jaxcore/test_native_attention.py compares it with the XLA path.
//
// Layout: attention_common.h's Shape (q [B, Lq, H, D], k and v [B, Lk, H, D] in float32, mask
// [B, Lk], lse [B, H, Lq]), D a multiple of 16 (one register of float32). Threads as
// amx_attention.cc: forward items are (pair, query range), backward items pairs.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention_common.h"

namespace {

constexpr int64_t kLanes = 16;       // float32 in one register
constexpr int64_t kChunk = 128;      // contraction steps whose b rows stay in L1 (32 KiB)

// c[R rows, 16 C columns] (= or +=) sum over p < depth of a(r, p) b[p, :], a(r, p) at
// a[r * a_row + p * a_step] (broadcast), b rows `ldb` apart, c rows `ldc` apart. R x C
// accumulators stay in registers through the contraction.
template <int R, int C>
void RegisterTile(int64_t depth, const float* a, int64_t a_row, int64_t a_step, const float* b,
                  int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j)
      acc[r][j] = accumulate ? _mm512_loadu_ps(c + r * ldc + j * kLanes) : _mm512_setzero_ps();
  for (int64_t p = 0; p < depth; ++p) {
    __m512 bv[C];
    for (int j = 0; j < C; ++j) bv[j] = _mm512_loadu_ps(b + p * ldb + j * kLanes);
    const float* ap = a + p * a_step;
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(ap[r * a_row]);
      for (int j = 0; j < C; ++j) acc[r][j] = _mm512_fmadd_ps(av, bv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) _mm512_storeu_ps(c + r * ldc + j * kLanes, acc[r][j]);
}

using TileFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                        int64_t, bool);

template <int R>
constexpr TileFn TileFor(int vectors) {
  return vectors == 1 ? RegisterTile<R, 1>
         : vectors == 2 ? RegisterTile<R, 2>
         : vectors == 3 ? RegisterTile<R, 3>
                        : RegisterTile<R, 4>;
}

// The register tile of `rows` (1..8) x `vectors` (1..4) registers.
TileFn Tile(int rows, int vectors) {
  switch (rows) {
    case 1: return TileFor<1>(vectors);
    case 2: return TileFor<2>(vectors);
    case 3: return TileFor<3>(vectors);
    case 4: return TileFor<4>(vectors);
    case 5: return TileFor<5>(vectors);
    case 6: return TileFor<6>(vectors);
    case 7: return TileFor<7>(vectors);
    default: return TileFor<8>(vectors);
  }
}

// c[m, n] (= or +=) a . b: a(i, p) at a[i * a_row + p * a_step], b [depth, n] rows `ldb`
// apart, c rows `ldc` apart; n a multiple of 16. Register tiles of kRows x kVectors registers
// (at most 24 accumulators: with their b registers and a broadcast, 32 fit); the contraction
// goes in chunks whose strip of b (kChunk x 16 kVectors columns) stays in L1 while every row
// tile passes over it.
template <int kRows, int kVectors>
void TiledGemm(int64_t m, int64_t n, int64_t depth, const float* a, int64_t a_row,
               int64_t a_step, const float* b, int64_t ldb, float* c, int64_t ldc,
               bool accumulate) {
  constexpr int64_t strip = kVectors * kLanes;
  for (int64_t p0 = 0; p0 < depth; p0 += kChunk) {
    const int64_t steps = std::min(kChunk, depth - p0);
    const bool add = accumulate || p0 > 0;
    for (int64_t n0 = 0; n0 < n; n0 += strip) {
      const int vectors = static_cast<int>(std::min(strip, n - n0) / kLanes);
      for (int64_t i0 = 0; i0 < m; i0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - i0));
        Tile(rows, vectors)(steps, a + i0 * a_row + p0 * a_step, a_row, a_step,
                            b + p0 * ldb + n0, ldb, c + i0 * ldc + n0, ldc, add);
      }
    }
  }
}

// The products in 4 x 64 tiles; the scores and dp (queries x a key block, contracting d) in
// 8 x 48: at head dim 128, 8,192 keys, the forward took 226-237 ms against 245-267 (torch
// SDPA 228-236), at 64 the same as 4 x 64 (the backward's s and dp: 79.5-80 -> 75-77 ms at
// 1,536 x 4 x 128). 6 or 8 rows x 64 measured no better.
constexpr auto Gemm = TiledGemm<4, 4>;
constexpr auto ScoresGemm = TiledGemm<8, 3>;

// x [lk, d] (rows `ld` apart) -> [d, keys] with rows `stride` apart (ScoresStride: rows
// 4 KiB apart would share one L1 set), keys after lk zeros: the right operand of
// q k^T, do v^T. 16 keys at a time, whose rows stay in L1 while their columns are written.
void Transpose(const float* x, int64_t lk, int64_t d, int64_t ld, int64_t stride,
               std::vector<float>& to) {
  to.assign(d * stride, 0.0f);
  for (int64_t n0 = 0; n0 < lk; n0 += kLanes) {
    const int64_t n1 = std::min(lk, n0 + kLanes);
    for (int64_t c = 0; c < d; ++c)
      for (int64_t n = n0; n < n1; ++n) to[c * stride + n] = x[n * ld + c];
  }
}

// x [n, d] (rows `ld` apart) as contiguous rows: v and k as the right operands of p v and
// ds k, whose contraction runs down their rows, and a block's queries (rows a multiple of
// 4 KiB apart, or 2 KiB at 8 heads x 64, share a few L1 sets: the forward of the Wan S
// self-attention took 11.0 ms reading v in place, 9.5 ms with this copy).
const float* Rows(const float* x, int64_t n_rows, int64_t d, int64_t ld, std::vector<float>& to) {
  if (ld == d) return x;
  to.resize(n_rows * d);
  for (int64_t n = 0; n < n_rows; ++n) std::memcpy(to.data() + n * d, x + n * ld, d * sizeof(float));
  return to.data();
}

inline int64_t PaddedKeys(int64_t lk) { return (lk + kLanes - 1) / kLanes * kLanes; }

// The forward streams the keys in blocks of kKeyBlock past kSuperRows queries at a time
// (FlashAttention's online softmax), so that what it reads repeatedly (a block's k^T and v,
// the queries' running sums) stays in L2 however long the sequence: reading every key for each
// block of 32 queries made its working set k^T + v (2 x keys x d floats), which outgrew L2 at
// head dim 128 (1,536 keys: 262 GFLOP/s against torch SDPA's 291; 8,192 keys: 217 against 266).
constexpr int64_t kKeyBlock = 512;
constexpr int64_t kSuperRows = 256;

struct Scratch {  // a thread's buffers, reused across calls
  std::vector<float> keys_t;    // [d, ScoresStride]: Transpose
  std::vector<float> values;    // [lk, d]: Rows
  std::vector<float> queries;   // [kSuperRows, d]: Rows
  std::vector<__mmask16> live;  // LiveKeys
  std::vector<float> scores;    // [32, ScoresStride(kKeyBlock)]: scores, then probabilities
  std::vector<float> sums;      // [kSuperRows, d]: unnormalised output
  std::vector<float> maxima;    // [kSuperRows]: each row's running max of its raw scores
  std::vector<float> totals;    // [kSuperRows]: each row's running sum of probabilities
};

// One key block's scores (`rows` rows `stride` apart, `keys` of them) -> probabilities in place
// (FlashAttention's online softmax): each row's running max (raw scores, -inf before any live
// key), its running sum and its unnormalised output (`sums`, d columns) rescaled to the new
// max. exp(scale (s - max)) as 2^(c s - c max), c = scale log2(e) (scale > 0: the max of the
// scaled scores is the scaled max).
void OnlineSoftmax(int64_t rows, int64_t keys, int64_t stride, int64_t d, float scale,
                   const __mmask16* live, float* scores, float* maxima, float* totals,
                   float* sums) {
  const float c = scale * kLog2e;
  const __m512 vc = _mm512_set1_ps(c);
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < rows; ++i) {
    float* row = scores + i * stride;
    __m512 vmax = vneg_inf;
    for (int64_t n = 0; n < keys; n += kLanes)
      vmax = _mm512_mask_max_ps(vmax, live[n / kLanes], vmax, _mm512_loadu_ps(row + n));
    const float before = maxima[i];
    const float m = std::max(before, _mm512_reduce_max_ps(vmax));
    const bool seen = std::isfinite(m);  // else no live key yet: zero probabilities
    if (seen && m > before && totals[i] > 0) {  // rescale what earlier blocks summed
      const float correction = std::exp2(c * (before - m));
      totals[i] *= correction;
      const __m512 vcorrection = _mm512_set1_ps(correction);
      for (int64_t col = 0; col < d; col += kLanes)
        _mm512_storeu_ps(sums + i * d + col,
                         _mm512_mul_ps(_mm512_loadu_ps(sums + i * d + col), vcorrection));
    }
    maxima[i] = m;
    const __m512 vshift = _mm512_set1_ps(seen ? c * m : 0.0f);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t n = 0; n < keys; n += kLanes) {
      const __mmask16 alive = seen ? live[n / kLanes] : 0;
      const __m512 p = Exp2(_mm512_fmsub_ps(_mm512_loadu_ps(row + n), vc, vshift), alive);
      vsum = _mm512_add_ps(vsum, p);
      _mm512_storeu_ps(row + n, p);
    }
    totals[i] += _mm512_reduce_add_ps(vsum);
  }
}

// Queries [r0, r1) of one pair: their output and lse, kSuperRows queries at a time, each
// group against every key block in turn, 32 queries (kBlock) per product.
void AttendRows(const Shape& s, const float* q, const float* k, const float* v, const bool* mask,
                float scale, float* out, float* lse, int64_t r0, int64_t r1, Scratch& w) {
  const int64_t d = s.d, ld = s.row(), padded_keys = PaddedKeys(s.lk);
  const int64_t stride = ScoresStride(padded_keys);
  Transpose(k, s.lk, d, ld, stride, w.keys_t);
  const float* values = Rows(v, s.lk, d, ld, w.values);
  LiveKeys(mask, s.lk, padded_keys, w.live);
  const int64_t block_keys = std::min(kKeyBlock, padded_keys);
  const int64_t block_stride = ScoresStride(block_keys);
  w.scores.resize(kBlock * block_stride);
  w.sums.resize(kSuperRows * d);
  w.maxima.resize(kSuperRows);
  w.totals.resize(kSuperRows);
  for (int64_t super0 = r0; super0 < r1; super0 += kSuperRows) {
    const int64_t super_rows = std::min(kSuperRows, r1 - super0);
    const float* queries = Rows(q + super0 * ld, super_rows, d, ld, w.queries);
    std::fill(w.sums.begin(), w.sums.begin() + super_rows * d, 0.0f);
    std::fill(w.maxima.begin(), w.maxima.end(), -std::numeric_limits<float>::infinity());
    std::fill(w.totals.begin(), w.totals.end(), 0.0f);
    for (int64_t key0 = 0; key0 < padded_keys; key0 += block_keys) {
      const int64_t keys = std::min(block_keys, padded_keys - key0);  // a multiple of 16
      const int64_t real_keys = std::min(keys, s.lk - key0);            // >= 1
      for (int64_t row0 = 0; row0 < super_rows; row0 += kBlock) {
        const int64_t rows = std::min(kBlock, super_rows - row0);
        ScoresGemm(rows, keys, d, queries + row0 * d, d, 1, w.keys_t.data() + key0, stride,
                   w.scores.data(), block_stride, false);
        OnlineSoftmax(rows, keys, block_stride, d, scale, w.live.data() + key0 / kLanes,
                      w.scores.data(), w.maxima.data() + row0, w.totals.data() + row0,
                      w.sums.data() + row0 * d);
        // p v over the real keys only (padded ones have p = 0 and no row in v)
        Gemm(rows, d, real_keys, w.scores.data(), block_stride, 1, values + key0 * d, d,
             w.sums.data() + row0 * d, d, true);
      }
    }
    for (int64_t i = 0; i < super_rows; ++i) {
      const float total = w.totals[i];
      const bool seen = total > 0;
      const __m512 inverse = _mm512_set1_ps(seen ? 1.0f / total : 0.0f);
      for (int64_t c = 0; c < d; c += kLanes)
        _mm512_storeu_ps(out + (super0 + i) * ld + c,
                         _mm512_mul_ps(_mm512_loadu_ps(w.sums.data() + i * d + c), inverse));
      lse[super0 + i] = seen ? scale * w.maxima[i] + std::log(total)
                             : std::numeric_limits<float>::infinity();
    }
  }
}

// AVX-512 needs no grant from the OS: always ready
constexpr KernelSpec kSpec{"avx512 attention", "float32", ffi::DataType::F32, kLanes, nullptr,
                           ""};

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale) {
  return ForwardHandler<float, Scratch>(kSpec, pool, q, k, v, mask, out, lse, scale, AttendRows);
}

// --- backward -------------------------------------------------------------------------------
//
// FlashAttention-2's backward for one pair, key block by key block (kBackwardKeyBlock keys) and
// within a block kBackwardRows queries at a time: s = q k^T and dp = do v^T (the forward's
// products, in its 8 x 48 tiles), p and ds in place of them, then dq += ds k for the queries,
// and dv^T += do^T p, dk^T += q^T ds accumulated over the queries ([d, block keys], so that
// their contraction over the queries runs along rows of p and ds as stored); a block's dk and
// dv are final when its queries are done. What the inner loop re-reads (the block's k^T, v^T,
// k, dk^T and dv^T: 5 x block x d floats) stays in L2. Over the whole sequence at once, 32
// queries at a time, it outgrew L2 at head dim 128: forward + backward at 1,536 keys x 4
// heads x 128 took 89-91 ms (torch SDPA 63-64), now 75-77; at 4,096 x 2 x 128 316-321 ms, now
// 255-264 (torch 218-221); the Wan S self-attention (1,024 x 8 x 64) is unchanged. 128 queries,
// or blocks of 256 keys, measured no better; 6 x 64 tiles for the other three products the same.
constexpr int64_t kBackwardKeyBlock = 512;
constexpr int64_t kBackwardRows = 64;

struct BackwardScratch {
  std::vector<float> keys_t, values_t;  // [d, ScoresStride]: Transpose
  std::vector<float> keys;              // [lk, d]: Rows
  std::vector<float> q_block, do_block;  // [kBackwardRows, d]: Rows
  std::vector<__mmask16> live;
  std::vector<float> delta;             // [lq]: rowsum(do * out)
  std::vector<float> probs, dscores;    // [kBackwardRows, ScoresStride(block)]
  std::vector<float> dk_t, dv_t;        // [d, ScoresStride(block)]
};

// p = exp(scale s - lse) (0 for masked keys and for rows that saw no key, lse +inf) in place
// of the scores, ds = scale p (dp - delta) in place of dp; `keys` of them, rows `stride` apart.
void ScoreGradients(int64_t rows, int64_t keys, int64_t stride, float scale, const float* lse,
                    const float* delta, const __mmask16* live, float* probs, float* dscores) {
  const __m512 vc = _mm512_set1_ps(scale * kLog2e), vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < rows; ++i) {
    const bool seen = std::isfinite(lse[i]);
    const __m512 shift = _mm512_set1_ps(seen ? lse[i] * kLog2e : 0.0f);
    const __m512 row_delta = _mm512_set1_ps(delta[i]);
    float* p_row = probs + i * stride;
    float* ds_row = dscores + i * stride;
    for (int64_t n = 0; n < keys; n += kLanes) {
      const __mmask16 alive = seen ? live[n / kLanes] : 0;
      const __m512 p = Exp2(_mm512_fmsub_ps(_mm512_loadu_ps(p_row + n), vc, shift), alive);
      const __m512 dp = _mm512_sub_ps(_mm512_loadu_ps(ds_row + n), row_delta);
      _mm512_storeu_ps(p_row + n, p);
      _mm512_storeu_ps(ds_row + n, _mm512_mul_ps(_mm512_mul_ps(p, dp), vscale));
    }
  }
}

void BackwardPair(const Shape& s, const float* q, const float* k, const float* v,
                  const bool* mask, const float* out, const float* d_out, const float* lse,
                  float scale, float* dq, float* dk, float* dv, BackwardScratch& w) {
  const int64_t d = s.d, ld = s.row(), padded_keys = PaddedKeys(s.lk);
  const int64_t stride = ScoresStride(padded_keys);
  Transpose(k, s.lk, d, ld, stride, w.keys_t);
  Transpose(v, s.lk, d, ld, stride, w.values_t);
  const float* keys = Rows(k, s.lk, d, ld, w.keys);
  LiveKeys(mask, s.lk, padded_keys, w.live);
  const int64_t block_keys = std::min(kBackwardKeyBlock, padded_keys);
  const int64_t block_stride = ScoresStride(block_keys);
  w.probs.resize(kBackwardRows * block_stride);
  w.dscores.resize(kBackwardRows * block_stride);
  w.delta.resize(s.lq);
  for (int64_t i = 0; i < s.lq; ++i) {  // and dq starts at zero: the key blocks add to it
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += kLanes) {
      sum = _mm512_fmadd_ps(_mm512_loadu_ps(d_out + i * ld + c), _mm512_loadu_ps(out + i * ld + c),
                            sum);
      _mm512_storeu_ps(dq + i * ld + c, _mm512_setzero_ps());
    }
    w.delta[i] = _mm512_reduce_add_ps(sum);
  }
  for (int64_t key0 = 0; key0 < padded_keys; key0 += block_keys) {
    const int64_t n_keys = std::min(block_keys, padded_keys - key0);  // a multiple of 16
    const int64_t real_keys = std::min(n_keys, s.lk - key0);          // >= 1
    w.dk_t.assign(d * block_stride, 0.0f);
    w.dv_t.assign(d * block_stride, 0.0f);
    for (int64_t row0 = 0; row0 < s.lq; row0 += kBackwardRows) {
      const int64_t rows = std::min(kBackwardRows, s.lq - row0);
      // the block's rows contiguous: the products below broadcast down their columns, which at
      // a 4 KiB row stride (16 heads x 64) all fall in one L1 set (the Wan M train step took
      // 5.46 s reading them in place, 4.56 s on XLA's path)
      const float* q_block = Rows(q + row0 * ld, rows, d, ld, w.q_block);
      const float* do_block = Rows(d_out + row0 * ld, rows, d, ld, w.do_block);
      ScoresGemm(rows, n_keys, d, q_block, d, 1, w.keys_t.data() + key0, stride,
                 w.probs.data(), block_stride, false);
      ScoresGemm(rows, n_keys, d, do_block, d, 1, w.values_t.data() + key0, stride,
                 w.dscores.data(), block_stride, false);
      ScoreGradients(rows, n_keys, block_stride, scale, lse + row0, w.delta.data() + row0,
                     w.live.data() + key0 / kLanes, w.probs.data(), w.dscores.data());
      Gemm(rows, d, real_keys, w.dscores.data(), block_stride, 1, keys + key0 * d, d,
           dq + row0 * ld, ld, true);
      // [d, keys] += x^T [d, rows] . y [rows, keys]: x^T(c, i) = x[i * d + c]
      Gemm(d, n_keys, rows, do_block, 1, d, w.probs.data(), block_stride, w.dv_t.data(),
           block_stride, true);
      Gemm(d, n_keys, rows, q_block, 1, d, w.dscores.data(), block_stride, w.dk_t.data(),
           block_stride, true);
    }
    for (int64_t n = 0; n < real_keys; ++n)
      for (int64_t c = 0; c < d; ++c) {
        dk[(key0 + n) * ld + c] = w.dk_t[c * block_stride + n];
        dv[(key0 + n) * ld + c] = w.dv_t[c * block_stride + n];
      }
  }
}

ffi::Error AttentionBackward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::Buffer<ffi::PRED> mask, ffi::AnyBuffer out,
                             ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out,
                             ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                             ffi::Result<ffi::AnyBuffer> dv, float scale) {
  return BackwardHandler<float, BackwardScratch>(kSpec, pool, q, k, v, mask, out, lse, d_out, dq,
                                                 dk, dv, scale, BackwardPair);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DifforgeAvx512Attention, Attention,
                              BindForward());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DifforgeAvx512AttentionBackward, AttentionBackward,
                              BindBackward());
