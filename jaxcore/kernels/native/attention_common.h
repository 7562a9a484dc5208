// What the native attention kernels share (amx_attention.cc in bf16, avx512_attention.cc in
// float32): the operands' shape check, the key mask as 16-key bit masks, 2^x in AVX-512, the work
// loop over XLA's intra-op pool, how a forward splits its queries into work items, and the FFI
// binding prefix both calls of each kernel take. Each kernel's library is its own translation
// unit, so everything here is internal (an anonymous namespace).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kLog2e = 1.44269504088896341f;  // exp(x) = 2^(x log2(e))

// Queries per block: the block's scores (block x Lk float32) stay in the core's cache between
// its two products.
constexpr int64_t kBlock = 32;

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

// Row stride of a block's float32 score rows of `padded_keys`: a cache line further apart than
// their length, so that rows a multiple of 4 KiB apart do not share one L1 set.
inline int64_t ScoresStride(int64_t padded_keys) { return padded_keys + 16; }

// q [B, Lq, H, D], k and v [B, Lk, H, D] (the model's own layout: no transposes around the
// call), mask [B, Lk], lse [B, H, Lq]. A pair is one (batch row, head); its rows are `row()`
// elements apart.
struct Shape {
  int64_t batch, lq, lk, heads, d;

  int64_t pairs() const { return batch * heads; }
  int64_t row() const { return heads * d; }
  int64_t q_offset(int64_t pair) const { return Offset(pair, lq); }
  int64_t kv_offset(int64_t pair) const { return Offset(pair, lk); }
  int64_t mask_offset(int64_t pair) const { return pair / heads * lk; }
  int64_t lse_offset(int64_t pair) const { return pair * lq; }

 private:
  int64_t Offset(int64_t pair, int64_t length) const {
    return pair / heads * length * row() + pair % heads * d;
  }
};

// Bit n % 16 of live[n / 16] set: attend to key n (keys up to `padded_keys` masked).
void LiveKeys(const bool* mask, int64_t lk, int64_t padded_keys, std::vector<__mmask16>& live) {
  live.assign(padded_keys / 16, 0);
  for (int64_t n = 0; n < lk; ++n)
    if (mask[n]) live[n / 16] |= static_cast<__mmask16>(1u << (n % 16));
}

// Calls fn(i) for every i in [0, items) on the calling thread and on helpers from XLA's
// intra-op pool, each index claimed once from a shared counter; returns when all are done. The
// caller works too, so it returns even when no helper ever runs (a pool busy elsewhere).
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable finished;
  };
  auto state = std::make_shared<State>();
  auto work = [state, items, fn] {
    for (int64_t i; (i = state->next.fetch_add(1)) < items;) {
      fn(i);
      if (state->done.fetch_add(1) + 1 == items) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->finished.notify_all();
      }
    }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 1; i < std::min(threads, items); ++i) {
    auto helper = work;
    pool.Schedule(std::move(helper));
  }
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->finished.wait(lock, [&] { return state->done.load() == items; });
}

// The shape when q and k (and `others`) are [B, L, H, D] of `type` with one B, H and D (D a
// multiple of `d_multiple`) and `others` shaped as q or k; nullopt otherwise.
std::optional<Shape> HeadsShape(ffi::DataType type, int64_t d_multiple, const ffi::AnyBuffer& q,
                                const ffi::AnyBuffer& k,
                                std::initializer_list<const ffi::AnyBuffer*> others) {
  const auto typed_4d = [type](const ffi::AnyBuffer* b) {
    return b->element_type() == type && b->dimensions().size() == 4;
  };
  if (!typed_4d(&q) || !typed_4d(&k)) return std::nullopt;
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd[3] % d_multiple != 0 || kd[0] != qd[0] || kd[2] != qd[2] || kd[3] != qd[3])
    return std::nullopt;
  for (const ffi::AnyBuffer* b : others) {
    if (!typed_4d(b)) return std::nullopt;
    const auto bd = b->dimensions();
    if (!std::equal(bd.begin(), bd.end(), qd.begin()) &&
        !std::equal(bd.begin(), bd.end(), kd.begin()))
      return std::nullopt;
  }
  return Shape{qd[0], qd[1], kd[1], qd[2], qd[3]};
}

// A forward's work items: each pair's queries cut into `items_per_pair` ranges of
// `rows_per_item` (whole blocks), about four items per thread and none under 4 blocks (an item
// repacks its pair's k and v, which must stay small next to its products).
struct QuerySplit {
  int64_t rows_per_item, items_per_pair;

  QuerySplit(const Shape& s, int64_t threads) {
    const int64_t blocks = (s.lq + kBlock - 1) / kBlock;
    int64_t parts = (4 * threads + s.pairs() - 1) / s.pairs();
    parts = std::max<int64_t>(1, std::min(parts, blocks / 4));
    rows_per_item = (blocks + parts - 1) / parts * kBlock;
    items_per_pair = (s.lq + rows_per_item - 1) / rows_per_item;
  }
};

// What both calls of a kernel take first: XLA's intra-op pool, then q, k, v and the key mask.
auto BindPoolQkvMask() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::PRED>>();
}

}  // namespace
