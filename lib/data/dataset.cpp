#include "data/dataset.h"

#include "core/error.h"
#include "core/log.h"
#include "core/parallel.h"
#include "data/shards.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <opencv2/imgproc.hpp>
#ifdef IMGTRAIN_WITH_IMGCODECS
#include <opencv2/imgcodecs.hpp>
#endif
#include <turbojpeg.h>

#include <csetjmp>
#include <cstdio>
#include <gif_lib.h>
#include <jpeglib.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <chrono>
#include <optional>
#include <set>
#include <atomic>
#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace imgtrain::data {

IdxArray read_idx(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw UserError(fmt::format("cannot open IDX file '{}'", path));
  std::unique_ptr<gzFile_s, int (*)(gzFile)> closer(f, gzclose);
  // Reads up to n more bytes; what the header declares bounds what is read, so a small file that
  // inflates without end (a gzip bomb) costs no more than the array it claims to hold.
  auto read = [&](std::string& out, size_t n) {
    char buf[1 << 16];
    while (n > 0) {
      const int got = gzread(f, buf, unsigned(std::min(n, sizeof buf)));
      if (got < 0) {
        int err = 0;
        const char* msg = gzerror(f, &err);
        throw UserError(fmt::format("IDX file '{}' is corrupt or truncated ({})", path, msg));
      }
      if (got == 0) return;
      out.append(buf, size_t(got));
      n -= size_t(got);
    }
  };
  std::string bytes;
  read(bytes, 4);
  if (bytes.size() < 4 || bytes[0] != 0 || bytes[1] != 0)
    throw UserError(fmt::format("'{}' is not an IDX file (wrong magic number)", path));
  if (uint8_t(bytes[2]) != 0x08)
    throw UserError(fmt::format("IDX file '{}' has element type 0x{:02x}; only unsigned bytes (0x08) are supported",
                                path, uint8_t(bytes[2])));
  IdxArray a;
  const size_t ndim = uint8_t(bytes[3]);
  read(bytes, 4 * ndim);
  if (ndim == 0 || bytes.size() < 4 + 4 * ndim)
    throw UserError(fmt::format("IDX file '{}' is truncated in its header", path));
  // Fashion-MNIST's training images are 47 MB; 16 GiB is far beyond any IDX dataset.
  constexpr uint64_t kMaxBytes = uint64_t(1) << 34;
  uint64_t total = 1;
  for (size_t d = 0; d < ndim; ++d) {
    const auto* p = reinterpret_cast<const uint8_t*>(bytes.data() + 4 + 4 * d);
    const uint64_t v = (uint64_t(p[0]) << 24) | (uint64_t(p[1]) << 16) | (uint64_t(p[2]) << 8) | p[3];
    if (v == 0) throw UserError(fmt::format("IDX file '{}': dimension {} is 0 (an empty array)", path, d));
    if (v > kMaxBytes / total)
      throw UserError(fmt::format("IDX file '{}': its dimensions declare more than {} bytes", path, kMaxBytes));
    a.dims.push_back(int64_t(v));
    total *= v;
  }
  bytes.clear();
  read(bytes, size_t(total));
  if (bytes.size() < total)
    throw UserError(fmt::format("IDX file '{}' is truncated: {} of {} data bytes", path, bytes.size(), total));
  a.data.assign(bytes.begin(), bytes.end());
  return a;
}

bool is_jpeg(const std::string& bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  return bytes.size() >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF;
}

namespace {
struct TjHandle {
  tjhandle h = tjInitDecompress();
  ~TjHandle() { tjDestroy(h); }
};

struct JpegHeader {
  int width = 0, height = 0, colorspace = 0;
};

JpegHeader read_jpeg_header(const TjHandle& tj, const std::string& bytes, const std::string& what) {
  JpegHeader hdr;
  int subsamp = 0;
  if (tjDecompressHeader3(tj.h, reinterpret_cast<const unsigned char*>(bytes.data()), (unsigned long)bytes.size(),
                          &hdr.width, &hdr.height, &subsamp, &hdr.colorspace) != 0 || hdr.width <= 0 || hdr.height <= 0)
    throw DecodeError(fmt::format("cannot decode JPEG '{}': {}", what, tjGetErrorStr2(tj.h)));
  return hdr;
}
}  // namespace

cv::Size jpeg_size(const std::string& bytes, const std::string& what) {
  const auto hdr = read_jpeg_header(TjHandle{}, bytes, what);
  return {hdr.width, hdr.height};
}

cv::Mat decode_jpeg(const std::string& bytes, int denom, const std::string& what) {
  TjHandle tj;
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const auto [w, hgt, colorspace] = read_jpeg_header(tj, bytes, what);
  const tjscalingfactor sf{1, denom};
  const int sw = TJSCALED(w, sf), sh = TJSCALED(hgt, sf);
  if (colorspace == TJCS_CMYK || colorspace == TJCS_YCCK) {
    // TurboJPEG 2.1 has no CMYK -> RGB; PIL's (what timm sees): the file's values are Adobe-
    // inverted, then R = (255 - K) - (255 - K) * C / 255 with C, K the un-inverted inks.
    cv::Mat cmyk(sh, sw, CV_8UC4);
    if (tjDecompress2(tj.h, p, (unsigned long)bytes.size(), cmyk.data, sw, 0, sh, TJPF_CMYK, TJFLAG_ACCURATEDCT) != 0)
      throw DecodeError(fmt::format("cannot decode JPEG '{}': {}", what, tjGetErrorStr2(tj.h)));
    cv::Mat out(sh, sw, CV_8UC3);
    auto muldiv255 = [](int a, int b) {
      const int t = a * b + 128;
      return ((t >> 8) + t) >> 8;
    };
    for (int y = 0; y < sh; ++y) {
      const uint8_t* in = cmyk.ptr<uint8_t>(y);
      uint8_t* o = out.ptr<uint8_t>(y);
      for (int x = 0; x < sw; ++x, in += 4, o += 3) {
        const int nk = in[3];  // 255 - (255 - raw K)
        for (int c = 0; c < 3; ++c) o[c] = uint8_t(std::clamp(nk - muldiv255(255 - in[c], nk), 0, 255));
      }
    }
    return out;
  }
  const bool gray = colorspace == TJCS_GRAY;
  cv::Mat out(sh, sw, gray ? CV_8UC1 : CV_8UC3);
  // Warnings (e.g. a premature end of data) leave a partly grey image; treat them as corrupt
  // input as PIL does for truncated files.
  if (tjDecompress2(tj.h, p, (unsigned long)bytes.size(), out.data, sw, 0, sh, gray ? TJPF_GRAY : TJPF_RGB,
                    TJFLAG_ACCURATEDCT) != 0)
    throw DecodeError(fmt::format("cannot decode JPEG '{}': {}", what, tjGetErrorStr2(tj.h)));
  return out;
}

namespace {
// libjpeg reports errors through a callback that must not return: jump back to the caller.
// Warnings (a truncated file, corrupt data) are errors here, as for TurboJPEG above.
struct JpegErrors {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};
[[noreturn]] void jpeg_fail(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegErrors*>(c->err);
  (*c->err->format_message)(c, e->message);
  std::longjmp(e->jump, 1);
}
void jpeg_message(j_common_ptr c, int level) {
  if (level < 0) jpeg_fail(c);  // a warning: corrupt or truncated data
}
}  // namespace

cv::Mat decode_jpeg_region(const std::string& bytes, int denom, cv::Rect region, const std::string& what) {
  jpeg_decompress_struct cinfo;
  JpegErrors err;
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = jpeg_fail;
  err.pub.emit_message = jpeg_message;
  err.message[0] = 0;
  // The output buffer exists before setjmp and is not reassigned after it (a longjmp leaves
  // locals changed in between indeterminate): the crop plus 16 columns each side, widened to
  // iMCU boundaries (at most 2 x 15 more), fits. Gray files use the first third of each row.
  cv::Mat out(std::max(region.height, 1), std::max(region.width, 1) + 64, CV_8UC3);
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw DecodeError(fmt::format("cannot decode JPEG '{}': {}", what, err.message));
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, reinterpret_cast<const unsigned char*>(bytes.data()), (unsigned long)bytes.size());
  jpeg_read_header(&cinfo, TRUE);
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  const bool gray = cinfo.jpeg_color_space == JCS_GRAYSCALE;
  if (cmyk) {  // libjpeg does not convert CMYK to RGB; decode_jpeg does (as PIL)
    jpeg_destroy_decompress(&cinfo);
    return decode_jpeg(bytes, denom, what)(region).clone();
  }
  cinfo.scale_num = 1;
  cinfo.scale_denom = unsigned(denom);
  cinfo.out_color_space = gray ? JCS_GRAYSCALE : JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;  // TJFLAG_ACCURATEDCT
  jpeg_start_decompress(&cinfo);
  const cv::Rect inside = region & cv::Rect(0, 0, int(cinfo.output_width), int(cinfo.output_height));
  if (inside != region || region.empty()) {
    jpeg_destroy_decompress(&cinfo);
    throw std::invalid_argument("decode_jpeg_region: region outside the scaled image");
  }
  // 16 more columns on each side keep the chroma upsampling of the region's edge columns identical
  // to a full decode's (at a crop edge the upsampler has no right neighbour).
  const int x0 = std::max(0, region.x - 16), x1 = std::min(int(cinfo.output_width), region.x + region.width + 16);
  JDIMENSION xoff = JDIMENSION(x0), width = JDIMENSION(x1 - x0);
  jpeg_crop_scanline(&cinfo, &xoff, &width);  // widened to iMCU boundaries
  if (int(width) > region.width + 64) {
    jpeg_destroy_decompress(&cinfo);
    throw std::logic_error("decode_jpeg_region: the iMCU-aligned crop is wider than expected");
  }
  if (region.y > 0) jpeg_skip_scanlines(&cinfo, JDIMENSION(region.y));
  for (int y = 0; y < region.height; ++y) {
    JSAMPROW row = out.ptr<uint8_t>(y);
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_abort_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  const cv::Rect want(region.x - int(xoff), 0, region.width, region.height);
  if (!gray) return out(want);
  return cv::Mat(region.height, int(width), CV_8UC1, out.data, out.step)(want).clone();
}

namespace {
bool is_gif(const std::string& bytes) { return bytes.rfind("GIF87a", 0) == 0 || bytes.rfind("GIF89a", 0) == 0; }

// A GIF's first frame on its logical screen (the background colour around the frame,
// transparent pixels left at the background), as RGB.
cv::Mat decode_gif(const std::string& bytes, const std::string& what) {
  struct Source {
    const std::string* bytes;
    size_t pos;
  } src{&bytes, 0};
  auto read = [](GifFileType* g, GifByteType* buf, int n) -> int {
    auto* s = static_cast<Source*>(g->UserData);
    const size_t k = std::min(size_t(std::max(n, 0)), s->bytes->size() - s->pos);
    std::memcpy(buf, s->bytes->data() + s->pos, k);
    s->pos += k;
    return int(k);
  };
  int err = 0;
  GifFileType* g = DGifOpen(&src, read, &err);
  if (!g) throw DecodeError(fmt::format("cannot decode GIF '{}': {}", what, GifErrorString(err)));
  if (DGifSlurp(g) != GIF_OK || g->ImageCount < 1 || g->SWidth <= 0 || g->SHeight <= 0) {
    const std::string why = GifErrorString(g->Error) ? GifErrorString(g->Error) : "no image";
    DGifCloseFile(g, &err);
    throw DecodeError(fmt::format("cannot decode GIF '{}': {}", what, why));
  }
  const SavedImage& im = g->SavedImages[0];
  const ColorMapObject* cmap = im.ImageDesc.ColorMap ? im.ImageDesc.ColorMap : g->SColorMap;
  if (!cmap) {
    DGifCloseFile(g, &err);
    throw DecodeError(fmt::format("cannot decode GIF '{}': no colour map", what));
  }
  GraphicsControlBlock gcb{};
  gcb.TransparentColor = NO_TRANSPARENT_COLOR;
  DGifSavedExtensionToGCB(g, 0, &gcb);
  auto colour = [&](int idx) {
    const GifColorType c = idx >= 0 && idx < cmap->ColorCount ? cmap->Colors[idx] : GifColorType{0, 0, 0};
    return cv::Vec3b(c.Red, c.Green, c.Blue);
  };
  const cv::Vec3b bg = colour(g->SColorMap ? g->SBackGroundColor : 0);
  cv::Mat out(g->SHeight, g->SWidth, CV_8UC3, cv::Scalar(bg[0], bg[1], bg[2]));
  const auto& d = im.ImageDesc;
  for (int y = 0; y < d.Height; ++y)
    for (int x = 0; x < d.Width; ++x) {
      const int px = d.Left + x, py = d.Top + y;
      const int idx = im.RasterBits[size_t(y) * size_t(d.Width) + size_t(x)];
      if (px < 0 || py < 0 || px >= out.cols || py >= out.rows || idx == gcb.TransparentColor) continue;
      out.at<cv::Vec3b>(py, px) = colour(idx);
    }
  DGifCloseFile(g, &err);
  return out;
}
}  // namespace

namespace {
// The container a file's first bytes name, for messages in words ("" when none we know).
const char* image_format(const std::string& b) {
  auto starts = [&](const char* magic, size_t n, size_t at = 0) { return b.size() >= at + n && !b.compare(at, n, magic, n); };
  if (starts("\x89PNG\r\n\x1a\n", 8)) return "PNG";
  if (starts("BM", 2)) return "BMP";
  if (starts("RIFF", 4) && starts("WEBP", 4, 8) && starts("VP8", 3, 12)) return "WebP";  // VP8, VP8L, VP8X
  if (starts("II*\0", 4) || starts("MM\0*", 4)) return "TIFF";
  if (starts("P5", 2) || starts("P6", 2)) return "PNM";
  return "";
}

// A PNG without its iCCP chunks: the colour profile is not applied (as PIL's convert('RGB')), and
// libpng would print warnings about some common profiles straight to stderr. A chunk list cut
// short (or without IEND) is reported here, before libpng prints its own error to stderr.
std::string png_without_iccp(const std::string& b, const std::string& what) {
  std::string out = b.substr(0, 8);
  size_t p = 8;
  bool end = false;
  while (!end) {
    if (p + 12 > b.size()) throw DecodeError(fmt::format("cannot decode '{}': truncated PNG", what));
    const auto* u = reinterpret_cast<const unsigned char*>(b.data() + p);
    const size_t len = (size_t(u[0]) << 24) | (size_t(u[1]) << 16) | (size_t(u[2]) << 8) | size_t(u[3]);
    if (len > b.size() - p - 12) throw DecodeError(fmt::format("cannot decode '{}': truncated PNG", what));
    end = b.compare(p + 4, 4, "IEND") == 0;
    if (b.compare(p + 4, 4, "iCCP") != 0) out.append(b, p, len + 12);
    p += len + 12;
  }
  return out;
}
}  // namespace

std::optional<cv::Size> header_size(const std::string& b) {
  const auto* u = reinterpret_cast<const unsigned char*>(b.data());
  auto le16 = [&](size_t at) { return int64_t(u[at]) | int64_t(u[at + 1]) << 8; };
  auto le24 = [&](size_t at) { return le16(at) | int64_t(u[at + 2]) << 16; };
  auto le32 = [&](size_t at) { return int64_t(int32_t(uint32_t(le16(at)) | uint32_t(le16(at + 2)) << 16)); };
  auto be32 = [&](size_t at) { return int64_t(u[at]) << 24 | int64_t(u[at + 1]) << 16 | int64_t(u[at + 2]) << 8 | int64_t(u[at + 3]); };
  auto size = [](int64_t w, int64_t h) -> std::optional<cv::Size> {
    if (w <= 0 || h <= 0 || w > INT32_MAX || h > INT32_MAX) return std::nullopt;
    return cv::Size(int(w), int(h));
  };
  const std::string format = image_format(b);
  if (is_gif(b) && b.size() >= 10) return size(le16(6), le16(8));  // the logical screen
  if (is_jpeg(b)) {
    try {
      return jpeg_size(b, "");
    } catch (const DecodeError&) {
      return std::nullopt;
    }
  }
  if (format == std::string("PNG") && b.size() >= 24) return size(be32(16), be32(20));
  if (format == std::string("TIFF") && b.size() >= 8) {  // the first image's ImageWidth / ImageLength tags
    const bool le = u[0] == 'I';
    auto rd16 = [&](size_t at) { return le ? le16(at) : (int64_t(u[at]) << 8 | int64_t(u[at + 1])); };
    auto rd32 = [&](size_t at) { return le ? int64_t(uint32_t(le32(at))) : be32(at); };
    const int64_t ifd = rd32(4);
    if (ifd < 8 || ifd > int64_t(b.size()) - 2) return std::nullopt;
    const int64_t n = rd16(size_t(ifd));
    int64_t w = -1, h = -1;
    for (int64_t e = 0; e < n; ++e) {
      const int64_t at = ifd + 2 + 12 * e;
      if (at + 12 > int64_t(b.size())) break;
      const int64_t tag = rd16(size_t(at)), type = rd16(size_t(at + 2));
      if (tag != 256 && tag != 257) continue;
      const int64_t v = type == 3 ? rd16(size_t(at + 8)) : type == 4 ? rd32(size_t(at + 8)) : -1;
      (tag == 256 ? w : h) = v;
    }
    return size(w, h);
  }
  if (format == std::string("BMP") && b.size() >= 26) return size(std::abs(le32(18)), std::abs(le32(22)));
  if (format == std::string("WebP") && b.size() >= 30) {
    if (!b.compare(12, 4, "VP8X")) return size(le24(24) + 1, le24(27) + 1);
    if (!b.compare(12, 4, "VP8L")) {
      const uint32_t bits = uint32_t(le16(21)) | uint32_t(le16(23)) << 16;
      return size((bits & 0x3fff) + 1, ((bits >> 14) & 0x3fff) + 1);
    }
    if (!b.compare(12, 4, "VP8 ")) return size(le16(26) & 0x3fff, le16(28) & 0x3fff);
  }
  return std::nullopt;
}

namespace {
std::atomic<int64_t> g_max_image_pixels{kDefaultMaxImagePixels};
}

void set_max_image_pixels(int64_t n) { g_max_image_pixels.store(n); }
int64_t max_image_pixels() { return g_max_image_pixels.load(); }

void check_image_pixels(int64_t width, int64_t height, const std::string& what) {
  const int64_t limit = max_image_pixels();
  if (limit > 0 && width * height > limit)
    throw DecodeError(fmt::format("'{}' is {}x{} = {} pixels, above the limit of {} (--max-image-pixels, PIL's "
                                  "decompression-bomb limit by default); skipped",
                                  what, width, height, width * height, limit));
}

cv::Mat decode_image(const std::string& bytes, const std::string& what) {
  if (bytes.empty()) throw DecodeError(fmt::format("cannot decode '{}': empty file", what));
  // the size from the header, before anything is allocated (a 37-byte GIF can claim 65535 x 65535)
  if (const auto hs = header_size(bytes)) check_image_pixels(hs->width, hs->height, what);
  if (is_gif(bytes)) return decode_gif(bytes, what);
  if (is_jpeg(bytes)) return decode_jpeg(bytes, 1, what);
  const std::string format = image_format(bytes);
#ifdef IMGTRAIN_WITH_IMGCODECS
  // OpenCV tries every decoder it has on unknown bytes, and some abort the process on bad input
  // (GDCM's DICOM reader asserts): only the formats imgtrain reads reach it.
  if (format.empty()) throw DecodeError(fmt::format("cannot decode '{}': not an image (no known image header)", what));
  // OpenCV picks the decoder by its own signature checks, and its DICOM reader's is "DICM" at
  // byte 128: a file its own decoder turns down would go there, which allocates what the bytes
  // claim (4 GB from a 169-byte input, found by fuzz_image). Such files are refused.
  if (bytes.size() >= 132 && bytes.compare(128, 4, "DICM") == 0)
    throw DecodeError(fmt::format("cannot decode '{}': a {} whose bytes 128-131 read 'DICM' (OpenCV would treat it as "
                                  "DICOM); skipped",
                                  what, format));
  const std::string data = format == "PNG" ? png_without_iccp(bytes, what) : std::string();
  const std::string& src = format == "PNG" ? data : bytes;
  cv::Mat raw;
  try {
    raw = cv::imdecode(cv::Mat(1, int(src.size()), CV_8UC1, const_cast<char*>(src.data())), cv::IMREAD_UNCHANGED);
  } catch (const cv::Exception&) {
    raw.release();
  }
  if (raw.empty() && format.empty())
    throw DecodeError(fmt::format("cannot decode '{}': not an image (no known image header)", what));
  if (raw.empty()) throw DecodeError(fmt::format("cannot decode '{}': truncated or corrupt {}", what, format));
  if (raw.depth() == CV_16U && raw.channels() >= 3) {  // PIL opens 16-bit RGB(A) as 8-bit: each sample's high byte
    cv::Mat high(raw.rows, raw.cols, CV_MAKETYPE(CV_8U, raw.channels()));
    for (int y = 0; y < raw.rows; ++y) {
      const uint16_t* s = raw.ptr<uint16_t>(y);
      uint8_t* d = high.ptr<uint8_t>(y);
      for (int i = 0; i < raw.cols * raw.channels(); ++i) d[i] = uint8_t(s[i] >> 8);
    }
    raw = high;
  }
  if (raw.depth() == CV_16U) raw.convertTo(raw, CV_8U, 1.0 / 257.0);  // grayscale: scaled (PIL's convert clips)
  if (raw.depth() != CV_8U) throw DecodeError(fmt::format("cannot decode '{}': unsupported pixel depth", what));
  cv::Mat out;
  switch (raw.channels()) {
    case 1: out = raw; break;
    case 3: cv::cvtColor(raw, out, cv::COLOR_BGR2RGB); break;
    case 4: cv::cvtColor(raw, out, cv::COLOR_BGRA2RGB); break;  // alpha dropped, as PIL's convert('RGB')
    default:
      throw DecodeError(fmt::format("cannot decode '{}': unsupported channel count {}", what, raw.channels()));
  }
  return out;
#else
  if (format.empty()) throw DecodeError(fmt::format("cannot decode '{}': not an image (no known image header)", what));
  throw DecodeError(fmt::format("cannot decode {} '{}': only JPEG and GIF in a build without imgcodecs", format, what));
#endif
}

namespace {

class FashionMnist : public Dataset {
 public:
  FashionMnist(const std::string& root, const std::string& split) {
    std::string prefix;
    if (split == "train" || split == "training")
      prefix = "train";
    else if (split == "validation" || split == "val" || split == "valid" || split == "test" || split == "eval" ||
             split == "evaluation")
      prefix = "t10k";
    else
      throw UserError(fmt::format("split '{}' of fashion-mnist: expected train or validation/test", split));
    auto images = read_idx(root + "/" + prefix + "-images-idx3-ubyte.gz");
    auto labels = read_idx(root + "/" + prefix + "-labels-idx1-ubyte.gz");
    if (images.dims.size() != 3 || labels.dims.size() != 1 || images.dims[0] != labels.dims[0])
      throw UserError(fmt::format("fashion-mnist in '{}': images {} and labels {} do not match", root,
                                  fmt::join(images.dims, "x"), fmt::join(labels.dims, "x")));
    n_ = size_t(images.dims[0]);
    h_ = int(images.dims[1]);
    w_ = int(images.dims[2]);
    pixels_ = std::move(images.data);
    labels_ = std::move(labels.data);
    for (auto l : labels_)
      if (l >= 10) throw UserError(fmt::format("fashion-mnist in '{}': label {} out of range 0..9", root, int(l)));
  }
  size_t size() const override { return n_; }
  int64_t label(size_t i) const override { return labels_[i]; }
  cv::Mat image(size_t i) const override {
    return cv::Mat(h_, w_, CV_8UC1, const_cast<uint8_t*>(pixels_.data() + i * size_t(h_ * w_))).clone();
  }
  std::string describe(size_t i) const override { return fmt::format("fashion-mnist[{}]", i); }
  int64_t num_classes() const override { return 10; }
  std::vector<std::string> class_names() const override {
    return {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
  }

 private:
  size_t n_;
  int h_, w_;
  std::vector<uint8_t> pixels_, labels_;
};

std::string lower_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext;
}

// Extensions imgtrain decodes that timm's reader leaves out unless --input-key names them: files
// with these are counted and named in a warning, other files (notes, labels) are passed over.
bool decodable_extension(const std::string& ext) {
  static const std::set<std::string> known = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif",
                                              ".tiff", ".jpe", ".jfif", ".ppm", ".pgm", ".pbm", ".pnm"};
  return known.count(ext) > 0;
}

// One class folder's image files (recursively) and every directory seen with its mtime.
struct ClassScan {
  std::vector<std::string> files;
  std::vector<std::pair<std::string, int64_t>> dirs;
  std::vector<std::string> skipped_links;  // folders reached a second time (link loops, other classes)
  std::vector<std::string> nested;         // images below a sub-folder of the class folder
  std::map<std::string, size_t> other_extensions;  // image files of extensions not read, by extension
  std::vector<std::string> broken_links;            // links to nothing
};

using FolderId = std::pair<uint64_t, uint64_t>;  // (device, inode)
std::optional<FolderId> folder_id(const fs::path& p) {
  struct stat st;
  if (::stat(p.c_str(), &st) != 0) return std::nullopt;
  return FolderId{uint64_t(st.st_dev), uint64_t(st.st_ino)};
}

int64_t mtime_ns(const fs::path& p) {
  std::error_code ec;
  auto t = fs::last_write_time(p, ec);
  return ec ? -1 : int64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
}

// One class folder, recursively, following folder links. A folder is entered once: `seen` starts
// with the split folder and every class folder, so a link back up (a loop) or into another class
// (its images would get this class's label) is skipped and reported, and the scan stays finite.
ClassScan scan_class(const fs::path& dir, std::set<FolderId> seen, const std::vector<std::string>& extensions) {
  ClassScan out;
  std::error_code ec;
  out.dirs.emplace_back(dir.string(), mtime_ns(dir));
  auto opts = fs::directory_options::follow_directory_symlink | fs::directory_options::skip_permission_denied;
  for (auto it = fs::recursive_directory_iterator(dir, opts, ec); it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (ec) break;
    if (it->is_directory(ec)) {
      const auto id = folder_id(it->path());
      if (id && !seen.insert(*id).second) {
        out.skipped_links.push_back(it->path().string());
        it.disable_recursion_pending();
        continue;
      }
      out.dirs.emplace_back(it->path().string(), mtime_ns(it->path()));
    } else if (it->is_regular_file(ec)) {
      const std::string ext = lower_extension(it->path());
      if (std::find(extensions.begin(), extensions.end(), ext) != extensions.end()) {
        out.files.push_back(it->path().string());
        if (it.depth() > 0) out.nested.push_back(it->path().string());
      } else if (decodable_extension(ext)) {
        ++out.other_extensions[ext];
      }
    } else if (it->is_symlink(ec) && !fs::exists(it->path(), ec)) {
      out.broken_links.push_back(it->path().string());
    }
  }
  return out;
}

// Where the scan of `folder` is cached: $XDG_CACHE_HOME/imgtrain (or ~/.cache/imgtrain), one
// file per absolute folder path of 10,000 files or more. IMGTRAIN_SCAN_CACHE=0 turns caching off.
std::string scan_cache_path(const std::string& folder) {
  if (const char* v = std::getenv("IMGTRAIN_SCAN_CACHE"); v && std::string(v) == "0") return "";
  std::string base;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) base = x;
  else if (const char* h = std::getenv("HOME"); h && *h) base = std::string(h) + "/.cache";
  else return "";
  std::error_code ec;
  const std::string abs = fs::absolute(folder, ec).lexically_normal().string();
  return fmt::format("{}/imgtrain/scan-{:016x}.txt", base, std::hash<std::string>{}(abs));
}

class ImageFolder : public Dataset {
 public:
  ImageFolder(const std::string& folder, std::vector<std::string> extensions, const std::string& class_map)
      : folder_(folder), extensions_(std::move(extensions)) {
    std::error_code ec;
    if (!fs::is_directory(folder, ec)) throw UserError(fmt::format("data folder '{}' does not exist", folder));
    const std::string cache = scan_cache_path(folder);
    if (cache.empty() || !load_cache(cache)) {
      scan();
      // Small folders scan in milliseconds: only large ones (10,000 files; env
      // IMGTRAIN_SCAN_CACHE_MIN_FILES) leave a cache file behind.
      const char* m = std::getenv("IMGTRAIN_SCAN_CACHE_MIN_FILES");
      const size_t min_files = m && *m ? size_t(std::strtoull(m, nullptr, 10)) : 10000;
      if (!cache.empty() && samples_.size() >= min_files) save_cache(cache);
    }
    for (auto& w : warnings_) log::warn("{}", w);
    if (samples_.empty())
      throw UserError(fmt::format("no images ({}) in class subfolders of '{}'", fmt::join(extensions_, ", "), folder));
    if (!class_map.empty()) apply_class_map(class_map);
  }
  size_t size() const override { return samples_.size(); }
  int64_t label(size_t i) const override { return samples_[i].second; }
  cv::Mat image(size_t i) const override {
    std::string bytes;
    encoded(i, bytes);
    return decode_image(bytes, samples_[i].first);
  }
  bool encoded(size_t i, std::string& bytes) const override {
    read_file_bytes(samples_[i].first, bytes);
    return true;
  }
  std::string describe(size_t i) const override { return samples_[i].first; }
  int64_t num_classes() const override { return int64_t(classes_.size()); }
  std::vector<std::string> class_names() const override { return classes_; }

 private:
  // Class folders scanned in parallel (many requests in flight help on network storage). Classes
  // and samples in timm's order: natural_less of the class names and of the image paths.
  void scan() {
    std::error_code ec;
    classes_.clear();
    samples_.clear();
    dirs_.clear();
    warnings_.clear();
    dirs_.emplace_back(folder_, mtime_ns(folder_));
    std::vector<std::string> loose;  // images directly in the split folder
    std::map<std::string, size_t> other;
    for (auto& entry : fs::directory_iterator(folder_, ec)) {
      if (entry.is_directory()) {
        classes_.push_back(entry.path().filename().string());
      } else if (entry.is_regular_file()) {
        const std::string ext = lower_extension(entry.path());
        if (std::find(extensions_.begin(), extensions_.end(), ext) != extensions_.end())
          loose.push_back(entry.path().filename().string());
      }
    }
    std::sort(classes_.begin(), classes_.end(), natural_less);
    std::vector<ClassScan> found(classes_.size());
    std::set<FolderId> tops;  // the split folder and every class folder
    if (auto id = folder_id(folder_)) tops.insert(*id);
    for (auto& c : classes_)
      if (auto id = folder_id(fs::path(folder_) / c)) tops.insert(*id);
    parallel_for(classes_.size(), 16,
                 [&](size_t c) { found[c] = scan_class(fs::path(folder_) / classes_[c], tops, extensions_); });
    // A folder with no image files is not a class (timm's reader labels images, not folders): it
    // would shift every later label and widen the classifier. Its directories stay in dirs_, so
    // the scan cache notices an image added to it.
    std::vector<std::string> links, kept, empty, nested, broken;
    // the first in timm's order, named in a warning (no need to sort the whole list)
    auto first = [](const std::vector<std::string>& v) { return *std::min_element(v.begin(), v.end(), natural_less); };
    for (size_t c = 0; c < classes_.size(); ++c) {
      (found[c].files.empty() ? empty : kept).push_back(classes_[c]);
      for (auto& f : found[c].files) samples_.emplace_back(std::move(f), int64_t(kept.size()) - 1);
      for (auto& d : found[c].dirs) dirs_.push_back(std::move(d));
      for (auto& l : found[c].skipped_links) links.push_back(std::move(l));
      for (auto& n : found[c].nested) nested.push_back(std::move(n));
      for (auto& b : found[c].broken_links) broken.push_back(std::move(b));
      for (auto& [e, n] : found[c].other_extensions) other[e] += n;
    }
    std::stable_sort(samples_.begin(), samples_.end(),
                     [](const auto& x, const auto& y) { return natural_less(x.first, y.first); });
    if (!other.empty()) {
      size_t n = 0;
      std::vector<std::string> counts, wider = extensions_;
      for (auto& [e, k] : other) {
        n += k;
        counts.push_back(fmt::format("{} {}", e, k));
        wider.push_back(e);
      }
      const bool timm_default = extensions_ == folder_extensions("");
      warnings_.push_back(fmt::format("{}: {} image file(s) with extensions {} were skipped ({}); --input-key '{}' "
                                      "reads them too",
                                      folder_, n,
                                      timm_default ? "timm's ImageFolder does not read" : "--input-key does not name",
                                      fmt::join(counts, ", "), fmt::join(wider, ";")));
    }
    if (!kept.empty() && !empty.empty())
      warnings_.push_back(fmt::format("{}: {} subfolder(s) hold no images ({}) and are not classes, as in timm "
                                      "(first: {})",
                                      folder_, empty.size(), fmt::join(extensions_, ", "), empty.front()));
    if (!loose.empty())
      warnings_.push_back(fmt::format("{}: {} image(s) directly in the split folder belong to no class folder and "
                                      "were skipped (first: {}); timm's reader makes them a class named ''",
                                      folder_, loose.size(), first(loose)));
    if (!nested.empty())
      warnings_.push_back(fmt::format("{}: {} image(s) lie in sub-folders of their class folder (first: {}): "
                                      "imgtrain labels them by the class folder, as torchvision's ImageFolder does; "
                                      "timm's reader labels each by its innermost folder's name",
                                      folder_, nested.size(), first(nested)));
    if (!broken.empty())
      warnings_.push_back(fmt::format("{}: {} link(s) lead to no file and were skipped (first: {})", folder_,
                                      broken.size(), first(broken)));
    classes_ = std::move(kept);
    if (!links.empty())
      warnings_.push_back(fmt::format("{}: {} linked folder(s) lead back into the split or into another class and "
                                      "were skipped (first: {})",
                                      folder_, links.size(), links.front()));
  }
  // timm's --class-map (load_class_map of a .txt): the classes in the file's order, the images of
  // folders it does not name skipped (timm: silently; here counted in a warning).
  void apply_class_map(const std::string& given) {
    std::error_code ec;
    std::string path = given;
    if (!fs::exists(path, ec)) path = (fs::path(folder_) / given).string();
    if (!fs::exists(path, ec))
      throw UserError(fmt::format("--class-map '{}': no such file (looked for as given and in '{}')", given, folder_));
    const std::string ext = lower_extension(given);
    if (ext == ".pkl")
      throw UserError(fmt::format("--class-map '{}': imgtrain reads class maps as text (.txt: one class name a line, "
                                  "its line number the index), not pickles",
                                  given));
    if (ext != ".txt")
      throw UserError(fmt::format("--class-map '{}': expected a .txt file (one class name a line, its line number the "
                                  "index), as timm's load_class_map",
                                  given));
    std::ifstream f(path);
    if (!f) throw UserError(fmt::format("--class-map '{}': cannot read the file", path));
    std::vector<std::string> names;
    std::map<std::string, int64_t> index;
    for (std::string line; std::getline(f, line);) {
      if (names.empty() && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 byte order mark
      const auto b = line.find_first_not_of(" \t\r\v\f");
      const auto e = line.find_last_not_of(" \t\r\v\f");
      line = b == std::string::npos ? "" : line.substr(b, e - b + 1);
      if (!line.empty() && !index.emplace(line, int64_t(names.size())).second)
        throw UserError(fmt::format("--class-map '{}': class '{}' is on lines {} and {}; give each class once", path,
                                    line, index[line] + 1, names.size() + 1));
      names.push_back(line);
    }
    std::vector<int64_t> to(classes_.size(), -1);
    std::vector<std::string> unnamed;
    for (size_t c = 0; c < classes_.size(); ++c) {
      auto it = index.find(classes_[c]);
      if (it != index.end()) to[c] = it->second;
      else unnamed.push_back(classes_[c]);
    }
    if (unnamed.size() == classes_.size())
      throw UserError(fmt::format("--class-map '{}' names none of the {} class folder(s) of '{}' (first: '{}')", path,
                                  classes_.size(), folder_, classes_.front()));
    size_t skipped = 0;
    std::vector<std::pair<std::string, int64_t>> kept;
    kept.reserve(samples_.size());
    for (auto& [p, c] : samples_) {
      if (to[size_t(c)] < 0) ++skipped;
      else kept.emplace_back(std::move(p), to[size_t(c)]);
    }
    if (skipped)
      log::warn("{}: {} image(s) in {} class folder(s) that --class-map '{}' does not name were skipped (first: {})",
                folder_, skipped, unnamed.size(), given, unnamed.front());
    samples_ = std::move(kept);
    classes_ = std::move(names);
  }
  // The cache holds every directory with its mtime (adding or removing a file changes its
  // folder's), the extensions read, the classes, the files and the scan's warnings; it is used
  // only if every directory is unchanged.
  static constexpr const char* kCacheVersion = "imgtrain-scan 2";
  bool load_cache(const std::string& path) {
    std::ifstream f(path);
    std::string line;
    if (!f || !std::getline(f, line) || line != kCacheVersion) return false;
    if (!std::getline(f, line) || line != folder_) return false;
    if (!std::getline(f, line) || line != fmt::format("{}", fmt::join(extensions_, ";"))) return false;
    auto count = [&] {
      size_t n = 0;
      f >> n;
      std::getline(f, line);
      return n;
    };
    auto number_and_text = [&](int64_t& v) {  // "<number> <text>" lines
      f >> v;
      f.get();
      return bool(std::getline(f, line));
    };
    int64_t v = 0;
    for (size_t i = 0, n = count(); i < n; ++i) {
      if (!number_and_text(v) || mtime_ns(line) != v) return reset();
      dirs_.emplace_back(line, v);
    }
    for (size_t i = 0, n = count(); i < n && std::getline(f, line); ++i) classes_.push_back(line);
    for (size_t i = 0, n = count(); i < n; ++i) {
      if (!number_and_text(v) || v < 0 || v >= int64_t(classes_.size())) return reset();
      samples_.emplace_back(line, v);
    }
    for (size_t i = 0, n = count(); i < n && std::getline(f, line); ++i) warnings_.push_back(line);
    return bool(f) ? true : reset();
  }
  bool reset() {
    classes_.clear();
    samples_.clear();
    dirs_.clear();
    warnings_.clear();
    return false;
  }
  void save_cache(const std::string& path) const {
    for (auto& [p, c] : samples_)
      if (p.find('\n') != std::string::npos) return;  // the line format cannot hold it
    for (auto& w : warnings_)
      if (w.find('\n') != std::string::npos) return;
    std::error_code ec;
    fs::create_directories(fs::path(path).parent_path(), ec);
    const std::string tmp = path + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream f(tmp);
      f << kCacheVersion << "\n" << folder_ << "\n" << fmt::format("{}", fmt::join(extensions_, ";")) << "\n";
      f << dirs_.size() << "\n";
      for (auto& [d, t] : dirs_) f << t << " " << d << "\n";
      f << classes_.size() << "\n";
      for (auto& c : classes_) f << c << "\n";
      f << samples_.size() << "\n";
      for (auto& [p, c] : samples_) f << c << " " << p << "\n";
      f << warnings_.size() << "\n";
      for (auto& w : warnings_) f << w << "\n";
      if (!f) return;  // a cache that cannot be written is only a slower next start
    }
    fs::rename(tmp, path, ec);
  }

  std::string folder_;
  std::vector<std::string> extensions_;  // lower-case, with the dot
  std::vector<std::string> classes_;
  std::vector<std::pair<std::string, int64_t>> samples_;
  std::vector<std::pair<std::string, int64_t>> dirs_;
  std::vector<std::string> warnings_;  // said at every open, also from the cache
};

}  // namespace

bool natural_less(std::string_view a, std::string_view b) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  auto lower = [](char c) { return (unsigned char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c); };
  size_t i = 0, j = 0;
  for (;;) {
    // a text run (maybe empty), compared lower-cased, code unit by code unit
    size_t ie = i, je = j;
    while (ie < a.size() && !digit(a[ie])) ++ie;
    while (je < b.size() && !digit(b[je])) ++je;
    for (size_t k = 0; k < std::min(ie - i, je - j); ++k)
      if (lower(a[i + k]) != lower(b[j + k])) return lower(a[i + k]) < lower(b[j + k]);
    if (ie - i != je - j) return ie - i < je - j;
    i = ie, j = je;
    if (i == a.size() || j == b.size()) {
      if (i == a.size() && j == b.size()) break;
      return i == a.size();  // the shorter key first
    }
    // a digit run, compared as a number
    while (ie < a.size() && digit(a[ie])) ++ie;
    while (je < b.size() && digit(b[je])) ++je;
    size_t is = i, js = j;
    while (is + 1 < ie && a[is] == '0') ++is;
    while (js + 1 < je && b[js] == '0') ++js;
    if (ie - is != je - js) return ie - is < je - js;
    for (; is < ie; ++is, ++js)
      if (a[is] != b[js]) return a[is] < b[js];
    i = ie, j = je;
  }
  return a < b;  // equal keys (case, leading zeros): byte order, so the order is always the same
}

std::vector<std::string> folder_extensions(const std::string& input_key) {
  if (input_key.empty()) return {".png", ".jpg", ".jpeg"};  // timm's IMG_EXTENSIONS
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t end = input_key.find(';', start);
    std::string e = input_key.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (e.size() < 2 || e[0] != '.' || e.find('/') != std::string::npos)
      throw UserError(fmt::format("--input-key '{}': for an ImageFolder it lists the file extensions to read, each "
                                  "with its dot, ';'-separated (timm's default: .png;.jpg;.jpeg)",
                                  input_key));
    std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return std::tolower(c); });
    if (std::find(out.begin(), out.end(), e) == out.end()) out.push_back(e);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

void read_file_bytes(const std::string& path, std::string& bytes) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw DecodeError(fmt::format("cannot read '{}'", path));
  const int64_t size = int64_t(f.tellg());
  // No image within the pixel limit needs more bytes than 8 per pixel (16-bit RGBA, uncompressed)
  // plus headers: a larger file is not read into memory.
  const int64_t limit = max_image_pixels();
  if (limit > 0 && size > 8 * limit + (int64_t(1) << 20))
    throw DecodeError(fmt::format("'{}' is {} bytes, more than any image within the pixel limit of {} needs "
                                  "(--max-image-pixels); skipped",
                                  path, size, limit));
  bytes.resize(size_t(size));
  f.seekg(0);
  if (!f.read(bytes.data(), std::streamsize(bytes.size()))) throw DecodeError(fmt::format("cannot read '{}'", path));
}

namespace {
// The split folder names timm accepts for each split.
const std::vector<std::string> kTrainSplits = {"train", "training"};
const std::vector<std::string> kEvalSplits = {"val", "valid", "validation", "eval", "evaluation"};
}  // namespace

std::string find_split_folder(const std::string& root, const std::string& split) {
  std::error_code ec;
  if (fs::exists(fs::path(root) / split, ec)) return (fs::path(root) / split).string();
  const std::vector<std::string>* syn = nullptr;
  if (std::find(kTrainSplits.begin(), kTrainSplits.end(), split) != kTrainSplits.end()) syn = &kTrainSplits;
  if (std::find(kEvalSplits.begin(), kEvalSplits.end(), split) != kEvalSplits.end()) syn = &kEvalSplits;
  if (syn)
    for (auto& s : *syn)
      if (fs::exists(fs::path(root) / s, ec)) return (fs::path(root) / s).string();
  return root;
}

std::shared_ptr<Dataset> create_dataset(const std::string& kind, const std::string& root, const std::string& split,
                                        const FolderOptions& fo) {
  if (!fo.input_key.empty() && !kind.empty())
    throw UserError(fmt::format("--input-key picks an ImageFolder's file extensions; it has no effect with --dataset {}",
                                kind));
  if (!fo.class_map.empty() && !kind.empty())
    throw UserError(fmt::format("--class-map names an ImageFolder's classes; it has no effect with --dataset {}", kind));
  if (kind == "fashion-mnist") return std::make_shared<FashionMnist>(root.empty() ? kFashionMnistDir : root, split);
  if (!kind.empty()) throw UserError(fmt::format("--dataset '{}': expected '' (ImageFolder) or fashion-mnist", kind));
  if (root.empty()) throw UserError("--data-dir is required for an ImageFolder dataset (or use --dataset fashion-mnist)");
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw UserError(fmt::format("--data-dir '{}': no such folder", root));
  const std::string folder = find_split_folder(root, split);
  if (folder == root && !split.empty()) {
    // No such split: the folder itself is read, its subfolders as classes (as timm does). When those
    // subfolders are other splits, the split name was most likely misspelt: said once, as a warning.
    std::vector<std::string> splits;
    for (const auto* names : {&kTrainSplits, &kEvalSplits})
      for (const auto& s : *names)
        if (fs::is_directory(fs::path(root) / s, ec)) splits.push_back(s);
    if (!splits.empty())
      log::warn("--data-dir '{}' has no '{}' split folder: the folder itself is read, with its split folders ({}) "
                "as the classes",
                root, split, fmt::join(splits, ", "));
  }
  if (!find_shards(folder).empty()) {
    if (!fo.input_key.empty())
      throw UserError(fmt::format("--input-key picks an ImageFolder's file extensions; '{}' holds tar shards", folder));
    if (!fo.class_map.empty())
      throw UserError(fmt::format("--class-map names an ImageFolder's classes; '{}' holds tar shards", folder));
    return open_shards(folder);
  }
  return std::make_shared<ImageFolder>(folder, folder_extensions(fo.input_key), fo.class_map);
}

}  // namespace imgtrain::data
