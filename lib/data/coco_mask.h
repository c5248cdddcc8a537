// COCO instance masks as run-length encodings, bit-identical to pycocotools.mask (maskApi.c):
// the same column-major runs, polygon rasterisation, compressed string form, areas, boxes and IoU.
// Plain C++ (no torch): the dataset keeps masks in this form, the evaluator scores with it.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace imgtrain::coco {

// Runs of alternating 0s and 1s over the mask in column-major (Fortran) order, starting with 0s;
// counts sum to h * w.
struct Rle {
  uint32_t h = 0, w = 0;
  std::vector<uint32_t> counts;
  bool operator==(const Rle&) const = default;
};

using Box = std::array<double, 4>;  // x, y, w, h (COCO's xywh)

// mask: h * w bytes in column-major order (pycocotools' np.asfortranarray layout); nonzero = 1.
Rle rle_encode(const uint8_t* mask, uint32_t h, uint32_t w);
// The column-major h * w mask of 0/1 bytes.
std::vector<uint8_t> rle_decode(const Rle& r);
// Union (intersect = false) or intersection of masks of one size (pycocotools merge).
Rle rle_merge(const std::vector<Rle>& rles, bool intersect = false);
uint64_t rle_area(const Rle& r);
Box rle_to_bbox(const Rle& r);
Rle rle_from_bbox(const Box& bb, uint32_t h, uint32_t w);
// xy: x0, y0, x1, y1, ... in pixel coordinates (pycocotools frPoly / rleFrPoly).
// As frPoly, 0, 1 or 2 points give what rleFrPoly gives (an empty mask) and an odd last value is
// ignored (len / 2 points); a coordinate whose 5x upsampling leaves the int range throws
// std::invalid_argument.
Rle rle_from_polygon(const std::vector<double>& xy, uint32_t h, uint32_t w);
// Several polygons of one object merged into one mask (what frPyObjects + merge does for COCO).
// As frPyObjects, throws when there are no polygons or the first has 4 values or fewer (it
// would read a 4-value first polygon as boxes and fail); later short polygons go through frPoly.
Rle rle_from_polygons(const std::vector<std::vector<double>>& polys, uint32_t h, uint32_t w);

// The compressed string form of COCO json ("counts": "...") and back. rle_from_string throws
// std::invalid_argument with a one-line reason when the string is malformed or the counts do not
// sum to h * w.
std::string rle_to_string(const Rle& r);
Rle rle_from_string(std::string_view s, uint32_t h, uint32_t w);
// Uncompressed counts from json ({"counts": [..], "size": [h, w]}): checked the same way.
Rle rle_from_counts(std::vector<uint32_t> counts, uint32_t h, uint32_t w);

// IoU of every detection with every ground truth, written row-major [dt.size() x gt.size()];
// for a crowd gt the union is the detection's area (pycocotools iou with iscrowd).
void rle_iou(const std::vector<Rle>& dt, const std::vector<Rle>& gt, const std::vector<uint8_t>& iscrowd,
             double* out);
void bbox_iou(const std::vector<Box>& dt, const std::vector<Box>& gt, const std::vector<uint8_t>& iscrowd,
              double* out);

}  // namespace imgtrain::coco
