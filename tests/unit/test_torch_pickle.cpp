// The restricted torch.save reader on hand-made files: pickles written opcode by opcode (as
// Lib/pickletools.py documents them) inside a zip or the legacy stream, valid and malformed.
// Files torch itself writes are checked in tests/parity/test_pth.cpp.
#include "core/error.h"
#include "engine/checkpoint.h"
#include "io/torch_pickle.h"
#include "io/weights.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cstring>
#include <random>

using namespace imgtrain;

namespace {
std::string le(uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(char((v >> (8 * i)) & 0xff));
  return s;
}
// A literal that holds NUL bytes.
template <size_t N>
std::string B(const char (&s)[N]) {
  return std::string(s, N - 1);
}
// Opcodes: BINUNICODE, BININT1 / BININT, GLOBAL, a tuple of ints.
std::string str(const std::string& s) { return std::string("X").append(le(s.size(), 4)).append(s); }
std::string num(int64_t v) {
  return v >= 0 && v < 256 ? std::string("K").append(le(uint64_t(v), 1)) : std::string("J").append(le(uint64_t(v), 4));
}
std::string global(const std::string& module, const std::string& name) { return "c" + module + "\n" + name + "\n"; }
std::string ints(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (auto x : v) s += num(x);
  return s + "t";
}
const std::string kProto = "\x80\x02";

// torch's recipe for a tensor: _rebuild_tensor_v2(persistent storage id, offset, size, stride,
// requires_grad, OrderedDict()). The legacy id has a sixth field, view_metadata (None).
std::string tensor(const std::string& key, int64_t numel, int64_t offset, const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& strides, bool legacy = false, const std::string& type = "FloatStorage") {
  return global("torch._utils", "_rebuild_tensor_v2") + "((" + str("storage") + global("torch", type) + str(key) +
         str("cpu") + num(numel) + (legacy ? "N" : "") + "tQ" + num(offset) + ints(sizes) + ints(strides) + "\x89" +
         global("collections", "OrderedDict") + ")Rt" + "R";
}
// A dict pickle of (already pickled) key -> value items.
std::string dict(const std::vector<std::pair<std::string, std::string>>& items) {
  std::string s = "}(";
  for (auto& [k, v] : items) s += str(k) + v;
  return s + "u";
}

struct Blob {
  std::string key, bytes;
  int64_t numel;
};
Blob floats(const std::string& key, const std::vector<float>& v) {
  std::string b(v.size() * 4, '\0');
  std::memcpy(b.data(), v.data(), b.size());
  return {key, b, int64_t(v.size())};
}

// A stored zip archive, optionally with every size and offset in zip64 records.
std::string zip(const std::vector<std::pair<std::string, std::string>>& entries, bool zip64 = false, int method = 0) {
  std::string out, cd;
  const uint64_t ff = 0xffffffff;
  for (auto& [name, data] : entries) {
    const uint64_t off = out.size(), n = data.size();
    out += le(0x04034b50, 4) + le(20, 2) + le(0, 2) + le(method, 2) + le(0, 4) + le(0, 4) + le(n, 4) + le(n, 4) +
           le(name.size(), 2) + le(0, 2) + name + data;
    const std::string extra = zip64 ? le(1, 2) + le(24, 2) + le(n, 8) + le(n, 8) + le(off, 8) : "";
    cd += le(0x02014b50, 4) + le(45, 2) + le(45, 2) + le(0, 2) + le(method, 2) + le(0, 4) + le(0, 4) +
          le(zip64 ? ff : n, 4) + le(zip64 ? ff : n, 4) + le(name.size(), 2) + le(extra.size(), 2) + le(0, 2) +
          le(0, 2) + le(0, 2) + le(0, 4) + le(zip64 ? ff : off, 4) + name + extra;
  }
  const uint64_t cd_off = out.size(), count = entries.size();
  out += cd;
  if (zip64) {
    const uint64_t rec = out.size();
    out += le(0x06064b50, 4) + le(44, 8) + le(45, 2) + le(45, 2) + le(0, 4) + le(0, 4) + le(count, 8) + le(count, 8) +
           le(cd.size(), 8) + le(cd_off, 8);
    out += le(0x07064b50, 4) + le(0, 4) + le(rec, 8) + le(1, 4);
  }
  out += le(0x06054b50, 4) + le(0, 2) + le(0, 2) + le(zip64 ? 0xffff : count, 2) + le(zip64 ? 0xffff : count, 2) +
         le(zip64 ? ff : cd.size(), 4) + le(zip64 ? ff : cd_off, 4) + le(0, 2);
  return out;
}
// torch.save's zip layout around a pickle and its storages.
std::string zip_file(const std::string& pkl, const std::vector<Blob>& blobs, bool zip64 = false, int method = 0) {
  std::vector<std::pair<std::string, std::string>> e = {{"arch/data.pkl", pkl}, {"arch/byteorder", "little"}};
  for (auto& b : blobs) e.emplace_back("arch/data/" + b.key, b.bytes);
  e.emplace_back("arch/version", "3\n");
  return zip(e, zip64, method);
}
// The legacy stream: magic number, protocol version, sys_info, the pickle, storage keys, data.
std::string legacy_file(const std::string& pkl, const std::vector<Blob>& blobs) {
  std::string s = kProto + "\x8a\x0a" + std::string("\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 10) + ".";
  s += kProto + "M\xe9\x03.";
  s += kProto + dict({{"little_endian", "\x88"}}) + ".";
  s += pkl;
  s += kProto + "](";
  for (auto& b : blobs) s += str(b.key);
  s += "e.";
  for (auto& b : blobs) s += le(uint64_t(b.numel), 8) + b.bytes;
  return s;
}

// A state dict {w: 2x3 floats, wt: its transpose (the same storage), row: its second row (offset 3)}.
std::string sd_pickle(bool legacy) {
  return kProto +
         dict({{"w", tensor("0", 6, 0, {2, 3}, {3, 1}, legacy)},
               {"wt", tensor("0", 6, 0, {3, 2}, {1, 3}, legacy)},
               {"row", tensor("0", 6, 3, {3}, {1}, legacy)}}) +
         ".";
}
const Blob kSix = floats("0", {0, 1, 2, 3, 4, 5});

std::string error_of(const std::string& bytes) {
  return test::error_text<UserError>([&] { io::parse_torch_save(bytes, "f.pth"); });
}
std::string legacy_error(const std::string& main_pickle, const std::vector<Blob>& blobs = {}) {
  return error_of(legacy_file(main_pickle, blobs));
}
}  // namespace

TEST_CASE("hand-made torch.save files read in the zip and zip64 and legacy layouts", "[pth]") {
  const auto want = torch::arange(6, torch::kFloat32).view({2, 3});
  for (const std::string& bytes : {zip_file(sd_pickle(false), {kSix}), zip_file(sd_pickle(false), {kSix}, true),
                                   legacy_file(sd_pickle(true), {kSix})}) {
    CHECK(io::is_torch_save_data(bytes));
    auto st = io::parse_torch_save(bytes, "f.pth");
    REQUIRE(st.tensors.size() == 3);
    CHECK(st.tensors[0].first == "w");
    CHECK(st.tensors[1].first == "wt");
    CHECK(st.tensors[2].first == "row");
    CHECK(torch::equal(st.tensors[0].second, want));
    CHECK(torch::equal(st.tensors[1].second, want.t()));
    CHECK(st.tensors[1].second.is_contiguous());
    CHECK(torch::equal(st.tensors[2].second, want[1]));
    CHECK(st.metadata.empty());
  }
}

TEST_CASE("torch.save files are told apart from safetensors by content", "[pth]") {
  CHECK(io::is_torch_save_data("PK\x03\x04rest"));
  CHECK(io::is_torch_save_data(legacy_file(sd_pickle(true), {kSix})));
  CHECK_FALSE(io::is_torch_save_data("hello"));
  CHECK_FALSE(io::is_torch_save_data(""));
  // A safetensors header of 0x280 bytes starts with 0x80 0x02, like a protocol-2 pickle.
  std::string json = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  json.resize(0x280, ' ');
  const std::string st_bytes = le(json.size(), 8) + json + "\x05\x06";
  REQUIRE(uint8_t(st_bytes[0]) == 0x80);
  REQUIRE(st_bytes[1] == 2);
  CHECK_FALSE(io::is_torch_save_data(st_bytes));
  test::TempDir d("pth");
  test::write_file(d / "w.bin", st_bytes);
  CHECK(io::load_weights_file(d / "w.bin").tensors.at(0).second[1].item<int>() == 6);
  test::write_file(d / "w.pth", zip_file(sd_pickle(false), {kSix}));
  CHECK(io::is_torch_save_file(d / "w.pth"));
  CHECK(io::load_weights_file(d / "w.pth").tensors.size() == 3);
}

TEST_CASE("truncated or corrupted torch.save files give a UserError and never crash", "[pth]") {
  for (const std::string& good : {zip_file(sd_pickle(false), {kSix}), zip_file(sd_pickle(false), {kSix}, true),
                                  legacy_file(sd_pickle(true), {kSix})}) {
    int other = 0, loaded = 0;
    for (size_t n = 0; n < good.size(); ++n) {  // every prefix is malformed
      try {
        io::parse_torch_save(good.substr(0, n), "f.pth");
        ++loaded;
      } catch (const UserError&) {
      } catch (...) {
        ++other;
      }
    }
    CHECK(loaded == 0);
    std::mt19937 rng(7);
    for (size_t i = 0; i < good.size(); ++i)  // every byte changed, three ways
      for (uint8_t x : {uint8_t(0xff), uint8_t(0x80), uint8_t(1 + rng() % 255)}) {
        std::string bad = good;
        bad[i] = char(uint8_t(bad[i]) ^ x);
        try {
          io::parse_torch_save(bad, "f.pth");
        } catch (const UserError&) {
        } catch (...) {
          ++other;
        }
      }
    CHECK(other == 0);
  }
}

TEST_CASE("malformed pickles are refused with the byte offset and the defect", "[pth]") {
  CHECK_THAT(legacy_error(kProto + "\xff"),
             Catch::Contains("opcode 0xff") && Catch::Contains("'f.pth'") && Catch::Contains("at byte "));
  CHECK_THAT(legacy_error(kProto + "\x8b\xff\xff\xff\x7f"), Catch::Contains("2147483647 bytes wanted"));
  CHECK_THAT(legacy_error(kProto + "\x8b\xff\xff\xff\xff"), Catch::Contains("LONG4 of negative length"));
  CHECK_THAT(legacy_error(kProto + "X\xff\xff\xff\xff"), Catch::Contains("4294967295 bytes wanted"));
  CHECK_THAT(legacy_error(kProto + "\x8d" + le(uint64_t(1) << 62, 8)), Catch::Contains("bytes wanted"));
  CHECK_THAT(legacy_error(kProto + B("X\x02\x00\x00\x00\xc3\x28.")), Catch::Contains("not UTF-8"));
  CHECK_THAT(legacy_error(kProto + std::string(100000, '(')), Catch::Contains("nested deeper than 1000"));
  CHECK_THAT(legacy_error(kProto + "h\x05."), Catch::Contains("memo entry 5 read before it was stored"));
  CHECK_THAT(legacy_error(kProto + "j\xff\xff\xff\xff."), Catch::Contains("memo entry 4294967295"));
  CHECK_THAT(legacy_error(kProto + "a."), Catch::Contains("stack underflow"));
  CHECK_THAT(legacy_error(kProto + "(K\x01"
                                   "a."),
             Catch::Contains("stack underflow"));  // APPEND cannot reach below a MARK
  CHECK_THAT(legacy_error(kProto + "1."), Catch::Contains("no MARK"));
  CHECK_THAT(legacy_error(kProto + "}"), Catch::Contains("without STOP"));
  CHECK_THAT(legacy_error(kProto + "(K\x01"
                                   "d."),
             Catch::Contains("odd number"));
  CHECK_THAT(legacy_error(kProto + ")K\x01"
                                   "a."),
             Catch::Contains("APPEND to a tuple"));
  CHECK_THAT(legacy_error(kProto + "}](K\x01"
                                   "s."),
             Catch::Contains("stack underflow"));
  CHECK_THAT(legacy_error(kProto + "}]K\x01"
                                   "s."),
             Catch::Contains("dict key of type list"));
  CHECK_THAT(legacy_error(kProto + "\x95" + le(1000, 8) + "N."), Catch::Contains("FRAME longer"));
  CHECK_THAT(legacy_error("\x80\x09N."), Catch::Contains("protocol above 5"));
  CHECK_THAT(error_of(std::string("\x80\x02N.")), Catch::Contains("without torch.save's magic number"));
  CHECK_THAT(error_of("not a weights file"), Catch::Contains("not a torch.save file"));
  // Deep nesting that needs no MARK (TUPLE1 of TUPLE1 ...): built and walked without recursion.
  CHECK_THAT(legacy_error(kProto + "}" + str("x") + ")" + std::string(500000, '\x85') + "s."),
             Catch::Contains("no state dict found (top-level keys: 'x')"));
  CHECK_THAT(legacy_error(kProto + ")" + std::string(3000000, '\x85') + "."),
             Catch::Contains("more than 2097152 objects"));
  // A cycle (a list that holds itself) is no hang either.
  CHECK_THAT(legacy_error(kProto + "}" + str("x") +
                          B("]q\x00h\x00"
                            "as.")),
             Catch::Contains("no state dict found"));
}

TEST_CASE("globals other than the tensor and container ones are refused by name", "[pth]") {
  auto refused = [](const std::string& name) {
    return Catch::Contains("refuses to load the global '" + name +
                           "' (only tensors, storages and plain containers are read; nothing in a weights file is "
                           "ever executed)");
  };
  const auto system = legacy_error(kProto + global("posix", "system") + "(" + str("touch x") + "tR.");
  CHECK_THAT(system, refused("posix.system"));
  CHECK_THAT(system, Catch::StartsWith("'f.pth': "));
  CHECK_THAT(legacy_error("\x80\x04\x8c\x08"
                          "builtins\x94\x8c\x04"
                          "eval\x94\x93\x94."),
             refused("builtins.eval"));
  CHECK_THAT(legacy_error(kProto + "(" + str("x") + "ios\nsystem\n."), refused("os.system"));
  CHECK_THAT(legacy_error(kProto + "(" + str("x") + "ios\nsystem\n."), !Catch::Contains("state_dict()"));
  // a whole model (torch.save(model)): its class is refused, with what to save instead
  CHECK_THAT(legacy_error(kProto + global("timm.models.resnet", "ResNet") + ")\x81."),
             refused("timm.models.resnet.ResNet") && Catch::Contains("save model.state_dict() instead"));
  CHECK_THAT(legacy_error(kProto + "\x82\x01."), Catch::Contains("extension registry, EXT1"));
  CHECK_THAT(legacy_error(kProto + global("torch._utils", "_rebuild_tensor_v3")),
             Catch::Contains("'torch._utils._rebuild_tensor_v3'"));
  CHECK_THAT(legacy_error(kProto + global("torch", "ComplexFloatStorage")),
             Catch::Contains("storage type torch.ComplexFloatStorage"));
  // Allowed names only in their own roles: a storage class is not called, Namespace takes no arguments.
  CHECK_THAT(legacy_error(kProto + global("torch", "FloatStorage") + ")R."),
             Catch::Contains("REDUCE of 'torch.FloatStorage'"));
  CHECK_THAT(legacy_error(kProto + global("argparse", "Namespace") + "(K\x01t\x81."),
             Catch::Contains("NEWOBJ of 'argparse.Namespace' with arguments"));
  CHECK_THAT(legacy_error(kProto + "]" + dict({}) + "b."), Catch::Contains("BUILD of a list"));
}

TEST_CASE("tensor views and storages are checked against the data", "[pth]") {
  auto sd = [](const std::string& t) { return kProto + dict({{"w", t}}) + "."; };
  CHECK_THAT(legacy_error(sd(tensor("0", 6, 0, {10}, {1}, true)), {kSix}),
             Catch::Contains("reaching element 9 of a storage of 6"));
  CHECK_THAT(legacy_error(sd(tensor("0", 6, 4, {2, 2}, {1, 1}, true)), {kSix}), Catch::Contains("reaching element 6"));
  CHECK_THAT(legacy_error(sd(tensor("0", 6, 7, {0}, {1}, true)), {kSix}), Catch::Contains("reaching element"));
  CHECK_THAT(legacy_error(sd(tensor("0", 6, 0, {2}, {-1}, true)), {kSix}), Catch::Contains("negative size or stride"));
  CHECK_THAT(legacy_error(sd(tensor("0", 6, 0, {1 << 30, 1 << 30, 1 << 30}, {1, 1, 1}, true)), {kSix}),
             Catch::Contains("absurd size"));
  CHECK_THAT(legacy_error(sd(tensor("0", 6, 0, {2}, {1, 1}, true)), {kSix}), Catch::Contains("1 sizes and 2 strides"));
  // A size beyond 64 bits.
  const std::string huge_size = global("torch._utils", "_rebuild_tensor_v2") + "((" + str("storage") +
                                global("torch", "FloatStorage") + str("0") + str("cpu") + num(6) +
                                B("NtQK\x00(\x8a\x09") + std::string(9, '\x01') + "t(K\x01t\x89}tR";
  CHECK_THAT(legacy_error(sd(huge_size), {kSix}), Catch::Contains("int beyond 64 bits"));
  CHECK_THAT(legacy_error(sd(tensor("0", 4, 0, {4}, {1}, true)), {kSix}),
             Catch::Contains("has 6 elements, its id says 4"));
  CHECK_THAT(legacy_error(sd(tensor("0", 6, 0, {6}, {1}, true)), {}), Catch::Contains("data is missing"));
  CHECK_THAT(legacy_error(sd(tensor("0", 6, 0, {6}, {1}, true)), {kSix, kSix}), Catch::Contains("listed twice"));
  CHECK_THAT(
      legacy_error(sd(tensor("0", 6, 0, {6}, {1}, true) + tensor("0", 6, 0, {6}, {1}, true, "IntStorage")), {kSix}),
      Catch::Contains("two different types or sizes"));
  auto zip_sd = [&](const std::string& t, const std::vector<Blob>& b) { return error_of(zip_file(sd(t), b)); };
  CHECK_THAT(zip_sd(tensor("0", 4, 0, {4}, {1}), {kSix}),
             Catch::Contains("storage '0' of 4 elements of Float has 24 bytes"));
  CHECK_THAT(zip_sd(tensor("1", 6, 0, {6}, {1}), {kSix}), Catch::Contains("storage '1' has no entry"));
  CHECK_THAT(error_of(zip_file(sd(tensor("0", 6, 0, {6}, {1})), {kSix}, false, 8)),
             Catch::Contains("compressed (method 8)"));
  // A bool that is neither 0 nor 1 reads as true.
  const Blob bools{"0", std::string("\x00\x01\x07", 3), 3};
  auto st = io::parse_torch_save(legacy_file(sd(tensor("0", 3, 0, {3}, {1}, true, "BoolStorage")), {bools}), "b.pth");
  CHECK(torch::equal(st.tensors.at(0).second, torch::tensor({false, true, true})));
}

TEST_CASE("checkpoint layouts flatten to model and ema prefixes with metadata", "[pth]") {
  auto sd = [](const std::string& key) { return dict({{"module.w", tensor(key, 6, 0, {2, 3}, {3, 1})}}); };
  // timm: state_dict (DDP names), state_dict_ema, optimizer with int keys and a tensor, args as a
  // Namespace (NEWOBJ + BUILD), epoch as a negative LONG1 to check the sign.
  const std::string optimizer = "}(" + str("state") + B("}(K\x00") +
                                dict({{"momentum_buffer", tensor("2", 6, 0, {6}, {1})}}) + "u" + str("param_groups") +
                                "](" + dict({{"lr", "G?\xb9\x99\x99\x99\x99\x99\x9a"}}) + "eu";
  const std::string args =
      global("argparse", "Namespace") + ")\x81" +
      dict({{"num_classes", num(10)}, {"gp", str("avg")}, {"mean", "N"}, {"scale", B("](G?\xb0\0\0\0\0\0\0e")}}) + "b";
  const std::string pkl = kProto +
                          dict({{"epoch", "\x8a\x01\xfe"},
                                {"arch", str("resnet18")},
                                {"state_dict", sd("0")},
                                {"optimizer", optimizer},
                                {"args", args},
                                {"state_dict_ema", sd("1")},
                                {"metric", B("G@Q\xe0\0\0\0\0\0")}}) +
                          ".";
  const std::vector<Blob> blobs = {kSix, floats("1", {5, 4, 3, 2, 1, 0}), floats("2", {1, 1, 1, 1, 1, 1})};
  auto st = io::parse_torch_save(zip_file(pkl, blobs), "c.pth");
  REQUIRE(st.tensors.size() == 2);
  CHECK(st.tensors[0].first == "model.w");
  CHECK(st.tensors[1].first == "ema.w");
  CHECK(st.tensors[1].second[0][0].item<float>() == 5);
  CHECK(st.metadata ==
        std::map<std::string, std::string>{
            {"arch", "resnet18"}, {"epoch", "-2"}, {"metric", "71.5"}, {"num_classes", "10"}, {"global_pool", "avg"}});
  CHECK(io::weights_prefix(st, true) == "ema.");

  // Through the real loaders: Checkpoint::read (--initial-checkpoint, validate --checkpoint,
  // export) loads the EMA into a module; --resume is refused with the way out.
  test::TempDir d("pthck");
  test::write_file(d / "c.pth.tar", zip_file(pkl, blobs));
  struct Net : torch::nn::Module {
    Net() { register_parameter("w", torch::zeros({2, 3})); }
  } net;
  auto ck = engine::Checkpoint::read(d / "c.pth.tar");
  CHECK(ck.meta().arch == "resnet18");
  CHECK(ck.meta().epoch == -2);
  ck.load_weights(net, /*prefer_ema=*/true);
  CHECK(torch::equal(net.named_parameters()["w"], torch::tensor({5.f, 4.f, 3.f, 2.f, 1.f, 0.f}).view({2, 3})));
  CHECK(engine::Checkpoint::read_meta(d / "c.pth.tar").arch == "resnet18");
  CHECK_THAT(
      test::error_text<UserError>([&] { ck.require_training("--resume", "resnet18"); }),
      Catch::Contains("--resume") && Catch::Contains("torch.save file") && Catch::Contains("--initial-checkpoint"));

  // torchvision references: model and model_ema (AveragedModel: module. names beside n_averaged).
  const std::string tv = kProto +
                         dict({{"model", dict({{"w", tensor("0", 6, 0, {2, 3}, {3, 1})}})},
                               {"model_ema", dict({{"n_averaged", tensor("3", 1, 0, {}, {}, false, "LongStorage")},
                                                   {"module.w", tensor("1", 6, 0, {2, 3}, {3, 1})}})},
                               {"lr_scheduler", dict({{"step_size", num(30)}})},
                               {"epoch", num(7)}}) +
                         ".";
  auto tvst = io::parse_torch_save(zip_file(tv, {kSix, blobs[1], {"3", le(1, 8), 1}}), "tv.pth");
  REQUIRE(tvst.tensors.size() == 2);
  CHECK(tvst.tensors[0].first == "model.w");
  CHECK(tvst.tensors[1].first == "ema.w");
  CHECK(tvst.metadata == std::map<std::string, std::string>{{"epoch", "7"}});
}

TEST_CASE("layouts without a known state dict are refused listing the top-level keys", "[pth]") {
  auto err = [](const std::string& body, const std::vector<Blob>& b = {kSix}) {
    return error_of(zip_file(kProto + body + ".", b));
  };
  const std::string t6 = tensor("0", 6, 0, {6}, {1});
  CHECK_THAT(err(dict({{"weights", dict({{"w", t6}})}, {"epoch", num(1)}})),
             Catch::Contains("tensors under 'weights'") && Catch::Contains("(top-level keys: 'weights', 'epoch')"));
  CHECK_THAT(err(dict({{"epoch", num(1)}})), Catch::Contains("no state dict found (top-level keys: 'epoch')"));
  CHECK_THAT(err("]"), Catch::Contains("holds a list"));
  CHECK_THAT(err(dict({{"state_dict", dict({{"w", num(1)}})}})),
             Catch::Contains("'state_dict' is a dict that is not a state dict"));
  CHECK_THAT(err(dict({{"state_dict", dict({{"w", t6}})}, {"model", dict({{"w", t6}})}})),
             Catch::Contains("two state dicts for 'model.'"));
  // Many views of one storage would expand a small file without bound.
  std::string many = "}(";
  for (int i = 0; i < 3000; ++i)
    many += str(std::string("v").append(std::to_string(i))) + tensor("0", 1 << 20, 0, {1 << 20}, {0});
  const Blob big{"0", std::string(4 << 20, '\0'), 1 << 20};
  CHECK_THAT(err(many + "u", {big}), Catch::Contains("more than 4 times the file's size"));
  // The tar format of PyTorch < 0.4.
  std::string tar(1024, '\0');
  tar.replace(257, 5, "ustar");
  CHECK(io::is_torch_save_data(tar));
  CHECK_THAT(error_of(tar), Catch::Contains("tar-based torch.save format"));
}
