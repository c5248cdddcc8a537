// COCO instance annotations (instances_*.json) and detection results read into memory, with
// pycocotools' semantics where they change what the evaluator sees (COCO.createIndex, loadRes,
// annToRLE). Plain C++ (no torch). Files are streamed through a SAX parser one list element at a
// time, so a 200 MB annotation file never exists as a whole DOM.
//
// Errors: a file that cannot be used at all (unreadable, invalid JSON, a missing top-level list,
// wrong types at the top) throws std::runtime_error with one line naming the file and the
// problem. A bad image / annotation / category is skipped and counted: Dataset::warnings holds
// one summary line per kind of problem (the first few ids named), for the caller to print.
#pragma once
#include "data/coco_mask.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace imgtrain::coco {

struct Image {
  int64_t id = 0;
  std::string file_name;
  uint32_t height = 0, width = 0;
};

struct Category {
  int64_t id = 0;
  std::string name, supercategory;
};

// What an annotation's segmentation holds.
enum class SegKind : uint8_t {
  none,      // no segmentation given (bbox-only data): an empty mask where one is needed
  polygons,  // Annotation::polygons, rasterised at the image size (annToRLE: frPyObjects + merge)
  rle,       // Annotation::rle (compressed string or uncompressed counts in the json)
  box,       // a bbox result: pycocotools' loadRes polygon [x1,y1, x1,y2, x2,y2, x2,y1] of bbox
};

struct Annotation {
  int64_t id = 0, image_id = 0, category_id = 0;
  Box bbox{};            // x, y, w, h
  double area = 0;       // gt: the json's area field; results: w*h (bbox) or the mask area (segm)
  double score = 0;      // results only
  bool iscrowd = false;
  SegKind seg = SegKind::none;
  std::vector<std::vector<double>> polygons;
  Rle rle;
};

struct Dataset {
  std::string path;
  std::vector<Image> images;            // file order
  std::vector<Annotation> annotations;  // file order, bad ones removed
  std::vector<Category> categories;     // file order
  // Summary lines of what was skipped or repaired while reading; `skipped` counts skipped items.
  std::vector<std::string> warnings;
  size_t skipped = 0;

  const Image* image(int64_t id) const;        // nullptr when absent
  const Category* category(int64_t id) const;  // nullptr when absent
  // Indices into `annotations` of one image's annotations, in file order (empty when none).
  const std::vector<uint32_t>& image_annotations(int64_t image_id) const;
  // Rebuilds the lookups after `images` / `annotations` / `categories` were changed by hand.
  void build_index();

 private:
  std::unordered_map<int64_t, uint32_t> image_pos_, category_pos_;
  std::vector<std::vector<uint32_t>> anns_by_image_;  // by position in `images`
};

struct LoadOptions {
  // Boxes with w <= 0 or h <= 0 are skipped by default (a training set cannot use them).
  // pycocotools keeps them; an evaluator that must match it exactly sets this (they are then kept
  // and only counted in the warnings).
  bool keep_degenerate_boxes = false;
  size_t examples = 5;  // ids named per warning line
};

// An instances_*.json (the "images", "annotations" and "categories" lists are required).
Dataset load_dataset(const std::string& path, const LoadOptions& opt = {});
// The same from json text in memory; `name` stands for the file in messages.
Dataset parse_dataset(const std::string& text, const std::string& name, const LoadOptions& opt = {});

// A results json (a list of {image_id, category_id, bbox | segmentation, score}) read as
// pycocotools' COCO.loadRes reads it against `gt`: the first entry decides the kind (a non-empty
// "bbox" -> box results: area = w*h, iscrowd 0, the box polygon as segmentation unless one is
// given; else "segmentation" -> mask results: area = mask area, bbox = the mask's box unless
// given); ids become 1..N in file order; the images and categories are the gt's. Throws
// std::runtime_error when the list is empty, or names image ids that are not in `gt` (pycocotools
// asserts there). Entries without the fields their kind needs are skipped and counted.
Dataset load_results(const Dataset& gt, const std::string& path);
Dataset parse_results(const Dataset& gt, const std::string& text, const std::string& name);

// annToRLE: the annotation's mask at the image's size (h, w): polygons rasterised and merged,
// uncompressed / compressed RLE as given, a bbox result's polygon rasterised, none -> empty mask.
Rle ann_to_rle(const Annotation& a, uint32_t h, uint32_t w);

}  // namespace imgtrain::coco
