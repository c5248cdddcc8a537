#include "io/torch_pickle.h"

#include "core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace imgtrain::io {
namespace {

// Limits far above anything torch.save writes (a state dict is a few pickle objects per tensor;
// Python's pickler cannot nest deeper than its recursion limit of 1000), low enough that no input
// makes the reader allocate more than a small multiple of its own size.
constexpr size_t kMaxStack = size_t(1) << 20;
constexpr size_t kMaxMarks = 1000;
constexpr size_t kMaxObjects = size_t(1) << 21;
constexpr size_t kMaxDims = 64;
constexpr size_t kMaxName = 1024;  // a global's module or name

uint64_t le_at(std::string_view d, size_t pos, int n) {  // the caller has checked the bounds
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t(uint8_t(d[pos + i])) << (8 * i);
  return v;
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// Names from the file in messages: printable, and short.
std::string shown(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 120))
    out += (c >= 0x20 && c < 0x7f) ? std::string(1, c) : fmt::format("\\x{:02x}", uint8_t(c));
  return s.size() > 120 ? out + "..." : out;
}

// Strict UTF-8 (no overlongs, no surrogates), as the JSON writer that later sees tensor names requires.
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const uint8_t c = uint8_t(s[i]);
    size_t n = c < 0x80                   ? 0
               : (c >= 0xc2 && c <= 0xdf) ? 1
               : (c >= 0xe0 && c <= 0xef) ? 2
               : (c >= 0xf0 && c <= 0xf4) ? 3
                                          : 9;
    if (n == 9 || s.size() - i - 1 < n) return false;
    for (size_t k = 1; k <= n; ++k)
      if ((uint8_t(s[i + k]) & 0xc0) != 0x80) return false;
    const uint8_t c1 = n ? uint8_t(s[i + 1]) : 0;
    if ((c == 0xe0 && c1 < 0xa0) || (c == 0xed && c1 >= 0xa0) || (c == 0xf0 && c1 < 0x90) || (c == 0xf4 && c1 >= 0x90))
      return false;
    i += n + 1;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The values a pickle builds. Objects live in an arena and point at each other with plain
// pointers: the memo lets a pickle share and even cycle objects, and nothing here ever walks or
// frees them recursively (the only walk, contains_tensor, is iterative with a visited set).

enum class Kind : uint8_t {
  None,
  Bool,
  Int,
  BigInt,
  Float,
  Str,
  Bytes,
  List,
  Tuple,
  Dict,
  Namespace,
  Global,
  Storage,
  Tensor
};

const char* kind_name(Kind k) {
  static const char* names[] = {"None", "bool",  "int",  "int beyond 64 bits", "float",  "str",     "bytes",
                                "list", "tuple", "dict", "argparse.Namespace", "global", "storage", "tensor"};
  return names[int(k)];
}

struct Obj {
  Kind kind = Kind::None;
  int64_t i = 0;            // Bool, Int; Storage and Tensor: the index into Graph's tables
  double f = 0;             // Float
  std::string s;            // Str, Bytes, Global ("module.name"), BigInt (its little-endian bytes)
  std::vector<Obj*> items;  // List, Tuple; Dict and Namespace: key, value, key, value, ... in insertion order
};

struct Storage {
  at::ScalarType dtype;
  int64_t numel;
  uint64_t offset = 0;  // where its numel * element size bytes start in the file, once known
  bool have_bytes = false;
  at::Tensor tensor;  // read out of the file on first use
};

struct TensorSpec {
  size_t storage;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
  at::Tensor value;  // on first use
};

struct Graph {
  std::deque<Obj> arena;
  std::vector<Storage> storages;
  std::unordered_map<std::string, size_t> storage_by_key;
  std::vector<TensorSpec> tensors;
  std::unordered_map<std::string, size_t> dict_slot;  // (dict address, key) -> index of the key in items
};

// The storage classes a persistent id may name, and the dtype of their elements.
const std::map<std::string, at::ScalarType>& storage_types() {
  static const std::map<std::string, at::ScalarType> m = {
      {"torch.DoubleStorage", at::kDouble},     {"torch.FloatStorage", at::kFloat}, {"torch.HalfStorage", at::kHalf},
      {"torch.BFloat16Storage", at::kBFloat16}, {"torch.LongStorage", at::kLong},   {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},       {"torch.CharStorage", at::kChar},   {"torch.ByteStorage", at::kByte},
      {"torch.BoolStorage", at::kBool}};
  return m;
}

// The only callables: what torch.save emits for tensors and OrderedDict, and argparse.Namespace.
// None of them is ever called; the VM builds their result itself.
const std::set<std::string> kCallables = {"collections.OrderedDict", "torch._utils._rebuild_tensor",
                                          "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
                                          "argparse.Namespace"};

// ---------------------------------------------------------------------------------------------
// The restricted pickle VM (protocols 2 to 5, opcodes as Lib/pickletools.py documents them).

class Unpickler {
 public:
  using PersistentLoad = std::function<Obj*(Obj* pid, Unpickler& up)>;
  // Runs the pickle that starts at `start` of `data`; `part` names `data` in messages.
  Unpickler(Graph& g, std::string_view data, size_t start, const std::string& what, std::string part,
            PersistentLoad persistent)
      : g_(g), data_(data), pos_(start), what_(what), part_(std::move(part)), persistent_(std::move(persistent)) {}

  Obj* load();
  size_t end() const { return pos_; }  // just past STOP

  [[noreturn]] void bad(const std::string& why) const {
    throw UserError(
        fmt::format("'{}' is not a valid torch.save file: {} (at byte {} of {})", what_, why, op_pos_, part_));
  }
  Obj* make(Kind k) {
    if (g_.arena.size() >= kMaxObjects) bad(fmt::format("more than {} objects", kMaxObjects));
    g_.arena.emplace_back();
    g_.arena.back().kind = k;
    return &g_.arena.back();
  }
  int64_t as_int(Obj* o, const char* what) const {
    if (o->kind == Kind::Int || o->kind == Kind::Bool) return o->i;
    bad(fmt::format("{} is a {}, not an int", what, kind_name(o->kind)));
  }

 private:
  [[noreturn]] void refuse(const std::string& global) const {
    // torch.save(model) pickles the model's classes: say what to save instead
    const bool model_class = global.rfind("torch.nn.modules.", 0) == 0 || global.rfind("timm.", 0) == 0 ||
                             global.rfind("torchvision.", 0) == 0 || global.rfind("__main__.", 0) == 0;
    throw UserError(
        fmt::format("'{}': refuses to load the global '{}' (only tensors, storages and plain containers are "
                    "read; nothing in a weights file is ever executed){}",
                    what_, shown(global),
                    model_class ? "; this looks like a whole model saved with torch.save(model): save "
                                  "model.state_dict() instead"
                                : ""));
  }
  std::string_view take(uint64_t n) {
    if (n > data_.size() - pos_)
      bad(fmt::format("the pickle ends inside an opcode's argument ({} bytes wanted, {} left)", n,
                      data_.size() - pos_));
    auto v = data_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  uint64_t uint(int n) { return le_at(take(n), 0, n); }
  std::string_view line() {  // GLOBAL's and INST's text arguments
    const size_t nl = data_.find('\n', pos_);
    if (nl == std::string_view::npos || nl - pos_ > kMaxName) bad("a global's name is unterminated or too long");
    auto v = data_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return v;
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(Obj* o) {
    if (stack_.size() >= kMaxStack) bad(fmt::format("more than {} values on the stack", kMaxStack));
    stack_.push_back(o);
  }
  Obj* pop() {
    if (stack_.size() <= floor()) bad("stack underflow");
    Obj* o = stack_.back();
    stack_.pop_back();
    return o;
  }
  Obj* top() {
    if (stack_.size() <= floor()) bad("stack underflow");
    return stack_.back();
  }
  std::vector<Obj*> pop_mark() {
    if (marks_.empty()) bad("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Obj*> items(stack_.begin() + long(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Obj* text(Kind k, uint64_t n) {
    auto b = take(n);
    if (k == Kind::Str && !valid_utf8(b)) bad("a string that is not UTF-8");
    Obj* o = make(k);
    o->s = b;
    return o;
  }
  Obj* integer(int64_t v) {
    Obj* o = make(Kind::Int);
    o->i = v;
    return o;
  }
  Obj* long_int(uint64_t n) {  // LONG1 / LONG4: n bytes of little-endian two's complement
    auto b = take(n);
    if (n > 8) {  // kept as bytes: only torch's legacy magic number is that large
      Obj* o = make(Kind::BigInt);
      o->s = b;
      return o;
    }
    uint64_t v = le_at(b, 0, int(n));
    if (n && n < 8 && (uint8_t(b[n - 1]) & 0x80)) v |= ~uint64_t(0) << (8 * n);
    return integer(int64_t(v));
  }
  Obj* items_of(Kind k, std::vector<Obj*> items) {
    Obj* o = make(k);
    o->items = std::move(items);
    return o;
  }
  void set_item(Obj* d, Obj* k, Obj* v);
  Obj* global(std::string_view module, std::string_view name);
  Obj* call(Obj* fn, Obj* args);
  Obj* rebuild_tensor(const std::vector<Obj*>& a, bool v2);
  Obj* new_object(Obj* cls, Obj* args);
  void build(Obj* o, Obj* state);

  Graph& g_;
  std::string_view data_;
  size_t pos_, op_pos_ = 0;
  const std::string& what_;
  std::string part_;
  PersistentLoad persistent_;
  std::vector<Obj*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Obj*> memo_;
};

void Unpickler::set_item(Obj* d, Obj* k, Obj* v) {
  if (d->kind != Kind::Dict && d->kind != Kind::Namespace) bad(fmt::format("SETITEM on a {}", kind_name(d->kind)));
  // Python's dict semantics (a repeated key keeps its first position, takes the last value; True == 1)
  std::string key(reinterpret_cast<const char*>(&d), sizeof d);
  switch (k->kind) {
    case Kind::Str: key += "s" + k->s; break;
    case Kind::Int:
    case Kind::Bool: key += "i" + std::to_string(k->i); break;
    case Kind::None: key += "n"; break;
    default: bad(fmt::format("a dict key of type {}", kind_name(k->kind)));
  }
  auto [it, fresh] = g_.dict_slot.emplace(std::move(key), d->items.size());
  if (fresh) {
    d->items.push_back(k);
    d->items.push_back(v);
  } else {
    d->items[it->second + 1] = v;
  }
}

Obj* Unpickler::global(std::string_view module, std::string_view name) {
  const std::string full = std::string(module) + "." + std::string(name);
  if (kCallables.count(full) || storage_types().count(full)) {
    Obj* o = make(Kind::Global);
    o->s = full;
    return o;
  }
  if (module == "torch" && name.size() > 7 && name.substr(name.size() - 7) == "Storage")
    throw UserError(
        fmt::format("'{}': holds a tensor of storage type {}, which is not read (supported: float64, float32, "
                    "float16, bfloat16, int64, int32, int16, int8, uint8, bool)",
                    what_, shown(full)));
  refuse(full);
}

Obj* Unpickler::rebuild_tensor(const std::vector<Obj*>& a, bool v2) {
  // _rebuild_tensor(storage, offset, size, stride); _v2 adds requires_grad, backward_hooks[, metadata]
  if (a.size() != (v2 ? 6 : 4) && !(v2 && a.size() == 7))
    bad(fmt::format("_rebuild_tensor with {} arguments", a.size()));
  if (a[0]->kind != Kind::Storage) bad(fmt::format("_rebuild_tensor of a {}, not a storage", kind_name(a[0]->kind)));
  const Storage& st = g_.storages[size_t(a[0]->i)];
  auto ints = [&](Obj* t, const char* what) {
    if (t->kind != Kind::Tuple && t->kind != Kind::List)
      bad(fmt::format("a tensor's {} is a {}", what, kind_name(t->kind)));
    std::vector<int64_t> v;
    for (Obj* x : t->items) v.push_back(as_int(x, what));
    return v;
  };
  TensorSpec t{size_t(a[0]->i), as_int(a[1], "storage offset"), ints(a[2], "size"), ints(a[3], "stride"), {}};
  if (t.sizes.size() != t.strides.size() || t.sizes.size() > kMaxDims)
    bad(fmt::format("a tensor of {} sizes and {} strides", t.sizes.size(), t.strides.size()));
  // as_strided's bounds: every element the view reaches lies inside the storage
  if (t.offset < 0) bad("a negative storage offset");
  unsigned __int128 numel = 1, last = uint64_t(t.offset);
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (t.sizes[d] < 0 || t.strides[d] < 0) bad("a negative size or stride");
    numel *= uint64_t(t.sizes[d]);
    if (t.sizes[d]) last += (unsigned __int128)(t.sizes[d] - 1) * uint64_t(t.strides[d]);
    if (numel > (uint64_t(1) << 62) || last > (uint64_t(1) << 62)) bad("a tensor of absurd size");
  }
  if (numel ? last >= uint64_t(st.numel) : uint64_t(t.offset) > uint64_t(st.numel))
    bad(fmt::format("a tensor view reaching element {} of a storage of {} elements", uint64_t(last), st.numel));
  g_.tensors.push_back(std::move(t));
  Obj* o = make(Kind::Tensor);
  o->i = int64_t(g_.tensors.size() - 1);
  return o;
}

Obj* Unpickler::call(Obj* fn, Obj* args) {  // REDUCE
  if (fn->kind != Kind::Global) bad(fmt::format("REDUCE of a {}", kind_name(fn->kind)));
  if (args->kind != Kind::Tuple) bad("REDUCE with arguments that are not a tuple");
  const auto& a = args->items;
  const std::string& f = fn->s;
  if (f == "collections.OrderedDict") {  // OrderedDict() then SETITEMS, or OrderedDict([(k, v), ...])
    Obj* d = make(Kind::Dict);
    if (a.size() == 1 && (a[0]->kind == Kind::List || a[0]->kind == Kind::Tuple)) {
      for (Obj* p : a[0]->items) {
        if ((p->kind != Kind::Tuple && p->kind != Kind::List) || p->items.size() != 2) bad("OrderedDict of non-pairs");
        set_item(d, p->items[0], p->items[1]);
      }
    } else if (!a.empty()) {
      bad("OrderedDict with unexpected arguments");
    }
    return d;
  }
  if (f == "argparse.Namespace" && a.empty()) return make(Kind::Namespace);
  if (f == "torch._utils._rebuild_tensor_v2" || f == "torch._utils._rebuild_tensor")
    return rebuild_tensor(a, f == "torch._utils._rebuild_tensor_v2");
  if (f == "torch._utils._rebuild_parameter") {  // (data, requires_grad, backward_hooks): the data is the tensor
    if (a.size() != 3 || a[0]->kind != Kind::Tensor) bad("_rebuild_parameter of something other than a tensor");
    return a[0];
  }
  bad(fmt::format("REDUCE of '{}' with these arguments", f));
}

Obj* Unpickler::new_object(Obj* cls, Obj* args) {  // NEWOBJ: cls.__new__(cls, *args)
  if (cls->kind != Kind::Global) bad(fmt::format("NEWOBJ of a {}", kind_name(cls->kind)));
  if (args->kind != Kind::Tuple || !args->items.empty()) bad(fmt::format("NEWOBJ of '{}' with arguments", cls->s));
  if (cls->s == "argparse.Namespace") return make(Kind::Namespace);
  if (cls->s == "collections.OrderedDict") return make(Kind::Dict);
  bad(fmt::format("NEWOBJ of '{}'", cls->s));
}

void Unpickler::build(Obj* o, Obj* state) {  // BUILD: o.__setstate__(state) or o.__dict__.update(state)
  if (o->kind == Kind::Namespace) {          // timm's args: the attributes become the namespace's items
    auto merge = [&](Obj* d) {
      if (d->kind == Kind::None) return;
      if (d->kind != Kind::Dict) bad(fmt::format("a Namespace's state is a {}", kind_name(d->kind)));
      for (size_t i = 0; i + 1 < d->items.size(); i += 2) set_item(o, d->items[i], d->items[i + 1]);
    };
    if (state->kind == Kind::Tuple && state->items.size() == 2) {  // (__dict__, slots)
      merge(state->items[0]);
      merge(state->items[1]);
    } else {
      merge(state);
    }
    return;
  }
  // An OrderedDict's instance attributes: a state dict's _metadata (module versions), not weights.
  if (o->kind == Kind::Dict) return;
  bad(fmt::format("BUILD of a {}", kind_name(o->kind)));
}

Obj* Unpickler::load() {
  for (;;) {
    op_pos_ = pos_;
    if (pos_ >= data_.size()) bad("the pickle ends without STOP (truncated file?)");
    const uint8_t op = uint8_t(data_[pos_++]);
    switch (op) {
      case 0x80:  // PROTO
        if (uint(1) > 5) bad("pickle protocol above 5");
        break;
      case 0x95:  // FRAME: only groups the opcodes that follow; nothing to do but check its length
        if (uint(8) > data_.size() - pos_) bad("a FRAME longer than the rest of the pickle");
        break;
      case '.': {  // STOP
        Obj* o = pop();
        return o;
      }
      case '(':  // MARK
        if (marks_.size() >= kMaxMarks) bad(fmt::format("containers nested deeper than {} levels", kMaxMarks));
        marks_.push_back(stack_.size());
        break;
      case '0':  // POP (of a MARK when the stack above it is empty, as Python does)
        if (stack_.size() > floor())
          stack_.pop_back();
        else
          pop_mark();
        break;
      case '1': pop_mark(); break;   // POP_MARK
      case '2': push(top()); break;  // DUP
      case 'N': push(make(Kind::None)); break;
      case 0x88:    // NEWTRUE
      case 0x89: {  // NEWFALSE
        Obj* o = make(Kind::Bool);
        o->i = op == 0x88;
        push(o);
        break;
      }
      case 'J': push(integer(int32_t(uint32_t(uint(4))))); break;  // BININT
      case 'K': push(integer(int64_t(uint(1)))); break;            // BININT1
      case 'M': push(integer(int64_t(uint(2)))); break;            // BININT2
      case 0x8a: push(long_int(uint(1))); break;                   // LONG1
      case 0x8b: {                                                 // LONG4
        const int32_t n = int32_t(uint32_t(uint(4)));
        if (n < 0) bad("LONG4 of negative length");
        push(long_int(uint64_t(n)));
        break;
      }
      case 'G': {  // BINFLOAT: big-endian IEEE double
        auto b = take(8);
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | uint8_t(b[i]);
        Obj* o = make(Kind::Float);
        std::memcpy(&o->f, &bits, 8);
        push(o);
        break;
      }
      case 0x8c: push(text(Kind::Str, uint(1))); break;  // SHORT_BINUNICODE
      case 'X': push(text(Kind::Str, uint(4))); break;   // BINUNICODE
      case 0x8d: push(text(Kind::Str, uint(8))); break;  // BINUNICODE8
      case 'U': push(text(Kind::Str, uint(1))); break;   // SHORT_BINSTRING (Python 2 str)
      case 'T': {                                        // BINSTRING
        const int32_t n = int32_t(uint32_t(uint(4)));
        if (n < 0) bad("BINSTRING of negative length");
        push(text(Kind::Str, uint64_t(n)));
        break;
      }
      case 'C': push(text(Kind::Bytes, uint(1))); break;         // SHORT_BINBYTES
      case 'B': push(text(Kind::Bytes, uint(4))); break;         // BINBYTES
      case 0x8e:                                                 // BINBYTES8
      case 0x96: push(text(Kind::Bytes, uint(8))); break;        // BYTEARRAY8
      case ']':                                                  // EMPTY_LIST
      case 0x8f: push(make(Kind::List)); break;                  // EMPTY_SET (a set is read as a list)
      case ')': push(make(Kind::Tuple)); break;                  // EMPTY_TUPLE
      case '}': push(make(Kind::Dict)); break;                   // EMPTY_DICT
      case 'l':                                                  // LIST
      case 0x91: push(items_of(Kind::List, pop_mark())); break;  // FROZENSET
      case 't': push(items_of(Kind::Tuple, pop_mark())); break;  // TUPLE
      case 0x85:                                                 // TUPLE1
      case 0x86:                                                 // TUPLE2
      case 0x87: {                                               // TUPLE3
        std::vector<Obj*> v(op - 0x84);
        for (size_t i = v.size(); i-- > 0;) v[i] = pop();
        push(items_of(Kind::Tuple, std::move(v)));
        break;
      }
      case 'd': {  // DICT
        auto items = pop_mark();
        if (items.size() % 2) bad("DICT of an odd number of items");
        Obj* d = make(Kind::Dict);
        for (size_t i = 0; i < items.size(); i += 2) set_item(d, items[i], items[i + 1]);
        push(d);
        break;
      }
      case 'a': {  // APPEND
        Obj* v = pop();
        Obj* l = top();
        if (l->kind != Kind::List) bad(fmt::format("APPEND to a {}", kind_name(l->kind)));
        l->items.push_back(v);
        break;
      }
      case 'e':     // APPENDS
      case 0x90: {  // ADDITEMS
        auto items = pop_mark();
        Obj* l = top();
        if (l->kind != Kind::List) bad(fmt::format("APPENDS to a {}", kind_name(l->kind)));
        l->items.insert(l->items.end(), items.begin(), items.end());
        break;
      }
      case 's': {  // SETITEM
        Obj* v = pop();
        Obj* k = pop();
        set_item(top(), k, v);
        break;
      }
      case 'u': {  // SETITEMS
        auto items = pop_mark();
        if (items.size() % 2) bad("SETITEMS of an odd number of items");
        Obj* d = top();
        for (size_t i = 0; i < items.size(); i += 2) set_item(d, items[i], items[i + 1]);
        break;
      }
      case 'h':    // BINGET
      case 'j': {  // LONG_BINGET
        const uint64_t k = uint(op == 'h' ? 1 : 4);
        auto it = memo_.find(k);
        if (it == memo_.end()) bad(fmt::format("memo entry {} read before it was stored", k));
        push(it->second);
        break;
      }
      case 'q':     // BINPUT
      case 'r':     // LONG_BINPUT
      case 0x94: {  // MEMOIZE
        const uint64_t k = op == 0x94 ? memo_.size() : uint(op == 'q' ? 1 : 4);
        if (memo_.size() >= kMaxObjects) bad("too many memo entries");
        memo_[k] = top();
        break;
      }
      case 'c': {  // GLOBAL "module\nname\n"
        auto module = line();
        auto name = line();
        push(global(module, name));
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        Obj* name = pop();
        Obj* module = pop();
        if (module->kind != Kind::Str || name->kind != Kind::Str) bad("STACK_GLOBAL of non-strings");
        push(global(module->s, name->s));
        break;
      }
      case 'R': {  // REDUCE
        Obj* args = pop();
        Obj* fn = pop();
        push(call(fn, args));
        break;
      }
      case 0x81: {  // NEWOBJ
        Obj* args = pop();
        Obj* cls = pop();
        push(new_object(cls, args));
        break;
      }
      case 0x92: {  // NEWOBJ_EX
        Obj* kwargs = pop();
        Obj* args = pop();
        Obj* cls = pop();
        if (kwargs->kind != Kind::Dict || !kwargs->items.empty()) bad("NEWOBJ_EX with keyword arguments");
        push(new_object(cls, args));
        break;
      }
      case 'b': {  // BUILD
        Obj* state = pop();
        build(top(), state);
        break;
      }
      case 'Q': {  // BINPERSID: a storage, by the id torch.save's persistent_id gave it
        Obj* pid = pop();
        push(persistent_(pid, *this));
        break;
      }
      case 'i': {  // INST "module\nname\n": a protocol-0 class instance, always refused
        auto module = line();
        auto name = line();
        refuse(std::string(module) + "." + std::string(name));
      }
      case 'o': {  // OBJ: a protocol-1 class instance
        auto items = pop_mark();
        refuse(items.empty() || items[0]->kind != Kind::Global ? "(an OBJ opcode's class)" : items[0]->s);
      }
      case 0x82:
      case 0x83:
      case 0x84: refuse("(an object from copyreg's extension registry, EXT" + std::to_string(1 << (op - 0x82)) + ")");
      default: bad(fmt::format("opcode 0x{:02x} is unknown or not used by torch.save (protocols 2 to 5)", op));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The file's bytes by offset: a buffer (parse_torch_save), or the file itself read on demand,
// so that each storage goes straight from the file into its tensor and the storages no state
// dict uses (optimizer state) are never read.

class Source {
 public:
  Source(const std::string& what, uint64_t size) : what_(what), size_(size) {}
  virtual ~Source() = default;
  uint64_t size() const { return size_; }
  void read(uint64_t off, uint64_t n, void* dst) const {
    if (off > size_ || n > size_ - off)  // callers check first; this only backs them up
      throw UserError(fmt::format("'{}' is not a valid torch.save file: a read past its end", what_));
    if (n) read_raw(off, n, static_cast<char*>(dst));
  }
  std::string read(uint64_t off, uint64_t n) const {
    std::string s(n <= size_ ? n : 0, '\0');
    read(off, n, s.data());
    return s;
  }

 protected:
  virtual void read_raw(uint64_t off, uint64_t n, char* dst) const = 0;
  const std::string& what_;
  uint64_t size_;
};

class BufferSource : public Source {
 public:
  BufferSource(std::string_view b, const std::string& what) : Source(what, b.size()), b_(b) {}

 private:
  void read_raw(uint64_t off, uint64_t n, char* dst) const override { std::memcpy(dst, b_.data() + off, n); }
  std::string_view b_;
};

class FileSource : public Source {
 public:
  FileSource(int fd, uint64_t size, const std::string& path) : Source(path, size), fd_(fd) {}
  ~FileSource() override { ::close(fd_); }
  static std::unique_ptr<FileSource> open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw UserError(fmt::format("cannot open '{}'", path));
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw UserError(fmt::format("'{}' is not a regular file", path));
    }
    return std::make_unique<FileSource>(fd, uint64_t(st.st_size), path);
  }

 private:
  void read_raw(uint64_t off, uint64_t n, char* dst) const override {
    while (n) {
      const ssize_t r = ::pread(fd_, dst, size_t(std::min<uint64_t>(n, uint64_t(1) << 30)), off_t(off));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        throw UserError(fmt::format("cannot read '{}' at byte {} (was it changed while being read?)", what_, off));
      dst += r, off += uint64_t(r), n -= uint64_t(r);
    }
  }
  int fd_;
};

// ---------------------------------------------------------------------------------------------
// The zip container: stored (uncompressed) entries, as torch.save writes them, with zip64.

class Zip {
 public:
  Zip(const Source& src, const std::string& what);
  bool has(const std::string& name) const { return entries_.count(name) > 0; }
  // Where the entry's bytes start and how many; UserError if it is absent, compressed or encrypted.
  std::pair<uint64_t, uint64_t> locate(const std::string& name) const;
  std::string read(const std::string& name) const {
    auto [off, n] = locate(name);
    return src_.read(off, n);
  }
  const std::vector<std::string>& names() const { return names_; }

 private:
  struct Entry {
    uint64_t data, size, usize;
    uint32_t method, flags;
  };
  [[noreturn]] void bad(const std::string& why) const {
    throw UserError(
        fmt::format("'{}' is not a valid torch.save file: {} (at byte {} of the zip archive)", what_, why, at_));
  }
  const Source& src_;
  const std::string& what_;
  std::unordered_map<std::string, Entry> entries_;
  std::vector<std::string> names_;
  mutable uint64_t at_ = 0;  // where the record being read starts, for messages
};

Zip::Zip(const Source& src, const std::string& what) : src_(src), what_(what) {
  const uint64_t n = src.size();
  at_ = n;
  if (n < 22) bad("shorter than a zip end record");
  // The end-of-central-directory record: the last 22 bytes, unless an archive comment follows it.
  const uint64_t tail_at = n - std::min<uint64_t>(n, 22 + 65535);
  const std::string tail = src.read(tail_at, n - tail_at);
  size_t eocd = std::string::npos;
  for (size_t p = tail.size() - 22;; --p) {
    if (le_at(tail, p, 4) == 0x06054b50 && p + 22 + le_at(tail, p + 20, 2) <= tail.size()) {
      eocd = p;
      break;
    }
    if (p == 0) break;
  }
  if (eocd == std::string::npos) bad("no zip end-of-central-directory record (truncated file?)");
  at_ = tail_at + eocd;
  uint64_t count = le_at(tail, eocd + 10, 2), cd_size = le_at(tail, eocd + 12, 4), cd_off = le_at(tail, eocd + 16, 4);
  if (count == 0xffff || cd_size == 0xffffffff || cd_off == 0xffffffff) {
    // zip64: a locator just before the end record points at the zip64 end record
    if (at_ < 20) bad("zip64 end record locator missing");
    const std::string loc = src.read(at_ - 20, 20);
    if (le_at(loc, 0, 4) != 0x07064b50) bad("zip64 end record locator missing");
    const uint64_t rec = le_at(loc, 8, 8);
    if (n < 56 || rec > n - 56) bad("zip64 end record outside the file");
    at_ = rec;
    const std::string r = src.read(rec, 56);
    if (le_at(r, 0, 4) != 0x06064b50) bad("zip64 end record missing");
    count = le_at(r, 32, 8), cd_size = le_at(r, 40, 8), cd_off = le_at(r, 48, 8);
  }
  if (cd_off > n || cd_size > n - cd_off) bad("central directory outside the file");
  if (count > cd_size / 46) bad(fmt::format("{} entries do not fit a central directory of {} bytes", count, cd_size));
  const std::string cd = src.read(cd_off, cd_size);
  size_t p = 0;
  for (uint64_t i = 0; i < count; ++i) {
    at_ = cd_off + p;
    if (cd.size() - p < 46 || le_at(cd, p, 4) != 0x02014b50)
      bad(fmt::format("central directory entry {} is malformed", i));
    const uint32_t flags = uint32_t(le_at(cd, p + 8, 2)), method = uint32_t(le_at(cd, p + 10, 2));
    uint64_t csize = le_at(cd, p + 20, 4), usize = le_at(cd, p + 24, 4), off = le_at(cd, p + 42, 4);
    const size_t nlen = le_at(cd, p + 28, 2), xlen = le_at(cd, p + 30, 2), clen = le_at(cd, p + 32, 2);
    if (46 + nlen + xlen + clen > cd.size() - p) bad(fmt::format("central directory entry {} runs past its end", i));
    const std::string name = cd.substr(p + 46, nlen);
    if (usize == 0xffffffff || csize == 0xffffffff || off == 0xffffffff) {
      // zip64 extra field (id 1): the 64-bit values of the fields set to 0xffffffff, in this order
      const std::string_view x = std::string_view(cd).substr(p + 46 + nlen, xlen);
      bool found = false;
      for (size_t q = 0; q + 4 <= x.size() && !found;) {
        const size_t id = le_at(x, q, 2), len = le_at(x, q + 2, 2);
        if (len > x.size() - q - 4) break;
        if (id == 1) {
          size_t r = q + 4;
          auto next = [&](uint64_t& v) {
            if (v != 0xffffffff) return;
            if (r + 8 > q + 4 + len) bad(fmt::format("entry '{}' has a short zip64 extra field", shown(name)));
            v = le_at(x, r, 8), r += 8;
          };
          next(usize), next(csize), next(off);
          found = true;
        }
        q += 4 + len;
      }
      if (!found) bad(fmt::format("entry '{}' lacks its zip64 extra field", shown(name)));
    }
    // The local header has its own name and extra lengths (torch pads its extra field so that
    // the data starts aligned).
    at_ = off;
    if (off > n || n - off < 30) bad(fmt::format("entry '{}' has no local header", shown(name)));
    const std::string local = src.read(off, 30);
    if (le_at(local, 0, 4) != 0x04034b50) bad(fmt::format("entry '{}' has no local header", shown(name)));
    const uint64_t data = off + 30 + le_at(local, 26, 2) + le_at(local, 28, 2);
    if (data > n || csize > n - data) bad(fmt::format("entry '{}' runs past the end of the file", shown(name)));
    if (!entries_.emplace(name, Entry{data, csize, usize, method, flags}).second)
      bad(fmt::format("entry '{}' appears twice", shown(name)));
    names_.push_back(name);
    p += 46 + nlen + xlen + clen;
  }
}

std::pair<uint64_t, uint64_t> Zip::locate(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) bad(fmt::format("no entry '{}'", shown(name)));
  const Entry& e = it->second;
  at_ = e.data;
  if (e.flags & 1) bad(fmt::format("entry '{}' is encrypted", shown(name)));
  if (e.method != 0 || e.size != e.usize)
    bad(fmt::format("entry '{}' is compressed (method {}); torch.save stores entries uncompressed", shown(name),
                    e.method));
  return {e.data, e.size};
}

// ---------------------------------------------------------------------------------------------
// Persistent ids and the two file layouts.

// ('storage', storage_type, key, location, numel[, view_metadata]) -> the storage's slot; the
// same key twice is the same storage (tensors that share one).
size_t storage_slot(Graph& g, Obj* pid, bool legacy, Unpickler& up) {
  const size_t want = legacy ? 6 : 5;
  if (pid->kind != Kind::Tuple || pid->items.size() != want)
    up.bad("a persistent id that is not ('storage', type, key, location, numel)");
  const auto& a = pid->items;
  if (a[0]->kind != Kind::Str || a[0]->s != "storage") up.bad("a persistent id that is not a storage");
  if (a[1]->kind != Kind::Global || !storage_types().count(a[1]->s))
    up.bad("a storage whose type is not a storage class");
  if (a[2]->kind != Kind::Str || a[3]->kind != Kind::Str) up.bad("a storage whose key or location is not a string");
  const int64_t numel = up.as_int(a[4], "a storage's size");
  const at::ScalarType dtype = storage_types().at(a[1]->s);
  if (numel < 0 || uint64_t(numel) > (uint64_t(1) << 60) / c10::elementSize(dtype)) up.bad("a storage of absurd size");
  if (legacy && a[5]->kind != Kind::None)
    up.bad("a storage view (view_metadata), which torch.save has not written since PyTorch 0.4");
  auto [it, fresh] = g.storage_by_key.emplace(a[2]->s, g.storages.size());
  if (fresh) {
    g.storages.push_back({dtype, numel});
  } else if (g.storages[it->second].dtype != dtype || g.storages[it->second].numel != numel) {
    up.bad(fmt::format("storage '{}' referenced with two different types or sizes", shown(a[2]->s)));
  }
  return it->second;
}

Obj* storage_obj(Unpickler& up, size_t slot) {
  Obj* o = up.make(Kind::Storage);
  o->i = int64_t(slot);
  return o;
}

// Reads tensors out of the file on first use, within a budget: views repeating one storage
// could otherwise make a small file expand without bound.
class Materializer {
 public:
  Materializer(Graph& g, const Source& src, const std::string& what)
      : g_(g), src_(src), what_(what), budget_(4 * src.size() + (uint64_t(64) << 20)) {}
  at::Tensor tensor(size_t i) {
    TensorSpec& t = g_.tensors[i];
    if (!t.value.defined()) {
      if (std::find(t.sizes.begin(), t.sizes.end(), 0) != t.sizes.end())  // empty: nothing to read
        return t.value = at::empty(t.sizes, at::TensorOptions().dtype(g_.storages[t.storage].dtype));
      at::Tensor st = storage(t.storage);
      at::Tensor v = st.as_strided(t.sizes, t.strides, t.offset);
      // A view of its whole storage is used as it is; any other is copied, contiguous, so that
      // no tensor keeps a larger storage alive.
      if (!(t.offset == 0 && v.numel() == st.numel() && v.is_contiguous())) {
        spend(uint64_t(v.numel()) * v.element_size());
        v = v.clone(at::MemoryFormat::Contiguous);
      }
      t.value = v;
    }
    return t.value;
  }

 private:
  at::Tensor storage(size_t i) {
    Storage& s = g_.storages[i];
    if (!s.tensor.defined()) {
      const uint64_t n = uint64_t(s.numel) * c10::elementSize(s.dtype);
      spend(n);
      auto t = at::empty({s.numel}, at::TensorOptions().dtype(s.dtype == at::kBool ? at::kByte : s.dtype));
      src_.read(s.offset, n, t.data_ptr());
      // A bool must be 0 or 1; any other byte (a crafted file) is read as true, not kept as is.
      s.tensor = s.dtype == at::kBool ? t.ne(0) : t;
    }
    return s.tensor;
  }
  void spend(uint64_t n) {
    if (n > budget_)
      throw UserError(
          fmt::format("'{}': its tensors would take more than 4 times the file's size (views repeating "
                      "one storage?); refusing to allocate that much",
                      what_));
    budget_ -= n;
  }
  Graph& g_;
  const Source& src_;
  const std::string& what_;
  uint64_t budget_;
};

bool contains_tensor(Obj* root) {
  std::vector<Obj*> todo{root};
  std::unordered_set<Obj*> seen;
  while (!todo.empty()) {
    Obj* o = todo.back();
    todo.pop_back();
    if (!seen.insert(o).second) continue;
    if (o->kind == Kind::Tensor || o->kind == Kind::Storage) return true;
    todo.insert(todo.end(), o->items.begin(), o->items.end());
  }
  return false;
}

Obj* find_key(Obj* d, const std::string& k) {
  for (size_t i = 0; i + 1 < d->items.size(); i += 2)
    if (d->items[i]->kind == Kind::Str && d->items[i]->s == k) return d->items[i + 1];
  return nullptr;
}

// The top-level object -> imgtrain's flat layout (see torch_pickle.h).
SafeTensors flatten(Graph& g, Obj* top, const Source& src, const std::string& what) {
  Materializer m(g, src, what);
  SafeTensors out;
  auto is_state_dict = [](Obj* d) {
    if (d->kind != Kind::Dict) return false;
    for (size_t i = 0; i + 1 < d->items.size(); i += 2)
      if (d->items[i]->kind != Kind::Str || d->items[i + 1]->kind != Kind::Tensor) return false;
    return true;
  };
  auto add = [&](Obj* sd, const std::string& prefix) {
    // DataParallel / DDP wrap the model as `module`; torchvision's EMA (AveragedModel) does too,
    // beside its n_averaged counter, which is not a weight.
    bool wrapped = false, all = true;
    for (size_t i = 0; i < sd->items.size(); i += 2) {
      const std::string& k = sd->items[i]->s;
      if (k == "n_averaged") continue;
      wrapped = true;
      all = all && starts_with(k, "module.");
    }
    wrapped = wrapped && all;
    for (size_t i = 0; i < sd->items.size(); i += 2) {
      const std::string& k = sd->items[i]->s;
      if (wrapped && k == "n_averaged") continue;
      out.tensors.emplace_back(prefix + (wrapped ? k.substr(7) : k), m.tensor(size_t(sd->items[i + 1]->i)));
    }
  };
  const char* accepted =
      "a state dict (name -> tensor) is read at the top level or under 'state_dict' / 'model', "
      "an EMA under 'state_dict_ema' / 'model_ema'";
  if (top->kind != Kind::Dict)
    throw UserError(
        fmt::format("'{}': holds a {}, not a state dict or checkpoint; {}", what, kind_name(top->kind), accepted));
  if (!top->items.empty() && is_state_dict(top)) {
    add(top, "");
    return out;
  }
  // A checkpoint: timm's (state_dict, state_dict_ema) or torchvision references' (model, model_ema).
  static const std::map<std::string, std::string> weights = {
      {"state_dict", "model."}, {"model", "model."}, {"state_dict_ema", "ema."}, {"model_ema", "ema."}};
  // Training state that may hold tensors but no weights: parsed, dropped.
  static const std::set<std::string> dropped = {"optimizer", "lr_scheduler", "scheduler",      "scaler", "amp_scaler",
                                                "amp",       "task_state",   "task_state_ema", "saver"};
  std::vector<std::string> keys, stray;
  std::map<std::string, std::string> source;  // prefix -> the key it came from
  for (size_t i = 0; i + 1 < top->items.size(); i += 2) {
    Obj *k = top->items[i], *v = top->items[i + 1];
    const std::string name = k->kind == Kind::Str   ? k->s
                             : k->kind == Kind::Int ? std::to_string(k->i)
                                                    : kind_name(k->kind);
    keys.push_back("'" + shown(name) + "'");
    auto w = k->kind == Kind::Str ? weights.find(k->s) : weights.end();
    if (w != weights.end() && v->kind != Kind::None) {
      if (!is_state_dict(v))
        throw UserError(fmt::format("'{}': '{}' is a {} that is not a state dict (name -> tensor)", what, name,
                                    kind_name(v->kind)));
      if (auto [it, fresh] = source.emplace(w->second, name); !fresh)
        throw UserError(
            fmt::format("'{}': holds two state dicts for '{}': '{}' and '{}'", what, w->second, it->second, name));
      add(v, w->second);
    } else if (w == weights.end() && !(k->kind == Kind::Str && dropped.count(k->s)) && contains_tensor(v)) {
      stray.push_back("'" + shown(name) + "'");
    }
  }
  if (keys.size() > 20) keys.resize(20), keys.push_back("...");
  auto list = [](const std::vector<std::string>& v) { return fmt::format("{}", fmt::join(v, ", ")); };
  if (!stray.empty())
    throw UserError(
        fmt::format("'{}': holds tensors under {}, which this reader does not know (top-level keys: {}); {}", what,
                    list(stray), list(keys), accepted));
  if (out.tensors.empty())
    throw UserError(fmt::format("'{}': no state dict found (top-level keys: {}); {}", what, list(keys), accepted));
  // What rebuilding the model and the logs use, as imgtrain's own checkpoints name it.
  if (Obj* a = find_key(top, "arch"); a && a->kind == Kind::Str) out.metadata["arch"] = a->s;
  if (Obj* e = find_key(top, "epoch"); e && e->kind == Kind::Int) out.metadata["epoch"] = std::to_string(e->i);
  if (Obj* v = find_key(top, "metric"); v && (v->kind == Kind::Float || v->kind == Kind::Int))
    out.metadata["metric"] = fmt::format("{}", v->kind == Kind::Float ? v->f : double(v->i));
  Obj* args = find_key(top, "args");
  if (args && args->kind == Kind::Namespace && out.metadata.count("arch")) {  // timm's train.py args
    for (const char* k : {"num_classes", "in_chans", "img_size"})
      if (Obj* v = find_key(args, k); v && v->kind == Kind::Int) out.metadata[k] = std::to_string(v->i);
    if (Obj* gp = find_key(args, "gp"); gp && gp->kind == Kind::Str) out.metadata["global_pool"] = gp->s;
  }
  return out;
}

SafeTensors load_zip(const Source& src, const std::string& what) {
  Zip zip(src, what);
  // The archive's one top folder (torch names it after the file): <archive>/data.pkl
  std::string archive;
  for (auto& n : zip.names()) {
    if (n.size() > 9 && n.compare(n.size() - 9, 9, "/data.pkl") == 0 && n.find('/') == n.size() - 9) {
      if (!archive.empty())
        throw UserError(fmt::format("'{}' is not a valid torch.save file: more than one data.pkl", what));
      archive = n.substr(0, n.size() - 8);
    }
  }
  if (archive.empty())
    throw UserError(fmt::format("'{}' is a zip file without <archive>/data.pkl: not a torch.save file", what));
  if (zip.has(archive + "constants.pkl"))
    throw UserError(
        fmt::format("'{}' is a TorchScript archive (torch.jit.save), which is not read; save the model's "
                    "state_dict() with torch.save instead",
                    what));
  if (zip.has(archive + "byteorder") && zip.read(archive + "byteorder") != "little")
    throw UserError(fmt::format("'{}': written on a big-endian machine, which is not read", what));
  Graph g;
  auto persistent = [&](Obj* pid, Unpickler& up) -> Obj* {
    const size_t slot = storage_slot(g, pid, false, up);
    Storage& s = g.storages[slot];
    if (!s.have_bytes) {
      const std::string entry = archive + "data/" + pid->items[2]->s;
      if (!zip.has(entry)) up.bad(fmt::format("storage '{}' has no entry in the archive", shown(pid->items[2]->s)));
      const auto [off, n] = zip.locate(entry);
      if (n != uint64_t(s.numel) * c10::elementSize(s.dtype))
        up.bad(fmt::format("storage '{}' of {} elements of {} has {} bytes", shown(pid->items[2]->s), s.numel,
                           c10::toString(s.dtype), n));
      s.offset = off;
      s.have_bytes = true;
    }
    return storage_obj(up, slot);
  };
  const std::string pkl_name = archive + "data.pkl";
  const std::string pkl = zip.read(pkl_name);
  Unpickler up(g, pkl, 0, what, pkl_name, persistent);
  Obj* top = up.load();
  return flatten(g, top, src, what);
}

// Before PyTorch 1.6: pickles of the magic number, the protocol version and sys_info, the
// object, the list of storage keys, then per key an int64 element count and the raw data.
SafeTensors load_legacy(std::string_view bytes, const std::string& what) {
  Graph g;
  size_t pos = 0;
  auto next = [&](Unpickler::PersistentLoad pl) {
    Unpickler up(g, bytes, pos, what, "the file", std::move(pl));
    Obj* o = up.load();
    pos = up.end();
    return o;
  };
  auto no_persistent = [](Obj*, Unpickler& up) -> Obj* { up.bad("a persistent id outside the main pickle"); };
  auto bad = [&](const std::string& why) {
    return UserError(fmt::format("'{}' is not a valid torch.save file: {} (at byte {} of the file)", what, why, pos));
  };
  static const std::string kMagic("\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 10);  // 0x1950a86a20f9469cfc6c
  Obj* magic = next(no_persistent);
  if (magic->kind != Kind::BigInt || magic->s != kMagic)
    throw UserError(
        fmt::format("'{}' is a pickle without torch.save's magic number: not a torch.save file (plain "
                    "pickle files are not read)",
                    what));
  Obj* version = next(no_persistent);
  if (version->kind != Kind::Int || version->i != 1001) throw bad("legacy protocol version is not 1001");
  Obj* sys_info = next(no_persistent);
  if (sys_info->kind != Kind::Dict) throw bad("sys_info is not a dict");
  if (Obj* le = find_key(sys_info, "little_endian"); le && le->kind == Kind::Bool && !le->i)
    throw UserError(fmt::format("'{}': written on a big-endian machine, which is not read", what));
  Obj* top = next([&](Obj* pid, Unpickler& up) { return storage_obj(up, storage_slot(g, pid, true, up)); });
  Obj* keys = next(no_persistent);
  if (keys->kind != Kind::List) throw bad("the storage key list is not a list");
  for (Obj* k : keys->items) {
    if (k->kind != Kind::Str) throw bad("a storage key is not a string");
    auto it = g.storage_by_key.find(k->s);
    if (it == g.storage_by_key.end()) throw bad(fmt::format("storage '{}' is listed but never used", shown(k->s)));
    Storage& s = g.storages[it->second];
    if (s.have_bytes) throw bad(fmt::format("storage '{}' is listed twice", shown(k->s)));
    if (bytes.size() - pos < 8) throw bad("the file ends before a storage's size (truncated file?)");
    const int64_t count = int64_t(le_at(bytes, pos, 8));
    if (count != s.numel)
      throw bad(fmt::format("storage '{}' has {} elements, its id says {}", shown(k->s), count, s.numel));
    const uint64_t n = uint64_t(count) * c10::elementSize(s.dtype);
    if (n > bytes.size() - pos - 8)
      throw bad(fmt::format("storage '{}' runs past the end of the file (truncated file?)", shown(k->s)));
    s.offset = pos + 8;
    s.have_bytes = true;
    pos += 8 + n;
  }
  for (auto& [k, i] : g.storage_by_key)
    if (!g.storages[i].have_bytes) throw bad(fmt::format("storage '{}' is used but its data is missing", shown(k)));
  return flatten(g, top, BufferSource(bytes, what), what);
}

bool is_tar(std::string_view head) { return head.size() >= 262 && head.substr(257, 5) == "ustar"; }

UserError tar_refusal(const std::string& what) {
  return UserError(
      fmt::format("'{}' is in the tar-based torch.save format of PyTorch before 0.4, which is not read; "
                  "load and re-save it with a current PyTorch",
                  what));
}

}  // namespace

bool is_torch_save_data(std::string_view head) {
  if (starts_with(head, "PK\x03\x04")) return true;
  if (is_tar(head)) return true;
  // A pickle: PROTO and a protocol byte. A safetensors file may start with the same two bytes
  // (its header length is little-endian), but its JSON header starts at byte 8 with '{'.
  return head.size() >= 2 && uint8_t(head[0]) == 0x80 && head[1] >= 2 && head[1] <= 5 &&
         !(head.size() > 8 && head[8] == '{');
}

bool is_torch_save_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char buf[512];
  f.read(buf, sizeof buf);
  return f.gcount() > 0 && is_torch_save_data(std::string_view(buf, size_t(f.gcount())));
}

SafeTensors parse_torch_save(std::string_view bytes, const std::string& what) {
  if (!is_torch_save_data(bytes.substr(0, 512)))
    throw UserError(fmt::format("'{}' is not a torch.save file (neither a zip archive nor a pickle stream)", what));
  if (starts_with(bytes, "PK\x03\x04")) return load_zip(BufferSource(bytes, what), what);
  if (is_tar(bytes)) throw tar_refusal(what);
  return load_legacy(bytes, what);
}

SafeTensors load_torch_save(const std::string& path) {
  // A zip is read by offset (pread, not a mapping: a file rewritten in place while it is read,
  // as timm's torch.save of last.pth.tar does, then gives an error rather than a SIGBUS); the
  // legacy stream, whose pickles have no index, is read whole.
  auto src = FileSource::open(path);
  const std::string head = src->read(0, std::min<uint64_t>(src->size(), 512));
  if (!is_torch_save_data(head))
    throw UserError(fmt::format("'{}' is not a torch.save file (neither a zip archive nor a pickle stream)", path));
  if (starts_with(head, "PK\x03\x04")) return load_zip(*src, path);
  if (is_tar(head)) throw tar_refusal(path);
  return load_legacy(src->read(0, src->size()), path);
}

}  // namespace imgtrain::io
