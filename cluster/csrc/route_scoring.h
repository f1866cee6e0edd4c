// The router's scoring (cluster/block_index.py; router/route.py calls it): the rules of
// router/routing_policy.py over one role's arrays, and the per-decision admission masks.
// Included once, by block_index.cpp.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// Scoring over one role's arrays (router/route.py; the spec is router/routing_policy.py).
// `table` is float64 [4, n]: KV usage, running, waiting, routed since the last Health
// (counted as waiting); workers ordered by id. `mask` (uint8 [n]) marks the candidates.
// A worker's overlap is `counts[slots[i]]` (an index lookup per slot; slot < 0: none).
using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Bytes = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;
using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Counts = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

struct Role {
  ssize_t n = 0;
  const double *k = nullptr, *r = nullptr, *w = nullptr, *routed = nullptr;
  const uint8_t* m = nullptr;
  const int64_t* slots = nullptr;
  const int32_t* counts = nullptr;
  ssize_t cap = 0;

  Role() = default;
  Role(const Doubles& table, const Bytes& mask, const Ints& sl, const Counts& c)
      : n(mask.size()), m(mask.data()), slots(sl.data()), counts(c.data()), cap(c.size()) {
    if (table.ndim() != 2 || table.shape(0) != 4 || table.shape(1) != n || sl.size() != n)
      throw py::value_error("table must be [4, n], mask and slots [n]");
    rows(table.data());
  }
  void rows(const double* table) {
    k = table;
    r = k + n;
    w = r + n;
    routed = w + n;
  }
  double waiting(ssize_t i) const { return w[i] + routed[i]; }
  int64_t overlap(ssize_t i) const {
    return slots[i] >= 0 && slots[i] < cap ? counts[slots[i]] : 0;
  }
};

// The next value of a Python iterator of ints (the router's tie counters, taken only
// when a choice is made).
int64_t next_turn(const py::handle& rotation) {
  PyObject* v = PyIter_Next(rotation.ptr());
  if (!v) {
    if (PyErr_Occurred()) throw py::error_already_set();
    throw py::value_error("the rotation counter ended");
  }
  long long turn = PyLong_AsLongLong(v);
  Py_DECREF(v);
  if (turn == -1 && PyErr_Occurred()) throw py::error_already_set();
  return turn;
}

// routing_policy.choose_decode_worker over the workers `a.m` marks (at least one);
// `turn()` gives the rotation for the ties.
template <class Turn>
int64_t pick_decode(const Role& a, int64_t block_size, int64_t num_tokens, int64_t min_cached,
                    std::vector<uint8_t>& pick, std::vector<int64_t>& cached, Turn turn) {
  pick.assign(a.m, a.m + a.n);
  if (min_cached > 0) {
    double least = INFINITY;
    for (ssize_t i = 0; i < a.n; ++i)
      if (a.m[i]) least = std::min(least, a.r[i] + a.waiting(i));
    double bound = least + std::max<int64_t>(2, static_cast<int64_t>(least) / 4);
    int64_t most = -1;
    cached.resize(a.n);
    for (ssize_t i = 0; i < a.n; ++i) {
      cached[i] = std::min(a.overlap(i) * block_size, num_tokens);
      if (a.m[i] && cached[i] >= min_cached && a.r[i] + a.waiting(i) <= bound)
        most = std::max(most, cached[i]);
    }
    if (most >= 0)
      for (ssize_t i = 0; i < a.n; ++i)
        pick[i] = a.m[i] && cached[i] == most && a.r[i] + a.waiting(i) <= bound;
  }
  ssize_t best = -1;
  for (ssize_t i = 0; i < a.n; ++i) {
    if (!pick[i]) continue;
    if (best < 0 || a.k[i] < a.k[best] ||
        (a.k[i] == a.k[best] && (a.r[i] < a.r[best] ||
                                 (a.r[i] == a.r[best] && a.waiting(i) < a.waiting(best)))))
      best = i;
  }
  if (best < 0) throw py::value_error("no candidate");
  int64_t num_tied = 0;
  for (ssize_t i = 0; i < a.n; ++i)
    num_tied += pick[i] && a.k[i] == a.k[best] && a.r[i] == a.r[best] &&
                a.waiting(i) == a.waiting(best);
  int64_t nth = turn() % num_tied;
  for (ssize_t i = 0; i < a.n; ++i)
    if (pick[i] && a.k[i] == a.k[best] && a.r[i] == a.r[best] &&
        a.waiting(i) == a.waiting(best) && nth-- == 0)
      return i;
  return best;  // not reached
}

// Of the marked workers passing `keep`, the one at `turn() % how many` (in order).
template <class Keep, class Turn>
int64_t nth_marked(const Role& a, Keep keep, Turn turn) {
  int64_t num = 0;
  for (ssize_t i = 0; i < a.n; ++i) num += a.m[i] && keep(i);
  if (num == 0) throw py::value_error("no candidate");
  int64_t nth = turn() % num;
  for (ssize_t i = 0; i < a.n; ++i)
    if (a.m[i] && keep(i) && nth-- == 0) return i;
  return -1;  // not reached
}

// routing_policy.choose_prefill_worker over the workers `a.m` marks (at least one).
template <class Turn>
int64_t pick_prefill(const Role& a, int64_t num_blocks, double overlap_weight,
                     double waiting_blocks, double running_blocks, double kv_usage_blocks,
                     std::vector<double>& cost, Turn turn) {
  cost.assign(a.n, INFINITY);
  double best = INFINITY;
  for (ssize_t i = 0; i < a.n; ++i) {
    if (!a.m[i]) continue;
    int64_t overlap = std::min<int64_t>(std::max<int64_t>(a.overlap(i), 0), num_blocks);
    double load = (waiting_blocks * a.waiting(i) + running_blocks * a.r[i]) +
                  kv_usage_blocks * a.k[i];
    cost[i] = overlap_weight * static_cast<double>(num_blocks - overlap) + load;
    best = std::min(best, cost[i]);
  }
  return nth_marked(a, [&](ssize_t i) { return cost[i] - best <= 1e-9; }, turn);
}

int64_t choose_decode(const Doubles& table, const Bytes& mask, const Ints& slots,
                      const Counts& counts, int64_t block_size, int64_t num_tokens,
                      int64_t min_cached, int64_t rotation) {
  Role a(table, mask, slots, counts);
  std::vector<uint8_t> pick;
  std::vector<int64_t> cached;
  return pick_decode(a, block_size, num_tokens, min_cached, pick, cached,
                     [rotation] { return rotation; });
}

int64_t choose_prefill(const Doubles& table, const Bytes& mask, const Ints& slots,
                       const Counts& counts, int64_t num_blocks, double overlap_weight,
                       double waiting_blocks, double running_blocks, double kv_usage_blocks,
                       int64_t rotation) {
  Role a(table, mask, slots, counts);
  std::vector<double> cost;
  return pick_prefill(a, num_blocks, overlap_weight, waiting_blocks, running_blocks,
                      kv_usage_blocks, cost, [rotation] { return rotation; });
}

// Of `counts` (leading blocks per index slot), how many of `slots` have some, and how
// many slots have some in all: (known, total).
py::tuple overlap_census(const Counts& counts, const Ints& slots) {
  const int32_t* c = counts.data();
  ssize_t cap = counts.size();
  int64_t known = 0, total = 0;
  for (ssize_t s = 0; s < cap; ++s) total += c[s] != 0;
  const int64_t* sl = slots.data();
  for (ssize_t i = 0; i < slots.size(); ++i) known += sl[i] >= 0 && sl[i] < cap && c[sl[i]] != 0;
  return py::make_tuple(known, total);
}

template <class T>
const T* held_data(const py::array& arr, ssize_t n, const char* what) {
  if (!(arr.flags() & py::array::c_style) || arr.itemsize() != sizeof(T) || arr.size() != n)
    throw py::value_error(std::string(what) + ": a C-contiguous array of [n] expected");
  return static_cast<const T*>(arr.data());
}

// One role's routing arrays (router/route.py's RoleArrays), held by reference: the
// per-decision calls compute the live and admission masks and choose in one pass over
// the role, with no numpy temporaries. Results: a position >= 0, or kNoLive (no live
// worker), kAllFull (live ones, all at their caps), kShort (not chosen: a short
// prompt), kNoneApart (no live prefill worker apart from the decode worker).
constexpr int64_t kNoLive = -1, kAllFull = -2, kShort = -3, kNoneApart = -4;

class RoleView {
 public:
  RoleView(py::array table, py::array healthy, py::array inflight, py::array others,
           py::array slots)
      : table_(table), healthy_(healthy), inflight_(inflight), others_(others), slots_(slots) {
    ssize_t n = healthy.size();
    if (table.ndim() != 2 || table.shape(0) != 4 || table.shape(1) != n ||
        table.dtype().kind() != 'f')
      throw py::value_error("table must be float64 [4, n]");
    if (healthy.dtype().kind() != 'b' && healthy.dtype().kind() != 'u')
      throw py::value_error("healthy must be bool [n]");
    if (inflight.dtype().kind() != 'f' || others.dtype().kind() != 'f' ||
        slots.dtype().kind() != 'i')
      throw py::value_error("inflight, others float64 [n]; slots int64 [n]");
    a_.n = n;
    a_.rows(held_data<double>(table, 4 * n, "table"));
    a_.slots = held_data<int64_t>(slots, n, "slots");
    healthy_p_ = held_data<uint8_t>(healthy, n, "healthy");
    inflight_p_ = held_data<double>(inflight, n, "inflight");
    others_p_ = held_data<double>(others, n, "others");
  }

  int64_t decode(const Counts& counts, const Bytes& exclude, bool admit, double max_inflight,
                 std::optional<double> max_kv, int64_t block_size, int64_t num_tokens,
                 int64_t min_cached, const py::handle& rotation) {
    int64_t state = masks(exclude, admit, max_inflight, max_kv);
    if (state < 0) return state;
    Role a = with(counts, open_.data());
    return pick_decode(a, block_size, num_tokens, min_cached, pick_, cached_,
                       [&rotation] { return next_turn(rotation); });
  }

  int64_t prefill(const Counts& counts, const Bytes& exclude, bool admit, double max_inflight,
                  const Bytes& apart, bool choose, bool round_robin, int64_t num_blocks,
                  double overlap_weight, double waiting_blocks, double running_blocks,
                  double kv_usage_blocks, const py::handle& rotation) {
    int64_t state = masks(exclude, admit, max_inflight, std::nullopt);
    if (state == kNoLive) return kNoLive;
    if (!choose) return kShort;
    ssize_t n = a_.n;
    const uint8_t* ap = apart.size() ? apart.data() : nullptr;  // none: always disaggregate
    if (ap && apart.size() != n) throw py::value_error("apart must be [n]");
    bool any_apart = false, any_open = false;
    for (ssize_t i = 0; i < n; ++i) {
      uint8_t candidate = live_[i] && (!ap || ap[i]);
      any_apart |= candidate;
      open_[i] = candidate && open_[i];
      any_open |= open_[i];
    }
    if (!any_apart) return kNoneApart;
    if (!any_open) return kAllFull;
    Role a = with(counts, open_.data());
    auto turn = [&rotation] { return next_turn(rotation); };
    if (round_robin) return nth_marked(a, [](ssize_t) { return true; }, turn);
    return pick_prefill(a, num_blocks, overlap_weight, waiting_blocks, running_blocks,
                        kv_usage_blocks, cost_, turn);
  }

 private:
  Role with(const Counts& counts, const uint8_t* mask) const {
    Role a = a_;
    a.m = mask;
    a.counts = counts.data();
    a.cap = counts.size();
    return a;
  }

  // live_: the workers not excluded, the healthy ones among them when any are
  // (WorkerPool.live); open_: those live and, with `admit`, below their caps
  // (RoleArrays.below_caps). Returns kNoLive, kAllFull or 0.
  int64_t masks(const Bytes& exclude, bool admit, double max_inflight,
                std::optional<double> max_kv) {
    ssize_t n = a_.n;
    const uint8_t* ex = exclude.size() ? exclude.data() : nullptr;
    if (ex && exclude.size() != n) throw py::value_error("exclude must be [n]");
    live_.resize(n);
    open_.resize(n);
    bool any_healthy = false;
    for (ssize_t i = 0; i < n; ++i) any_healthy |= (!ex || !ex[i]) && healthy_p_[i];
    bool any_live = false, any_open = false;
    for (ssize_t i = 0; i < n; ++i) {
      bool live = (!ex || !ex[i]) && (!any_healthy || healthy_p_[i]);
      bool open = live && (!admit || (inflight_p_[i] + others_p_[i] < max_inflight &&
                                      (!max_kv || a_.k[i] < *max_kv)));
      live_[i] = live;
      open_[i] = open;
      any_live |= live;
      any_open |= open;
    }
    return !any_live ? kNoLive : !any_open ? kAllFull : 0;
  }

  py::array table_, healthy_, inflight_, others_, slots_;  // kept alive
  Role a_;
  const uint8_t* healthy_p_;
  const double *inflight_p_, *others_p_;
  std::vector<uint8_t> live_, open_, pick_;
  std::vector<int64_t> cached_;
  std::vector<double> cost_;
};

}  // namespace
