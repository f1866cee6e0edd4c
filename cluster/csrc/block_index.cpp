// The router's native hot loop (cluster/block_index.py): the chained block hashes of a
// prompt (byte-identical to engine/block_hash.hash_block_chain) and an in-memory block
// index, block hash -> the worker slots holding it, whose lookup costs
// O(chain length x bitmap words), not O(holders).
//
// Keys are the first 8 bytes of a 16-byte block hash. Holders are kept inline (up to
// kInline slots) and as a bitmap of `capacity` bits once a block is popular.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
// NOTE: SHA256_Init/Update/Final are deprecated in OpenSSL 3 but kept, and faster here
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "route_scoring.h"

namespace py = pybind11;

namespace {

constexpr int kHashBytes = 16;
constexpr int kInline = 6;

// A Python int token id as int64 (a compact int read directly: the hot loop's conversion).
inline int64_t token_value(PyObject* o) {
#if PY_VERSION_HEX >= 0x030C0000
  if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(o)))
    return PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(o));
#else
  if (PyLong_CheckExact(o)) {
    Py_ssize_t size = Py_SIZE(o);
    if (size == 1) return reinterpret_cast<PyLongObject*>(o)->ob_digit[0];
    if (size == 0) return 0;
  }
#endif
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// Token ids of a Python list, tuple or int64 buffer, read a block at a time (a prompt's
// later blocks are never converted when its lookup stops early).
class Tokens {
 public:
  explicit Tokens(const py::handle& obj) {
    PyObject* o = obj.ptr();
    if (PyList_Check(o) || PyTuple_Check(o)) {
      seq_ = py::reinterpret_borrow<py::object>(obj);
      size_ = static_cast<size_t>(PySequence_Fast_GET_SIZE(o));
      items_ = PySequence_Fast_ITEMS(o);
      return;
    }
    arr_ = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
    if (!arr_) throw py::type_error("token ids must be a list, tuple or int64 array");
    size_ = static_cast<size_t>(arr_.size());
    data_ = arr_.data();
  }
  size_t size() const { return size_; }
  // Tokens [start, start + count) as int64 bytes into `out`.
  void read(size_t start, size_t count, unsigned char* out) const {
    if (data_) {
      std::memcpy(out, data_ + start, count * 8);
      return;
    }
    for (size_t i = 0; i < count; ++i) {
      int64_t v = token_value(items_[start + i]);
      std::memcpy(out + 8 * i, &v, 8);
    }
  }

 private:
  py::object seq_;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> arr_;
  PyObject** items_ = nullptr;
  const int64_t* data_ = nullptr;
  size_t size_ = 0;
};

// The chained block hashes of a prompt, one block at a time (engine/block_hash.py).
class Chain {
 public:
  Chain(const py::handle& token_ids, int64_t block_size, const std::string& root,
        const std::string& salt)
      : tokens_(token_ids), block_size_(block_size) {
    if (block_size <= 0) throw py::value_error("block_size must be positive");
    if (root.size() != kHashBytes) throw py::value_error("root hash must be 16 bytes");
    num_blocks_ = tokens_.size() / block_size;
    buf_.resize(kHashBytes + block_size * 8 + salt.size());
    std::memcpy(buf_.data(), root.data(), kHashBytes);
    std::memcpy(buf_.data() + kHashBytes + block_size * 8, salt.data(), salt.size());
  }
  size_t num_blocks() const { return num_blocks_; }
  // The next block's 16-byte hash (blocks in order from 0).
  const unsigned char* next() {
    // NOTE: little-endian int64 payload: this host's order (x86, arm64 Linux)
    tokens_.read(done_ * block_size_, block_size_, buf_.data() + kHashBytes);
    // NOTE: the low-level API: OpenSSL 3's one-shot SHA256() fetches the digest per
    // call (~2 us per block here against ~0.4 us)
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, buf_.data(), buf_.size());
    SHA256_Final(digest_, &ctx);
    std::memcpy(buf_.data(), digest_, kHashBytes);
    ++done_;
    return digest_;
  }

 private:
  Tokens tokens_;
  int64_t block_size_;
  size_t num_blocks_ = 0, done_ = 0;
  std::vector<unsigned char> buf_;  // parent hash, tokens, salt
  unsigned char digest_[SHA256_DIGEST_LENGTH];
};

// Packed 16-byte hashes of every full block, chained from `root`.
std::string chain_packed(const py::handle& token_ids, int64_t block_size, const std::string& root,
                         const std::string& salt) {
  Chain chain(token_ids, block_size, root, salt);
  std::string out(chain.num_blocks() * kHashBytes, '\0');
  for (size_t b = 0; b < chain.num_blocks(); ++b)
    std::memcpy(&out[b * kHashBytes], chain.next(), kHashBytes);
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

// Block hash key -> Holders, open addressing with linear probing (one cache line per
// probe, where std::unordered_map's nodes cost two or three misses a lookup at 10M
// registrations). An entry with count 0 is empty: a key leaves when its last holder does.
class BlockMap {
 public:
  BlockMap() : entries_(16) {}
  size_t size() const { return size_; }

  const Holders* find(uint64_t key) const {
    for (size_t i = key & mask(); entries_[i].h.count; i = (i + 1) & mask())
      if (entries_[i].key == key) return &entries_[i].h;
    return nullptr;
  }
  Holders* find(uint64_t key) {
    return const_cast<Holders*>(static_cast<const BlockMap*>(this)->find(key));
  }
  void prefetch(uint64_t key) const { __builtin_prefetch(&entries_[key & mask()]); }

  // The key's holders; a new key's (count 0) must get a holder before the next call.
  Holders& get(uint64_t key) {
    if (Holders* h = find(key)) return *h;
    if (4 * (size_ + 1) > 3 * entries_.size()) grow();  // NOTE: load factor <= 3/4
    size_t i = key & mask();
    while (entries_[i].h.count) i = (i + 1) & mask();
    entries_[i].key = key;
    ++size_;
    return entries_[i].h;
  }

  // Removes the key (present; its count just went to 0): backward-shift deletion.
  void erase(uint64_t key) {
    size_t i = key & mask();
    // NOTE: every entry from the key's home to it is occupied by another key
    while (entries_[i].key != key) i = (i + 1) & mask();
    for (size_t j = (i + 1) & mask(); entries_[j].h.count; j = (j + 1) & mask()) {
      size_t home = entries_[j].key & mask();
      // NOTE: j's entry may fill the hole at i when its home is not in (i, j] cyclically
      if (((j - home) & mask()) >= ((j - i) & mask())) {
        entries_[i] = std::move(entries_[j]);
        i = j;
      }
    }
    entries_[i] = Entry();
    --size_;
  }

 private:
  struct Entry {
    uint64_t key = 0;
    Holders h;
  };
  size_t mask() const { return entries_.size() - 1; }
  void grow() {
    std::vector<Entry> old(entries_.size() * 2);
    old.swap(entries_);
    for (Entry& e : old) {
      if (!e.h.count) continue;
      size_t i = e.key & mask();
      while (entries_[i].h.count) i = (i + 1) & mask();
      entries_[i] = std::move(e);
    }
  }
  std::vector<Entry> entries_;
  size_t size_ = 0;
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
      Holders& h = map_.get(k);
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

  // Makes `slot` hold exactly the packed hashes (a worker's whole set, republished) in
  // one call, so no lookup (each holds the GIL) sees the slot emptied between the two
  // halves; returns how many it holds now.
  int64_t replace(int32_t slot, const std::string& packed) {
    check(slot, packed);
    remove_slot(slot);
    add(slot, packed);
    return slot_counts_[slot];
  }

  // Leading blocks of the packed chain held per slot (int32 [capacity]); a slot's run
  // stops at its first miss.
  py::array_t<int32_t> lookup(const std::string& packed) const {
    if (packed.size() % kHashBytes) throw py::value_error("hashes must be 16 bytes each");
    py::array_t<int32_t> result(capacity_);
    const char* p = packed.data();
    leading_runs(packed.size() / kHashBytes, [p](size_t i) { return key_at(p + i * kHashBytes); },
                 result.mutable_data());
    return result;
  }

  // `lookup` of a prompt's chain: (its full blocks, leading blocks held per slot). The
  // blocks are hashed as the walk goes (one ahead, to prefetch its entry): the hashes
  // past the first block no slot continues to, and one, are never computed (nor their
  // tokens read).
  py::tuple lookup_tokens(const py::handle& token_ids, int64_t block_size,
                          const std::string& root, const std::string& salt) const {
    Chain chain(token_ids, block_size, root, salt);
    py::array_t<int32_t> result(capacity_);
    leading_runs(chain.num_blocks(),
                 [&chain](size_t) { return key_at(reinterpret_cast<const char*>(chain.next())); },
                 result.mutable_data());
    return py::make_tuple(static_cast<int64_t>(chain.num_blocks()), result);
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

  // Per slot, how many of the chain's `n` keys (key(i), asked in order, each once) it
  // holds from the first on, into out[capacity]; asks one key ahead, and stops once no
  // slot runs on.
  template <class Key>
  void leading_runs(size_t n, Key key, int32_t* out) const {
    std::memset(out, 0, sizeof(int32_t) * capacity_);
    if (n == 0) return;
    std::vector<uint64_t> running(words_, 0);
    uint64_t next_key = key(0);
    for (size_t i = 0; i < n; ++i) {
      uint64_t this_key = next_key;
      if (i + 1 < n) {  // NOTE: the next block's entry is fetched while this one is walked
        next_key = key(i + 1);  // NOTE: before the find: no Python runs while `h` is held
        map_.prefetch(next_key);
      }
      const Holders* h = map_.find(this_key);
      if (i == 0) {
        if (!h) return;
        holders_bits(*h, running.data());
        continue;
      }
      bool any = false;
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
      if (!any) return;
    }
    for (int32_t w = 0; w < used_words_; ++w)
      for (uint64_t r = running[w]; r; r &= r - 1)
        out[w * 64 + __builtin_ctzll(r)] = static_cast<int32_t>(n);
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
    Holders* found = map_.find(k);
    if (!found || !found->has(s)) return 0;
    Holders& h = *found;
    if (h.bits) {
      h.bits[s >> 6] &= ~(1ULL << (s & 63));
    } else {
      for (int i = 0; i < h.count; ++i)
        if (h.slots[i] == s) {
          h.slots[i] = h.slots[h.count - 1];
          break;
        }
    }
    if (--h.count == 0) map_.erase(k);
    return 1;
  }

  void compact(int32_t slot) {
    std::vector<uint64_t> kept;
    kept.reserve(slot_counts_[slot]);
    for (uint64_t k : slot_keys_[slot]) {
      const Holders* h = map_.find(k);
      if (h && h->has(slot)) kept.push_back(k);
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
  BlockMap map_;
  std::vector<std::vector<uint64_t>> slot_keys_;
  std::vector<int64_t> slot_counts_;
};


}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pdserve's block hash chain and in-memory block index";
  m.def("hash_chain", &hash_chain, py::arg("token_ids"), py::arg("block_size"),
        py::arg("root"), py::arg("salt"));
  m.def("hash_chain_packed", &hash_chain_packed, py::arg("token_ids"), py::arg("block_size"),
        py::arg("root"), py::arg("salt"));
  m.def("choose_decode", &choose_decode);
  m.def("choose_prefill", &choose_prefill);
  m.def("overlap_census", &overlap_census, py::arg("counts"), py::arg("slots"));
  m.attr("NO_LIVE") = kNoLive;
  m.attr("ALL_FULL") = kAllFull;
  m.attr("SHORT") = kShort;
  m.attr("NONE_APART") = kNoneApart;
  py::class_<RoleView>(m, "RoleView")
      .def(py::init<py::array, py::array, py::array, py::array, py::array>(),
           py::arg("table"), py::arg("healthy"), py::arg("inflight"), py::arg("others"),
           py::arg("slots"))
      .def("decode", &RoleView::decode, py::arg("counts"), py::arg("exclude"),
           py::arg("admit"), py::arg("max_inflight"), py::arg("max_kv_usage"),
           py::arg("block_size"), py::arg("num_tokens"), py::arg("min_cached"),
           py::arg("rotation"))
      .def("prefill", &RoleView::prefill, py::arg("counts"), py::arg("exclude"),
           py::arg("admit"), py::arg("max_inflight"), py::arg("apart"), py::arg("choose"),
           py::arg("round_robin"), py::arg("num_blocks"), py::arg("overlap_weight"),
           py::arg("waiting_blocks"), py::arg("running_blocks"), py::arg("kv_usage_blocks"),
           py::arg("rotation"));
  py::class_<BlockIndex>(m, "BlockIndex")
      .def(py::init<int32_t>(), py::arg("capacity"))
      .def("add", &BlockIndex::add, py::arg("slot"), py::arg("packed"))
      .def("remove", &BlockIndex::remove, py::arg("slot"), py::arg("packed"))
      .def("remove_slot", &BlockIndex::remove_slot, py::arg("slot"))
      .def("replace", &BlockIndex::replace, py::arg("slot"), py::arg("packed"))
      .def("lookup", &BlockIndex::lookup, py::arg("packed"))
      .def("lookup_tokens", &BlockIndex::lookup_tokens, py::arg("token_ids"),
           py::arg("block_size"), py::arg("root"), py::arg("salt"))
      .def("num_blocks", &BlockIndex::num_blocks, py::arg("slot"))
      .def("num_hashes", &BlockIndex::num_hashes)
      .def("capacity", &BlockIndex::capacity);
}
