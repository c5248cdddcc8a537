#include "data/coco.h"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

namespace imgtrain::coco {

using json = nlohmann::json;

namespace {

// Streams the elements of chosen top-level lists through a SAX parser: each element is built as a
// small json value, handed to `sink`, and dropped, so memory stays at one element plus what the
// sink keeps. In object mode the file is an object and `lists` names its keys of interest (other
// keys are skipped unbuilt); in array mode the file is one list (lists[0] names it in messages).
class ListStreamer : public nlohmann::json_sax<json> {
 public:
  using Sink = std::function<void(int list, json& element)>;
  ListStreamer(std::vector<std::string> lists, bool array_mode, Sink sink)
      : lists_(std::move(lists)), array_mode_(array_mode), seen_(lists_.size(), false), sink_(std::move(sink)) {}

  const std::string& error() const { return error_; }
  bool seen(size_t i) const { return seen_[i]; }

  bool null() override { return value(json(nullptr)); }
  bool boolean(bool v) override { return value(json(v)); }
  bool number_integer(number_integer_t v) override { return value(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return value(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return value(json(v)); }
  bool string(string_t& v) override { return value(json(std::move(v))); }
  bool binary(binary_t&) override { return fail("unexpected binary value"); }
  bool start_object(std::size_t) override { return start(true); }
  bool start_array(std::size_t) override { return start(false); }
  bool end_object() override { return end(); }
  bool end_array() override { return end(); }
  bool key(string_t& k) override {
    if (!stack_.empty())
      key_ = std::move(k);
    else if (!array_mode_ && depth_ == 1)
      top_key_ = std::move(k);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    // nlohmann's message is "[json.exception.parse_error.101] parse error at line L, column C: ..."
    std::string what = ex.what();
    if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    return fail("invalid JSON: " + what);
  }

 private:
  bool fail(std::string msg) {
    if (error_.empty()) error_ = std::move(msg);
    return false;
  }
  int top_list() const {
    for (size_t i = 0; i < lists_.size(); ++i)
      if (lists_[i] == top_key_) return int(i);
    return -1;
  }
  void attach(json&& v, bool container) {
    json& top = *stack_.back();
    json* child = top.is_array() ? &(top.emplace_back(std::move(v))) : &(top[key_] = std::move(v));
    if (container) stack_.push_back(child);
  }
  bool value(json&& v) {
    if (depth_ == 0) return fail(array_mode_ ? "the top level is not a list" : "the top level is not an object");
    if (!stack_.empty()) {
      attach(std::move(v), false);
    } else if (list_ >= 0 && depth_ == list_depth_) {
      element_ = std::move(v);
      sink_(list_, element_);
    } else if (!array_mode_ && depth_ == 1 && top_list() >= 0) {
      return fail("\"" + top_key_ + "\" is not a list (it is " + v.type_name() + ")");
    }
    return true;
  }
  bool start(bool object) {
    if (depth_ == 0) {
      if (array_mode_ && object) return fail("the top level is not a list (it is an object)");
      if (!array_mode_ && !object) return fail("the top level is not an object (it is a list)");
      if (array_mode_) list_ = 0, list_depth_ = 1, seen_[0] = true;
    } else if (!stack_.empty()) {
      attach(object ? json::object() : json::array(), true);
    } else if (list_ >= 0 && depth_ == list_depth_) {
      element_ = object ? json::object() : json::array();
      stack_.push_back(&element_);
    } else if (!array_mode_ && depth_ == 1) {
      if (int l = top_list(); l >= 0) {
        if (object) return fail("\"" + top_key_ + "\" is not a list (it is an object)");
        list_ = l, list_depth_ = 2, seen_[size_t(l)] = true;
      }
    }
    ++depth_;
    return true;
  }
  bool end() {
    --depth_;
    if (!stack_.empty()) {
      stack_.pop_back();
      if (stack_.empty()) {
        sink_(list_, element_);
        element_ = nullptr;
      }
    } else if (list_ >= 0 && depth_ == list_depth_ - 1) {
      list_ = -1;
    }
    return true;
  }

  std::vector<std::string> lists_;
  bool array_mode_;
  std::vector<bool> seen_;
  Sink sink_;
  int depth_ = 0, list_ = -1, list_depth_ = 0;
  std::string top_key_, key_, error_;
  json element_;
  std::vector<json*> stack_;
};

// Per-item problems, grouped by kind: one summary line each, the first few items named.
class Issues {
 public:
  explicit Issues(size_t examples) : examples_(examples) {}
  // skip: the item was dropped (counts in Dataset::skipped) rather than kept as noted.
  void add(const std::string& kind, const std::string& item, bool skip = true) {
    auto it = kinds_.begin();
    while (it != kinds_.end() && it->kind != kind) ++it;
    if (it == kinds_.end()) it = kinds_.insert(it, {kind, skip, 0, {}});
    if (it->items.size() < examples_) it->items.push_back(item);
    ++it->count;
    if (skip) ++skipped_;
  }
  void flush(Dataset& d) {
    for (auto& k : kinds_) {
      std::string kind = k.kind;
      if (k.count == 1)  // "1 annotation skipped", not "1 annotations"
        for (const char* plural : {"annotations", "results", "images", "categories"})
          if (kind.rfind(plural, 0) == 0) {
            const std::string p = plural;
            kind = (p == "categories" ? std::string("category") : p.substr(0, p.size() - 1)) + kind.substr(p.size());
            break;
          }
      std::string line = d.path + ": " + std::to_string(k.count) + " " + kind + " (";
      for (size_t i = 0; i < k.items.size(); ++i) line += (i ? ", " : "") + k.items[i];
      d.warnings.push_back(line + (k.count > k.items.size() ? ", ...)" : ")"));
    }
    d.skipped += skipped_;
  }

 private:
  struct Kind {
    std::string kind;
    bool skip;
    size_t count;
    std::vector<std::string> items;
  };
  size_t examples_, skipped_ = 0;
  std::vector<Kind> kinds_;
};

// An integer id: json integers, or floats holding an integer (Python's dict keys treat 1.0 as 1).
bool get_id(const json& o, const char* key, int64_t& out) {
  auto it = o.find(key);
  if (it == o.end()) return false;
  if (it->is_number_integer()) {
    if (it->is_number_unsigned() && it->get<uint64_t>() > uint64_t(INT64_MAX)) return false;
    out = it->get<int64_t>();
    return true;
  }
  if (it->is_number_float()) {
    double v = it->get<double>();
    if (!(std::abs(v) < 9.2e18) || v != std::floor(v)) return false;
    out = int64_t(v);
    return true;
  }
  return false;
}

bool get_number(const json& o, const char* key, double& out) {
  auto it = o.find(key);
  if (it == o.end() || !it->is_number()) return false;
  out = it->get<double>();
  return std::isfinite(out);
}

bool get_size(const json& o, const char* key, uint32_t& out) {
  int64_t v;
  if (!get_id(o, key, v) || v <= 0 || v > int64_t(UINT32_MAX)) return false;
  out = uint32_t(v);
  return true;
}

bool get_box(const json& o, Box& b) {
  auto it = o.find("bbox");
  if (it == o.end() || !it->is_array() || it->size() != 4) return false;
  for (size_t i = 0; i < 4; ++i) {
    if (!(*it)[i].is_number()) return false;
    b[i] = (*it)[i].get<double>();
    if (!std::isfinite(b[i])) return false;
  }
  return true;
}

std::string name_of(const json& o, size_t index) {
  int64_t id;
  if (o.is_object() && get_id(o, "id", id)) return "id " + std::to_string(id);
  return "#" + std::to_string(index);
}

// Reads a segmentation (polygons, or RLE with compressed or uncompressed counts) into `a`.
// Returns an empty string when fine, else the kind of problem (the detail goes to `detail`).
std::string read_segmentation(const json& s, Annotation& a, std::string& detail, bool* odd = nullptr) {
  if (s.is_array()) {
    if (s.empty()) return {};  // no mask given
    a.polygons.reserve(s.size());
    for (auto& p : s) {
      if (!p.is_array()) return "a polygon that is not a list of numbers";
      std::vector<double> xy;
      xy.reserve(p.size());
      for (auto& v : p) {
        if (!v.is_number()) return "a polygon that is not a list of numbers";
        xy.push_back(v.get<double>());
        if (!std::isfinite(xy.back())) return "a polygon that is not a list of numbers";
        // pycocotools would walk every point of a 10^9-pixel edge (or overflow its int cast)
        if (std::abs(xy.back()) > 1e6) return "a polygon coordinate beyond 1,000,000 pixels";
      }
      if (xy.size() % 2 && odd) *odd = true;  // pycocotools' frPoly reads len / 2 points: the last is ignored
      a.polygons.push_back(std::move(xy));
    }
    a.seg = SegKind::polygons;
    return {};
  }
  if (!s.is_object()) return "a segmentation that is neither polygons nor RLE";
  auto size = s.find("size");
  auto counts = s.find("counts");
  if (size == s.end() || counts == s.end() || !size->is_array() || size->size() != 2 ||
      !(*size)[0].is_number_unsigned() || !(*size)[1].is_number_unsigned())
    return "an RLE without counts and [h, w] size";
  const uint64_t h = (*size)[0].get<uint64_t>(), w = (*size)[1].get<uint64_t>();
  if (h > UINT32_MAX || w > UINT32_MAX) return "an RLE without counts and [h, w] size";
  try {
    if (counts->is_string()) {
      a.rle = rle_from_string(counts->get_ref<const std::string&>(), uint32_t(h), uint32_t(w));
    } else if (counts->is_array()) {
      std::vector<uint32_t> c;
      c.reserve(counts->size());
      for (auto& v : *counts) {
        if (!v.is_number_unsigned() || v.get<uint64_t>() > UINT32_MAX) return "RLE counts that are not counts";
        c.push_back(uint32_t(v.get<uint64_t>()));
      }
      a.rle = rle_from_counts(std::move(c), uint32_t(h), uint32_t(w));
    } else {
      return "RLE counts that are not counts";
    }
  } catch (const std::exception& e) {
    detail = e.what();
    return "a bad RLE";
  }
  a.seg = SegKind::rle;
  return {};
}

void parse_stream(std::istream& in, ListStreamer& s, const std::string& name) {
  bool ok = json::sax_parse(in, &s);
  if (!ok || !s.error().empty())
    throw std::runtime_error(name + ": " + (s.error().empty() ? "invalid JSON" : s.error()));
}

template <typename Input>
Dataset read_dataset(Input& in, const std::string& name, const LoadOptions& opt) {
  Dataset d;
  d.path = name;
  Issues issues(opt.examples);
  size_t counter[3] = {0, 0, 0};
  ListStreamer s({"images", "annotations", "categories"}, false, [&](int list, json& e) {
    const size_t index = counter[list]++;
    if (list == 0) {
      Image im;
      if (!e.is_object() || !get_id(e, "id", im.id)) return issues.add("images skipped: no integer id", name_of(e, index));
      if (!get_size(e, "height", im.height) || !get_size(e, "width", im.width))
        return issues.add("images skipped: no positive integer height and width", name_of(e, index));
      if (auto f = e.find("file_name"); f != e.end() && f->is_string()) im.file_name = f->get<std::string>();
      d.images.push_back(std::move(im));
    } else if (list == 2) {
      Category c;
      if (!e.is_object() || !get_id(e, "id", c.id))
        return issues.add("categories skipped: no integer id", name_of(e, index));
      if (auto f = e.find("name"); f != e.end() && f->is_string()) c.name = f->get<std::string>();
      if (auto f = e.find("supercategory"); f != e.end() && f->is_string()) c.supercategory = f->get<std::string>();
      d.categories.push_back(std::move(c));
    } else {
      Annotation a;
      const std::string item = name_of(e, index);
      if (!e.is_object() || !get_id(e, "id", a.id)) return issues.add("annotations skipped: no integer id", item);
      if (!get_id(e, "image_id", a.image_id)) return issues.add("annotations skipped: no integer image_id", item);
      if (!get_id(e, "category_id", a.category_id))
        return issues.add("annotations skipped: no integer category_id", item);
      if (!get_box(e, a.bbox)) return issues.add("annotations skipped: no bbox of 4 finite numbers", item);
      if (!(a.bbox[2] > 0 && a.bbox[3] > 0)) {
        if (!opt.keep_degenerate_boxes) return issues.add("annotations skipped: empty box (w or h <= 0)", item);
        issues.add("annotations kept with an empty box (w or h <= 0)", item, false);
      }
      if (!get_number(e, "area", a.area)) {
        a.area = a.bbox[2] * a.bbox[3];
        issues.add("annotations without a numeric area: w*h used", item, false);
      }
      if (auto c = e.find("iscrowd"); c != e.end()) {
        if (c->is_boolean()) a.iscrowd = c->get<bool>();
        else if (c->is_number()) a.iscrowd = c->get<double>() != 0;
        else return issues.add("annotations skipped: iscrowd is not a number", item);
      }
      if (auto sg = e.find("segmentation"); sg != e.end() && !sg->is_null()) {
        bool odd = false;
        std::string detail, bad = read_segmentation(*sg, a, detail, &odd);
        if (!bad.empty()) {
          // pycocotools' bbox evaluation never reads the segmentation: the box and crowd flag still count
          a.seg = SegKind::none;
          a.polygons.clear();
          a.rle = {};
          issues.add("annotations kept without their segmentation (" + bad + "; segm scores an empty mask)",
                     detail.empty() ? item : item + " (" + detail + ")", false);
        }
        if (odd)
          issues.add("annotations with a polygon of an odd number of coordinates: the last one ignored, as pycocotools",
                     item, false);
        if (a.seg == SegKind::polygons && a.polygons[0].size() <= 4)
          issues.add("annotations kept whose first polygon has under 3 points (pycocotools cannot rasterise them)",
                     item, false);
      }
      d.annotations.push_back(std::move(a));
    }
  });
  parse_stream(in, s, name);
  for (size_t i = 0; i < 3; ++i)
    if (!s.seen(i))
      throw std::runtime_error(name + ": no \"" + std::string(i == 0 ? "images" : i == 1 ? "annotations" : "categories") +
                               "\" list at the top level (not a COCO instances file?)");

  // Duplicate ids: the first image / category wins (pycocotools' dict keeps the last; files with
  // duplicates are broken either way, so they are reported).
  auto drop_duplicate_ids = [&](auto& items, const char* what) {
    std::unordered_set<int64_t> ids;
    size_t out = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!ids.insert(items[i].id).second) {
        issues.add(std::string(what) + " skipped: duplicate id", "id " + std::to_string(items[i].id));
        continue;
      }
      if (out != i) items[out] = std::move(items[i]);  // (a self-move would empty its strings)
      ++out;
    }
    items.resize(out);
  };
  drop_duplicate_ids(d.images, "images");
  drop_duplicate_ids(d.categories, "categories");
  d.build_index();
  // Annotations against the images and categories (which may come later in the file).
  std::unordered_set<int64_t> ann_ids;
  ann_ids.reserve(d.annotations.size());
  size_t out = 0;
  for (size_t i = 0; i < d.annotations.size(); ++i) {
    Annotation& a = d.annotations[i];
    const std::string item = "id " + std::to_string(a.id);
    const Image* im = d.image(a.image_id);
    if (!im) {
      issues.add("annotations skipped: unknown image_id", item + " (image_id " + std::to_string(a.image_id) + ")");
      continue;
    }
    if (!d.category(a.category_id)) {
      issues.add("annotations skipped: unknown category_id",
                 item + " (category_id " + std::to_string(a.category_id) + ")");
      continue;
    }
    if (a.seg == SegKind::rle && (a.rle.h != im->height || a.rle.w != im->width)) {
      a.seg = SegKind::none;  // the box still counts (bbox evaluation and training)
      a.rle = {};
      issues.add("annotations kept without their segmentation (an RLE whose size differs from the image size; segm "
                 "scores an empty mask)", item, false);
    }
    if (!ann_ids.insert(a.id).second) issues.add("annotations with a duplicate id (kept)", item, false);
    if (out != i) d.annotations[out] = std::move(a);
    ++out;
  }
  d.annotations.resize(out);
  d.annotations.shrink_to_fit();
  d.build_index();
  issues.flush(d);
  return d;
}

template <typename Input>
Dataset read_results(const Dataset& gt, Input& in, const std::string& name) {
  Dataset d;
  d.path = name;
  d.images = gt.images;
  d.categories = gt.categories;
  Issues issues(5);
  enum class Kind { unknown, box, segm } kind = Kind::unknown;
  size_t index = 0;
  std::vector<int64_t> foreign;  // image ids not in gt (first few)
  size_t n_foreign = 0;
  ListStreamer s({"results"}, true, [&](int, json& e) {
    const size_t i = index++;
    const std::string item = "#" + std::to_string(i);
    if (!e.is_object()) return issues.add("results skipped: not an object", item);
    if (kind == Kind::unknown) {
      // loadRes decides by the first entry: a non-empty bbox -> box results, else segmentation.
      auto b = e.find("bbox");
      if (b != e.end() && !(b->is_array() && b->empty())) kind = Kind::box;
      else if (e.contains("segmentation")) kind = Kind::segm;
      else throw std::runtime_error(name + ": the first result has neither \"bbox\" nor \"segmentation\"");
    }
    Annotation a;
    if (!get_id(e, "image_id", a.image_id)) return issues.add("results skipped: no integer image_id", item);
    if (!gt.image(a.image_id)) {
      if (foreign.size() < 5 && std::find(foreign.begin(), foreign.end(), a.image_id) == foreign.end())
        foreign.push_back(a.image_id);  // distinct ids
      ++n_foreign;
      return;
    }
    if (!get_id(e, "category_id", a.category_id)) return issues.add("results skipped: no integer category_id", item);
    if (!get_number(e, "score", a.score)) return issues.add("results skipped: no numeric score", item);
    const Image& im = *gt.image(a.image_id);
    if (kind == Kind::box) {
      if (!get_box(e, a.bbox)) return issues.add("results skipped: no bbox of 4 finite numbers", item);
      a.area = a.bbox[2] * a.bbox[3];
      a.seg = SegKind::box;
      if (auto sg = e.find("segmentation"); sg != e.end()) {
        std::string detail, bad = read_segmentation(*sg, a, detail);
        if (!bad.empty()) return issues.add("results skipped: " + bad, detail.empty() ? item : item + " (" + detail + ")");
      }
    } else {
      auto sg = e.find("segmentation");
      if (sg == e.end() || !sg->is_object()) return issues.add("results skipped: no RLE segmentation", item);
      std::string detail, bad = read_segmentation(*sg, a, detail);
      if (!bad.empty()) return issues.add("results skipped: " + bad, detail.empty() ? item : item + " (" + detail + ")");
      a.area = double(rle_area(a.rle));
      if (!get_box(e, a.bbox)) a.bbox = rle_to_bbox(a.rle);
    }
    if (a.seg == SegKind::rle && (a.rle.h != im.height || a.rle.w != im.width))
      return issues.add("results skipped: RLE size differs from the image size", item);
    a.iscrowd = false;
    d.annotations.push_back(std::move(a));
  });
  parse_stream(in, s, name);
  if (n_foreign) {
    std::string ids;
    for (size_t i = 0; i < foreign.size(); ++i) ids += (i ? ", " : "") + std::to_string(foreign[i]);
    throw std::runtime_error(name + ": " + std::to_string(n_foreign) +
                             " results are for images that are not in the ground truth " + gt.path + " (image ids " +
                             ids + (foreign.size() == 5 ? ", ...)" : ")"));
  }
  if (index == 0) throw std::runtime_error(name + ": the results list is empty: there are no detections to evaluate");
  // ids 1..N in file order, as loadRes numbers them
  for (size_t i = 0; i < d.annotations.size(); ++i) d.annotations[i].id = int64_t(i + 1);
  d.annotations.shrink_to_fit();
  d.build_index();
  issues.flush(d);
  return d;
}

std::ifstream open_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw std::runtime_error(path + ": a folder, not a json file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
  return f;
}

}  // namespace

const Image* Dataset::image(int64_t id) const {
  auto it = image_pos_.find(id);
  return it == image_pos_.end() ? nullptr : &images[it->second];
}

const Category* Dataset::category(int64_t id) const {
  auto it = category_pos_.find(id);
  return it == category_pos_.end() ? nullptr : &categories[it->second];
}

const std::vector<uint32_t>& Dataset::image_annotations(int64_t image_id) const {
  static const std::vector<uint32_t> none;
  auto it = image_pos_.find(image_id);
  return it == image_pos_.end() ? none : anns_by_image_[it->second];
}

void Dataset::build_index() {
  image_pos_.clear();
  category_pos_.clear();
  image_pos_.reserve(images.size());
  for (size_t i = 0; i < images.size(); ++i) image_pos_.emplace(images[i].id, uint32_t(i));
  for (size_t i = 0; i < categories.size(); ++i) category_pos_.emplace(categories[i].id, uint32_t(i));
  anns_by_image_.assign(images.size(), {});
  for (size_t i = 0; i < annotations.size(); ++i)
    if (auto it = image_pos_.find(annotations[i].image_id); it != image_pos_.end())
      anns_by_image_[it->second].push_back(uint32_t(i));
}

Dataset load_dataset(const std::string& path, const LoadOptions& opt) {
  auto f = open_file(path);
  return read_dataset(f, path, opt);
}

Dataset parse_dataset(const std::string& text, const std::string& name, const LoadOptions& opt) {
  std::istringstream in(text);
  return read_dataset(in, name, opt);
}

Dataset load_results(const Dataset& gt, const std::string& path) {
  auto f = open_file(path);
  return read_results(gt, f, path);
}

Dataset parse_results(const Dataset& gt, const std::string& text, const std::string& name) {
  std::istringstream in(text);
  return read_results(gt, in, name);
}

Rle ann_to_rle(const Annotation& a, uint32_t h, uint32_t w) {
  switch (a.seg) {
    case SegKind::polygons: {
      if (a.polygons[0].size() > 4) return rle_from_polygons(a.polygons, h, w);
      // A first polygon of fewer than 3 points makes pycocotools' frPyObjects fail; here the
      // polygons of 3+ points make the mask (shorter ones enclose nothing).
      std::vector<std::vector<double>> keep;
      for (auto& p : a.polygons)
        if (p.size() >= 6) keep.push_back(p);
      if (!keep.empty()) return rle_from_polygons(keep, h, w);
      break;
    }
    case SegKind::rle: return a.rle;
    case SegKind::box: {
      const double x1 = a.bbox[0], x2 = a.bbox[0] + a.bbox[2], y1 = a.bbox[1], y2 = a.bbox[1] + a.bbox[3];
      // the box as a polygon, as pycocotools' loadRes makes it (whose rasteriser casts each
      // coordinate x 5 to a C int: far beyond the image it is undefined there, an error of the
      // file here, as the reader reports one)
      for (double v : {x1, x2, y1, y2})
        if (!(std::abs(v) <= 1e8))
          throw std::runtime_error("a result's bbox reaches " + std::to_string(v) +
                                   ": beyond 100,000,000 pixels, no mask can be made of it (result of image " +
                                   std::to_string(a.image_id) + ")");
      return rle_from_polygon({x1, y1, x1, y2, x2, y2, x2, y1}, h, w);
    }
    case SegKind::none: break;
  }
  Rle r;
  r.h = h, r.w = w;
  r.counts = {uint32_t(uint64_t(h) * w)};
  return r;
}

}  // namespace imgtrain::coco
