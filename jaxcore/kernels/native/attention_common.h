// What the native attention kernels share (amx_attention.cc in bf16, avx512_attention.cc in
// float32): the operands' shape check, the key mask as 16-key bit masks, 2^x in AVX-512, how a
// forward splits its queries into work items (run by parallel_for.h's loop), and the FFI
// binding prefix and the FFI handlers themselves (ForwardHandler, BackwardHandler: checks,
// operands, work items), to which each kernel gives its element type and its per-item work.
// Each kernel's library is its own translation unit, so everything here is internal (an
// anonymous namespace).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "parallel_for.h"
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

// What a kernel's handlers check before they run: its name and element type (for the errors),
// the head-dim multiple it needs, and whether the OS lets it run (AMX's tile state).
struct KernelSpec {
  const char* name;        // "amx attention"
  const char* type_name;   // "bf16"
  ffi::DataType type;
  int64_t d_multiple;
  bool (*ready)();         // nullptr: always ready
  const char* not_ready;   // the error when ready() is false
};

inline std::string DMultiple(const KernelSpec& spec) {
  return "D % " + std::to_string(spec.d_multiple) + " == 0";
}

// What each call takes, for its InvalidArgument error.
inline std::string ForwardOperands(const KernelSpec& spec) {
  return std::string(spec.name) + ": q [B, Lq, H, D], k/v [B, Lk, H, D] in " + spec.type_name +
         ", " + DMultiple(spec);
}

inline std::string BackwardOperands(const KernelSpec& spec) {
  return std::string(spec.name) + " backward: " + spec.type_name + " [B, L, H, D], " +
         DMultiple(spec);
}

// The operands' shape, or the error that names what the call takes (`operands`) or why the
// kernel cannot run.
ffi::ErrorOr<Shape> CheckedShape(const KernelSpec& spec, std::string (*operands)(const KernelSpec&),
                                 const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                 std::initializer_list<const ffi::AnyBuffer*> others) {
  const std::optional<Shape> shape = HeadsShape(spec.type, spec.d_multiple, q, k, others);
  if (!shape) return ffi::Unexpected(ffi::Error::InvalidArgument(operands(spec)));
  if (spec.ready != nullptr && !spec.ready())
    return ffi::Unexpected(ffi::Error::Internal(spec.not_ready));
  return *shape;
}

// A kernel's forward handler: every pair's queries in QuerySplit's items, each one call of
// attend(shape, q, k, v, mask, scale, out, lse, first row, end row, scratch) on that pair's
// operands (T: the element type; Scratch: a thread's buffers, reused across calls).
template <typename T, typename Scratch, typename Attend>
ffi::Error ForwardHandler(const KernelSpec& spec, ffi::ThreadPool& pool, const ffi::AnyBuffer& q,
                          const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                          const ffi::Buffer<ffi::PRED>& mask, ffi::Result<ffi::AnyBuffer>& out,
                          ffi::Result<ffi::Buffer<ffi::F32>>& lse, float scale, Attend attend) {
  const ffi::ErrorOr<Shape> shape = CheckedShape(spec, ForwardOperands, q, k, {&v});
  if (!shape.has_value()) return shape.error();
  const Shape s = *shape;
  if (s.pairs() == 0 || s.lq == 0) return ffi::Error::Success();
  const auto* qp = static_cast<const T*>(q.untyped_data());
  const auto* kp = static_cast<const T*>(k.untyped_data());
  const auto* vp = static_cast<const T*>(v.untyped_data());
  const bool* mp = mask.typed_data();
  auto* op = static_cast<T*>(out->untyped_data());
  float* lp = lse->typed_data();
  const QuerySplit split(s, pool.num_threads());
  ParallelFor(pool, s.pairs() * split.items_per_pair, [&](int64_t i) {
    thread_local Scratch scratch;
    const int64_t pair = i / split.items_per_pair, part = i % split.items_per_pair;
    const int64_t r0 = part * split.rows_per_item;
    const int64_t r1 = std::min(s.lq, r0 + split.rows_per_item);
    const int64_t q_off = s.q_offset(pair), kv_off = s.kv_offset(pair);
    attend(s, qp + q_off, kp + kv_off, vp + kv_off, mp + s.mask_offset(pair), scale, op + q_off,
           lp + s.lse_offset(pair), r0, r1, scratch);
  });
  return ffi::Error::Success();
}

// A kernel's backward handler: one item per pair (its dk and dv sum over all its queries), each
// one call of backward_pair(shape, q, k, v, mask, out, d_out, lse, scale, dq, dk, dv, scratch).
template <typename T, typename Scratch, typename BackwardPair>
ffi::Error BackwardHandler(const KernelSpec& spec, ffi::ThreadPool& pool,
                           const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                           const ffi::AnyBuffer& v, const ffi::Buffer<ffi::PRED>& mask,
                           const ffi::AnyBuffer& out, const ffi::Buffer<ffi::F32>& lse,
                           const ffi::AnyBuffer& d_out, ffi::Result<ffi::AnyBuffer>& dq,
                           ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                           float scale, BackwardPair backward_pair) {
  const ffi::ErrorOr<Shape> shape =
      CheckedShape(spec, BackwardOperands, q, k, {&v, &out, &d_out});
  if (!shape.has_value()) return shape.error();
  const Shape s = *shape;
  if (s.pairs() == 0) return ffi::Error::Success();
  const auto* qp = static_cast<const T*>(q.untyped_data());
  const auto* kp = static_cast<const T*>(k.untyped_data());
  const auto* vp = static_cast<const T*>(v.untyped_data());
  const auto* op = static_cast<const T*>(out.untyped_data());
  const auto* dop = static_cast<const T*>(d_out.untyped_data());
  const bool* mp = mask.typed_data();
  const float* lp = lse.typed_data();
  auto* dqp = static_cast<T*>(dq->untyped_data());
  auto* dkp = static_cast<T*>(dk->untyped_data());
  auto* dvp = static_cast<T*>(dv->untyped_data());
  ParallelFor(pool, s.pairs(), [&](int64_t pair) {
    thread_local Scratch scratch;
    const int64_t q_off = s.q_offset(pair), kv_off = s.kv_offset(pair);
    backward_pair(s, qp + q_off, kp + kv_off, vp + kv_off, mp + s.mask_offset(pair), op + q_off,
                  dop + q_off, lp + s.lse_offset(pair), scale, dqp + q_off, dkp + kv_off,
                  dvp + kv_off, scratch);
  });
  return ffi::Error::Success();
}

// What both calls of a kernel take first: XLA's intra-op pool, then q, k, v and the key mask.
auto BindPoolQkvMask() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::PRED>>();
}

// Every kernel's forward binding: (pool, q, k, v, mask) -> (out, lse), attribute scale.
auto BindForward() {
  return BindPoolQkvMask().Ret<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>().Attr<float>(
      "scale");
}

// Every kernel's backward binding: (pool, q, k, v, mask, out, lse, d_out) -> (dq, dk, dv),
// attribute scale.
auto BindBackward() {
  return BindPoolQkvMask()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<float>("scale");
}

}  // namespace
