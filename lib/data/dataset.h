// Datasets: Fashion-MNIST from its IDX .gz files and ImageFolder (one class per subfolder).
// A dataset hands out decoded 8-bit images (HWC, 1 or 3 channels, RGB order) and labels.
#pragma once
#include "data/target.h"

#include <opencv2/core.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace imgtrain::data {

// An image that cannot be read or decoded; the loader skips the sample and counts it.
class DecodeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual size_t size() const = 0;
  virtual int64_t label(size_t i) const = 0;
  virtual cv::Mat image(size_t i) const = 0;  // throws DecodeError
  // The sample's encoded file bytes, for datasets that have them (the loader then decodes with
  // the transform's knowledge: a scaled JPEG decode when the crop is much larger than the output).
  // False when the dataset holds decoded pixels.
  virtual bool encoded(size_t i, std::string& bytes) const { return false; }
  // Sharded storage: shard s holds samples [starts[s], starts[s + 1]); empty otherwise. The
  // loader's training order then reads shard by shard (see LoaderOptions::shuffle_buffer).
  virtual std::vector<size_t> shard_starts() const { return {}; }
  virtual std::string describe(size_t i) const = 0;
  // Detection datasets: each sample's target (boxes, labels, masks as RLE) and its image size
  // from the annotations (no decoding; the aspect-ratio grouping reads it). `image`: the decoded
  // image's size, which the boxes are clamped to and the masks drawn at (torchvision's
  // ConvertCocoPolysToMask), where it is known; else the annotations' size.
  virtual bool has_targets() const { return false; }
  virtual BoxTarget target(size_t i, cv::Size image = {}) const { return {}; }
  virtual cv::Size image_size(size_t i) const { return {}; }
  virtual int64_t num_classes() const = 0;
  virtual std::vector<std::string> class_names() const = 0;
};

// An IDX array (the MNIST container): dims then raw uint8 data. Throws UserError on a wrong magic
// number, an unsupported element type or a truncated file.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};
IdxArray read_idx(const std::string& path);

// A whole file into `bytes`; DecodeError naming it when it cannot be read.
void read_file_bytes(const std::string& path, std::string& bytes);

// PIL refuses images above 2 x Image.MAX_IMAGE_PIXELS (DecompressionBombError) and timm skips
// them; imgtrain does the same, from the header, before decoding. The limit is process-wide, as
// PIL's Image.MAX_IMAGE_PIXELS: --max-image-pixels sets it once at start-up (0: no limit).
inline constexpr int64_t kDefaultMaxImagePixels = 2 * 89478485;
void set_max_image_pixels(int64_t n);
int64_t max_image_pixels();
// DecodeError naming the image when width x height is above max_image_pixels().
void check_image_pixels(int64_t width, int64_t height, const std::string& what);
// An encoded image's width and height from its header (JPEG, PNG, GIF screen, BMP, WebP), without
// decoding; nullopt for other formats or a header too short to say.
std::optional<cv::Size> header_size(const std::string& bytes);

// Decodes JPEG (TurboJPEG), PNG, BMP, WebP (OpenCV) bytes into RGB or grayscale 8-bit.
cv::Mat decode_image(const std::string& bytes, const std::string& what);

bool is_jpeg(const std::string& bytes);
// A JPEG's size from its header (no decoding); throws DecodeError.
cv::Size jpeg_size(const std::string& bytes, const std::string& what);
// A JPEG decoded at 1/`denom` of its size (denom 1, 2, 4 or 8) by libjpeg-turbo's DCT-domain
// scaling: each side ceil(side / denom), much cheaper than a full decode and a resize.
cv::Mat decode_jpeg(const std::string& bytes, int denom, const std::string& what);
// Only `region` (in the 1/denom-scaled image's coordinates) of a JPEG: rows above it are skipped
// and columns outside it are not decoded (to iMCU granularity), through libjpeg-turbo's
// jpeg_skip_scanlines / jpeg_crop_scanline. The pixels equal those of decode_jpeg(...)(region).
cv::Mat decode_jpeg_region(const std::string& bytes, int denom, cv::Rect region, const std::string& what);

// The default location of Debian's dataset-fashion-mnist package.
inline const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// kind: "" (ImageFolder, or tar shards when the split folder holds *.tar files) or
// "fashion-mnist"; split: timm's split name (folder synonyms apply). COCO detection data is
// opened by data::open_coco (data/coco_detection.h).
// How an ImageFolder is read (timm's flags of the same names).
struct FolderOptions {
  // --input-key: the ';'-separated file extensions read (empty: timm's .png, .jpg, .jpeg)
  std::string input_key;
  // --class-map: a .txt file, one class name a line, the line number its index (looked for as
  // given, then in the split folder); images of class folders it does not name are skipped
  std::string class_map;
};

// Classes and images come in timm's order (natural_less); `folder` applies to ImageFolders only
// (a user error with other kinds and with tar shards).
std::shared_ptr<Dataset> create_dataset(const std::string& kind, const std::string& root, const std::string& split,
                                        const FolderOptions& folder = {});

// timm's natural_key order (timm.utils.natural_key): lower-cased, runs of digits compared as
// numbers ("class2" before "class10"); keys that tie in it fall back to byte order.
bool natural_less(std::string_view a, std::string_view b);

// The extensions an ImageFolder reads for --input-key (lower-cased, with the dot); a user error
// for entries that are not extensions.
std::vector<std::string> folder_extensions(const std::string& input_key);

// timm's split-folder search: `split` itself, else its synonyms (train/training,
// val/valid/validation/eval/evaluation), else the root.
std::string find_split_folder(const std::string& root, const std::string& split);

}  // namespace imgtrain::data
