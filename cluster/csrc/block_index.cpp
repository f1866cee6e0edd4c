// The router's native hot loop (cluster/block_index.py): the chained block hashes of a
// prompt (byte-identical to engine/block_hash.hash_block_chain) and an in-memory block
// index, block hash -> the worker slots holding it, whose lookup costs
// O(chain length x bitmap words), not O(holders).
//
// Keys are the first 8 bytes of a 16-byte block hash. Holders are kept inline (up to
// kInline slots) and as a bitmap of `capacity` bits once a block is popular.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
// NOTE: SHA256_Init/Update/Final are deprecated in OpenSSL 3 but kept, and faster here
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kHashBytes = 16;
constexpr int kInline = 6;

// Token ids of a Python list, tuple or int64 buffer, as int64.
std::vector<int64_t> tokens_of(const py::handle& obj) {
  std::vector<int64_t> out;
  PyObject* o = obj.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    out.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      long long v = PyLong_AsLongLong(items[i]);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      out[i] = v;
    }
    return out;
  }
  auto arr = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!arr) throw py::type_error("token ids must be a list, tuple or int64 array");
  out.assign(arr.data(), arr.data() + arr.size());
  return out;
}

// Packed 16-byte hashes of every full block, chained from `root`.
std::string chain_packed(const py::handle& token_ids, int64_t block_size, const std::string& root,
                         const std::string& salt) {
  if (block_size <= 0) throw py::value_error("block_size must be positive");
  if (root.size() != kHashBytes) throw py::value_error("root hash must be 16 bytes");
  std::vector<int64_t> tokens = tokens_of(token_ids);
  size_t num_blocks = tokens.size() / block_size;
  std::string out(num_blocks * kHashBytes, '\0');
  std::vector<unsigned char> buf(kHashBytes + block_size * 8 + salt.size());
  std::memcpy(buf.data(), root.data(), kHashBytes);
  unsigned char digest[SHA256_DIGEST_LENGTH];
  for (size_t b = 0; b < num_blocks; ++b) {
    // NOTE: little-endian int64 payload: this host's order (x86, arm64 Linux)
    std::memcpy(buf.data() + kHashBytes, tokens.data() + b * block_size, block_size * 8);
    std::memcpy(buf.data() + kHashBytes + block_size * 8, salt.data(), salt.size());
    // NOTE: the low-level API: OpenSSL 3's one-shot SHA256() fetches the digest per
    // call (~2 us per block here against ~0.4 us)
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, buf.data(), buf.size());
    SHA256_Final(digest, &ctx);
    std::memcpy(&out[b * kHashBytes], digest, kHashBytes);
    std::memcpy(buf.data(), digest, kHashBytes);
  }
  return out;
}

py::list hash_chain(const py::handle& token_ids, int64_t block_size, py::bytes root,
                    py::bytes salt) {
  std::string packed = chain_packed(token_ids, block_size, root, salt);
  py::list out;
  for (size_t i = 0; i < packed.size(); i += kHashBytes)
    out.append(py::bytes(packed.data() + i, kHashBytes));
  return out;
}

py::bytes hash_chain_packed(const py::handle& token_ids, int64_t block_size, py::bytes root,
                            py::bytes salt) {
  return py::bytes(chain_packed(token_ids, block_size, root, salt));
}

inline uint64_t key_at(const char* p) {
  uint64_t k;
  std::memcpy(&k, p, 8);
  return k;
}

struct Holders {
  int32_t count = 0;
  int32_t slots[kInline];
  std::unique_ptr<uint64_t[]> bits;  // set once count passed kInline; kept after

  bool has(int32_t s) const {
    if (bits) return (bits[s >> 6] >> (s & 63)) & 1;
    for (int i = 0; i < count; ++i)
      if (slots[i] == s) return true;
    return false;
  }
};

class BlockIndex {
 public:
  explicit BlockIndex(int32_t capacity)
      : capacity_(capacity), words_((capacity + 63) / 64), slot_keys_(capacity),
        slot_counts_(capacity, 0) {
    if (capacity <= 0) throw py::value_error("capacity must be positive");
  }

  // Registers `slot` as holding each packed hash; returns how many were new to it.
  int64_t add(int32_t slot, const std::string& packed) {
    check(slot, packed);
    int64_t added = 0;
    for (size_t i = 0; i < packed.size(); i += kHashBytes) {
      uint64_t k = key_at(packed.data() + i);
      Holders& h = map_[k];
      if (h.has(slot)) continue;
      used_words_ = std::max(used_words_, (slot >> 6) + 1);
      insert(h, slot);
      slot_keys_[slot].push_back(k);
      ++slot_counts_[slot];
      ++added;
    }
    return added;
  }

  // Unregisters `slot` from each packed hash; returns how many it held.
  int64_t remove(int32_t slot, const std::string& packed) {
    check(slot, packed);
    int64_t removed = 0;
    for (size_t i = 0; i < packed.size(); i += kHashBytes)
      removed += erase(key_at(packed.data() + i), slot);
    slot_counts_[slot] -= removed;
    // NOTE: slot_keys_ keeps removed keys until it is twice the live count
    if (slot_keys_[slot].size() > 2 * static_cast<size_t>(slot_counts_[slot]) + 64) compact(slot);
    return removed;
  }

  // Forgets every block of `slot` (a worker gone), O(its blocks); returns how many.
  int64_t remove_slot(int32_t slot) {
    check(slot, std::string());
    int64_t removed = 0;
    for (uint64_t k : slot_keys_[slot]) removed += erase(k, slot);
    slot_keys_[slot].clear();
    slot_keys_[slot].shrink_to_fit();
    slot_counts_[slot] = 0;
    return removed;
  }

  // Leading blocks of the packed chain held per slot (int32 [capacity]); a slot's run
  // stops at its first miss.
  py::array_t<int32_t> lookup(const std::string& packed) const {
    if (packed.size() % kHashBytes) throw py::value_error("hashes must be 16 bytes each");
    py::array_t<int32_t> result(capacity_);
    int32_t* out = result.mutable_data();
    std::memset(out, 0, sizeof(int32_t) * capacity_);
    size_t n = packed.size() / kHashBytes;
    if (n == 0) return result;
    std::vector<uint64_t> running(words_, 0);
    bool any = false;
    for (size_t i = 0; i < n; ++i) {
      auto it = map_.find(key_at(packed.data() + i * kHashBytes));
      const Holders* h = it == map_.end() ? nullptr : &it->second;
      if (i == 0) {
        if (!h) return result;
        holders_bits(*h, running.data());
        continue;
      }
      any = false;
      // NOTE: only the words of slots ever used: slots are given from 0 up, so a router
      // with 1,000 workers walks 16 words per block whatever its capacity
      for (int32_t w = 0; w < used_words_; ++w) {
        uint64_t held = !h ? 0 : h->bits ? h->bits[w] : inline_word(*h, w);
        uint64_t dropped = running[w] & ~held;
        while (dropped) {
          out[w * 64 + __builtin_ctzll(dropped)] = static_cast<int32_t>(i);
          dropped &= dropped - 1;
        }
        running[w] &= held;
        any |= running[w] != 0;
      }
      if (!any) return result;
    }
    for (int32_t w = 0; w < used_words_; ++w)
      for (uint64_t r = running[w]; r; r &= r - 1)
        out[w * 64 + __builtin_ctzll(r)] = static_cast<int32_t>(n);
    return result;
  }

  int64_t num_blocks(int32_t slot) const {
    check(slot, std::string());
    return slot_counts_[slot];
  }
  int64_t num_hashes() const { return static_cast<int64_t>(map_.size()); }
  int32_t capacity() const { return capacity_; }

 private:
  void check(int32_t slot, const std::string& packed) const {
    if (slot < 0 || slot >= capacity_) throw py::index_error("slot out of range");
    if (packed.size() % kHashBytes) throw py::value_error("hashes must be 16 bytes each");
  }

  void insert(Holders& h, int32_t s) {
    if (!h.bits && h.count < kInline) {
      h.slots[h.count++] = s;
      return;
    }
    if (!h.bits) {
      h.bits.reset(new uint64_t[words_]());
      for (int i = 0; i < h.count; ++i) h.bits[h.slots[i] >> 6] |= 1ULL << (h.slots[i] & 63);
    }
    h.bits[s >> 6] |= 1ULL << (s & 63);
    ++h.count;
  }

  int64_t erase(uint64_t k, int32_t s) {
    auto it = map_.find(k);
    if (it == map_.end() || !it->second.has(s)) return 0;
    Holders& h = it->second;
    if (h.bits) {
      h.bits[s >> 6] &= ~(1ULL << (s & 63));
    } else {
      for (int i = 0; i < h.count; ++i)
        if (h.slots[i] == s) {
          h.slots[i] = h.slots[h.count - 1];
          break;
        }
    }
    if (--h.count == 0) map_.erase(it);
    return 1;
  }

  void compact(int32_t slot) {
    std::vector<uint64_t> kept;
    kept.reserve(slot_counts_[slot]);
    for (uint64_t k : slot_keys_[slot]) {
      auto it = map_.find(k);
      if (it != map_.end() && it->second.has(slot)) kept.push_back(k);
    }
    std::sort(kept.begin(), kept.end());
    kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
    slot_keys_[slot].swap(kept);
  }

  void holders_bits(const Holders& h, uint64_t* out) const {
    if (h.bits) {
      std::memcpy(out, h.bits.get(), sizeof(uint64_t) * words_);
      return;
    }
    for (int i = 0; i < h.count; ++i) out[h.slots[i] >> 6] |= 1ULL << (h.slots[i] & 63);
  }

  static uint64_t inline_word(const Holders& h, int32_t w) {
    uint64_t word = 0;
    for (int i = 0; i < h.count; ++i)
      if ((h.slots[i] >> 6) == w) word |= 1ULL << (h.slots[i] & 63);
    return word;
  }

  int32_t capacity_;
  int32_t words_;
  int32_t used_words_ = 0;  // words holding any slot ever added
  std::unordered_map<uint64_t, Holders> map_;
  std::vector<std::vector<uint64_t>> slot_keys_;
  std::vector<int64_t> slot_counts_;
};


// Scoring over one role's arrays (router/route.py; the spec is router/routing_policy.py).
// `table` is float64 [4, n]: KV usage, running, waiting, routed since the last Health
// (counted as waiting); workers ordered by id. `mask` (uint8 [n]) marks the candidates.
// A worker's overlap is `counts[slots[i]]` (an index lookup per slot; slot < 0: none).
using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Bytes = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;
using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Counts = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

struct Role {
  ssize_t n;
  const double *k, *r, *w, *routed;
  const uint8_t* m;
  const int64_t* slots;
  const int32_t* counts;
  ssize_t cap;

  Role(const Doubles& table, const Bytes& mask, const Ints& sl, const Counts& c)
      : n(mask.size()), m(mask.data()), slots(sl.data()), counts(c.data()), cap(c.size()) {
    if (table.ndim() != 2 || table.shape(0) != 4 || table.shape(1) != n || sl.size() != n)
      throw py::value_error("table must be [4, n], mask and slots [n]");
    k = table.data();
    r = k + n;
    w = r + n;
    routed = w + n;
  }
  double waiting(ssize_t i) const { return w[i] + routed[i]; }
  int64_t overlap(ssize_t i) const {
    return slots[i] >= 0 && slots[i] < cap ? counts[slots[i]] : 0;
  }
};

int64_t choose_decode(const Doubles& table, const Bytes& mask, const Ints& slots,
                      const Counts& counts, int64_t block_size, int64_t num_tokens,
                      int64_t min_cached, int64_t rotation) {
  Role a(table, mask, slots, counts);
  std::vector<uint8_t> pick(a.m, a.m + a.n);
  if (min_cached > 0) {
    double least = INFINITY;
    for (ssize_t i = 0; i < a.n; ++i)
      if (a.m[i]) least = std::min(least, a.r[i] + a.waiting(i));
    double bound = least + std::max<int64_t>(2, static_cast<int64_t>(least) / 4);
    int64_t most = -1;
    std::vector<int64_t> cached(a.n);
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
  std::vector<ssize_t> tied;
  for (ssize_t i = 0; i < a.n; ++i)
    if (pick[i] && a.k[i] == a.k[best] && a.r[i] == a.r[best] &&
        a.waiting(i) == a.waiting(best))
      tied.push_back(i);
  return tied[rotation % tied.size()];
}

int64_t choose_prefill(const Doubles& table, const Bytes& mask, const Ints& slots,
                       const Counts& counts, int64_t num_blocks, double overlap_weight,
                       double waiting_blocks, double running_blocks, double kv_usage_blocks,
                       int64_t rotation) {
  Role a(table, mask, slots, counts);
  std::vector<double> cost(a.n, INFINITY);
  double best = INFINITY;
  for (ssize_t i = 0; i < a.n; ++i) {
    if (!a.m[i]) continue;
    int64_t overlap = std::min<int64_t>(std::max<int64_t>(a.overlap(i), 0), num_blocks);
    double load = (waiting_blocks * a.waiting(i) + running_blocks * a.r[i]) +
                  kv_usage_blocks * a.k[i];
    cost[i] = overlap_weight * static_cast<double>(num_blocks - overlap) + load;
    best = std::min(best, cost[i]);
  }
  std::vector<ssize_t> tied;
  for (ssize_t i = 0; i < a.n; ++i)
    if (a.m[i] && cost[i] - best <= 1e-9) tied.push_back(i);
  if (tied.empty()) throw py::value_error("no candidate");
  return tied[rotation % tied.size()];
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pdserve's block hash chain and in-memory block index";
  m.def("hash_chain", &hash_chain, py::arg("token_ids"), py::arg("block_size"),
        py::arg("root"), py::arg("salt"));
  m.def("hash_chain_packed", &hash_chain_packed, py::arg("token_ids"), py::arg("block_size"),
        py::arg("root"), py::arg("salt"));
  m.def("choose_decode", &choose_decode);
  m.def("choose_prefill", &choose_prefill);
  py::class_<BlockIndex>(m, "BlockIndex")
      .def(py::init<int32_t>(), py::arg("capacity"))
      .def("add", &BlockIndex::add, py::arg("slot"), py::arg("packed"))
      .def("remove", &BlockIndex::remove, py::arg("slot"), py::arg("packed"))
      .def("remove_slot", &BlockIndex::remove_slot, py::arg("slot"))
      .def("lookup", &BlockIndex::lookup, py::arg("packed"))
      .def("num_blocks", &BlockIndex::num_blocks, py::arg("slot"))
      .def("num_hashes", &BlockIndex::num_hashes)
      .def("capacity", &BlockIndex::capacity);
}
